"""Soak: many mixed asynchronous collectives in a different order on every rank, results checked.

    python benchmarks/soak.py [--np 3] [--ops 20000] [--capacities 0 16 1024] [--json PATH]

For each response-cache capacity one world is launched (``spark_hvd.runner.run``). It runs rounds
of ``--per-round`` operations drawn from a pool of ``--pool`` named requests (more names and
signatures than the default cache holds, so ids are evicted all the time): allreduce (several
dtypes and ops), grouped allreduce, allgather with uneven rows, broadcast from a varying root,
alltoall with uneven splits, reducescatter. Every rank submits a round's operations
asynchronously in its own random order, with short random pauses between them, then waits for
all and compares every result with what it must be; some rounds end with a barrier. Per world it
reports operations, wrong results, errors, seconds, and each rank's resident memory after the
warm-up rounds and at the end. The exit status is 1 when any result was wrong or any world failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

__all__ = ["soak", "main"]

KINDS = ("allreduce", "grouped_allreduce", "allgather", "broadcast", "alltoall", "reducescatter")


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def _spec(index: int) -> Tuple[str, str, int]:
    """Kind, dtype and length of pool entry ``index``: fixed, so every rank agrees."""
    kind = KINDS[index % len(KINDS)]
    dtype = ("float32", "float64", "int64", "int32")[(index // len(KINDS)) % 4]
    return kind, dtype, 1 + (index * 37) % 300


def _data(np_mod: Any, index: int, rank: int, round_no: int, length: int, dtype: str) -> Any:
    return ((np_mod.arange(length) % 11) + rank * 3 + round_no % 5).astype(dtype)


def soak(rounds: int, per_round: int, pool: int, seed: int, warmup: int) -> Dict[str, Any]:
    """Runs inside every rank (after init); returns counts and memory readings."""
    import random

    import numpy as np

    import spark_hvd.runtime as rt

    rt.init()
    rank, size = rt.rank(), rt.size()
    mine = random.Random(seed * 1009 + rank)
    wrong, errors, done = [], [], 0
    rss_warm = 0.0
    start = time.perf_counter()
    try:
        for round_no in range(rounds):
            if round_no == warmup:
                rss_warm = _rss_mib()
            chosen = random.Random(seed * 7919 + round_no).sample(range(pool), per_round)
            order = list(chosen)
            mine.shuffle(order)
            pending = []
            for index in order:
                kind, dtype, length = _spec(index)
                name = f"soak.{index}"
                mk = lambda r: _data(np, index, r, round_no, length, dtype)  # noqa: E731
                if kind == "allreduce":
                    handle = rt.allreduce_async(mk(rank), op=rt.Sum, name=name)
                    want = sum(mk(r) for r in range(size))
                elif kind == "grouped_allreduce":
                    handle = rt.grouped_allreduce_async([mk(rank), mk(rank)[: length // 2]], op=rt.Max, name=name)
                    top = np.max([mk(r) for r in range(size)], axis=0)
                    want = [top, top[: length // 2]]
                elif kind == "allgather":
                    handle = rt.allgather_async(mk(rank)[: (length + rank) % 7], name=name)
                    want = np.concatenate([mk(r)[: (length + r) % 7] for r in range(size)])
                elif kind == "broadcast":
                    root = (index + round_no) % size
                    handle = rt.broadcast_async(mk(rank), root, name=name)
                    want = mk(root)
                elif kind == "alltoall":
                    def splits_of(r: int) -> List[int]:
                        return [(r + j + index) % 3 for j in range(size)]

                    blocks = [np.full(n, 100 * rank + j, dtype=dtype) for j, n in enumerate(splits_of(rank))]
                    handle = rt.alltoall_async(np.concatenate(blocks), splits=splits_of(rank), name=name)
                    want = np.concatenate([np.full(splits_of(r)[rank], 100 * r + rank, dtype=dtype)
                                           for r in range(size)])
                else:
                    rows = size * 2 + 1
                    handle = rt.reducescatter_async(np.tile(mk(rank)[:3], (rows, 1)) if length >= 3
                                                    else np.tile(np.resize(mk(rank), 3), (rows, 1)),
                                                    op=rt.Sum, name=name)
                    full = sum(np.tile(np.resize(mk(r), 3), (rows, 1)) for r in range(size))
                    counts = [rows // size + (1 if i < rows % size else 0) for i in range(size)]
                    want = full[sum(counts[:rank]):sum(counts[:rank + 1])]
                pending.append((name, kind, handle, want))
                if mine.random() < 0.2:
                    time.sleep(mine.random() * 0.0003)
            for name, kind, handle, want in pending:
                try:
                    got = rt.synchronize(handle, timeout=120)
                except Exception as exc:  # reported, not raised: the count is the result
                    errors.append(f"round {round_no} {name}: {exc!r}")
                    continue
                if kind == "alltoall":
                    got = got[0]
                pairs = list(zip(got, want)) if kind == "grouped_allreduce" else [(got, want)]
                if not all(g.shape == w.shape and np.array_equal(g, w) for g, w in pairs):
                    wrong.append(f"round {round_no} {name}")
                done += 1
            if round_no % 10 == 9:
                rt.barrier()
    finally:
        seconds = time.perf_counter() - start
        rt.shutdown()
    return {"rank": rank, "ops": done, "wrong": wrong[:20], "wrong_count": len(wrong), "errors": errors[:20],
            "error_count": len(errors), "seconds": seconds, "rss_after_warmup_mib": rss_warm,
            "rss_end_mib": _rss_mib()}


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--np", type=int, default=3, help="ranks per world (default 3)")
    parser.add_argument("--ops", type=int, default=20000, help="operations per rank and world (default 20000)")
    parser.add_argument("--per-round", type=int, default=50, help="operations submitted before waiting")
    parser.add_argument("--pool", type=int, default=3000, help="distinct named requests to draw from")
    parser.add_argument("--capacities", type=int, nargs="+", default=[0, 16, 1024],
                        help="response-cache capacities, one world each (1024 is the default)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per world")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if args.per_round > args.pool:
        parser.error(f"--per-round {args.per_round} exceeds --pool {args.pool}; expected per-round <= pool")
    from spark_hvd.runner import run

    rounds = max(1, args.ops // args.per_round)
    warmup = min(rounds - 1, max(1, rounds // 10))
    report: Dict[str, Any] = {"np": args.np, "ops_per_rank": rounds * args.per_round, "worlds": {}}
    failed = False
    print(f"soak: np={args.np}, {rounds} rounds x {args.per_round} ops per rank, pool of {args.pool} names")
    print("capacity | ops/rank | wrong | errors | seconds | ops/s/rank | RSS MiB after warm-up -> end (per rank)")
    for capacity in args.capacities:
        try:
            results = run(soak, args=(rounds, args.per_round, args.pool, args.seed, warmup), np=args.np,
                          settings={"cache_capacity": capacity}, timeout=args.timeout)
        except Exception as exc:
            failed = True
            report["worlds"][str(capacity)] = {"status": "failed", "error": str(exc)[:4000]}
            print(f"{capacity:>8} | world failed: {str(exc).splitlines()[0]}")
            continue
        wrong = sum(r["wrong_count"] for r in results)
        errors = sum(r["error_count"] for r in results)
        seconds = max(r["seconds"] for r in results)
        ops = min(r["ops"] for r in results)
        rss = ", ".join(f"{r['rss_after_warmup_mib']:.0f}->{r['rss_end_mib']:.0f}" for r in results)
        print(f"{capacity:>8} | {ops:>8} | {wrong:>5} | {errors:>6} | {seconds:7.1f} | {ops / seconds:10.0f} | {rss}")
        for r in results:
            for line in r["wrong"][:3] + r["errors"][:3]:
                print(f"         rank {r['rank']}: {line}")
        failed |= bool(wrong or errors)
        report["worlds"][str(capacity)] = {"status": "ok", "ranks": results}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
