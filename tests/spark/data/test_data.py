"""prepare_data: validation before any Spark job, vectors, splits, sharding, metadata and the cache."""

from __future__ import annotations

import os
import uuid
from typing import Dict

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spark_hvd.spark.data.prepare import PreparedData, prepare_data
from spark_hvd.spark.data.reader import make_reader, scan_parquet
from spark_hvd.spark.data.store import Store

N = 40


@pytest.fixture(scope="module")
def frame(spark):
    """40 rows: id, dense vector v (3), sparse vector s (5), array a (2 floats), label y, weight w,
    a 0/1 int marker and a boolean marker (every 4th row), a string and a struct column."""
    from pyspark.ml.linalg import Vectors
    from pyspark.sql import Row

    rows = [Row(id=i, v=Vectors.dense([i, i + 0.5, -i]), s=Vectors.sparse(5, {i % 5: float(i)}),
                a=[float(i), float(2 * i)], y=float(i % 2), w=1.0 + i / 100, mark=int(i % 4 == 0),
                flag=i % 4 == 0, name=f"row{i}", nested=Row(p=i, q=i), arr2=[[1.0], [2.0]],
                m={"k": 1.0})
            for i in range(N)]
    return spark.createDataFrame(rows)


def jobs_run_by(spark, action) -> int:
    """Number of Spark jobs ``action()`` starts (it runs in its own job group)."""
    sc = spark.sparkContext
    group = f"probe-{uuid.uuid4().hex}"
    sc.setJobGroup(group, "counting jobs")
    try:
        action()
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
    return len(sc.statusTracker().getJobIdsForGroup(group))


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(feature_cols=["v", "nope"]), "column 'nope' is not in the DataFrame; available columns: id, v, s"),
    (dict(feature_cols=["name"]), "column 'name' has type string, which is not numeric; fix: index it"),
    (dict(feature_cols=["nested"]), r"column 'nested' has type struct<p:bigint,q:bigint>, a nested struct"),
    (dict(feature_cols=["m"]), "column 'm' has type map<string,double>, a map"),
    (dict(feature_cols=["arr2"]), r"column 'arr2' has type array<array<double>>, a nested array.*flatten"),
    (dict(validation=1.5), "validation=1.5 is not valid: expected a fraction strictly between 0 and 1"),
    (dict(validation=0.0), "validation=0.0 is not valid"),
    (dict(validation="missing"), "validation column 'missing' is not in the DataFrame"),
    (dict(validation="a"), "validation column 'a' has type array<double>"),
    (dict(sample_weight_col="v"), "sample_weight_col 'v' has type vector"),
    (dict(num_proc=0), "num_proc=0 is not valid"),
    (dict(feature_cols=[]), "feature_cols=.* is not valid"),
])
def test_invalid_input_fails_before_any_spark_job(spark, frame, tmp_path, kwargs, fragment):
    """Column, type and argument mistakes raise ValueError naming the problem, with no Spark job run."""
    args = dict(feature_cols=["v"], label_cols=["y"])
    args.update(kwargs)

    def call():
        with pytest.raises(ValueError, match=fragment):
            prepare_data(frame, Store.create(str(tmp_path)), **args)

    assert jobs_run_by(spark, call) == 0
    assert not os.listdir(tmp_path)


def test_empty_frame_is_refused(spark, frame, tmp_path):
    """A DataFrame with no rows raises ValueError and writes nothing."""
    with pytest.raises(ValueError, match="the DataFrame has no rows"):
        prepare_data(frame.filter("id < 0"), Store.create(str(tmp_path)), ["v"], ["y"])
    assert not os.listdir(tmp_path)


def read_all(info: PreparedData, store: Store, path: str) -> Dict[str, np.ndarray]:
    """Every row of one split, in one rank's file order."""
    rows = scan_parquet(store.url(path)).num_rows
    with make_reader("builtin", store.url(path), rank=0, size=1, batch_size=rows, feature_cols=["id", "v", "s", "a"],
                     label_cols=["y"], sample_weight_col="w", shuffle=False, shapes=info.shapes) as reader:
        (batch,) = list(reader.iter_epoch(0))
    return batch


def test_prepare_writes_vectors_as_arrays_with_metadata(spark, frame, tmp_path):
    """Vectors (dense and sparse) and arrays round-trip with their shapes; the fraction split covers
    every row once; each split has a multiple of num_proc files; metadata JSON matches the result."""
    store = Store.create(str(tmp_path / "store"))
    info = prepare_data(frame, store, ["id", "v", "s", "a"], ["y"], sample_weight_col="w", validation=0.25,
                        num_proc=2, seed=3)
    assert info.train_rows + info.val_rows == N and info.train_rows > 0 and info.val_rows > 0
    assert info.train_files % 2 == 0 and info.train_files >= 2 and info.val_files >= 1
    assert info.train_row_groups >= 2
    assert info.shapes == {"id": (), "v": (3,), "s": (5,), "a": (2,), "y": (), "w": ()}
    assert info.dtypes == {"id": "int64", "v": "float64", "s": "float64", "a": "float64", "y": "float64",
                           "w": "float64"}
    assert info.column("v").kind == "vector" and info.column("a").kind == "array"
    assert [c.encoding for c in info.columns] == ["plain", "row_bytes", "row_bytes", "row_bytes", "plain", "plain"]
    # Array and Vector columns are raw rows in the files: binary, marked with their dtype.
    layout = scan_parquet(store.url(info.train_path))
    assert layout.row_bytes == {"v": "float64", "s": "float64", "a": "float64"}
    first = pq.read_table(layout.files[0])
    assert first.schema.field("v").type == pa.binary() and first.schema.field("y").type == pa.float64()
    assert PreparedData.from_json(store.read(store.get_data_metadata_path(info.key))) == info

    train, val = read_all(info, store, info.train_path), read_all(info, store, info.val_path)
    ids = np.concatenate([train["id"], val["id"]])
    assert sorted(ids.tolist()) == list(range(N))
    for batch in (train, val):
        i = batch["id"].astype(np.float64)
        np.testing.assert_array_equal(batch["v"], np.stack([i, i + 0.5, -i], axis=1))
        sparse = np.zeros((len(i), 5))
        sparse[np.arange(len(i)), batch["id"] % 5] = i
        np.testing.assert_array_equal(batch["s"], sparse)
        np.testing.assert_array_equal(batch["a"], np.stack([i, 2 * i], axis=1))
        np.testing.assert_allclose(batch["w"], 1.0 + i / 100)


def test_integer_and_boolean_arrays_round_trip(spark, tmp_path):
    """Arrays of int, long and boolean elements are stored as raw rows of their own dtype and read
    back with the same values."""
    rows = [(i, [i, -i, 7], [i * 10**10], [i % 2 == 0, True]) for i in range(12)]
    frame = spark.createDataFrame(rows, "id long, ints array<int>, longs array<long>, flags array<boolean>")
    store = Store.create(str(tmp_path / "store"))
    info = prepare_data(frame, store, ["ints", "longs", "flags"], ["id"])
    assert info.dtypes == {"ints": "int32", "longs": "int64", "flags": "bool", "id": "int64"}
    with make_reader("builtin", store.url(info.train_path), rank=0, size=1, batch_size=12,
                     feature_cols=["ints", "longs", "flags"], label_cols=["id"], shuffle=False,
                     shapes=info.shapes) as reader:
        (batch,) = list(reader.iter_epoch(0))
    order = np.argsort(batch["id"])
    ids = batch["id"][order]
    assert ids.tolist() == list(range(12))
    assert batch["ints"].dtype == np.int32 and batch["flags"].dtype == np.bool_
    np.testing.assert_array_equal(batch["ints"][order], np.stack([ids, -ids, np.full(12, 7)], axis=1))
    np.testing.assert_array_equal(batch["longs"][order], (ids * 10**10).reshape(-1, 1))
    np.testing.assert_array_equal(batch["flags"][order], np.stack([ids % 2 == 0, np.ones(12, bool)], axis=1))


@pytest.mark.parametrize("marker", ["mark", "flag"])
def test_validation_by_marker_column(spark, frame, tmp_path, marker):
    """A 0/1 or boolean column sends its true rows to validation and the rest to training."""
    store = Store.create(str(tmp_path / "store"))
    info = prepare_data(frame, store, ["v"], ["y", "id"], validation=marker, num_proc=2)
    assert (info.train_rows, info.val_rows) == (30, 10)
    val_ids = read_all_ids(store, info.val_path)
    assert sorted(val_ids) == list(range(0, N, 4))


def read_all_ids(store: Store, path: str):
    with make_reader("builtin", store.url(path), rank=0, size=1, batch_size=1, feature_cols=["id"],
                     shuffle=False) as reader:
        return [int(b["id"][0]) for b in reader.iter_epoch(0)]


def test_float32_vectors_and_many_row_groups(spark, frame, tmp_path):
    """vector_dtype='float32' stores float arrays; files_per_proc and small row groups give every
    one of 3 ranks several files."""
    store = Store.create(str(tmp_path / "store"))
    info = prepare_data(frame, store, ["v"], ["y"], num_proc=3, vector_dtype="float32", files_per_proc=2)
    assert info.dtypes["v"] == "float32" and info.train_files == 6 and info.train_row_groups == 6
    assert info.val_path is None and info.val_rows == 0


def test_second_prepare_reuses_the_written_data(spark, frame, tmp_path):
    """Preparing the same DataFrame again runs no Spark job and leaves the files untouched; another
    DataFrame, or other settings, get a new key."""
    store = Store.create(str(tmp_path / "store"))
    made = []
    assert jobs_run_by(spark, lambda: made.append(
        prepare_data(frame, store, ["v"], ["y"], validation=0.2, num_proc=2))) > 0  # the probe sees jobs
    first = made[0]
    files = [os.path.join(d, f) for d, _, fs in os.walk(store.prefix) for f in fs]
    mtimes = {f: os.stat(f).st_mtime_ns for f in files}

    again = []
    assert jobs_run_by(spark, lambda: again.append(
        prepare_data(frame, store, ["v"], ["y"], validation=0.2, num_proc=2))) == 0
    assert again[0] == first
    assert {f: os.stat(f).st_mtime_ns for f in files} == mtimes
    assert sorted(os.path.join(d, f) for d, _, fs in os.walk(store.prefix) for f in fs) == sorted(files)

    other = prepare_data(frame.filter("id < 30"), store, ["v"], ["y"], validation=0.2, num_proc=2)
    assert other.key != first.key and other.train_rows + other.val_rows == 30
    assert prepare_data(frame, store, ["v"], ["y"], validation=0.2, num_proc=3).key != first.key


@pytest.mark.parametrize("validation", [0.25, "mark"])
def test_one_job_writes_both_splits_and_hashes_rows_held_in_memory(spark, frame, tmp_path, validation):
    """Rows held in memory (their key needs a digest of the rows) are read once: one Spark job
    writes both splits and hashes the rows on the way. The key is the one a digest job of its own
    gives, so another session finds the data; the fit's data identity of the same rows (without
    the validation column) needs no job after it."""
    from spark_hvd.spark.data import identity

    df = frame.select("id", "v", "y", "w", "mark")  # a plan of its own: no digest remembered yet
    store = Store.create(str(tmp_path / "store"))
    made = []
    assert jobs_run_by(spark, lambda: made.append(
        prepare_data(df, store, ["v"], ["y"], "w", validation=validation, num_proc=2))) == 1
    info = made[0]
    assert info.train_rows + info.val_rows == N and info.train_rows > 0 and info.val_rows > 0
    if validation == "mark":
        assert info.val_rows == N // 4
    # Both splits are sub-directories of the key's training data path; nothing else is left.
    assert os.path.dirname(info.train_path) == os.path.dirname(info.val_path) == store.get_train_data_path(info.key)
    assert sorted(os.listdir(store.prefix)) == sorted(os.path.basename(p) for p in (
        store.get_train_data_path(info.key), store.get_data_metadata_path(info.key)))
    written = [pq.read_table(f).num_rows for p in (info.train_path, info.val_path)
               for f in scan_parquet(store.url(p)).files]
    assert sum(written) == N

    assert jobs_run_by(spark, lambda: identity.data_identity(df, ["v", "y", "w"])) == 0
    remembered = identity.data_identity(df, ["v", "y", "w"])
    identity._digests.clear()  # as in another session: the digest is not known
    assert identity.data_identity(df, ["v", "y", "w"]) == remembered  # now from a job of its own
    identity._digests.clear()
    again = prepare_data(df, store, ["v"], ["y"], "w", validation=validation, num_proc=2)
    assert again == info
    assert not [n for n in os.listdir(store.prefix) if "pending" in n]


def test_a_store_with_its_own_val_path_gets_the_validation_rows_there(spark, frame, tmp_path):
    """Horovod's layout settings: with train_path and val_path set, the training rows are under
    the store's train_path and the validation rows under its val_path; a second prepare finds them."""
    store = Store.create(str(tmp_path / "store"), train_path=str(tmp_path / "tr"), val_path=str(tmp_path / "va"))
    info = prepare_data(frame, store, ["v"], ["y"], validation=0.25, num_proc=2, seed=3)
    assert info.train_path.startswith(store.get_train_data_path(info.key) + os.sep)
    assert info.val_path == store.get_val_data_path(info.key) == str(tmp_path / "va") + "." + info.key
    rows = [sum(pq.read_table(f).num_rows for f in scan_parquet(store.url(p)).files)
            for p in (info.train_path, info.val_path)]
    assert rows == [info.train_rows, info.val_rows] and sum(rows) == N and info.val_rows > 0
    assert jobs_run_by(spark, lambda: prepare_data(frame, store, ["v"], ["y"], validation=0.25, num_proc=2,
                                                   seed=3)) == 0


def test_ragged_arrays_and_nulls_are_refused_and_cleaned_up(spark, tmp_path):
    """Arrays of unequal length and null values raise ValueError naming the column; nothing stays."""
    from pyspark.sql import Row

    store = Store.create(str(tmp_path / "store"))
    ragged = spark.createDataFrame([Row(a=[1.0] * (1 + i % 2), y=1.0) for i in range(6)])
    with pytest.raises(ValueError, match=r"column 'a' has rows of different lengths \(1 to 2\)"):
        prepare_data(ragged, store, ["a"], ["y"])
    nulls = spark.createDataFrame([(float(i), None if i == 2 else 1.0) for i in range(6)], "x double, y double")
    with pytest.raises(ValueError, match=r"column 'y': 1 null\): expected a finite number"):
        prepare_data(nulls, store, ["x"], ["y"])
    assert os.listdir(store.prefix) == []


@pytest.mark.petastorm
def test_petastorm_reads_prepared_vectors(spark, frame, tmp_path):
    """petastorm's reader reads prepare_data's Parquet with the recorded shapes, every row once."""
    store = Store.create(str(tmp_path / "store"))
    info = prepare_data(frame, store, ["v"], ["id"], num_proc=2)
    ids = []
    for rank in range(2):
        with make_reader("petastorm", store.url(info.train_path), rank=rank, size=2, batch_size=5,
                         feature_cols=["v"], label_cols=["id"], shapes=info.shapes, shuffle=False) as reader:
            for batch in reader.iter_epoch(0):
                i = batch["id"].astype(np.float64)
                np.testing.assert_array_equal(batch["v"], np.stack([i, i + 0.5, -i], axis=1))
                ids.extend(batch["id"].tolist())
    assert len(ids) == 2 * 5 * ((N + 9) // 10) and set(ids) <= set(range(N))


def test_local_session_settings(spark):
    """The shared session builder runs local[2] on loopback with the fast-test settings and this Python."""
    import sys

    conf = spark.sparkContext.getConf()
    assert spark.sparkContext.master == "local[2]"
    assert conf.get("spark.driver.host") == conf.get("spark.driver.bindAddress") == "127.0.0.1"
    assert conf.get("spark.ui.enabled") == "false" and spark.conf.get("spark.sql.shuffle.partitions") == "4"
    assert conf.get("spark.scheduler.barrier.maxConcurrentTasksCheck.maxFailures") == "1"
    assert spark.sparkContext.pythonExec == sys.executable
    assert spark.sparkContext.parallelize([0], 1).map(lambda _: __import__("sys").executable).collect() == [
        sys.executable]
