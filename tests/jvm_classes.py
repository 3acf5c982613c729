"""Write the class-data-sharing archive the tests' JVMs start from.

    python tests/jvm_classes.py ARCHIVE

A Spark JVM loads and verifies about ten thousand classes from pyspark's jars every time it
starts, and the tests start a hundred or so (every module's session, Spark Connect servers, the
cluster's masters, workers and executors, the example programs' own sessions). This runs the kinds
of work the tests do in one JVM (a classic session: an ML Pipeline, Arrow and pandas UDFs,
partitioned Parquet, a barrier stage, a saved model; then a Spark Connect session in the same JVM)
and has the JVM write every class it loaded into ARCHIVE when it exits (HotSpot's dynamic archive,
``-XX:ArchiveClassesAtExit``). ``tests/conftest.py`` hands the archive to every JVM the tests start
(``-XX:SharedArchiveFile``): they map the classes instead of parsing and verifying them again. A JVM
whose version or class path does not match the archive ignores it and starts as usual, so the archive
only saves CPU, it never changes what runs. The file is written under a temporary name and renamed
once the JVM has exited, so an interrupted run leaves no half-written archive.
"""

import os
import sys
import tempfile

# The JVM logs what it could not archive (signed jars, classes that failed verification): noise here.
QUIET = "-Xlog:cds=off -Xlog:cds+dynamic=off"


def _work(spark, folder: str) -> None:
    import pandas as pd
    from pyspark.ml import Pipeline
    from pyspark.ml.feature import StandardScaler, VectorAssembler
    from pyspark.ml.functions import vector_to_array
    from pyspark.sql import functions as F

    frame = spark.createDataFrame(pd.DataFrame({"a": [float(i) for i in range(64)],
                                                "b": [float(i % 7) for i in range(64)],
                                                "label": [float(i % 2) for i in range(64)]}))
    pipeline = Pipeline(stages=[VectorAssembler(inputCols=["a", "b"], outputCol="v"),
                                StandardScaler(inputCol="v", outputCol="s")]).fit(frame)
    scored = pipeline.transform(frame).withColumn("arr", vector_to_array("s"))
    scored.write.mode("overwrite").partitionBy("label").parquet(os.path.join(folder, "rows"))
    back = spark.read.parquet(os.path.join(folder, "rows"))

    @F.pandas_udf("double")
    def plus_one(x: pd.Series) -> pd.Series:
        return x + 1

    back.select(plus_one("a")).collect()
    back.mapInArrow(lambda batches: batches, back.schema).count()
    back.groupBy("label").agg(F.sum("a"), F.count("*")).orderBy("label").toPandas()
    pipeline.write().overwrite().save(os.path.join(folder, "model"))


def main(argv) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    archive = os.path.abspath(argv[0])
    partial = f"{archive}.partial-{os.getpid()}"
    options = os.environ.get("JDK_JAVA_OPTIONS", "")
    os.environ["JDK_JAVA_OPTIONS"] = f"{options} -XX:TieredStopAtLevel=1 -XX:ArchiveClassesAtExit={partial} {QUIET}"

    from pyspark import SparkContext

    from spark_hvd.spark.session import local_session

    with tempfile.TemporaryDirectory() as folder:
        spark = local_session("spark-hvd-jvm-classes")
        _work(spark, folder)
        spark.sparkContext.parallelize(range(2), 2).barrier().mapPartitions(lambda rows: rows).collect()
        spark.stop()
        connect = local_session("spark-hvd-jvm-classes", connect=True)
        _work(connect, folder)
        connect.stop()
        gateway = SparkContext._gateway
        if gateway is not None:  # the JVM writes the archive as it exits
            gateway.shutdown()
            process = getattr(gateway, "proc", None)
            if process is not None:
                process.stdin.close()
                process.wait(timeout=300)
    if not os.path.exists(partial):  # a JVM that cannot archive (another vendor's) writes none
        print(f"the JVM wrote no archive at {partial}", file=sys.stderr)
        return 1
    os.replace(partial, archive)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
