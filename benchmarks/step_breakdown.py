"""Where one training step's time goes at np=2: each phase of the step, timed on every rank, for
spark-hvd's DistributedOptimizer, DDP (gloo), and controls that separate communication from what
merely pausing does to the compute around it.

    python benchmarks/step_breakdown.py [--model tabular] [--batch 128] [--steps 3000] [--repeats 2]
                                        [--pause-us 250] [--json PATH]

Every mode runs as fresh processes through ``spark_hvd.runner.run`` with one torch thread per rank
(DDP ranks form a gloo group on 127.0.0.1 and shut spark-hvd down before timing):

- ``torch np=1``: one process, plain torch;
- ``torch x2``: two processes training at once with no communication at all;
- ``spark-hvd``: DistributedOptimizer (the default buckets);
- ``ddp-gloo``: DistributedDataParallel over gloo;
- ``x2 + 4 B spark-hvd`` / ``x2 + 4 B gloo``: plain steps, each followed by a 4-byte allreduce;
- ``x2 + spin`` / ``x2 + sleep``: plain steps, each followed by ``--pause-us`` of busy loop or sleep.

For each phase (zero_grad, forward with the loss, backward, optimizer step, what follows the step)
the table shows the median microseconds over the timed steps, the larger of the ranks' medians;
``step`` is the wall time per step of the slowest rank. Forward and backward carry no
communication in any mode but spark-hvd's and DDP's (their gradient hooks run in backward), so a
control whose forward and backward grow against ``torch x2`` shows the cost the pause itself lays
on the compute that follows it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

from training_scaling import MODELS, _build  # noqa: E402

__all__ = ["main", "MODES"]

PHASES = ("zero_grad", "forward", "backward", "opt.step", "after")
MODES = ("torch np=1", "torch x2", "spark-hvd", "ddp-gloo", "x2 + 4 B spark-hvd", "x2 + 4 B gloo", "x2 + spin",
         "x2 + sleep")
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "step_breakdown.json"


def rank_main(config: Dict[str, Any]) -> Dict[str, Any]:
    """One rank of one mode: train ``steps`` timed steps, timing every phase."""
    import datetime
    import os

    import numpy as np
    import torch
    import torch.nn.functional as F

    import spark_hvd.torch as hvd

    torch.set_num_threads(1)
    mode = config["mode"]
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    dist = None
    if mode in ("ddp-gloo", "x2 + 4 B gloo"):
        import socket

        import torch.distributed as dist

        port = 0
        if rank == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        port = hvd.broadcast_object(port, root_rank=0)
        hvd.shutdown()  # only gloo communicates from here on
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
        dist.init_process_group("gloo", rank=rank, world_size=size, timeout=datetime.timedelta(seconds=120))
    model, shape = _build(config["model"])
    if mode == "ddp-gloo":
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if mode == "spark-hvd":
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(config["batch"], *shape, generator=g)
    y = torch.randint(0, 2 if shape == (16,) else 10, (config["batch"],), generator=g)
    scalar = torch.zeros(1)
    scalar_np = np.zeros(1, np.float32)
    pause = config["pause_us"] / 1e6
    clock = time.perf_counter

    def after() -> None:
        if mode == "x2 + 4 B spark-hvd":
            hvd.allreduce_(torch.from_numpy(scalar_np), name="after.step")
        elif mode == "x2 + 4 B gloo":
            dist.all_reduce(scalar)
        elif mode == "x2 + spin":
            end = clock() + pause
            while clock() < end:
                pass
        elif mode == "x2 + sleep":
            time.sleep(pause)

    samples: List[List[float]] = [[] for _ in PHASES]

    def step(record: bool) -> None:
        t0 = clock()
        optimizer.zero_grad()
        t1 = clock()
        loss = F.cross_entropy(model(x), y)
        t2 = clock()
        loss.backward()
        t3 = clock()
        optimizer.step()
        t4 = clock()
        after()
        t5 = clock()
        if record:
            for i, (a, b) in enumerate(((t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5))):
                samples[i].append((b - a) * 1e6)

    def barrier() -> None:
        if dist is not None:
            dist.barrier()
        elif size > 1:
            hvd.barrier()

    try:
        for _ in range(config["warmup"]):
            step(False)
        barrier()
        start = clock()
        for _ in range(config["steps"]):
            step(True)
        wall = clock() - start
        barrier()
    finally:
        if dist is not None:
            dist.destroy_process_group()
        else:
            hvd.shutdown()
    return {"rank": rank, "step_us": wall / config["steps"] * 1e6,
            "phases_us": {name: statistics.median(values) for name, values in zip(PHASES, samples)}}


def run_mode(mode: str, config: Dict[str, Any], timeout: float) -> Dict[str, Any]:
    from spark_hvd.runner import run

    results = run(rank_main, args=(dict(config, mode=mode),), np=1 if mode == "torch np=1" else 2, timeout=timeout,
                  env={"OMP_NUM_THREADS": "1"})
    return {"step_us": max(r["step_us"] for r in results),
            "phases_us": {p: max(r["phases_us"][p] for r in results) for p in PHASES}}


def _median_runs(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    return {"step_us": statistics.median(r["step_us"] for r in runs),
            "phases_us": {p: statistics.median(r["phases_us"][p] for r in runs) for p in PHASES}}


def table(results: Dict[str, Dict[str, Any]]) -> str:
    base = results.get("torch x2", {}).get("step_us")
    lines = [f"{'mode':<20}" + "".join(f"{p:>11}" for p in PHASES) + f"{'step':>10}{'vs x2':>8}"]
    for mode, r in results.items():
        ratio = f"{r['step_us'] / base:.2f}" if base else "-"
        lines.append(f"{mode:<20}" + "".join(f"{r['phases_us'][p]:>11.0f}" for p in PHASES)
                     + f"{r['step_us']:>10.0f}{ratio:>8}")
    return "\n".join(lines)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Per-phase time of one training step at np=2, with controls.")
    parser.add_argument("--model", choices=sorted(MODELS), default="tabular")
    parser.add_argument("--batch", type=int, default=128, help="rows per rank per step (default 128)")
    parser.add_argument("--steps", type=int, default=3000, help="timed steps per run (default 3000)")
    parser.add_argument("--warmup", type=int, default=300, help="untimed steps first (default 300)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per mode, interleaved; medians count")
    parser.add_argument("--pause-us", type=float, default=250.0, help="length of the spin and sleep controls")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write the raw results")
    args = parser.parse_args(argv)
    for flag in ("batch", "steps", "repeats"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} {getattr(args, flag)} must be at least 1")
    if args.warmup < 0 or args.pause_us < 0:
        parser.error("--warmup and --pause-us must not be negative")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    config = {"model": args.model, "batch": args.batch, "steps": args.steps, "warmup": args.warmup,
              "pause_us": args.pause_us}
    runs: Dict[str, List[Dict[str, Any]]] = {mode: [] for mode in args.modes}
    for repeat in range(args.repeats):
        for mode in args.modes:
            runs[mode].append(run_mode(mode, config, args.timeout))
            print(f"run {repeat + 1}/{args.repeats} {mode}: {runs[mode][-1]['step_us']:.0f} us per step", flush=True)
    results = {mode: _median_runs(r) for mode, r in runs.items()}
    print(f"\n{MODELS[args.model]['describe']}, batch {args.batch} per rank, medians of {args.repeats} run(s), "
          "microseconds (per phase: median step, slower rank; step: wall time per step, slowest rank)")
    print(table(results))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"config": config, "runs": runs, "results": results}, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
