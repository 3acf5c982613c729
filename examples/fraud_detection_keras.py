"""Card fraud detection with a Spark ML pipeline that trains a Keras 3 model on two ranks.

The Keras variant of ``examples/fraud_detection.py``: the same synthetic transactions (imported
from it), the same pipeline with KerasEstimator in place of TorchEstimator, the same evaluation.
Run it from the project root; the virtualenv need not be activated:

    .venv/bin/python examples/fraud_detection_keras.py

A pipeline of VectorAssembler, StandardScaler and KerasEstimator(num_proc=2) trains on an
embedded local[2] Spark (the ranks run Keras on TensorFlow), weighting fraud rows up to counter
the imbalance; the held-out 20% is scored with BinaryClassificationEvaluator (area under PR and
ROC) on the model's standard rawPrediction column; the fitted pipeline is saved, reloaded and
checked to score the same. ``--connect`` runs the same on a Spark Connect session.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import List, Optional

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402

from fraud_detection import FEATURES, build_session, generate_transactions  # noqa: E402  the torch example's data


def fraud_net(inputs: int = len(FEATURES)) -> keras.Model:
    """A small MLP returning one logit per transaction, compiled with its optimizer and loss."""
    model = keras.Sequential([
        keras.Input((inputs,)),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(1),
    ])
    model.compile(optimizer=keras.optimizers.Adam(learning_rate=1e-3),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True))
    return model


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=200_000, help="transactions to generate")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--num-proc", type=int, default=2, help="training ranks")
    parser.add_argument("--fraud-weight", type=float, default=20.0, help="loss weight of a fraud row")
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "spark-hvd-fraud-keras"),
                        help="directory for the store and the saved pipeline")
    parser.add_argument("--connect", action="store_true", help="run on a Spark Connect session")
    args = parser.parse_args(argv)

    from pyspark.ml import Pipeline, PipelineModel
    from pyspark.ml.evaluation import BinaryClassificationEvaluator
    from pyspark.ml.feature import StandardScaler, VectorAssembler
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql import functions as F

    from spark_hvd.spark import Store
    from spark_hvd.spark.keras import KerasEstimator

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

    keras.utils.set_random_seed(0)
    # The compiled model brings its optimizer and loss; the estimator takes them from it.
    estimator = KerasEstimator(
        num_proc=args.num_proc, model=fraud_net(), feature_cols=["features"], label_cols=["Class"],
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
    print(f"pipeline fitted in {time.monotonic() - fit_started:.1f} s (KerasEstimator: {phases})")

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
