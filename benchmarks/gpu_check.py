"""The CUDA/NCCL path end to end on a GPU machine: correctness, then allreduce time next to
torch.distributed's NCCL backend in the same processes.

    python benchmarks/gpu_check.py [--np N] [--sizes 4 1M 64M] [--json PATH]

One rank per visible GPU by default (NCCL refuses two ranks on one device). Each rank checks that
CUDA tensors take the NCCL path (no staging warning, a communicator exists), that every collective
gives the host path's answer (allreduce of each NCCL dtype single and fused, Average with
pre/postscale, broadcast, allgather and alltoall with uneven rows, reducescatter, a process set),
that a dtype NCCL lacks (int16) is staged and still right, that tensors written on a side stream
are read after that work, that DistributedOptimizer keeps a CUDA model identical on every
rank, and that TorchModel.transform's batched inference on the GPU matches the CPU. Then it times an in-place float32 Sum allreduce of each size through spark-hvd and through
torch.distributed (NCCL), and prints both with their ratio.

Without a CUDA device it says so and exits 0: nothing here can run on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from _peers_common import KiB, MiB  # noqa: E402

DEFAULT_SIZES = [4, 64 * KiB, MiB, 16 * MiB, 256 * MiB]


def _parse_size(text: str) -> int:
    units = {"": 1, "K": KiB, "M": MiB, "G": 1024 * MiB}
    text = text.strip().upper().rstrip("B").rstrip("I")
    unit = text[-1] if text and text[-1] in units else ""
    number = text[:-1] if unit else text
    if not number.isdigit() or int(number) * units[unit] % 4:
        raise argparse.ArgumentTypeError(f"size {text!r} is not understood: expected e.g. 4, 64K, 1M (a multiple of 4)")
    return int(number) * units[unit]


def _time(fn: Any, sync: Any, budget_s: float = 2.0, warmup: int = 3) -> List[float]:
    for _ in range(warmup):
        fn()
    sync()
    times: List[float] = []
    start = time.perf_counter()
    while len(times) < 5 or (time.perf_counter() - start < budget_s and len(times) < 200):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return times


def _checks(hvd: Any, torch: Any, dev: Any) -> List[str]:
    """The correctness checks; returns what passed (raises at the first failure)."""
    from spark_hvd.runtime import api

    rank, size = hvd.rank(), hvd.size()
    passed: List[str] = []
    assert hvd.nccl_built(), f"nccl_built() is False: {hvd.nccl_problem()}"
    passed.append(f"NCCL found ({hvd.nccl_problem() or 'usable'})")

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a staging warning fails the check
        for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64,
                      torch.uint8, torch.int8):
            x = (torch.arange(10, device=dev) % 7 + rank).to(dtype)
            got = hvd.allreduce(x, op=hvd.Sum, name=f"c.sum.{dtype}")
            want = ((torch.arange(10) % 7) * size + sum(range(size))).to(dtype)
            assert got.is_cuda and torch.equal(got.cpu(), want), (dtype, got, want)
        passed.append("allreduce Sum of 8 dtypes on the device")
        device = api._state.session.engine.executor.device
        assert device is not None and device.plane.comms, "no NCCL communicator was made: the tensors were staged"
        passed.append(f"NCCL communicator made ({len(device.plane.comms)}), no host staging")
        handles = [hvd.allreduce_async(torch.full((1000 + i,), float(rank + i), device=dev), op=hvd.Average,
                                       name=f"c.fused.{i}", prescale_factor=2.0, postscale_factor=0.5)
                   for i in range(64)]
        for i, handle in enumerate(handles):
            out = hvd.synchronize(handle)
            expect = sum(r + i for r in range(size)) / size
            assert torch.allclose(out, torch.full_like(out, expect)), (i, out[:3], expect)
        passed.append("64 async Average allreduces with pre/postscale (fused)")
        b = torch.full((33,), float(rank), device=dev)
        hvd.broadcast_(b, root_rank=size - 1, name="c.bcast")
        assert torch.all(b == size - 1)
        passed.append("broadcast_")
        g = hvd.allgather(torch.full((rank + 1, 3), rank, device=dev, dtype=torch.int64), name="c.gather")
        assert g.is_cuda and g.cpu().tolist() == [[r] * 3 for r in range(size) for _ in range(r + 1)]
        passed.append("allgather with uneven rows")
        splits = torch.tensor([(rank + j) % 3 for j in range(size)], dtype=torch.int32)
        send = torch.cat([torch.full((int(n),), 100 * rank + j, dtype=torch.int32) for j, n in enumerate(splits)]).to(dev)
        received, got_splits = hvd.alltoall(send, splits=splits, name="c.a2a")
        assert received.cpu().tolist() == [100 * r + rank for r in range(size) for _ in range((r + rank) % 3)]
        assert got_splits.tolist() == [(r + rank) % 3 for r in range(size)]
        passed.append("alltoall with uneven splits")
        rows = 2 * size + 1
        part = hvd.reducescatter(torch.ones(rows, 4, device=dev) * (rank + 1), op=hvd.Sum, name="c.rs")
        mine = rows // size + (1 if rank < rows % size else 0)
        assert part.shape == (mine, 4) and float(part.max()) == sum(range(1, size + 1))
        passed.append("reducescatter with uneven blocks")
        if size > 1:
            firsts = hvd.add_process_set(list(range(size - 1)))
            if firsts.included():
                y = hvd.allreduce(torch.ones(8, device=dev), op=hvd.Sum, process_set=firsts, name="c.ps")
                assert torch.all(y == size - 1)
            passed.append("allreduce in a process set")
        side = torch.cuda.Stream(device=dev)
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)  # keep the side stream busy, then write the input on it
            z = torch.full((1 << 20,), float(rank + 1), device=dev)
            out = hvd.allreduce(z, op=hvd.Sum, name="c.side")
        assert torch.all(out == sum(range(1, size + 1))), "the collective read the input before the side stream wrote it"
        passed.append("input written on a side stream is read after that work")
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        s16 = hvd.allreduce(torch.full((5,), rank + 1, dtype=torch.int16, device=dev), op=hvd.Sum, name="c.int16")
    assert s16.is_cuda and torch.all(s16.cpu() == sum(range(1, size + 1)))
    passed.append("int16 (no NCCL type) is staged through host memory and right")

    torch.manual_seed(1234 + rank)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1)).to(dev)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters())
    for step in range(20):
        xb = torch.randn(32, 64, device=dev)
        loss = ((model(xb) - xb[:, :1]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    spread = hvd.allreduce(flat, op=hvd.Max, name="c.max") - hvd.allreduce(flat, op=hvd.Min, name="c.min")
    assert float(spread.abs().max()) == 0.0, f"ranks' weights differ by {float(spread.abs().max())}"
    passed.append("DistributedOptimizer: 20 steps on CUDA, weights identical on every rank")
    return passed


def transform_check(torch: Any, dev: Any) -> str:
    """TorchModel.transform's batched inference on ``dev`` (what a Spark task assigned a GPU uses)
    gives the CPU answer."""
    import numpy as np

    from spark_hvd.spark.estimator.inference import InferencePlan
    from spark_hvd.spark.torch.predictor import TorchPredictor

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)).eval()
    plan = InferencePlan(key="gpu-check", feature_cols=("features",), input_shapes=((8,),), output_cols=("out",),
                         scalar_outputs=(False,), batch_size=256, dtype="float32", sys_path=())
    columns = [np.random.default_rng(0).standard_normal((5000, 8)).astype(np.float32)]
    predictor = TorchPredictor()
    want = predictor.predict(model, "cpu", plan, columns)[0]
    moved = model.to(dev)
    got = predictor.predict(moved, str(dev), plan, columns)[0]
    assert next(moved.parameters()).device.type == dev.type
    assert np.allclose(got, want, atol=1e-4), float(np.abs(got - want).max())
    return f"TorchModel.transform inference on {dev}: 5000 rows match the CPU (max diff {np.abs(got - want).max():.1e})"


def run_rank(sizes: Sequence[int], port: int) -> Dict[str, Any]:
    import torch
    import torch.distributed as dist

    import spark_hvd.torch as hvd

    hvd.init()
    local = hvd.local_rank() % torch.cuda.device_count()
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    result: Dict[str, Any] = {"rank": hvd.rank(), "device": torch.cuda.get_device_name(dev)}
    try:
        result["passed"] = _checks(hvd, torch, dev)
        result["passed"].append(transform_check(torch, dev))
    except Exception as exc:  # reported with the rest; the timing still runs
        import traceback

        result["failed"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=hvd.rank(), world_size=hvd.size(), device_id=dev)
    timing: Dict[str, Any] = {}
    for nbytes in sizes:
        buf = torch.ones(nbytes // 4, device=dev)
        ours = _time(lambda: hvd.allreduce_(buf, op=hvd.Sum, name=f"t.{nbytes}"), torch.cuda.synchronize)
        theirs = _time(lambda: dist.all_reduce(buf), torch.cuda.synchronize)
        host = buf.cpu()
        staged = _time(lambda: hvd.allreduce_(host, op=hvd.Sum, name=f"h.{nbytes}"), lambda: None, budget_s=1.0)
        timing[str(nbytes)] = {"spark-hvd": statistics.median(ours), "torch-nccl": statistics.median(theirs),
                               "spark-hvd-host": statistics.median(staged)}
    result["timing"] = timing
    dist.destroy_process_group()
    hvd.shutdown()
    return result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--np", type=int, default=None, help="ranks (default: one per visible GPU)")
    parser.add_argument("--sizes", nargs="+", type=_parse_size, default=DEFAULT_SIZES)
    parser.add_argument("--json", type=Path, default=HERE / "results" / "gpu_check.json")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device visible to torch {torch.__version__} "
              f"(built with CUDA {torch.version.cuda}); nothing to check on this machine.")
        return 0
    gpus = torch.cuda.device_count()
    np_ = args.np or gpus
    if np_ > gpus:
        parser.error(f"--np {np_} needs {np_} GPUs; {gpus} visible (NCCL puts one rank on each device)")
    from spark_hvd.runner import run

    started = time.perf_counter()
    results = run(run_rank, args=(args.sizes, _free_port()), np=np_, timeout=540)
    print(f"gpu_check: {np_} rank(s) on {results[0]['device']}, {time.perf_counter() - started:.1f} s")
    ok = True
    for res in results:
        if "failed" in res:
            ok = False
            print(f"rank {res['rank']}: FAILED after {len(res.get('passed', []))} checks: {res['failed']}")
    for line in results[0].get("passed", []):
        print(f"  ok  {line}")
    print(f"{'size':>10} {'spark-hvd':>12} {'torch-nccl':>12} {'ratio':>7} {'via host':>12} {'busbw GB/s':>11}")
    for nbytes in args.sizes:
        row = [r["timing"][str(nbytes)] for r in results]
        ours = max(t["spark-hvd"] for t in row)
        theirs = max(t["torch-nccl"] for t in row)
        host = max(t["spark-hvd-host"] for t in row)
        busbw = nbytes / ours * (2 * (np_ - 1) / np_ if np_ > 1 else 1) / 1e9
        print(f"{nbytes:>10} {ours * 1e6:>10.1f}us {theirs * 1e6:>10.1f}us {ours / theirs:>7.2f} "
              f"{host * 1e6:>10.1f}us {busbw:>11.2f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"np": np_, "results": results}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
