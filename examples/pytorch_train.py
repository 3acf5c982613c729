"""Train a handwritten-digits classifier with Horovod's PyTorch API on spark-hvd.

This is a Horovod training script: only its import line differs (``import spark_hvd.torch as hvd``
instead of ``import horovod.torch as hvd``). Run it on two processes, or alone:

    spark-hvd-run -np 2 python examples/pytorch_train.py
    python examples/pytorch_train.py

It shards the training rows across ranks, scales the learning rate by the number of ranks,
averages gradients with DistributedOptimizer, starts every rank from rank 0's parameters and
optimizer state, averages the evaluation metrics across ranks, and checkpoints on rank 0
(``--checkpoint``; with ``--resume`` a run continues from it). The data is scikit-learn's digits
set, shipped inside the package.
"""

import argparse
import json
import os

import numpy as np
import torch
import torch.nn.functional as F

import spark_hvd.torch as hvd
from spark_hvd.datasets import load_digits


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20, help="passes over the training rows")
    parser.add_argument("--batch-size", type=int, default=32, help="rows per rank per step")
    parser.add_argument("--lr", type=float, default=0.02, help="learning rate of one process; scaled by size")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--fp16-allreduce", action="store_true", help="send gradients as float16")
    parser.add_argument("--checkpoint", default=None, help="file rank 0 saves the model to after every epoch")
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint if it exists")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--result-json", default=None, help="rank 0 writes the final metrics here")
    return parser.parse_args()


def split_digits(seed):
    """A fixed 80/20 train/test split of the digits, features scaled to [0, 1]."""
    features, labels = load_digits()
    order = np.random.default_rng(seed).permutation(len(labels))
    features = torch.from_numpy(features[order] / 16.0).float()
    labels = torch.from_numpy(labels[order])
    cut = int(0.8 * len(labels))
    return (features[:cut], labels[:cut]), (features[cut:], labels[cut:])


def make_model():
    return torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(),
        torch.nn.Linear(128, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 10),
    )


def metric_average(value, name):
    """The mean of a scalar over all ranks."""
    return hvd.allreduce(torch.tensor(float(value)), name=name).item()


def train_epoch(model, optimizer, loader, sampler, epoch):
    model.train()
    sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank
    total_loss, steps = 0.0, 0
    for features, labels in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(features), labels)
        loss.backward()
        optimizer.step()
        total_loss += loss.item()
        steps += 1
    return metric_average(total_loss / max(steps, 1), "train.loss")


def evaluate(model, features, labels):
    """Accuracy over the whole test set: each rank scores its share, the counts are summed."""
    model.eval()
    mine = torch.arange(hvd.rank(), len(labels), hvd.size())
    with torch.no_grad():
        correct = (model(features[mine]).argmax(dim=1) == labels[mine]).sum()
    counts = hvd.allreduce(torch.stack([correct, torch.tensor(len(mine))]).double(), op=hvd.Sum, name="eval.counts")
    return (counts[0] / counts[1]).item()


def main():
    args = parse_args()
    hvd.init()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed + hvd.rank())  # different on purpose: the broadcast below aligns them

    (train_x, train_y), (test_x, test_y) = split_digits(args.seed)
    # Each rank reads its own shard of the training rows, as with horovod.torch.
    train_set = torch.utils.data.TensorDataset(train_x, train_y)
    sampler = torch.utils.data.distributed.DistributedSampler(
        train_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True, seed=args.seed)
    loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum)

    first_epoch = 0
    if args.resume and args.checkpoint and hvd.rank() == 0 and os.path.exists(args.checkpoint):
        state = torch.load(args.checkpoint)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        first_epoch = state["epoch"] + 1
    first_epoch = hvd.broadcast_object(first_epoch, root_rank=0, name="first_epoch")

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)

    accuracy = evaluate(model, test_x, test_y)
    if first_epoch and hvd.rank() == 0:
        print(f"resumed after epoch {first_epoch}  test accuracy {accuracy:.4f}", flush=True)
    for epoch in range(first_epoch, args.epochs):
        loss = train_epoch(model, optimizer, loader, sampler, epoch)
        accuracy = evaluate(model, test_x, test_y)
        if hvd.rank() == 0:
            print(f"epoch {epoch + 1:3d}/{args.epochs}  train loss {loss:.4f}  test accuracy {accuracy:.4f}",
                  flush=True)
            if args.checkpoint:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                           args.checkpoint)

    if hvd.rank() == 0:
        print(f"final test accuracy {accuracy:.4f} with {hvd.size()} rank(s)", flush=True)
        if args.result_json:
            with open(args.result_json, "w") as out:
                json.dump({"accuracy": accuracy, "size": hvd.size(), "epochs": args.epochs}, out)
    hvd.shutdown()


if __name__ == "__main__":
    main()
