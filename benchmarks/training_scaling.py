"""Training throughput at np=1 and np=2: spark-hvd's DistributedOptimizer next to PyTorch DDP (gloo).

    python benchmarks/training_scaling.py [--models mlp cnn] [--repeats 3] [--steps 30] [--json PATH]

Two compute-bound models train on synthetic data, one torch thread per rank: an MLP of about
4.2 million parameters (1024-2048-1024-10, batch 64 per rank) and a small CNN on 32x32 RGB
images (batch 32 per rank). Each configuration is launched as fresh processes: spark-hvd ranks
through ``spark_hvd.runner.run``, DDP ranks as ``torch.distributed`` gloo processes on 127.0.0.1.
After warm-up steps, every rank times the same number of steps between two barriers; throughput
is samples per second over all ranks, using the slowest rank's time. Scaling efficiency is
throughput(np=2) / (2 x throughput(np=1)) of the same framework. Each configuration runs
``--repeats`` times (interleaved, to spread background load evenly) and the median counts.
The table goes to stdout, raw numbers and machine facts to JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

__all__ = ["main", "MODELS", "FRAMEWORKS"]

HERE = Path(__file__).resolve().parent
DEFAULT_JSON = HERE / "results" / "training_scaling.json"
FRAMEWORKS = ("spark-hvd", "ddp-gloo")
MODELS = {
    "mlp": {"batch": 64, "describe": "MLP 1024-2048-1024-10 (4.2M parameters)"},
    "cnn": {"batch": 32, "describe": "CNN 3x32x32: conv32-conv64-pool-conv128-pool-fc256-fc10 (2.2M parameters)"},
}
TARGET_EFFICIENCY = 0.90


# -- what every rank runs ---------------------------------------------------------------------------
def _build(model_name: str):
    import torch

    torch.manual_seed(0)
    nn = torch.nn
    if model_name == "mlp":
        model = nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 1024), nn.ReLU(), nn.Linear(1024, 10))
        shape = (1024,)
    else:
        model = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(128 * 8 * 8, 256), nn.ReLU(), nn.Linear(256, 10),
        )
        shape = (3, 32, 32)
    return model, shape


def _time_steps(step, barrier, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        step()
    barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    barrier()
    return time.perf_counter() - start


def _synthetic_step(model, optimizer, shape, batch: int):
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, *shape, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)

    def step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    return step


def sparkhvd_rank(config: Dict[str, Any]) -> Dict[str, Any]:
    """One spark-hvd rank: DistributedOptimizer training, timed."""
    import torch

    import spark_hvd.torch as hvd

    from spark_hvd.runtime.config import read_setting

    # Before init() starts the engine thread, so it inherits the placement.
    _pin(config, read_setting("local_rank") or 0)
    torch.set_num_threads(1)
    hvd.init()
    model, shape = _build(config["model"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    step = _synthetic_step(model, optimizer, shape, config["batch"])
    seconds = _time_steps(step, hvd.barrier, config["warmup"], config["steps"])
    slowest = hvd.allreduce(torch.tensor(seconds), op=hvd.Max, name="bench.seconds").item()
    result = {"rank": hvd.rank(), "size": hvd.size(), "seconds": seconds, "slowest": slowest}
    hvd.shutdown()
    return result


def _pin(config: Dict[str, Any], rank: int) -> None:
    if config.get("pin") and hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})


def plain_process(config: Dict[str, Any]) -> Dict[str, Any]:
    """Single-process torch without any distributed framework: the baseline both scale against."""
    import torch

    _pin(config, 0)
    torch.set_num_threads(1)
    model, shape = _build(config["model"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    step = _synthetic_step(model, optimizer, shape, config["batch"])
    seconds = _time_steps(step, lambda: None, config["warmup"], config["steps"])
    return {"rank": 0, "size": 1, "seconds": seconds, "slowest": seconds}


def ddp_rank(config: Dict[str, Any]) -> Dict[str, Any]:
    """One DDP rank (gloo), timed; the launcher sets RANK, WORLD_SIZE and MASTER_* variables."""
    import datetime

    import torch
    import torch.distributed as dist

    if config.get("framework") == "torch":
        return plain_process(config)
    _pin(config, int(os.environ["RANK"]))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    try:
        model, shape = _build(config["model"])
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        step = _synthetic_step(ddp, optimizer, shape, config["batch"])
        seconds = _time_steps(step, dist.barrier, config["warmup"], config["steps"])
        slowest = torch.tensor(seconds)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return {"rank": dist.get_rank(), "size": dist.get_world_size(), "seconds": seconds,
                "slowest": float(slowest)}
    finally:
        dist.destroy_process_group()


# -- launching ------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_ddp(config: Dict[str, Any], np: int, timeout: float) -> List[Dict[str, Any]]:
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="ddp-bench-") as tmp:
        procs = []
        for rank in range(np):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(np), LOCAL_RANK=str(rank),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo",
                       OMP_NUM_THREADS="1")
            out = os.path.join(tmp, f"rank{rank}.json")
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "--ddp-rank", json.dumps(config), out], env=env))
        try:
            deadline = time.monotonic() + timeout
            for proc in procs:
                code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
                if code != 0:
                    raise RuntimeError(f"a DDP rank exited with code {code}; see its output above")
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(np)]


def _launch(framework: str, config: Dict[str, Any], np: int, timeout: float) -> float:
    """Samples per second of one run: all ranks' samples over the slowest rank's time."""
    config = dict(config, framework=framework)
    if framework == "spark-hvd":
        from spark_hvd.runner import run

        results = run(sparkhvd_rank, args=(config,), np=np, timeout=timeout, env={"OMP_NUM_THREADS": "1"})
    else:
        results = _launch_ddp(config, np, timeout)
    slowest = max(r["slowest"] for r in results)
    return np * config["batch"] * config["steps"] / slowest


# -- report ---------------------------------------------------------------------------------------------
def _table(rows: List[Dict[str, Any]]) -> str:
    header = (f"{'model':<5} {'framework':<10} {'np=1 samples/s':>15} {'np=2 samples/s':>15} "
              f"{'efficiency':>11} {'vs torch':>9} {'target':>8}")
    lines = [header, "-" * len(header)]
    for row in rows:
        ok = "met" if row["efficiency"] >= row["target"] else "MISSED"
        lines.append(
            f"{row['model']:<5} {row['framework']:<10} {row['np1']:>15.1f} {row['np2']:>15.1f} "
            f"{row['efficiency'] * 100:>10.1f}% {row['vs_torch'] * 100:>8.1f}% {ok:>8}"
        )
    return "\n".join(lines)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["mlp", "cnn"])
    parser.add_argument("--frameworks", nargs="+", choices=FRAMEWORKS, default=list(FRAMEWORKS))
    parser.add_argument("--repeats", type=int, default=3, help="runs per configuration; the median counts")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before timing")
    parser.add_argument("--batch", action="append", default=[], metavar="MODEL=ROWS",
                        help="rows per rank per step for a model, e.g. mlp=128 (default: mlp=64, cnn=32)")
    parser.add_argument("--pin", action="store_true", help="pin rank r to the r-th allowed CPU")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one run may take")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write the raw results")
    parser.add_argument("--ddp-rank", nargs=2, metavar=("CONFIG", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.steps < 1 or args.warmup < 0:
        parser.error(f"--repeats {args.repeats} and --steps {args.steps} must be >= 1, --warmup >= 0")
    args.batches = {m: spec["batch"] for m, spec in MODELS.items()}
    for item in args.batch:
        model, _, rows = item.partition("=")
        if model not in MODELS or not rows.isdigit() or int(rows) < 1:
            parser.error(f"--batch {item!r} is invalid: expected MODEL=ROWS with MODEL in {sorted(MODELS)}")
        args.batches[model] = int(rows)
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.ddp_rank:
        config, out = args.ddp_rank
        Path(out).write_text(json.dumps(ddp_rank(json.loads(config))))
        return 0
    import torch

    runs = [("torch", 1)] + [(f, np) for f in args.frameworks for np in (1, 2)]
    samples: Dict[str, List[float]] = {}
    loads = []
    for repeat in range(args.repeats):
        for model in args.models:
            config = {"model": model, "batch": args.batches[model], "steps": args.steps, "warmup": args.warmup,
                      "pin": args.pin}
            for framework, np in runs:
                key = f"{model}/{framework}/np{np}"
                value = _launch(framework, config, np, args.timeout)
                samples.setdefault(key, []).append(value)
                loads.append(os.getloadavg()[0])
                print(f"run {repeat + 1}/{args.repeats} {key}: {value:.1f} samples/s (load {loads[-1]:.2f})",
                      file=sys.stderr, flush=True)
    rows = []
    for model in args.models:
        base = statistics.median(samples[f"{model}/torch/np1"])
        for framework in args.frameworks:
            np1 = statistics.median(samples[f"{model}/{framework}/np1"])
            np2 = statistics.median(samples[f"{model}/{framework}/np2"])
            rows.append({"model": model, "framework": framework, "np1": np1, "np2": np2, "torch_np1": base,
                         "efficiency": np2 / (2 * np1), "vs_torch": np2 / (2 * base), "target": TARGET_EFFICIENCY})
    print("efficiency = np=2 throughput / (2 x the same framework's np=1); vs torch: over 2 x plain torch np=1")
    print(_table(rows))
    for model in args.models:
        effs = {r["framework"]: r["efficiency"] for r in rows if r["model"] == model}
        if {"spark-hvd", "ddp-gloo"} <= effs.keys():
            verdict = "at least" if effs["spark-hvd"] >= effs["ddp-gloo"] else "below"
            print(f"{model}: spark-hvd scales {verdict} DDP's efficiency "
                  f"({effs['spark-hvd'] * 100:.1f}% vs {effs['ddp-gloo'] * 100:.1f}%)")
    report = {
        "rows": rows,
        "samples_per_second": samples,
        "models": {m: MODELS[m]["describe"] for m in args.models},
        "batch_per_rank": {m: args.batches[m] for m in args.models},
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "pinned": args.pin,
        "load_average_during_runs": loads,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__},
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
