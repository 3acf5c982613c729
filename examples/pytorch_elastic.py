"""Elastic training with spark-hvd: workers may die or join mid-epoch, training goes on.

    .venv/bin/spark-hvd-run -np 3 --min-np 2 --max-np 4 python examples/pytorch_elastic.py

The digits classifier of examples/pytorch_train.py, written with ``hvd.elastic``: the state
(model, optimizer, ElasticSampler, epoch and a count of how often each sample was trained on) is
committed after every batch; a lost worker makes the others roll back to the last commit, and a
new world (with a replacement, or with workers the discovery script added) takes rank 0's state
and carries on from there. Rank 0 prints a line per epoch; at the end every rank prints one JSON line: its rank, the world size,
accuracy, a checksum of the weights, and how many samples were trained on 0, 1, 2 ... times per
epoch (one entry, at ``epochs``, when nothing was skipped or repeated).

``--kill-worker W --kill-at EPOCH:BATCH`` makes worker W (its SPARK_HVD_WORKER_ID, e.g. w1)
kill itself with SIGKILL at that point, to try a lost worker.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import spark_hvd.torch as hvd
from spark_hvd.datasets import load_digits


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--kill-worker", default=None, help="worker id (e.g. w1) that kills itself")
    parser.add_argument("--kill-at", default="1:3", help="EPOCH:BATCH at which --kill-worker dies")
    parser.add_argument("--min-epoch-seconds", type=float, default=0.0,
                        help="stretch each epoch to at least this long, as a larger model would take "
                             "(gives workers added mid-training time to start)")
    args = parser.parse_args()
    torch.set_num_threads(1)

    hvd.init()
    features, labels = load_digits()
    dataset = TensorDataset(torch.tensor(features, dtype=torch.float32), torch.tensor(labels, dtype=torch.int64),
                            torch.arange(len(labels)))
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=42)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    kill_epoch, kill_batch = (int(x) for x in args.kill_at.split(":"))
    me = os.environ.get("SPARK_HVD_WORKER_ID")

    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0,
                                   seen=np.zeros((args.epochs, len(dataset)), dtype=np.int64))

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        for state.epoch in range(state.epoch, args.epochs):
            started = time.monotonic()
            if state.sampler.processed_num == 0:
                state.sampler.set_epoch(state.epoch)
            for batch_idx, (x, y, ids) in enumerate(loader):
                if args.kill_worker and me == args.kill_worker and (state.epoch, batch_idx) == (kill_epoch, kill_batch):
                    os.kill(os.getpid(), signal.SIGKILL)
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                counts = np.zeros(len(dataset), dtype=np.int64)
                np.add.at(counts, ids.numpy(), 1)
                # Which samples this step trained on, over the whole world: part of the committed state.
                state.seen[state.epoch] += hvd.allreduce(torch.from_numpy(counts), op=hvd.Sum,
                                                         name="seen").numpy()
                state.sampler.record_batch(batch_idx, len(ids))
                state.commit()
                rest = args.min_epoch_seconds - (time.monotonic() - started)
                if rest > 0:
                    time.sleep(rest / max(1, len(loader) - batch_idx))
            if hvd.rank() == 0:
                print(f"epoch {state.epoch} done in a world of {hvd.size()} workers, last loss {loss.item():.4f}",
                      flush=True)
            state.sampler.set_epoch(state.epoch + 1)
            state.commit()

    train(state)
    with torch.no_grad():
        accuracy = (model(dataset.tensors[0]).argmax(1) == dataset.tensors[1]).float().mean().item()
    weights = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
    histogram = {int(k): int(v) for k, v in zip(*np.unique(state.seen, return_counts=True))}
    print(json.dumps({"rank": hvd.rank(), "size": hvd.size(), "accuracy": round(accuracy, 4),
                      "weights": hashlib.sha256(weights).hexdigest()[:16], "seen_times": histogram}), flush=True)


if __name__ == "__main__":
    main()
