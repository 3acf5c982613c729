"""Training throughput at np=1 and np=2: spark-hvd's DistributedOptimizer next to PyTorch DDP (gloo).

    python benchmarks/training_scaling.py [--models mlp cnn tabular deep] [--repeats 3] [--steps 30]
                                          [--batch mlp=64 --batch tabular=32,128,512] [--pin] [--json PATH]
                                          [--frameworks spark-hvd spark-hvd-per-gradient spark-hvd-buckets ddp-gloo]

Models train on synthetic data with one torch thread per rank: two compute-bound ones, an MLP of
4.2 million parameters (1024-2048-1024-10, batch 64 per rank) and a small CNN on 32x32 RGB images
(2.2 million parameters, batch 32 per rank); the small tabular MLP of fraud detection (16 features,
16-64-64-2, 5.4 thousand parameters) at batches 32, 128 and 512, where per-step communication
overhead decides whether two ranks beat one; and a deep residual MLP with 162 parameter tensors
(40 blocks of Linear(128, 128) + LayerNorm, 0.7 million parameters, batch 64), where the number
of requests per step counts. ``spark-hvd`` is DistributedOptimizer as it comes (buckets of 25 MiB),
``spark-hvd-per-gradient`` the same with ``bucket_cap_mb=0`` (one request per gradient, Horovod's
way) and ``spark-hvd-buckets`` with ``bucket_cap_mb`` set by ``--bucket-mb``. Every configuration runs as fresh processes:
spark-hvd ranks through ``spark_hvd.runner.run``, DDP ranks as ``torch.distributed`` gloo
processes on 127.0.0.1, and plain single-process torch as the common baseline. After warm-up,
every rank times the same number of steps between two barriers.

Reported per framework and model:
- samples/s: all ranks' samples over the slowest rank's wall time;
- efficiency: samples/s at np=2 over twice the same framework's np=1 (the issue's measure), and
  the same against plain torch at np=1;
- CPU efficiency: CPU time per sample at np=1 over CPU time per sample per rank at np=2 (all
  threads of a rank's process). On a quiet machine with a core per rank the two agree; on a
  shared machine the wall-clock figures swing with other load, the CPU figures much less.
Configurations are interleaved across ``--repeats`` runs and the medians count. The table goes
to stdout, raw numbers, load averages and machine facts to JSON.
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
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

__all__ = ["main", "MODELS", "FRAMEWORKS"]

HERE = Path(__file__).resolve().parent
DEFAULT_JSON = HERE / "results" / "training_scaling.json"
FRAMEWORKS = ("spark-hvd", "spark-hvd-per-gradient", "spark-hvd-buckets", "ddp-gloo")
DEFAULT_FRAMEWORKS = ("spark-hvd", "spark-hvd-per-gradient", "ddp-gloo")
MODELS: Dict[str, Dict[str, Any]] = {
    "mlp": {"batch": [64], "describe": "MLP 1024-2048-1024-10 (4.2M parameters)"},
    "cnn": {"batch": [32], "describe": "CNN 3x32x32: conv32-conv64-pool-conv128-pool-fc256-fc10 (2.2M parameters)"},
    # Its steps take about a millisecond: it times 30 times as many as --steps (and warms up 10
    # times as long), so a run lasts long enough to average out scheduling noise.
    "tabular": {"batch": [32, 128, 512], "describe": "tabular MLP 16-64-64-2 (5.4k parameters)", "step_scale": 30,
                "warmup_scale": 10},
    "deep": {"batch": [64], "describe": "residual MLP, 40 x (Linear 128-128 + LayerNorm) + head (162 tensors, 0.7M)"},
}
DEFAULT_MODELS = ("mlp", "cnn", "tabular", "deep")
TARGET_EFFICIENCY = 0.90


# -- what every rank runs ---------------------------------------------------------------------------
def _build(model_name: str) -> Tuple[Any, Tuple[int, ...]]:
    import torch

    torch.manual_seed(0)
    nn = torch.nn
    if model_name == "mlp":
        model = nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 1024), nn.ReLU(), nn.Linear(1024, 10))
        return model, (1024,)
    if model_name == "tabular":
        return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2)), (16,)
    if model_name == "deep":
        class Block(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.linear, self.norm = nn.Linear(128, 128), nn.LayerNorm(128)

            def forward(self, x: Any) -> Any:
                return x + torch.relu(self.norm(self.linear(x)))

        return nn.Sequential(*[Block() for _ in range(40)], nn.Linear(128, 10)), (128,)
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(128 * 8 * 8, 256), nn.ReLU(), nn.Linear(256, 10),
    )
    return model, (3, 32, 32)


def _synthetic_step(model: Any, optimizer: Any, shape: Tuple[int, ...], batch: int) -> Callable[[], None]:
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, *shape, generator=g)
    classes = 2 if shape == (16,) else 10  # the tabular model is a binary classifier
    y = torch.randint(0, classes, (batch,), generator=g)

    def step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    return step


def _timed(step: Callable[[], None], barrier: Callable[[], None], config: Dict[str, Any]) -> Dict[str, float]:
    """Wall and process CPU seconds of ``config['steps']`` steps, after warm-up, between barriers."""
    for _ in range(config["warmup"]):
        step()
    barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(config["steps"]):
        step()
    cpu = time.process_time() - cpu
    barrier()
    return {"seconds": time.perf_counter() - wall, "cpu_seconds": cpu}


def _pin(config: Dict[str, Any], rank: int) -> None:
    """With --pin, bind this process (and threads it starts later) to one CPU per rank."""
    if config.get("pin") and hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})


def sparkhvd_rank(config: Dict[str, Any]) -> Dict[str, Any]:
    """One spark-hvd rank: DistributedOptimizer training."""
    import torch

    import spark_hvd.torch as hvd
    from spark_hvd.runtime.config import read_setting

    _pin(config, read_setting("local_rank") or 0)  # before init() starts the engine thread
    torch.set_num_threads(1)
    hvd.init()
    try:
        model, shape = _build(config["model"])
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             bucket_cap_mb=config.get("bucket_cap_mb"))
        return _timed(_synthetic_step(model, optimizer, shape, config["batch"]), hvd.barrier, config)
    finally:
        hvd.shutdown()


def plain_process(config: Dict[str, Any]) -> Dict[str, Any]:
    """Single-process torch without any distributed framework: the common baseline."""
    import torch

    _pin(config, 0)
    torch.set_num_threads(1)
    model, shape = _build(config["model"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return _timed(_synthetic_step(model, optimizer, shape, config["batch"]), lambda: None, config)


def ddp_rank(config: Dict[str, Any], rank: int) -> Dict[str, Any]:
    """One DDP rank over gloo; the launcher sets RANK, WORLD_SIZE and MASTER_* variables."""
    import datetime

    import torch
    import torch.distributed as dist

    _pin(config, rank)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    try:
        model, shape = _build(config["model"])
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        return _timed(_synthetic_step(ddp, optimizer, shape, config["batch"]), dist.barrier, config)
    finally:
        dist.destroy_process_group()


# -- launching ------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_processes(config: Dict[str, Any], np: int, timeout: float) -> List[Dict[str, Any]]:
    """Run ``np`` copies of this script as DDP ranks (or one plain process); collect their JSON."""
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="training-bench-") as tmp:
        procs = []
        for rank in range(np):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(np), LOCAL_RANK=str(rank),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo",
                       OMP_NUM_THREADS="1")
            out = os.path.join(tmp, f"rank{rank}.json")
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "--rank-process", json.dumps(config), str(rank), out], env=env))
        try:
            deadline = time.monotonic() + timeout
            for proc in procs:
                code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
                if code != 0:
                    raise RuntimeError(f"a {config['framework']} rank exited with code {code}; see its output above")
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(np)]


def _launch(framework: str, config: Dict[str, Any], np: int, timeout: float) -> Dict[str, float]:
    """One run: samples/s over the slowest rank's wall time, and CPU ms per sample per rank."""
    config = dict(config, framework=framework)
    bucket_mb = config.pop("bucket_mb", None)
    if framework == "spark-hvd-buckets":
        config["bucket_cap_mb"] = bucket_mb
    elif framework == "spark-hvd-per-gradient":
        config["bucket_cap_mb"] = 0
    if framework.startswith("spark-hvd"):
        from spark_hvd.runner import run

        results = run(sparkhvd_rank, args=(config,), np=np, timeout=timeout, env={"OMP_NUM_THREADS": "1"})
    else:
        results = _launch_processes(config, np, timeout)
    samples = config["batch"] * config["steps"]
    return {
        "samples_per_second": np * samples / max(r["seconds"] for r in results),
        "cpu_ms_per_sample": 1000 * statistics.mean(r["cpu_seconds"] for r in results) / samples,
    }


# -- report ---------------------------------------------------------------------------------------------
def _table(rows: List[Dict[str, Any]]) -> str:
    header = (f"{'model':<12} {'framework':<17} {'np=1 samples/s':>15} {'np=2 samples/s':>15} {'np2/np1':>8} "
              f"{'efficiency':>11} {'vs torch':>9} {'CPU eff.':>9} {'target':>7}")
    lines = [header, "-" * len(header)]
    for row in rows:
        ok = "met" if row["efficiency"] >= row["target"] else "missed"
        lines.append(
            f"{row['model'] + '@' + str(row['batch_per_rank']):<12} {row['framework']:<17} {row['np1']:>15.1f} "
            f"{row['np2']:>15.1f} {row['np2'] / row['np1']:>8.2f} "
            f"{row['efficiency'] * 100:>10.1f}% {row['vs_torch'] * 100:>8.1f}% {row['cpu_efficiency'] * 100:>8.1f}% "
            f"{ok:>7}"
        )
    return "\n".join(lines)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(DEFAULT_MODELS))
    parser.add_argument("--frameworks", nargs="+", choices=FRAMEWORKS, default=list(DEFAULT_FRAMEWORKS))
    parser.add_argument("--repeats", type=int, default=3, help="runs per configuration; the median counts")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before timing")
    parser.add_argument("--batch", action="append", default=[], metavar="MODEL=ROWS[,ROWS...]",
                        help="rows per rank per step for a model, e.g. mlp=128 or tabular=32,512 (default: mlp=64, "
                             "cnn=32, tabular=32,128,512, deep=64)")
    parser.add_argument("--pin", action="store_true", help="pin rank r to the r-th allowed CPU")
    parser.add_argument("--bucket-mb", type=float, default=1.0,
                        help="bucket_cap_mb of the spark-hvd-buckets framework (default 1; spark-hvd itself uses 25)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one run may take")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write the raw results")
    parser.add_argument("--rank-process", nargs=3, metavar=("CONFIG", "RANK", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.steps < 1 or args.warmup < 0:
        parser.error(f"--repeats {args.repeats} and --steps {args.steps} must be >= 1, --warmup >= 0")
    args.batches = {m: list(spec["batch"]) for m, spec in MODELS.items()}
    for item in args.batch:
        model, _, rows = item.partition("=")
        sizes = rows.split(",")
        if model not in MODELS or not all(r.isdigit() and int(r) >= 1 for r in sizes):
            parser.error(f"--batch {item!r} is invalid: expected MODEL=ROWS[,ROWS...] with MODEL in {sorted(MODELS)} "
                         "and ROWS >= 1")
        args.batches[model] = [int(r) for r in sizes]
    return args


def _rank_process(config_text: str, rank: str, out: str) -> int:
    config = json.loads(config_text)
    result = plain_process(config) if config["framework"] == "torch" else ddp_rank(config, int(rank))
    Path(out).write_text(json.dumps(result))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.rank_process:
        return _rank_process(*args.rank_process)
    import torch

    runs = [("torch", 1)] + [(f, np) for f in args.frameworks for np in (1, 2)]
    measured: Dict[str, List[Dict[str, float]]] = {}
    loads = []
    cases = [(model, batch) for model in args.models for batch in args.batches[model]]
    for repeat in range(args.repeats):
        for model, batch in cases:
            scale = MODELS[model]
            config = {"model": model, "batch": batch, "steps": args.steps * scale.get("step_scale", 1),
                      "warmup": args.warmup * scale.get("warmup_scale", 1),
                      "pin": args.pin, "bucket_mb": args.bucket_mb}
            for framework, np in runs:
                key = f"{model}@{batch}/{framework}/np{np}"
                result = _launch(framework, config, np, args.timeout)
                measured.setdefault(key, []).append(result)
                loads.append(os.getloadavg()[0])
                print(f"run {repeat + 1}/{args.repeats} {key}: {result['samples_per_second']:.1f} samples/s, "
                      f"{result['cpu_ms_per_sample']:.3f} CPU ms/sample (load {loads[-1]:.2f})",
                      file=sys.stderr, flush=True)

    def median(key: str, field: str) -> float:
        return statistics.median(r[field] for r in measured[key])

    rows = []
    for model, batch in cases:
        case = f"{model}@{batch}"
        base = median(f"{case}/torch/np1", "samples_per_second")
        for framework in args.frameworks:
            np1 = median(f"{case}/{framework}/np1", "samples_per_second")
            np2 = median(f"{case}/{framework}/np2", "samples_per_second")
            cpu1 = median(f"{case}/{framework}/np1", "cpu_ms_per_sample")
            cpu2 = median(f"{case}/{framework}/np2", "cpu_ms_per_sample")
            rows.append({"model": model, "framework": framework, "batch_per_rank": batch,
                         "np1": np1, "np2": np2, "torch_np1": base, "efficiency": np2 / (2 * np1),
                         "vs_torch": np2 / (2 * base), "cpu_efficiency": cpu1 / cpu2, "target": TARGET_EFFICIENCY})
    print("efficiency: np=2 samples/s over 2 x the same framework's np=1; vs torch: over 2 x plain torch np=1;")
    print("CPU eff.: CPU time per sample at np=1 over that per rank at np=2 (less sensitive to other load)")
    print(_table(rows))
    for model, batch in cases:
        effs = {r["framework"]: r["efficiency"] for r in rows if (r["model"], r["batch_per_rank"]) == (model, batch)}
        if {"spark-hvd", "ddp-gloo"} <= effs.keys():
            verdict = "at least" if effs["spark-hvd"] >= effs["ddp-gloo"] else "below"
            print(f"{model}@{batch}: spark-hvd scales {verdict} DDP's efficiency "
                  f"({effs['spark-hvd'] * 100:.1f}% vs {effs['ddp-gloo'] * 100:.1f}%)")
        tabular = [r for r in rows if r["model"] == "tabular" and r["batch_per_rank"] == batch
                   and r["framework"] == "spark-hvd" and model == "tabular"]
        for r in tabular:
            verdict = "met" if batch < 128 or r["np2"] >= r["np1"] else "missed"
            print(f"tabular@{batch}: spark-hvd np=2 / np=1 rows/s = {r['np2'] / r['np1']:.2f} "
                  f"(target >= 1 from batch 128 up: {verdict if batch >= 128 else 'not a target below 128'})")
    report = {
        "rows": rows,
        "runs": measured,
        "models": {m: MODELS[m]["describe"] for m in args.models},
        "batch_per_rank": {m: args.batches[m] for m in args.models},
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "pinned": args.pin,
        "load_average_after_each_run": loads,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__},
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
