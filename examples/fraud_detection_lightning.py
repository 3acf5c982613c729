"""Card fraud detection with a Spark ML pipeline that trains a LightningModule on two ranks.

The PyTorch Lightning variant of ``examples/fraud_detection.py``: the same generated transactions,
the same pipeline (VectorAssembler, StandardScaler, then the estimator), the same held-out
evaluation and the same save/reload check. Only the model changes: ``FraudModule`` is a
LightningModule whose ``training_step`` gives the fraud-weighted loss and whose
``configure_optimizers`` gives Adam, trained by ``LightningEstimator(num_proc=2)``.

    .venv/bin/python examples/fraud_detection_lightning.py [--rows N] [--epochs N] [--connect]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import List, Optional

import pytorch_lightning as pl
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fraud_detection import FEATURES, FraudNet, build_session, generate_transactions  # noqa: E402


class FraudModule(pl.LightningModule):
    """FraudNet (one logit per transaction) trained with a per-row weighted BCE loss.

    Batches arrive as dicts from column name to tensor: 'features' (the scaled vector), 'Class'
    (the label) and 'weight' (the sample weight column).
    """

    def __init__(self, lr: float = 2e-3) -> None:
        super().__init__()
        self.net = FraudNet(len(FEATURES))
        self.lr = lr

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.net(features)

    def _loss(self, batch: dict) -> torch.Tensor:
        logits = self(batch["features"]).squeeze(1)
        per_row = F.binary_cross_entropy_with_logits(logits, batch["Class"].float(), reduction="none")
        return (per_row * batch["weight"]).mean()

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("loss", loss, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=200_000, help="transactions to generate")
    parser.add_argument("--fraud-rate", type=float, default=0.002, help="share of fraudulent transactions")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--num-proc", type=int, default=2, help="training ranks")
    parser.add_argument("--fraud-weight", type=float, default=20.0, help="loss weight of a fraud row")
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "spark-hvd-fraud-lightning"),
                        help="directory for the store and the saved pipeline")
    parser.add_argument("--connect", action="store_true", help="run on a Spark Connect session")
    args = parser.parse_args(argv)

    from pyspark.ml import Pipeline, PipelineModel
    from pyspark.ml.evaluation import BinaryClassificationEvaluator
    from pyspark.ml.feature import StandardScaler, VectorAssembler
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql import functions as sql

    from spark_hvd.spark import Store
    from spark_hvd.spark.lightning import LightningEstimator

    started = time.monotonic()
    spark = build_session(max(2, args.num_proc), args.connect)
    data = generate_transactions(args.rows, fraud_rate=args.fraud_rate)
    frauds = int(data["Class"].sum())
    print(f"generated {len(data):,} transactions, {frauds} fraudulent ({100 * frauds / len(data):.2f}%)")
    df = spark.createDataFrame(data)
    train, test = df.randomSplit([0.8, 0.2], seed=42)
    test = test.withColumn("row_id", sql.monotonically_increasing_id()).cache()
    train = train.withColumn("weight", sql.when(sql.col("Class") == 1, args.fraud_weight).otherwise(1.0))

    torch.manual_seed(0)
    estimator = LightningEstimator(
        num_proc=args.num_proc, model=FraudModule(), feature_cols=["features"], label_cols=["Class"],
        sample_weight_col="weight", validation=0.1, batch_size=256, epochs=args.epochs, random_seed=1,
        task="binary", store=Store.create(os.path.join(args.out, "store")))
    pipeline = Pipeline(stages=[
        VectorAssembler(inputCols=FEATURES, outputCol="raw_features"),
        StandardScaler(inputCol="raw_features", outputCol="features", withMean=True, withStd=True),
        estimator,
    ])
    fit_started = time.monotonic()
    fitted = pipeline.fit(train)
    phases = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in fitted.stages[-1].fit_timings.items())
    print(f"pipeline fitted in {time.monotonic() - fit_started:.1f} s (LightningEstimator: {phases})")

    scored = fitted.transform(test).cache()
    metrics = {}
    for metric in ("areaUnderPR", "areaUnderROC"):
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
