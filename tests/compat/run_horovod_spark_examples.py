"""Run Horovod's own Spark examples on spark-hvd, with only their imports renamed, and print what they report.

    python tests/compat/run_horovod_spark_examples.py HOROVOD_SRC [--examples pytorch_mnist keras_mnist rossmann]
        [--num-proc 2] [--epochs 3] [--no-keras3-edits]

HOROVOD_SRC is a Horovod checkout or a bare git directory of one (its HEAD is read). Each example
is copied into a temporary folder with every ``horovod.`` module path renamed to ``spark_hvd.``;
its download is replaced by local data of the same layout, written before it runs: for the MNIST
examples a ``mnist.bz2`` libsvm file of 28x28 digits (the bundled 8x8 digits, each pixel a 3x3
block, padded by 2, in shifted copies), for the Rossmann example a small generated set of the
competition's CSV files. The Rossmann example also passes two Keras 2 arguments that Keras 3
removed (``Adam(lr=)``, ``Embedding(input_length=)``); those two edits (KERAS3_EDITS) are made
and reported unless ``--no-keras3-edits``. Each runs at ``--num-proc`` with ``--epochs``; the
script prints a table of exit code, test accuracy (Rossmann: best validation RMSPE) and duration.
The exit status is 0 when every example exited 0.
"""

from __future__ import annotations

import argparse
import bz2
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

EXAMPLES: Dict[str, str] = {
    "pytorch_mnist": "examples/spark/pytorch/pytorch_spark_mnist.py",
    "keras_mnist": "examples/spark/keras/keras_spark_mnist.py",
    "rossmann": "examples/spark/keras/keras_spark_rossmann_estimator.py",
}

_RENAME = re.compile(r"\bhorovod\.")


def read_source(src: str, path: str) -> str:
    """``path`` of the Horovod checkout or bare git directory ``src``."""
    checkout = Path(src) / path
    if checkout.exists():
        return checkout.read_text()
    return subprocess.run(["git", "-C", src, "show", f"HEAD:{path}"], check=True, capture_output=True,
                          text=True).stdout


def renamed(source: str) -> str:
    """The example with every ``horovod.`` module path spark-hvd's (imports and uses alike)."""
    return _RENAME.sub("spark_hvd.", source)


def write_mnist(path: Path, copies: int = 6) -> int:
    """A libsvm ``mnist.bz2`` of 28x28 digits in [0, 1] (label, then 1-based feature indices): each
    of the bundled 1,797 digits enlarged (a pixel to 3x3) and placed ``copies`` times, shifted by up
    to two pixels each way, as handwriting sits in MNIST's frames."""
    import numpy as np

    from spark_hvd.datasets import load_digits

    digits, digit_labels = load_digits()
    digits = np.kron(np.asarray(digits, dtype=np.float64).reshape(-1, 8, 8) / 16.0, np.ones((3, 3)))
    rng = np.random.default_rng(0)
    images, labels = [], []
    for _ in range(copies):
        shifted = np.zeros((len(digits), 28, 28))
        for i, (dy, dx) in enumerate(rng.integers(0, 5, size=(len(digits), 2))):
            shifted[i, dy:dy + 24, dx:dx + 24] = digits[i]
        images.append(shifted)
        labels.append(digit_labels)
    big = np.concatenate(images)
    labels = np.concatenate(labels)
    lines = []
    for label, image in zip(labels, big.reshape(len(big), -1)):
        nonzero = np.nonzero(image)[0]
        lines.append(f"{int(label)} " + " ".join(f"{i + 1}:{image[i]:.4f}" for i in nonzero))
    path.write_bytes(bz2.compress(("\n".join(lines) + "\n").encode()))
    return len(lines)


def write_rossmann(folder: Path, stores: int = 12, train_days: int = 600, test_days: int = 48) -> None:
    """Small CSV files with the Rossmann competition's columns (train, test, store, store_states,
    state_names, googletrend, weather) and its calendar: training days end where the test days
    begin, more than a year earlier, so the example's validation period (the test period a year
    before) lies inside them. Sales depend on the store, the day of the week and promotions."""
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    state_names = {"NW": "NordrheinWestfalen", "BY": "Bayern", "HE": "Hessen", "BE": "Berlin"}
    states = list(state_names)
    store_ids = np.arange(1, stores + 1)
    pd.DataFrame({"Store": store_ids, "State": rng.choice(states, stores)}).to_csv(folder / "store_states.csv",
                                                                                 index=False)
    pd.DataFrame({"StateName": list(state_names.values()), "State": states}).to_csv(folder / "state_names.csv",
                                                                                   index=False)
    promo2 = rng.integers(0, 2, stores)
    stores_frame = pd.DataFrame({
        "Store": store_ids, "StoreType": rng.choice(list("abcd"), stores), "Assortment": rng.choice(list("abc"), stores),
        "CompetitionDistance": rng.integers(100, 20000, stores).astype(float),
        "CompetitionOpenSinceMonth": rng.integers(1, 13, stores), "CompetitionOpenSinceYear": rng.integers(2005, 2015, stores),
        "Promo2": promo2, "Promo2SinceWeek": pd.array(np.where(promo2, rng.integers(1, 52, stores), 0), dtype="Int64"),
        "Promo2SinceYear": pd.array(np.where(promo2, rng.integers(2009, 2015, stores), 0), dtype="Int64"),
        "PromoInterval": np.where(promo2, rng.choice(["Jan,Apr,Jul,Oct", "Feb,May,Aug,Nov", "Mar,Jun,Sept,Dec"],
                                                     stores), ""),
    })
    for col in ("Promo2SinceWeek", "Promo2SinceYear"):  # empty where the store has no Promo2, as in the data
        stores_frame.loc[stores_frame["Promo2"] == 0, col] = pd.NA
    stores_frame.to_csv(folder / "store.csv", index=False)
    dates = pd.date_range(end="2015-09-17", periods=train_days + test_days, freq="D")
    train_dates, test_dates = dates[:train_days], dates[train_days:]
    level = rng.normal(1.0, 0.25, stores).clip(0.5)
    frames = []
    for day in train_dates:
        promo = rng.integers(0, 2, stores)
        open_ = (rng.random(stores) > 0.05).astype(int)
        sales = (open_ * level * (5000 + 2000 * promo + 1200 * (day.dayofweek < 5)
                                  + rng.normal(0, 250, stores))).clip(0).round()
        frames.append(pd.DataFrame({"Store": store_ids, "DayOfWeek": day.dayofweek + 1, "Date": f"{day:%Y-%m-%d}",
                                    "Sales": sales.astype(int), "Customers": (sales / 10).astype(int), "Open": open_,
                                    "Promo": promo, "StateHoliday": "0", "SchoolHoliday": rng.integers(0, 2, stores)}))
    pd.concat(frames).to_csv(folder / "train.csv", index=False)
    tests = [pd.DataFrame({"Id": np.arange(i * stores + 1, (i + 1) * stores + 1), "Store": store_ids,
                           "DayOfWeek": day.dayofweek + 1, "Date": f"{day:%Y-%m-%d}", "Open": 1,
                           "Promo": rng.integers(0, 2, stores), "StateHoliday": "0",
                           "SchoolHoliday": rng.integers(0, 2, stores)})
             for i, day in enumerate(test_dates)]
    pd.concat(tests).to_csv(folder / "test.csv", index=False)
    # The example joins the trend on (State, Year, Week) of the week's first date: one row per
    # calendar year and ISO week of the data, for each state and for Germany ("Rossmann_DE").
    firsts: Dict[Tuple[int, int], Any] = {}
    for day in dates:
        firsts.setdefault((day.year, day.isocalendar()[1]), day)
    trend = [{"file": name, "week": f"{w:%Y-%m-%d} - {w + pd.Timedelta(days=6):%Y-%m-%d}",
              "trend": int(rng.integers(40, 100))}
             for name in [f"Rossmann_DE_{s}" for s in states] + ["Rossmann_DE"] for w in firsts.values()]
    pd.DataFrame(trend).to_csv(folder / "googletrend.csv", index=False)
    weather = [{"file": state_names[s], "Date": f"{d:%Y-%m-%d}", "Max_TemperatureC": int(rng.integers(-5, 30)),
                "Mean_TemperatureC": int(rng.integers(-5, 25)), "Min_TemperatureC": int(rng.integers(-10, 20)),
                "Max_Humidity": int(rng.integers(40, 100)), "Mean_Humidity": int(rng.integers(30, 90)),
                "Min_Humidity": int(rng.integers(20, 80)), "Max_Wind_SpeedKm_h": int(rng.integers(5, 50)),
                "Mean_Wind_SpeedKm_h": int(rng.integers(2, 30)), "CloudCover": float(rng.integers(0, 8)),
                "Events": str(rng.choice(["Rain", "Fog", "Snow", "Sunny"]))} for s in states for d in dates]
    pd.DataFrame(weather).to_csv(folder / "weather.csv", index=False)


KERAS3_EDITS: Dict[str, List[Tuple[str, str]]] = {
    "rossmann": [("tf.keras.optimizers.Adam(lr=", "tf.keras.optimizers.Adam(learning_rate="),
                 (", input_length=1", "")],
}
"""Keras 2 arguments an example passes that Keras 3 removed (its own error without the edit:
``Argument(s) not recognized: {'lr': ...}``, ``Unrecognized keyword arguments passed to
Embedding: {'input_length': 1}``): applied unless ``--no-keras3-edits``, and reported."""


def run_example(name: str, source: str, work: Path, num_proc: int, epochs: int,
                keras3_edits: bool = True) -> Tuple[int, str, float, List[str]]:
    """(exit code, what it reported, seconds, edits made beyond the rename) of one example."""
    from spark_hvd.spark.session import LOCAL_ENVIRONMENT

    source = renamed(source)
    edits = []
    for old, new in KERAS3_EDITS.get(name, []) if keras3_edits else []:
        if old in source:
            source = source.replace(old, new)
            edits.append(f"`{old}` -> `{new}`" if new else f"`{old}` removed")
    script = work / f"{name}.py"
    script.write_text(source)
    data = work / "data"
    data.mkdir(exist_ok=True)
    args = [sys.executable, str(script), "--num-proc", str(num_proc), "--epochs", str(epochs)]
    if name == "rossmann":
        write_rossmann(data)
        args += ["--data-dir", f"file://{data}", "--work-dir", str(work / "store")]
    else:
        write_mnist(data / "mnist.bz2")
        args += ["--work-dir", str(work / "store"), "--data-dir", str(data)]
    env = {**os.environ, **LOCAL_ENVIRONMENT, "TF_CPP_MIN_LOG_LEVEL": "3"}
    started = time.monotonic()
    done = subprocess.run(args, cwd=work, env=env, capture_output=True, text=True, timeout=3600)
    seconds = time.monotonic() - started
    (work / f"{name}.log").write_text(done.stdout + "\n--- stderr ---\n" + done.stderr)
    accuracy = re.findall(r"Test accuracy: *([0-9.]+)", done.stdout)
    rmspe = re.findall(r"Best RMSPE: *([0-9.]+)", done.stdout)
    if done.returncode == 0 and accuracy:
        report = f"test accuracy {float(accuracy[-1]):.4f}"
    elif done.returncode == 0 and rmspe:
        rows = max(0, len((work / "submission.csv").read_text().splitlines()) - 1) \
            if (work / "submission.csv").exists() else 0
        report = f"best validation RMSPE {float(rmspe[-1]):.4f}, {rows} test predictions written"
    else:
        tail = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()][-3:]
        report = " | ".join(tail)[:300]
    return done.returncode, report, seconds, edits


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("horovod_src", help="a Horovod checkout or bare git directory")
    parser.add_argument("--examples", nargs="+", default=list(EXAMPLES), choices=list(EXAMPLES))
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--no-keras3-edits", action="store_true",
                        help="run the examples exactly as renamed, Keras 2 arguments included")
    args = parser.parse_args(argv)
    failed = 0
    rows = []
    for name in args.examples:
        work = Path(tempfile.mkdtemp(prefix=f"spark-hvd-horovod-{name}-"))
        code, report, seconds, edits = run_example(name, read_source(args.horovod_src, EXAMPLES[name]), work,
                                                   args.num_proc, args.epochs, not args.no_keras3_edits)
        failed += code != 0
        rows.append((name, code, report, seconds, edits))
        print(f"{name}: exit {code}, {report}, {seconds:.0f} s (log: {work / (name + '.log')})", flush=True)
    print("\n| example | changed beyond the rename | exit | result | seconds |\n|---|---|---|---|---|")
    for name, code, report, seconds, edits in rows:
        print(f"| {EXAMPLES[name]} | {'; '.join(edits) or 'nothing'} | {code} | {report} | {seconds:.0f} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
