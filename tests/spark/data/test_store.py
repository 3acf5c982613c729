"""Stores: factory dispatch, layout, Spark URLs, file operations and atomic writes."""

from __future__ import annotations

import os
import pickle
import selectors
import signal
import subprocess
import sys
import textwrap
import threading
import uuid
from typing import Iterator

import pytest

from spark_hvd.spark.data.store import DBFSLocalStore, FsspecStore, LocalStore, Store


@pytest.mark.parametrize("prefix, cls, stored_prefix", [
    ("/tmp/store", LocalStore, "/tmp/store"),
    ("file:///tmp/store", LocalStore, "/tmp/store"),
    ("dbfs:/ml/store", DBFSLocalStore, "/dbfs/ml/store"),
    ("/dbfs/ml/store", DBFSLocalStore, "/dbfs/ml/store"),
    ("memory://store", FsspecStore, "memory://store"),
    ("s3://bucket/store/", FsspecStore, "s3://bucket/store"),
    ("hdfs://namenode:8020/user/me", FsspecStore, "hdfs://namenode:8020/user/me"),
])
def test_create_picks_the_store_for_the_prefix(prefix, cls, stored_prefix, monkeypatch):
    """Store.create returns LocalStore, DBFSLocalStore (on Databricks) or FsspecStore by prefix, normalized."""
    monkeypatch.setenv("DATABRICKS_RUNTIME_VERSION", "16.4")
    store = Store.create(prefix)
    assert type(store) is cls
    assert store.prefix == stored_prefix


@pytest.mark.parametrize("bad", ["", None, 3])
def test_create_refuses_an_empty_prefix(bad):
    """A missing prefix is a ValueError that says what a prefix looks like."""
    with pytest.raises(ValueError, match="expected a non-empty path or URL"):
        Store.create(bad)


def test_layout_under_the_prefix():
    """Data, metadata, run, checkpoint and log paths follow the documented layout."""
    store = Store.create("memory://root")
    assert store.get_train_data_path("k1") == "memory://root/intermediate_train_data.k1"
    assert store.get_val_data_path("k1") == "memory://root/intermediate_val_data.k1"
    assert store.get_train_data_path() == "memory://root/intermediate_train_data"
    assert store.get_data_metadata_path("k1") == "memory://root/intermediate_data_metadata.k1.json"
    assert store.get_run_path("r1") == "memory://root/runs/r1"
    assert store.get_checkpoint_path("r1") == "memory://root/runs/r1/checkpoint"
    assert store.get_logs_path("r1") == "memory://root/runs/r1/logs"


@pytest.mark.parametrize("run_id", ["", "a/b"])
def test_run_id_must_be_a_plain_name(run_id):
    """A run id that is empty or contains '/' is refused."""
    with pytest.raises(ValueError, match="run_id"):
        Store.create("/tmp/x").get_run_path(run_id)


@pytest.mark.parametrize("prefix, options, path_suffix, url", [
    ("/data/store", None, "a", "file:///data/store/a"),
    ("dbfs:/ml/store", None, "a", "dbfs:/ml/store/a"),
    ("s3://bucket/store", None, "a", "s3a://bucket/store/a"),
    ("gs://bucket/store", None, "a", "gs://bucket/store/a"),
    ("hdfs://nn:8020/store", None, "a", "hdfs://nn:8020/store/a"),
    ("abfs://container/store", {"account_name": "acct"}, "a",
     "abfss://container@acct.dfs.core.windows.net/store/a"),
])
def test_spark_url_names_the_same_location_for_spark(prefix, options, path_suffix, url, monkeypatch):
    """spark_url maps a store path to the scheme Spark's Hadoop filesystems use."""
    monkeypatch.setenv("DATABRICKS_RUNTIME_VERSION", "16.4")
    store = Store.create(prefix, options)
    assert store.spark_url(store.join(path_suffix)) == url


def test_spark_url_refuses_filesystems_spark_cannot_write():
    """An in-memory fsspec store has no Spark equivalent: ValueError naming the protocol."""
    store = Store.create("memory://x")
    with pytest.raises(ValueError, match="Spark cannot write Parquet to memory://"):
        store.spark_url(store.join("a"))


def test_azure_without_account_says_how_to_name_it():
    """An abfs:// URL without account asks for storage_options account_name."""
    store = Store.create("abfs://container/store")
    with pytest.raises(ValueError, match="account_name"):
        store.spark_url(store.join("a"))


@pytest.fixture(params=["local", "memory", "fsspec-file"])
def store(request, tmp_path) -> Iterator[Store]:
    """A fresh store of each kind: LocalStore, in-memory fsspec, fsspec on file://."""
    if request.param == "local":
        yield Store.create(str(tmp_path / "store"))
    elif request.param == "memory":
        s = Store.create(f"memory://spark-hvd-test-{uuid.uuid4().hex}")
        yield s
        s.delete(s.prefix)
    else:
        yield FsspecStore("file://" + str(tmp_path / "store"))


def test_write_read_list_delete(store):
    """write creates parents; read returns the bytes; listdir names; delete removes files and trees."""
    path = store.join("runs", "r", "checkpoint")
    assert not store.exists(path)
    store.write(path, b"first")
    store.write(path, [b"sec", b"ond"])
    assert store.read(path) == b"second"
    store.write(store.join("runs", "r", "logs", "l.txt"), b"log")
    assert store.listdir(store.join("runs", "r")) == ["checkpoint", "logs"]
    store.delete(store.join("runs", "r", "logs"))
    assert store.listdir(store.join("runs", "r")) == ["checkpoint"]
    store.delete(path)
    store.delete(path)  # deleting what is gone is not an error
    assert not store.exists(path)


def test_move_renames_a_directory_tree(store):
    """move puts a directory tree (nested files included) under the new name, creating parents;
    the old name is gone."""
    source = store.join("intermediate_train_data.pending-x")
    store.write(store.join("intermediate_train_data.pending-x", "split=0", "part-0.parquet"), b"rows")
    store.write(store.join("intermediate_train_data.pending-x", "_SUCCESS"), b"")
    target = store.join("deeper", "intermediate_train_data.k")
    store.move(source, target)
    assert not store.exists(source)
    assert store.read(store.join("deeper", "intermediate_train_data.k", "split=0", "part-0.parquet")) == b"rows"
    assert store.listdir(target) == ["_SUCCESS", "split=0"]


def test_failed_write_keeps_the_old_content(store):
    """A writer that fails mid-stream leaves the previous file whole and no temporary file behind."""
    path = store.join("checkpoint")
    store.write(path, b"old")

    def chunks():
        yield b"new-partial"
        raise RuntimeError("producer died")

    with pytest.raises(RuntimeError, match="producer died"):
        store.write(path, chunks())
    assert store.read(path) == b"old"
    assert store.listdir(store.prefix) == ["checkpoint"]


def test_readers_never_see_a_write_in_progress(store):
    """While a write is half done, the final path holds the old content only."""
    path = store.join("checkpoint")
    store.write(path, b"old")
    half_written, release = threading.Event(), threading.Event()

    def chunks():
        yield b"x" * 100_000
        half_written.set()
        assert release.wait(30)
        yield b"y" * 100_000

    writer = threading.Thread(target=store.write, args=(path, chunks()))
    writer.start()
    try:
        assert half_written.wait(30)
        assert store.read(path) == b"old"
        assert store.listdir(store.prefix) == ["checkpoint"]
    finally:
        release.set()
        writer.join(30)
    assert store.read(path) == b"x" * 100_000 + b"y" * 100_000


_KILLED_WRITER = textwrap.dedent("""
    import sys, time
    from spark_hvd.spark.data.store import FsspecStore, LocalStore
    store = LocalStore(sys.argv[1]) if sys.argv[2] == "local" else FsspecStore("file://" + sys.argv[1])
    def chunks():
        yield b"n" * 1_000_000
        print("half", flush=True)
        time.sleep(120)
        yield b"never"
    store.write(store.join("checkpoint"), chunks())
""")


@pytest.mark.parametrize("kind", ["local", "fsspec-file"])
@pytest.mark.parametrize("had_old", [True, False])
def test_writer_killed_mid_write_leaves_no_partial_file(tmp_path, kind, had_old):
    """SIGKILL of a writer process mid-write: the final path keeps the old bytes (or does not
    exist); the partial bytes sit only in a hidden temporary file that listdir skips."""
    root = tmp_path / "store"
    store = LocalStore(str(root))
    final = store.join("checkpoint")
    if had_old:
        store.write(final, b"old")
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(root), kind],
                            stdout=subprocess.PIPE, text=True)
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            assert sel.select(timeout=60), "writer did not start writing within 60 s"
        assert proc.stdout.readline().strip() == "half"
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        proc.stdout.close()
    leftovers = [n for n in os.listdir(root) if n != "checkpoint"]
    assert len(leftovers) == 1 and leftovers[0].startswith(".checkpoint")
    assert os.path.getsize(root / leftovers[0]) == 1_000_000  # the kill did land mid-write
    if had_old:
        assert store.read(final) == b"old"
    else:
        assert not store.exists(final)
    assert store.listdir(store.prefix) == (["checkpoint"] if had_old else [])


def test_stores_pickle_and_compare_by_prefix():
    """Stores survive pickling (they travel to Spark tasks) and compare equal by type and prefix."""
    for store in (Store.create("/tmp/a"), DBFSLocalStore("dbfs:/a"), Store.create("memory://a")):
        copy = pickle.loads(pickle.dumps(store))
        assert copy == store and hash(copy) == hash(store)
    memory = Store.create("memory://a")
    memory.exists("memory://a/x")  # builds the filesystem client, which is not pickled
    assert pickle.loads(pickle.dumps(memory))._fs is None
    assert Store.create("/tmp/a") != Store.create("/tmp/b")


def test_dbfs_store_uses_the_fuse_mount():
    """DBFSLocalStore reads and writes /dbfs/... while Spark gets dbfs:/..."""
    store = DBFSLocalStore("dbfs:/ml/x")
    assert store.get_train_data_path("k") == "/dbfs/ml/x/intermediate_train_data.k"
    assert store.spark_url(store.get_train_data_path("k")) == "dbfs:/ml/x/intermediate_train_data.k"


def test_dbfs_paths_off_databricks_are_local_paths_or_refused(monkeypatch):
    """Where DBFS cannot be reached (not Databricks, no /dbfs mount), /dbfs/... is a local path like
    any other and dbfs:/... is refused with the fix, instead of a store that fails at its first write."""
    monkeypatch.delenv("DATABRICKS_RUNTIME_VERSION", raising=False)
    monkeypatch.setattr(os.path, "isdir", lambda path: False if path == "/dbfs" else os.path.exists(path))
    assert type(Store.create("/dbfs/ml/store")) is LocalStore
    with pytest.raises(ValueError, match=r"prefix='dbfs:/ml/store' is on DBFS, which is not reachable here.*fix"):
        Store.create("dbfs:/ml/store")


def test_the_stores_are_horovods_filesystem_stores_with_its_path_helpers(tmp_path):
    """As in Horovod: every store is a FilesystemStore, and FilesystemStore(prefix) builds the one
    for the prefix; the path helpers Horovod's users call answer as Horovod's do."""
    from spark_hvd.spark.common.store import FilesystemStore, HDFSStore

    local = FilesystemStore(str(tmp_path / "store"), train_path="train")
    assert type(local) is LocalStore and isinstance(DBFSLocalStore("/dbfs/x"), FilesystemStore)
    assert type(FilesystemStore("memory://root/p", storage_options={})) is FsspecStore
    assert pickle.loads(pickle.dumps(local)) == local
    assert local.get_train_data_path() == str(tmp_path / "store" / "train")
    assert local.get_full_path("a") == f"file://{tmp_path}/store/a"
    assert local.get_full_path_fn()("a") == local.get_full_path("a")
    assert local.get_localized_path(f"file://{tmp_path}/b") == str(tmp_path / "b")
    assert (local.get_checkpoint_filename(), local.get_logs_subdir(), local.saving_runs()) == ("checkpoint", "logs", True)
    assert local.get_test_data_path("k") == str(tmp_path / "store" / "intermediate_test_data.k")

    hdfs = HDFSStore("/user/p", train_path="/user/t")
    assert hdfs.get_train_data_path() == "hdfs:///user/t" and hdfs.get_runs_path() == "hdfs:///user/p/runs"
    assert hdfs.get_full_path("/user/x") == "hdfs:///user/x" and hdfs.get_localized_path("hdfs:///user/t") == "/user/t"
    named = HDFSStore("hdfs://nn:8020/user/p", val_path="/user/v")
    assert named.get_val_data_path("k") == "hdfs://nn:8020/user/v.k"

    dbfs = DBFSLocalStore("dbfs:/ml")
    assert dbfs.get_full_path("x") == "file:///dbfs/ml/x" and dbfs.get_localized_path("dbfs:/ml/y") == "/dbfs/ml/y"
    assert [DBFSLocalStore.normalize_path(p) for p in ("dbfs:/a/b", "/dbfs/a", "file:/dbfs/a", "file:///dbfs/a")] == \
        ["/dbfs/a/b", "/dbfs/a", "/dbfs/a", "/dbfs/a"]
    with pytest.raises(ValueError, match="is not a DBFS path"):
        DBFSLocalStore.normalize_path("/tmp/a")
    assert [DBFSLocalStore.matches_dbfs(p) for p in ("dbfs:/a", "file:///dbfs/a", "dbfs://host/a", "/tmp/a")] == \
        [True, True, False, False]


def test_store_create_takes_the_dbfs_mounts_file_urls_on_databricks(monkeypatch):
    """On Databricks, file:/dbfs/... and file:///dbfs/... make a DBFSLocalStore at the mount, as
    dbfs:/ and /dbfs/ do (Horovod's test_dbfs_local_store)."""
    monkeypatch.setenv("DATABRICKS_RUNTIME_VERSION", "15.4")
    for prefix in ("/dbfs/tmp/d1", "dbfs:/tmp/d1", "file:///dbfs/tmp/d1", "file:/dbfs/tmp/d1"):
        store = Store.create(prefix)
        assert type(store) is DBFSLocalStore and store.prefix == "/dbfs/tmp/d1", prefix


def test_sync_fn_copies_a_local_run_directory_into_the_run(tmp_path):
    """store.sync_fn(run_id)(local_dir) copies the directory's files (sub-directories included)
    into the run's directory; get_checkpoints lists the run's files by suffix."""
    store = LocalStore(str(tmp_path / "store"))
    with store.get_local_output_dir_fn("r1")() as local:
        os.makedirs(os.path.join(local, "logs"))
        for name, text in (("epoch=1.ckpt", "1"), ("epoch=2.ckpt", "2"), (os.path.join("logs", "events"), "e")):
            with open(os.path.join(local, name), "w") as f:
                f.write(text)
        store.sync_fn("r1")(local)
    assert store.get_checkpoints("r1") == ["epoch=1.ckpt", "epoch=2.ckpt"]
    assert store.read(os.path.join(store.get_logs_path("r1"), "events")) == b"e"
    assert store.get_checkpoints("never-ran") == []


def test_a_run_that_trained_something_else_is_refused_or_started_over(tmp_path):
    """The shared rule of every estimator: refuse naming what changed and the fix, or, with
    overwrite_run, delete the run's files so the fit starts over."""
    import pytest

    from spark_hvd.spark import Store
    from spark_hvd.spark.estimator.fingerprint import start_over_or_refuse

    store = Store.create(str(tmp_path / "store"))
    path = store.get_checkpoint_path("r1")
    store.write(path, b"old")
    with pytest.raises(ValueError, match=r"run_id='r1' already holds a checkpoint \(2 epoch\(s\) done\) of a different "
                                         r"model architecture, data: .*overwrite_run=True"):
        start_over_or_refuse(store, "r1", ["model architecture", "data"], False, 2)
    assert store.exists(path)
    with pytest.raises(ValueError, match=r"already holds a checkpoint of a different checkpoint format"):
        start_over_or_refuse(store, "r1", ["checkpoint format"], False, None)
    start_over_or_refuse(store, "r1", ["loss"], True, 2)
    assert not store.exists(path)
