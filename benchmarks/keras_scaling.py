"""Keras 3 training at np=1 and np=2 through spark_hvd.keras, on the TensorFlow and the torch backend.

    python benchmarks/keras_scaling.py [--backends tensorflow torch] [--models deep small]
                                       [--repeats 2] [--steps 200] [--json PATH]

A model of many small layers (``deep``: 40 x Dense(32) + head, 82 variables) and a small one
(``small``: 3 layers, 6 variables) train with ``model.fit`` on synthetic data, batch 64 per rank,
one thread per rank. Frameworks, each run as fresh processes:

- ``keras``: plain Keras in one process, the baseline (np=1 only);
- ``spark-hvd``: ``spark_hvd.keras.DistributedOptimizer`` as it comes (each dtype's gradients
  travel as one flat tensor);
- ``spark-hvd-per-gradient``: the same with ``groups=<number of variables>``, one request per
  gradient (how Horovod reduces gradients without grouping);
- ``tf-mwms``: TensorFlow's own ``MultiWorkerMirroredStrategy`` with two workers on 127.0.0.1
  (TensorFlow backend only), reported as failed with its reason when Keras 3 refuses it.

Each run times ``--steps`` steps of one ``fit`` epoch (best of three epochs after a warm-up).
Reported: ms per step, samples/s of all ranks, and efficiency: np=2 samples/s over twice the
plain Keras np=1 samples/s. Configurations are interleaved across ``--repeats`` runs; medians count.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

__all__ = ["main"]

HERE = Path(__file__).resolve().parent
DEFAULT_JSON = HERE / "results" / "keras_scaling.json"
MODELS = {"deep": 40, "small": 2}
FRAMEWORKS = ("spark-hvd", "spark-hvd-per-gradient", "tf-mwms")
BATCH = 64


def _fit_and_time(config: Dict[str, Any], strategy: Any = None, distributed: Optional[Any] = None) -> float:
    """Seconds per step of the best of three timed epochs (after a warm-up epoch)."""
    import numpy as np
    import keras

    def build() -> Any:
        keras.utils.set_random_seed(0)
        layers = [keras.Input((32,))] + [keras.layers.Dense(32, activation="relu")
                                         for _ in range(MODELS[config["model"]])] + [keras.layers.Dense(1)]
        model = keras.Sequential(layers)
        optimizer = keras.optimizers.SGD(0.01)
        if distributed is not None:
            optimizer = distributed(optimizer, len(model.trainable_variables))
        model.compile(optimizer=optimizer, loss="mse")
        return model

    if strategy is not None:
        with strategy.scope():
            model = build()
    else:
        model = build()
    steps, batch = config["steps"], BATCH * config.get("workers", 1)
    rng = np.random.default_rng(config.get("rank", 0))
    x = rng.random((batch * steps, 32), dtype=np.float32)
    y = rng.random((batch * steps, 1), dtype=np.float32)
    if strategy is not None:
        import tensorflow as tf

        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
        fit = lambda n: model.fit(data.take(n), epochs=1, verbose=0)  # noqa: E731
    else:
        fit = lambda n: model.fit(x[:n * batch], y[:n * batch], batch_size=batch, epochs=1,  # noqa: E731
                                  verbose=0, shuffle=False)
    fit(20)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        fit(steps)
        best = min(best, time.perf_counter() - start)
    return best / steps


def _threads(backend: str) -> None:
    if backend == "tensorflow":
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    else:
        import torch

        torch.set_num_threads(1)


def sparkhvd_rank(config: Dict[str, Any]) -> Dict[str, Any]:
    _threads(config["backend"])
    import spark_hvd.keras as hvd

    hvd.init()
    try:
        def distributed(optimizer: Any, variables: int) -> Any:
            groups = variables if config["framework"] == "spark-hvd-per-gradient" else None
            return hvd.DistributedOptimizer(optimizer, groups=groups)

        seconds = _fit_and_time({**config, "rank": hvd.rank()}, distributed=distributed)
        import numpy as np

        worst = hvd.allreduce(np.array([seconds]), op=hvd.Max, name="bench.keras.time")
        return {"seconds_per_step": float(np.asarray(worst)[0])}
    finally:
        hvd.shutdown()


def _single(config: Dict[str, Any]) -> Dict[str, Any]:
    _threads(config["backend"])
    return {"seconds_per_step": _fit_and_time(config)}


def _mwms(config: Dict[str, Any]) -> Dict[str, Any]:
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": config["workers_at"]},
                                          "task": {"type": "worker", "index": config["rank"]}})
    _threads("tensorflow")
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    return {"seconds_per_step": _fit_and_time({**config, "workers": len(config["workers_at"])}, strategy=strategy)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _processes(kind: str, configs: List[Dict[str, Any]], backend: str, timeout: float) -> List[Dict[str, Any]]:
    """Run ``kind`` (single or mwms) in one fresh process per config; their results, or raise."""
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3", OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for i, config in enumerate(configs):
            out = Path(tmp) / f"{i}.json"
            procs.append((subprocess.Popen([sys.executable, __file__, "--_rank", kind, json.dumps(config), str(out)],
                                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True),
                          out))
        results, errors = [], []
        for proc, out in procs:
            try:
                _, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
                err = f"timed out after {timeout:.0f} s\n{err}"
            if proc.returncode != 0 or not out.exists():
                lines = [line.strip() for line in err.strip().splitlines() if line.strip()]
                raised = [line for line in lines if re.match(r"^[\w.]+(Error|Exception): ", line)]
                if raised and lines[-1] != raised[-1]:  # a message of several lines: its start and end
                    errors.append(f"{raised[-1][:80]} ... {lines[-1][-160:]}")
                else:
                    errors.append((raised or lines or [f"exit {proc.returncode}"])[-1][:300])
            else:
                results.append(json.loads(out.read_text()))
        if errors:
            raise RuntimeError(errors[0])
        return results


def _run(framework: str, backend: str, model: str, np: int, steps: int, timeout: float) -> Dict[str, Any]:
    config = {"backend": backend, "model": model, "steps": steps, "framework": framework}
    if framework == "keras":
        return _processes("single", [config], backend, timeout)[0]
    if framework == "tf-mwms":
        workers = [f"127.0.0.1:{_free_port()}" for _ in range(np)]
        results = _processes("mwms", [{**config, "rank": r, "workers_at": workers} for r in range(np)], backend,
                             timeout)
        return {"seconds_per_step": max(r["seconds_per_step"] for r in results)}
    from spark_hvd.runner import run

    return run(sparkhvd_rank, args=(config,), np=np, env={"KERAS_BACKEND": backend, "OMP_NUM_THREADS": "1",
                                                           "TF_CPP_MIN_LOG_LEVEL": "3"})[0]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", nargs="+", choices=("tensorflow", "torch"), default=["tensorflow", "torch"])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["deep", "small"])
    parser.add_argument("--frameworks", nargs="+", choices=FRAMEWORKS, default=list(FRAMEWORKS))
    parser.add_argument("--repeats", type=int, default=2, help="runs per configuration; the median counts")
    parser.add_argument("--steps", type=int, default=200, help="timed steps per epoch")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write the raw results")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.steps < 1:
        parser.error(f"--repeats {args.repeats} and --steps {args.steps} must both be at least 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    plan = []
    for backend in args.backends:
        for model in args.models:
            plan.append(("keras", backend, model, 1))
            plan += [(f, backend, model, 2) for f in args.frameworks if f != "tf-mwms" or backend == "tensorflow"]
    times: Dict[tuple, List[float]] = {key: [] for key in plan}
    failures: Dict[tuple, str] = {}
    for repeat in range(args.repeats):
        for key in plan:
            if key in failures:
                continue
            framework, backend, model, np = key
            try:
                seconds = _run(framework, backend, model, np, args.steps, args.timeout)["seconds_per_step"]
            except Exception as exc:  # a peer that cannot run here is reported, the others go on
                failures[key] = f"{type(exc).__name__}: {exc}"
                print(f"run {repeat + 1}/{args.repeats} {model}/{backend}/{framework}/np{np}: FAILED {failures[key]}",
                      flush=True)
                continue
            times[key].append(seconds)
            print(f"run {repeat + 1}/{args.repeats} {model}/{backend}/{framework}/np{np}: {seconds * 1e3:.3f} ms/step",
                  flush=True)
    print("\nmodel   backend     framework                np  ms/step  samples/s  efficiency (np2 over 2 x keras np1)")
    rows = []
    for key in plan:
        framework, backend, model, np = key
        baseline = times.get(("keras", backend, model, 1)) or []
        if key in failures or not times[key]:
            print(f"{model:7s} {backend:11s} {framework:24s} {np:2d}  failed: {failures.get(key, 'no result')[:300]}")
            rows.append({"model": model, "backend": backend, "framework": framework, "np": np,
                         "error": failures.get(key, "no result")})
            continue
        step = statistics.median(times[key])
        rate = np * BATCH / step
        efficiency = ""
        if np == 2 and baseline:
            efficiency = f"{rate / (2 * BATCH / statistics.median(baseline)):.1%}"
        print(f"{model:7s} {backend:11s} {framework:24s} {np:2d}  {step * 1e3:7.3f}  {rate:9,.0f}  {efficiency}")
        rows.append({"model": model, "backend": backend, "framework": framework, "np": np,
                     "seconds_per_step": times[key], "samples_per_s": rate})
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"batch_per_rank": BATCH, "steps": args.steps, "rows": rows}, indent=2))
    print(f"wrote {args.json}")
    return 0


def _rank_main(kind: str, config_text: str, out: str) -> int:
    config = json.loads(config_text)
    result = _single(config) if kind == "single" else _mwms(config)
    Path(out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--_rank":
        sys.exit(_rank_main(*sys.argv[2:]))
    sys.exit(main())
