"""Data-parallel logistic regression on the bare runtime (numpy only).

Run with:  .venv/bin/spark-hvd-run -np 2 python examples/demo_train.py

Each rank trains on its own shard of a synthetic data set; gradients are averaged with
allreduce, so every rank holds the same weights after every step.
"""

import time

import numpy as np

import spark_hvd.runtime as hvd


def make_data(n_rows: int, n_features: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    true_w = rng.normal(size=n_features)
    x = rng.normal(size=(n_rows, n_features)).astype(np.float32)
    y = (x @ true_w + 0.5 * rng.normal(size=n_rows) > 0).astype(np.float32)
    return x, y


def main() -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    x, y = make_data(20_000, 32)
    shard = slice(rank, None, size)  # each rank sees a different part of the data
    x_local, y_local = x[shard], y[shard]

    # Start from rank 0's random weights everywhere.
    w = hvd.broadcast(np.random.default_rng(rank).normal(size=32).astype(np.float32) * 0.01, root_rank=0,
                      name="init.w")
    lr, batch = 0.5, 256
    start = time.perf_counter()
    for epoch in range(5):
        order = np.random.default_rng(epoch * size + rank).permutation(len(x_local))
        steps = len(x_local) // batch
        for step in range(steps):
            idx = order[step * batch:(step + 1) * batch]
            xb, yb = x_local[idx], y_local[idx]
            p = 1.0 / (1.0 + np.exp(-(xb @ w)))
            grad = xb.T @ (p - yb) / len(idx)
            grad = hvd.allreduce(grad.astype(np.float32), op=hvd.Average, name="grad.w")
            w -= lr * grad
        p_all = 1.0 / (1.0 + np.exp(-(x_local @ w)))
        loss = -np.mean(y_local * np.log(p_all + 1e-7) + (1 - y_local) * np.log(1 - p_all + 1e-7))
        mean_loss = hvd.allreduce(np.array([loss], np.float64), op=hvd.Average, name="loss")[0]
        if rank == 0:
            print(f"epoch {epoch + 1}: loss {mean_loss:.4f}", flush=True)
    accuracy = hvd.allreduce(np.array([np.mean((x_local @ w > 0) == (y_local > 0.5))]), name="acc")[0]
    same = hvd.allgather(w.reshape(1, -1), name="check.w")
    assert np.allclose(same, same[0]), "ranks diverged"
    if rank == 0:
        print(f"{size} ranks trained in {time.perf_counter() - start:.2f} s; accuracy {accuracy:.3f}; "
              "weights identical on every rank", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
