"""Train a handwritten-digits classifier with Horovod's Keras API on spark-hvd (Keras 3).

This is a Horovod Keras script: only its import line differs (``import spark_hvd.keras as hvd``
instead of ``import horovod.tensorflow.keras as hvd``). Run it on two processes, or alone:

    spark-hvd-run -np 2 python examples/keras_train.py
    python examples/keras_train.py

Each rank fits its shard of the training rows with ``model.fit``; DistributedOptimizer averages
the gradients inside the compiled step, the learning rate is scaled by the number of ranks and
warmed up, rank 0's initial weights are broadcast, epoch metrics are averaged across ranks, and
rank 0 keeps the best model in ``--checkpoint``. KERAS_BACKEND=torch runs it on PyTorch.
"""

import argparse
import json

import keras
import numpy as np

import spark_hvd.keras as hvd
from spark_hvd.datasets import load_digits


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20, help="passes over the training rows")
    parser.add_argument("--batch-size", type=int, default=32, help="rows per rank per step")
    parser.add_argument("--lr", type=float, default=0.02, help="learning rate of one process; scaled by size")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--checkpoint", default=None, help="rank 0 keeps the best model here (.keras)")
    parser.add_argument("--result-json", default=None, help="rank 0 writes the final metrics here")
    return parser.parse_args()


def split_digits(seed):
    """A fixed 80/20 train/test split of the digits, features scaled to [0, 1]."""
    features, labels = load_digits()
    order = np.random.default_rng(seed).permutation(len(labels))
    features = (features[order] / 16.0).astype("float32")
    labels = labels[order].astype("int64")
    cut = int(0.8 * len(labels))
    return (features[:cut], labels[:cut]), (features[cut:], labels[cut:])


def main():
    args = parse_args()
    hvd.init()
    keras.utils.set_random_seed(args.seed + hvd.rank())  # different on purpose: the broadcast aligns them
    (train_x, train_y), (test_x, test_y) = split_digits(args.seed)
    shard = slice(hvd.rank(), None, hvd.size())  # each rank fits its own share of the rows

    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(args.lr * hvd.size(), momentum=0.9))
    model.compile(optimizer=optimizer, metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=args.lr * hvd.size(), warmup_epochs=3),
    ]
    if args.checkpoint:
        callbacks.append(hvd.callbacks.BestModelCheckpoint(monitor="val_accuracy", mode="max",
                                                           filepath=args.checkpoint))
    # Every rank scores its share of the test rows; MetricAverageCallback averages the scores.
    model.fit(train_x[shard], train_y[shard], batch_size=args.batch_size, epochs=args.epochs, callbacks=callbacks,
              validation_data=(test_x[shard], test_y[shard]), verbose=2 if hvd.rank() == 0 else 0)

    logits = model.predict(test_x, verbose=0)
    accuracy = float(np.mean(np.argmax(logits, axis=1) == test_y))
    accuracies = hvd.allgather_object(accuracy)
    if hvd.rank() == 0:
        assert len(set(accuracies)) == 1, f"ranks hold different models: {accuracies}"
        print(f"final test accuracy {accuracy:.4f} with {hvd.size()} rank(s)", flush=True)
        if args.result_json:
            with open(args.result_json, "w") as out:
                json.dump({"accuracy": accuracy, "size": hvd.size(), "epochs": args.epochs}, out)
    hvd.shutdown()


if __name__ == "__main__":
    main()
