"""Card fraud detection with a Spark ML pipeline that trains a PyTorch model on two ranks.

Run it from the project root; the virtualenv need not be activated:

    .venv/bin/python examples/fraud_detection.py

It generates about 200,000 card transactions (about 0.2% fraud) shaped like the well-known
anonymized credit-card data set: 28 PCA-like features V1..V28, Amount and Time. Fraud differs
in ways a model can learn but not trivially: shifted means, values far from typical in either
direction (which no linear score sees), coupled features, a bimodal amount, and some frauds that
look almost normal. A pipeline of VectorAssembler, StandardScaler and TorchEstimator(num_proc=2)
trains on an embedded local[2] Spark, weighting fraud rows up to counter the imbalance; the
held-out 20% is scored with BinaryClassificationEvaluator (area under PR and ROC) on the model's
standard rawPrediction column; the fitted pipeline is saved, reloaded and checked to score the
same. ``--connect`` runs the same on a Spark Connect session.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import List, Optional

import numpy as np
import pandas as pd
import torch

FEATURES = [f"V{i}" for i in range(1, 29)] + ["Amount", "Time"]


def generate_transactions(rows: int = 200_000, fraud_rate: float = 0.002, seed: int = 7) -> pd.DataFrame:
    """Synthetic transactions with columns V1..V28, Amount, Time and Class (1 = fraud)."""
    rng = np.random.default_rng(seed)
    label = np.zeros(rows, np.int32)
    label[rng.choice(rows, int(round(rows * fraud_rate)), replace=False)] = 1
    fraud = label == 1
    k = int(fraud.sum())
    # PCA components: uncorrelated, variance falling from the first to the last.
    scales = np.linspace(2.0, 0.3, 28)
    v = rng.normal(size=(rows, 28)) * scales
    stealthy = rng.random(k) < 0.15
    strength = np.where(stealthy, rng.uniform(0.3, 0.8, k), rng.uniform(0.8, 1.8, k))
    shift = np.zeros(28)
    shift[[2, 9, 11, 13, 16]] = [-1.0, -1.1, -1.2, -1.3, -0.9]
    fraud_v = rng.normal(size=(k, 28)) * scales * 1.4 + strength[:, None] * shift * scales
    for j in (0, 3, 6, 10):  # unusually far from the mean, in either direction
        fraud_v[:, j] += rng.choice([-1.0, 1.0], k) * strength * 2.6 * scales[j]
    fraud_v[:, 4] += 0.8 * fraud_v[:, 1] * ~stealthy
    v[fraud] = fraud_v
    # Normal spending is log-normal; fraud is either small card tests or large purchases.
    amount = rng.lognormal(3.0, 1.2, rows)
    small = rng.random(k) < 0.6
    amount[fraud] = np.where(small, rng.lognormal(0.5, 1.0, k), rng.lognormal(4.8, 0.9, k))
    frame = pd.DataFrame(v, columns=FEATURES[:28])
    frame["Amount"] = np.round(amount, 2)
    frame["Time"] = np.sort(rng.uniform(0, 172_800, rows)).round()  # two days, in seconds
    frame["Class"] = label
    return frame


class FraudNet(torch.nn.Module):
    """A small MLP returning one logit per transaction."""

    def __init__(self, inputs: int = len(FEATURES)) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(inputs, 32), torch.nn.ReLU(),
            torch.nn.Linear(32, 32), torch.nn.ReLU(),
            torch.nn.Linear(32, 1))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.layers(features)


def build_session(num_cores: int, connect: bool) -> "object":
    """An embedded local Spark (classic, or a Spark Connect server in this process) whose Python
    workers run this interpreter."""
    from spark_hvd.spark import local_session

    session = local_session("fraud-detection", num_cores=num_cores, connect=connect, conf={
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        "spark.driver.memory": "2g",
    })
    if not connect:
        session.sparkContext.setLogLevel("ERROR")
    return session


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=200_000, help="transactions to generate")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--num-proc", type=int, default=2, help="training ranks")
    parser.add_argument("--fraud-weight", type=float, default=20.0, help="loss weight of a fraud row")
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "spark-hvd-fraud"),
                        help="directory for the store and the saved pipeline")
    parser.add_argument("--connect", action="store_true", help="run on a Spark Connect session")
    args = parser.parse_args(argv)

    from pyspark.ml import Pipeline, PipelineModel
    from pyspark.ml.evaluation import BinaryClassificationEvaluator
    from pyspark.ml.feature import StandardScaler, VectorAssembler
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql import functions as F

    from spark_hvd.spark import Store
    from spark_hvd.spark.torch import TorchEstimator

    started = time.monotonic()
    spark = build_session(max(2, args.num_proc), args.connect)
    data = generate_transactions(args.rows)
    frauds = int(data["Class"].sum())
    print(f"generated {len(data):,} transactions, {frauds} fraudulent ({100 * frauds / len(data):.2f}%)")
    df = spark.createDataFrame(data)
    train, test = df.randomSplit([0.8, 0.2], seed=42)
    test = test.withColumn("row_id", F.monotonically_increasing_id()).cache()
    # Fraud rows weigh more in the loss: without it the model learns to say "no fraud".
    train = train.withColumn("weight", F.when(F.col("Class") == 1, args.fraud_weight).otherwise(1.0))

    torch.manual_seed(0)
    model = FraudNet()
    estimator = TorchEstimator(
        num_proc=args.num_proc, model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
        loss=torch.nn.BCEWithLogitsLoss(), feature_cols=["features"], label_cols=["Class"],
        sample_weight_col="weight", validation=0.1, batch_size=256, epochs=args.epochs, random_seed=1,
        store=Store.create(os.path.join(args.out, "store")))
    pipeline = Pipeline(stages=[
        VectorAssembler(inputCols=FEATURES, outputCol="raw_features"),
        StandardScaler(inputCol="raw_features", outputCol="features", withMean=True, withStd=True),
        estimator,
    ])
    fit_started = time.monotonic()
    fitted = pipeline.fit(train)
    phases = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in fitted.stages[-1].fit_timings.items())
    print(f"pipeline fitted in {time.monotonic() - fit_started:.1f} s (TorchEstimator: {phases})")

    rows = test.count()
    passes = []
    for _ in range(2):  # the first pass also starts Spark's Python workers and loads the model
        inference_started = time.monotonic()
        # Summing a column of the predictions makes Spark run the model on every row (a count
        # alone would let it skip the prediction columns).
        fitted.transform(test).agg(F.sum(vector_to_array("probability")[1])).collect()
        passes.append(time.monotonic() - inference_started)
    print(f"transform: {rows:,} rows scored in {passes[0]:.1f} s, then {passes[1]:.1f} s warm "
          f"({rows / passes[1]:,.0f} rows/s)")
    scored = fitted.transform(test).cache()
    metrics = {}
    for metric in ("areaUnderPR", "areaUnderROC"):
        # The model adds Spark ML's rawPrediction, probability and prediction columns.
        evaluator = BinaryClassificationEvaluator(labelCol="Class", metricName=metric)
        metrics[metric] = evaluator.evaluate(scored)
    held_out = scored.filter("Class = 1").count()
    print(f"held-out test set: AUC-PR {metrics['areaUnderPR']:.4f}, AUC-ROC {metrics['areaUnderROC']:.4f} "
          f"({held_out} frauds in {scored.count():,} transactions)")

    path = os.path.join(args.out, "fraud-pipeline")
    fitted.write().overwrite().save(path)
    reloaded = PipelineModel.load(path)
    fraud_probability = vector_to_array("probability")[1].alias("p")
    before = scored.select("row_id", fraud_probability).toPandas().set_index("row_id")["p"]
    after = reloaded.transform(test).select("row_id", fraud_probability).toPandas().set_index("row_id")["p"]
    difference = float((before - after.reindex(before.index)).abs().max())
    same = len(after) == len(before) and difference == 0.0
    print(f"saved to {path} and reloaded: {'the same' if same else 'DIFFERENT'} predictions on all "
          f"{len(before):,} held-out transactions (largest difference {difference:g})")
    history = fitted.stages[-1].getHistory()
    print(f"epochs trained: {len(history)}, last val_loss {history[-1].get('val_loss', float('nan')):.4f}; "
          f"total {time.monotonic() - started:.0f} s")
    spark.stop()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
