"""The fraud demo's training speed before and after a change, measured in one invocation.

    python benchmarks/fraud_before_after.py [--before REV] [--runs 2] [--epochs 3] [--json PATH] [--no-floor]

Checks out ``--before`` (a git revision of this repository) into a temporary worktree and runs
``examples/fraud_detection.py`` from it and from this checkout in turn, ``--runs`` times each,
alternating, with the same interpreter and packages: only the project's code differs (the older
tree's modules come first on ``PYTHONPATH``, for the driver, Spark's Python workers and the
ranks alike). Each run's epoch lines (``epoch 2/3: ..., 52,000 rows/s``) give its training rows
per second; the first epoch, which includes the ranks' warm-up, is left out. Prints the medians
and their ratio (after over before).

In the same invocation (between the demo runs, so a machine's drift reaches both) it times the
floor: two bare torch loops at once, each in a process of its own with one torch thread, over
in-memory tensors of one rank's share of the demo's training rows (:data:`FLOOR_ROWS` each): the
demo's model, Adam, its weighted logistic loss and batch 256, no reader and no allreduce
(:data:`FLOOR_PASSES` passes). Both
revisions' rates are also given as a share of that floor, which bounds what any change can gain.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_JSON = ROOT / "benchmarks" / "results" / "fraud_before_after.json"
DEFAULT_BEFORE = "c6d1634"
"""The revision whose fraud demo the estimator-at-scale work set out to double."""
FLOOR_ROWS = 72_000
"""Training rows of one rank in the demo: 200,000 rows, 80% of them for training and 10% of those
for validation, over two ranks."""
FLOOR_BATCH = 256
FLOOR_PASSES = 4
"""Passes of each bare loop over its rows: one pass takes about a tenth of a second here, too
short to time steadily."""
_EPOCH = re.compile(r"epoch (\d+)/(\d+): .*?([\d,]+) rows/s")


def epoch_rates(output: str) -> List[float]:
    """Training rows/s of each epoch after the first, from a run's output."""
    rates = []
    for match in _EPOCH.finditer(output):
        if int(match.group(1)) > 1:
            rates.append(float(match.group(3).replace(",", "")))
    return rates


def run_demo(tree: Path, epochs: int) -> List[float]:
    env = dict(os.environ)
    if tree != ROOT:
        env["PYTHONPATH"] = os.pathsep.join([str(tree)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    done = subprocess.run([sys.executable, str(tree / "examples" / "fraud_detection.py"), "--epochs", str(epochs)],
                          cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"the demo of {tree} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    rates = epoch_rates(done.stdout + done.stderr)
    if not rates:
        raise RuntimeError(f"the demo of {tree} printed no epoch lines after the first:\n{done.stdout[-3000:]}")
    return rates


def bare_fraud_loop(example: str, rows: int, batch: int, seed: int, passes: int = 1) -> Dict[str, float]:
    """One rank's bare loop: the demo's model (from ``example``), Adam and the per-row weighted
    logistic loss, ``passes`` times over ``rows`` in-memory rows of 30 features; its seconds and
    the rows it trained on."""
    import importlib.util
    import time

    import numpy as np
    import torch

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # as the estimator's ranks do (flush_denormal=True)
    spec = importlib.util.spec_from_file_location("fraud_example", example)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.standard_normal((rows, len(module.FEATURES)), dtype=np.float32))
    y = torch.from_numpy((rng.random((rows, 1)) < 0.002).astype(np.float32))
    w = 1.0 + 19.0 * y.reshape(-1)
    torch.manual_seed(seed)
    model = module.FraudNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    steps = rows // batch
    started = time.perf_counter()
    for i in range(steps * passes):
        part = slice((i % steps) * batch, (i % steps + 1) * batch)
        optimizer.zero_grad()
        losses = torch.nn.functional.binary_cross_entropy_with_logits(model(x[part]), y[part], reduction="none")
        (losses.reshape(-1) * w[part]).mean().backward()
        optimizer.step()
    return {"seconds": time.perf_counter() - started, "rows": float(steps * batch * passes)}


def floor_rate(tree: Path, num_proc: int = 2, rows: int = FLOOR_ROWS) -> float:
    """Rows/s of ``num_proc`` bare loops of the demo's model running at once, ``rows`` each (the
    slowest one's time)."""
    from spark_hvd.runner import run

    results = run(bare_fraud_loop, args=(str(tree / "examples" / "fraud_detection.py"), rows, FLOOR_BATCH, 0,
                                         FLOOR_PASSES), np=num_proc, timeout=600)
    return sum(r["rows"] for r in results) / max(r["seconds"] for r in results)


def checkout(revision: str, folder: Path) -> Path:
    """``revision`` in a worktree at ``folder``, importable as spark_hvd (its runtime/ too)."""
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(folder), revision], check=True,
                   capture_output=True)
    # The installed package maps spark_hvd.runtime to this checkout's runtime/; inside the older
    # tree's package directory the path finder meets the older runtime first.
    link = folder / "spark_hvd" / "runtime"
    if not link.exists():
        link.symlink_to(folder / "runtime", target_is_directory=True)
    return folder


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default=DEFAULT_BEFORE, help="git revision to compare against")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--no-floor", action="store_true", help="leave out the bare loops of the demo's model")
    args = parser.parse_args(argv)
    floors: List[float] = []
    with tempfile.TemporaryDirectory(prefix="spark-hvd-before-") as scratch:
        before = checkout(args.before, Path(scratch) / "tree")
        try:
            rates: Dict[str, List[float]] = {"before": [], "after": []}
            for run in range(args.runs):
                for label, tree in (("before", before), ("after", ROOT)):
                    got = run_demo(tree, args.epochs)
                    rates[label].extend(got)
                    print(f"run {run + 1}, {label}: " + ", ".join(f"{r:,.0f}" for r in got) + " rows/s", flush=True)
                if not args.no_floor:
                    floors.append(floor_rate(ROOT))
                    print(f"run {run + 1}, floor (two bare loops at once): {floors[-1]:,.0f} rows/s", flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)], capture_output=True)
    medians = {label: statistics.median(values) for label, values in rates.items()}
    ratio = medians["after"] / medians["before"]
    print(f"\n| fraud demo training (epochs 2..{args.epochs}, median) | rows/s |\n|---|---|")
    print(f"| before ({args.before}) | {medians['before']:,.0f} |\n| after (this checkout) | {medians['after']:,.0f} |")
    floor = statistics.median(floors) if floors else None
    if floor is not None:
        print(f"| floor: two bare loops of the demo's model at once, in memory | {floor:,.0f} |")
    print(f"after / before: {ratio:.2f}x (target >= 2.0)")
    if floor is not None:
        print(f"share of the floor: before {medians['before'] / floor:.2f}x, after {medians['after'] / floor:.2f}x; "
              f"the most any change could give over before: {floor / medians['before']:.2f}x")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"benchmark": "fraud_before_after", "before": args.before, "rates": rates,
                                     "medians": medians, "ratio": ratio, "floors": floors, "floor": floor},
                                    indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
