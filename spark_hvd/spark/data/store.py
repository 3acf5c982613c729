"""Stores: where prepared training data, checkpoints and logs live (local, DBFS, any fsspec URL)."""

from __future__ import annotations

import os
import posixpath
import shutil
import tempfile
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Union

__all__ = ["Store", "FilesystemStore", "LocalStore", "DBFSLocalStore", "VolumeStore", "FsspecStore", "HDFSStore", "Data", "IntermediateData"]

Data = Union[bytes, bytearray, memoryview, Iterable[bytes]]
"""What :meth:`Store.write` accepts: a bytes-like object, or an iterable of byte chunks."""

_TEMP_MARKER = ".tmp-spark-hvd-"

# Filesystems whose rename is atomic within a directory; everything else is an object store,
# where an object becomes visible only when its upload completes.
_RENAME_IS_ATOMIC = frozenset({"file", "local", "hdfs", "arrow_hdfs", "viewfs", "webhdfs", "sftp"})

# fsspec protocol -> the scheme Spark's Hadoop filesystems use for the same storage.
_SPARK_SCHEMES = {
    "file": "file",
    "local": "file",
    "hdfs": "hdfs",
    "arrow_hdfs": "hdfs",
    "viewfs": "viewfs",
    "webhdfs": "webhdfs",
    "s3": "s3a",
    "s3a": "s3a",
    "gs": "gs",
    "gcs": "gs",
    "abfs": "abfss",
    "abfss": "abfss",
    "az": "abfss",
    "wasb": "wasb",
    "wasbs": "wasbs",
    "oss": "oss",
    "dbfs": "dbfs",
}


_INTERMEDIATE_PREFIXES = ("intermediate_train_data.", "intermediate_val_data.", "intermediate_data_metadata.")


@dataclass(frozen=True)
class IntermediateData:
    """One materialized dataset in a store, as :meth:`Store.list_intermediate` reports it."""

    key: str
    """The dataset's cache key (see ``spark_hvd.spark.data.identity.dataset_key``)."""
    paths: List[str]
    """Its training and validation directories and metadata file that exist."""
    modified: Optional[float]
    """When it was last written (seconds since the epoch), None when the filesystem does not say."""
    complete: bool
    """Whether its metadata file exists, i.e. it was written to the end and fits reuse it."""


def _chunks(data: Data) -> Iterable[bytes]:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return (bytes(data),)
    return data


def _temp_name(path: str) -> str:
    """A hidden sibling of ``path``: Spark and Parquet readers skip names starting with '.'."""
    head, tail = posixpath.split(path)
    return posixpath.join(head, f".{tail}{_TEMP_MARKER}{uuid.uuid4().hex}")


class Store(ABC):
    """Where prepared data, checkpoints and logs of training runs are kept.

    Layout under :attr:`prefix`::

        intermediate_train_data.<key>/         Parquet written by Spark; with validation rows, the
                                               two splits in spark_hvd_split=0/ and =1/
        intermediate_data_metadata.<key>.json  row counts, shapes, dtypes, paths (written last)
        runs/<run_id>/checkpoint               latest checkpoint
        runs/<run_id>/logs/                    logs of the run

    :meth:`write` is atomic: a reader sees the old content or the complete new content, never a
    partial file, even when the writer dies mid-write.
    """

    prefix: str
    """Root of the store: a local path or a URL."""
    train_path: Optional[str] = None
    """Where prepared training data goes instead of ``prefix/intermediate_train_data`` (Horovod's name)."""
    val_path: Optional[str] = None
    """Where prepared validation data goes (as ``<val_path>.<key>``, moved there after the write)
    instead of beside the training rows."""
    test_path: Optional[str] = None
    """Horovod's place for test data (kept for its programs; spark-hvd writes none)."""
    runs_path: Optional[str] = None
    """Where runs (checkpoints, logs) go instead of ``prefix/runs``."""
    save_runs: bool = True
    """Keep a run's checkpoints and logs after a successful fit (False: removed once fit returns)."""
    checkpoint_filename: str = "checkpoint"
    """File name of a run's checkpoint in its directory."""

    @staticmethod
    def create(prefix_path: str, storage_options: Optional[Mapping[str, Any]] = None, **layout: Any) -> "Store":
        """The store for ``prefix_path``: local path or ``file://`` -> :class:`LocalStore`;
        ``/Volumes/<catalog>/<schema>/<volume>/...`` -> :class:`VolumeStore`;
        ``dbfs:/...``, ``/dbfs/...`` or ``file:///dbfs/...`` on Databricks (or wherever ``/dbfs`` is mounted) ->
        :class:`DBFSLocalStore` (elsewhere ``/dbfs/...`` is a local path and ``dbfs:/...`` is
        refused); any other URL ->
        :class:`FsspecStore` (``hdfs://``, ``s3://``, ``gs://``, ``abfs://``, ``memory://``...).
        ``layout`` takes Horovod's ``train_path``, ``val_path``, ``test_path``, ``runs_path``,
        ``save_runs`` and ``checkpoint_filename``."""
        prefix = prefix_path
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"store prefix={prefix!r} is not valid: expected a non-empty path or URL, "
                             "e.g. '/tmp/spark-hvd' or 's3://bucket/spark-hvd'")
        if VolumeStore.matches(prefix):
            return VolumeStore(prefix, **layout)
        if DBFSLocalStore.matches(prefix):
            if DBFSLocalStore.available():
                return DBFSLocalStore(prefix, **layout)
            if prefix.startswith("dbfs:"):
                raise ValueError(f"store prefix={prefix!r} is on DBFS, which is not reachable here (not on Databricks "
                                 "and no /dbfs mount); fix: a local path or a URL of shared storage, e.g. "
                                 "'/tmp/spark-hvd' or 's3://bucket/spark-hvd'")
        if prefix.startswith("file://") or "://" not in prefix:
            return LocalStore(prefix, **layout)
        return FsspecStore(prefix, storage_options, **layout)

    def _set_layout(self, train_path: Optional[str] = None, val_path: Optional[str] = None,
                    test_path: Optional[str] = None, runs_path: Optional[str] = None, save_runs: bool = True,
                    checkpoint_filename: Optional[str] = None) -> None:
        """Horovod's layout settings: directories of this store's own filesystem (relative ones
        under ``prefix``), whether runs are kept, the checkpoint's file name."""
        for name, value in (("train_path", train_path), ("val_path", val_path), ("test_path", test_path),
                            ("runs_path", runs_path)):
            if value is not None:
                if not isinstance(value, str) or not value:
                    raise ValueError(f"{name}={value!r} is not valid: expected a directory path of the store")
                setattr(self, name, self._absolute(value))
        if not isinstance(save_runs, bool):
            raise ValueError(f"save_runs={save_runs!r} is not valid: expected True or False")
        self.save_runs = save_runs
        if checkpoint_filename is not None:
            if not isinstance(checkpoint_filename, str) or not checkpoint_filename or "/" in checkpoint_filename:
                raise ValueError(f"checkpoint_filename={checkpoint_filename!r} is not valid: expected a file name")
            self.checkpoint_filename = checkpoint_filename

    def _absolute(self, path: str) -> str:
        """``path`` in this store's syntax: relative ones are under ``prefix``."""
        return path.rstrip("/") if path.startswith("/") or "://" in path else self.join(path)

    # ---- layout -------------------------------------------------------------------------
    def join(self, *parts: str) -> str:
        """``prefix/part/...`` in this store's path syntax."""
        return posixpath.join(self.prefix, *parts)

    def get_train_data_path(self, idx: Optional[str] = None) -> str:
        """Directory of the prepared training Parquet for dataset key ``idx``."""
        base = self.train_path or self.join("intermediate_train_data")
        return base + ("" if idx is None else f".{idx}")

    def get_val_data_path(self, idx: Optional[str] = None) -> str:
        """Directory of the prepared validation Parquet for dataset key ``idx``."""
        base = self.val_path or self.join("intermediate_val_data")
        return base + ("" if idx is None else f".{idx}")

    def get_data_metadata_path(self, idx: Optional[str] = None) -> str:
        """JSON file describing the prepared dataset ``idx``; it exists only once the data is complete."""
        return self.join("intermediate_data_metadata" + ("" if idx is None else f".{idx}") + ".json")

    def get_runs_path(self) -> str:
        """Directory holding one sub-directory per run."""
        return self.runs_path or self.join("runs")

    def get_run_path(self, run_id: str) -> str:
        """Directory of run ``run_id``."""
        if not run_id or "/" in run_id:
            raise ValueError(f"run_id={run_id!r} is not valid: expected a non-empty name without '/', "
                             "e.g. 'run-20240101'")
        return posixpath.join(self.get_runs_path(), run_id)

    def get_checkpoint_path(self, run_id: str) -> str:
        """File holding the latest checkpoint of run ``run_id``."""
        return posixpath.join(self.get_run_path(run_id), self.checkpoint_filename)

    def get_logs_path(self, run_id: str) -> str:
        """Directory for the logs of run ``run_id``."""
        return posixpath.join(self.get_run_path(run_id), "logs")

    # ---- Horovod's helpers ----------------------------------------------------------------
    def get_test_data_path(self, idx: Optional[str] = None) -> str:
        """Horovod's directory for test data of dataset ``idx`` (spark-hvd writes none there)."""
        base = self.test_path or self.join("intermediate_test_data")
        return base + ("" if idx is None else f".{idx}")

    def saving_runs(self) -> bool:
        """Whether runs are kept after a successful fit (``save_runs``)."""
        return self.save_runs

    def get_checkpoint_filename(self) -> str:
        """File name of a run's checkpoint in its directory (``checkpoint_filename``)."""
        return self.checkpoint_filename

    def get_logs_subdir(self) -> str:
        """Name of the logs directory inside a run's directory."""
        return "logs"

    def get_checkpoints(self, run_id: str, suffix: str = ".ckpt") -> List[str]:
        """Names of the files in run ``run_id``'s directory that end with ``suffix``, sorted."""
        run_path = self.get_run_path(run_id)
        if not self.exists(run_path):
            return []
        return sorted(name for name in self.listdir(run_path) if name.endswith(suffix))

    def get_full_path(self, path: str) -> str:
        """``path`` as a full URL of this store's filesystem (``file:///...`` for local paths)."""
        return self._absolute(path)

    def get_full_path_fn(self) -> Callable[[str], str]:
        """:meth:`get_full_path` as a plain function (it pickles with the store)."""
        return self.get_full_path

    def get_localized_path(self, path: str) -> str:
        """``path`` as this store's filesystem names it: a local path, or the URL's path on it."""
        return self._absolute(path)

    def get_local_output_dir_fn(self, run_id: str) -> Callable[[], Any]:
        """A context manager factory yielding a temporary local directory for run ``run_id``'s output."""
        return lambda: tempfile.TemporaryDirectory(prefix=f"spark-hvd-{run_id}-")

    def sync_fn(self, run_id: str) -> Callable[[str], None]:
        """A function that copies a local directory's files into run ``run_id``'s directory
        (each file written atomically), as training code syncs its local output to the store."""
        run_path = self.get_run_path(run_id)

        def sync(local_run_path: str) -> None:
            for directory, _, files in os.walk(local_run_path):
                relative = os.path.relpath(directory, local_run_path)
                for name in files:
                    target = posixpath.join(run_path, *([] if relative == "." else relative.split(os.sep)), name)
                    with open(os.path.join(directory, name), "rb") as f:
                        self.write(target, f)

        return sync

    # ---- materialized data ----------------------------------------------------------------
    def list_intermediate(self) -> List[IntermediateData]:
        """Every materialized dataset in this store, oldest first (by last write)."""
        if not self.exists(self.prefix):
            return []
        found: Dict[str, List[str]] = {}
        for name in self.listdir(self.prefix):
            for head in _INTERMEDIATE_PREFIXES:
                if name.startswith(head):
                    key = name[len(head):]
                    key = key[:-len(".json")] if key.endswith(".json") else key
                    if key:
                        found.setdefault(key, []).append(self.join(name))
        items = []
        for key, paths in found.items():
            times = [t for t in (self.modified_time(p) for p in paths) if t is not None]
            items.append(IntermediateData(key=key, paths=sorted(paths), modified=max(times) if times else None,
                                          complete=self.exists(self.get_data_metadata_path(key))))
        return sorted(items, key=lambda item: (item.modified if item.modified is not None else 0.0, item.key))

    def remove_intermediate(self, keys: Optional[Iterable[str]] = None, *, older_than: Optional[float] = None,
                            keep: int = 0) -> List[str]:
        """Remove materialized datasets; returns the keys removed.

        ``keys``: only these datasets (default all). ``older_than``: only those last written more
        than this many seconds ago. ``keep``: spare the ``keep`` most recently written of those
        selected. A fit running on a removed dataset fails, so call this between fits.
        """
        if older_than is not None and not older_than >= 0:
            raise ValueError(f"older_than={older_than!r} is not valid: expected seconds >= 0, or None for any age")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
            raise ValueError(f"keep={keep!r} is not valid: expected an integer >= 0 (how many recent datasets to spare)")
        wanted = None if keys is None else set([keys] if isinstance(keys, str) else keys)
        items = [item for item in self.list_intermediate() if wanted is None or item.key in wanted]
        if older_than is not None:
            limit = time.time() - older_than
            items = [item for item in items if item.modified is not None and item.modified < limit]
        doomed = items[:len(items) - keep] if keep else items
        for item in doomed:
            # The metadata goes first: without it no fit takes the dataset for complete.
            for path in sorted(item.paths, key=lambda p: not p.endswith(".json")):
                self.delete(path)
        return [item.key for item in doomed]

    # ---- I/O ----------------------------------------------------------------------------
    def modified_time(self, path: str) -> Optional[float]:
        """When the file or directory at ``path`` was last modified (seconds since the epoch), or
        None when the filesystem does not tell."""
        return None

    @property
    def storage_options(self) -> Dict[str, Any]:
        """Options for fsspec (credentials, endpoints) needed to open this store's URLs."""
        return {}

    @abstractmethod
    def exists(self, path: str) -> bool:
        """Whether a file or directory exists at ``path``."""

    @abstractmethod
    def read(self, path: str) -> bytes:
        """The whole content of the file at ``path``."""

    @abstractmethod
    def write(self, path: str, data: Data) -> None:
        """Atomically replace the file at ``path`` with ``data``, creating parent directories."""

    @abstractmethod
    def listdir(self, path: str) -> List[str]:
        """Sorted names (not paths) in directory ``path``, without in-progress temporary files."""

    @abstractmethod
    def delete(self, path: str) -> None:
        """Remove the file or directory tree at ``path``; nothing happens if it does not exist."""

    def move(self, source: str, target: str) -> None:
        """Rename the file or directory tree ``source`` to ``target`` (which must not exist)."""
        raise NotImplementedError(f"{type(self).__name__} cannot rename {source!r}: implement Store.move")

    @abstractmethod
    def spark_url(self, path: str) -> str:
        """The URL Spark uses to read or write Parquet at ``path``."""

    def url(self, path: str) -> str:
        """A location fsspec and the readers open, together with :attr:`storage_options`."""
        return path

    def check_writable(self) -> None:
        """Write and remove a small file under :attr:`prefix`, or raise a ValueError naming the
        store, the error and the fix; called before any Spark job, so that a store nobody can
        write fails at once instead of after Spark has worked."""
        probe = self.join(f".spark-hvd-write-check-{uuid.uuid4().hex[:12]}")
        try:
            self.write(probe, b"ok")
            self.delete(probe)
        except Exception as exc:
            raise ValueError(
                f"store {self.prefix!r} cannot be written ({type(exc).__name__}: {exc}): expected a directory this "
                "process and the executors can write; fix: choose a writable path (on Databricks a Unity Catalog "
                "volume such as '/Volumes/<catalog>/<schema>/<volume>/spark-hvd' or 'dbfs:/tmp/spark-hvd'), or grant "
                "write access") from None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.prefix!r})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.prefix == self.prefix  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.prefix))


class FilesystemStore(Store):
    """Horovod's base of the stores on a filesystem (:class:`LocalStore`, :class:`DBFSLocalStore`,
    :class:`VolumeStore`, :class:`FsspecStore`, :class:`HDFSStore`). ``FilesystemStore(prefix,
    storage_options=..., train_path=...)`` builds the one for ``prefix``, as Horovod's does: a
    :class:`LocalStore` for a local path or ``file://`` URL, an :class:`FsspecStore` for any other URL."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls is FilesystemStore:
            prefix = args[0] if args else kwargs.get("prefix_path", "")
            local = isinstance(prefix, str) and (prefix.startswith("file://") or "://" not in prefix)
            return super().__new__(LocalStore if local else FsspecStore)
        return super().__new__(cls)


class LocalStore(FilesystemStore):
    """A store on a local (or network-mounted, shared) filesystem path."""

    def __init__(self, prefix_path: str, *, train_path: Optional[str] = None, val_path: Optional[str] = None,
                 test_path: Optional[str] = None, runs_path: Optional[str] = None, save_runs: bool = True,
                 checkpoint_filename: Optional[str] = None, storage_options: Optional[Mapping[str, Any]] = None) -> None:
        prefix = prefix_path
        if prefix.startswith("file://"):
            prefix = prefix[len("file://"):]
        if not prefix:
            raise ValueError("LocalStore prefix is empty: expected a directory path such as '/tmp/spark-hvd'")
        self.prefix = os.path.abspath(os.path.expanduser(prefix))
        self._set_layout(train_path, val_path, test_path, runs_path, save_runs, checkpoint_filename)

    def _absolute(self, path: str) -> str:
        path = path[len("file://"):] if path.startswith("file://") else path
        return os.path.abspath(os.path.join(self.prefix, os.path.expanduser(path)))

    def get_full_path(self, path: str) -> str:
        return "file://" + self._absolute(path)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def read(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def write(self, path: str, data: Data) -> None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = _temp_name(path)
        try:
            with open(tmp, "wb") as f:
                for chunk in _chunks(data):
                    f.write(chunk)
                f.flush()
                # Durable before visible: after a crash the final name holds complete bytes.
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise

    def listdir(self, path: str) -> List[str]:
        return sorted(n for n in os.listdir(path) if _TEMP_MARKER not in n)

    def modified_time(self, path: str) -> Optional[float]:
        try:
            return os.path.getmtime(path)
        except OSError:
            return None

    def delete(self, path: str) -> None:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=False)
        elif os.path.lexists(path):
            os.remove(path)

    def move(self, source: str, target: str) -> None:
        os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
        os.rename(source, target)

    def spark_url(self, path: str) -> str:
        return "file://" + os.path.abspath(path)


class DBFSLocalStore(LocalStore):
    """A store on Databricks' DBFS through its FUSE mount: ``dbfs:/x`` is read and written at
    ``/dbfs/x`` by Python, while Spark is given ``dbfs:/x``."""

    @staticmethod
    def matches(prefix: str) -> bool:
        """Whether ``prefix`` names a DBFS location: ``dbfs:/...``, ``/dbfs/...``, or the local-file
        URLs of the mount, ``file:/dbfs/...`` and ``file:///dbfs/...``."""
        return (prefix.startswith(("dbfs:", "/dbfs/", "file:/dbfs/", "file:///dbfs/"))
                or prefix in ("/dbfs", "file:/dbfs", "file:///dbfs"))

    @staticmethod
    def matches_dbfs(path: str) -> bool:
        """Horovod's test for a DBFS path: the forms :meth:`normalize_path` takes (so not
        ``dbfs://host/...``, which names a host)."""
        try:
            DBFSLocalStore.normalize_path(path)
        except ValueError:
            return False
        return True

    @staticmethod
    def available() -> bool:
        """Whether DBFS is reachable here: on Databricks, or wherever ``/dbfs`` is mounted."""
        return bool(os.environ.get("DATABRICKS_RUNTIME_VERSION")) or os.path.isdir("/dbfs")

    @staticmethod
    def normalize_path(path: str) -> str:
        """Horovod's normal form of a DBFS path, ``/dbfs/...``, from ``dbfs:/...``, ``/dbfs/...``,
        ``file:/dbfs/...`` or ``file:///dbfs/...``; ValueError for anything else."""
        for prefix, keep in (("file:///dbfs/", 7), ("file:/dbfs/", 5)):
            if path.startswith(prefix):
                return path[keep:]
        if path.startswith("/dbfs/") or (path.startswith("dbfs:/") and not path.startswith("dbfs://")):
            return DBFSLocalStore.to_fuse_path(path)
        raise ValueError(f"path {path!r} is not a DBFS path: expected '/dbfs/...', 'dbfs:/...', 'file:/dbfs/...' "
                         "or 'file:///dbfs/...'")

    @staticmethod
    def to_fuse_path(path: str) -> str:
        """``dbfs:/x`` (or ``dbfs:///x``) and ``file:/dbfs/x`` (or ``file:///dbfs/x``) -> ``/dbfs/x``;
        other paths are returned unchanged."""
        if path.startswith("dbfs:"):
            return "/dbfs/" + path[len("dbfs:"):].lstrip("/")
        if path.startswith("file:/dbfs") or path.startswith("file:///dbfs"):
            return "/" + path[len("file:"):].lstrip("/")
        return path

    def __init__(self, prefix_path: str, **layout: Any) -> None:
        prefix = prefix_path
        if not self.matches(prefix):
            raise ValueError(f"DBFSLocalStore prefix={prefix!r} is not a DBFS location: expected "
                             "'dbfs:/path', '/dbfs/path' or 'file:///dbfs/path'")
        super().__init__(self.to_fuse_path(prefix), **layout)

    def _absolute(self, path: str) -> str:
        return super()._absolute(self.to_fuse_path(path))

    def spark_url(self, path: str) -> str:
        fuse = os.path.abspath(path)
        if fuse != "/dbfs" and not fuse.startswith("/dbfs/"):
            raise ValueError(f"path {path!r} is outside the DBFS mount /dbfs")
        return "dbfs:/" + fuse[len("/dbfs"):].lstrip("/")


class VolumeStore(LocalStore):
    """A store on a Databricks Unity Catalog volume, ``/Volumes/<catalog>/<schema>/<volume>/...``.

    Python reads and writes the volume through its POSIX mount on every node; Spark is given the
    same path without a scheme, which Databricks resolves to the volume (``dbfs:/Volumes/...``
    is accepted as a prefix too).
    """

    @staticmethod
    def matches(prefix: str) -> bool:
        """Whether ``prefix`` names a Unity Catalog volume path."""
        return prefix == "/Volumes" or prefix.startswith(("/Volumes/", "dbfs:/Volumes/"))

    def __init__(self, prefix_path: str, **layout: Any) -> None:
        prefix = prefix_path
        if prefix.startswith("dbfs:"):
            prefix = prefix[len("dbfs:"):]
        parts = [p for p in prefix.split("/") if p]
        if len(parts) < 4 or parts[0] != "Volumes":
            raise ValueError(f"VolumeStore prefix={prefix!r} is not a path inside a volume: expected "
                             "'/Volumes/<catalog>/<schema>/<volume>/<directory>', e.g. "
                             "'/Volumes/main/default/ml/spark-hvd'")
        super().__init__(prefix, **layout)

    def spark_url(self, path: str) -> str:
        return os.path.abspath(path)


class FsspecStore(FilesystemStore):
    """A store on any fsspec filesystem URL (``hdfs://``, ``s3://``, ``gs://``, ``abfs://``, ...).

    Paths are full URLs. ``storage_options`` go to fsspec (credentials, endpoints); the matching
    Hadoop settings for Spark are the cluster's business.
    """

    def __init__(self, prefix_path: str, storage_options: Optional[Mapping[str, Any]] = None, **layout: Any) -> None:
        prefix = prefix_path
        if "://" not in prefix:
            raise ValueError(f"FsspecStore prefix={prefix!r} is not a URL: expected e.g. 's3://bucket/dir'; "
                             "use LocalStore for local paths")
        self.prefix = prefix.rstrip("/")
        self._storage_options = dict(storage_options or {})
        self.protocol = prefix.split("://", 1)[0].lower()
        self._fs: Any = None
        self._set_layout(**layout)

    @property
    def storage_options(self) -> Dict[str, Any]:
        return dict(self._storage_options)

    def _absolute(self, path: str) -> str:
        """URLs as they are; an absolute path on this store's filesystem (its scheme and authority:
        ``/user/t`` of ``hdfs://nn:8020/p`` is ``hdfs://nn:8020/user/t``); relative ones under ``prefix``."""
        if path.startswith("/"):
            authority = self.prefix.split("://", 1)[1].split("/", 1)[0]
            return f"{self.protocol}://{authority}{path.rstrip('/')}"
        return super()._absolute(path)

    def get_localized_path(self, path: str) -> str:
        return self._absolute(path).split("://", 1)[1]

    @property
    def fs(self) -> Any:
        """The fsspec filesystem, created on first use (and again after unpickling)."""
        if self._fs is None:
            import fsspec

            self._fs = fsspec.filesystem(self.protocol, **self._storage_options)
        return self._fs

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state["_fs"] = None  # filesystem clients hold sockets and threads; rebuild where unpickled
        return state

    def _fs_path(self, path: str) -> str:
        return self.fs._strip_protocol(path)

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(self._fs_path(path)))

    def read(self, path: str) -> bytes:
        return bytes(self.fs.cat_file(self._fs_path(path)))

    def write(self, path: str, data: Data) -> None:
        target = self._fs_path(path)
        fs = self.fs
        parent = posixpath.dirname(target)
        if parent:
            fs.makedirs(parent, exist_ok=True)
        if self.protocol in _RENAME_IS_ATOMIC:
            tmp = _temp_name(target)
            try:
                with fs.open(tmp, "wb") as f:
                    for chunk in _chunks(data):
                        f.write(chunk)
                # HDFS renames do not replace an existing file; the old one goes first, so a
                # reader may briefly see no file, but never a partial one.
                if fs.exists(target) and self.protocol != "file" and self.protocol != "local":
                    fs.rm(target)
                fs.mv(tmp, target)
            except BaseException:
                if fs.exists(tmp):
                    fs.rm(tmp)
                raise
            return
        # Object stores publish an object when its upload completes, and their "rename" is a
        # copy: so the bytes are completed in a local file first and then put in one call.
        with tempfile.NamedTemporaryFile(prefix="spark-hvd-upload-", delete=True) as local:
            for chunk in _chunks(data):
                local.write(chunk)
            local.flush()
            fs.put_file(local.name, target)

    def listdir(self, path: str) -> List[str]:
        entries = self.fs.ls(self._fs_path(path), detail=False)
        names = (posixpath.basename(e.rstrip("/")) for e in entries)
        return sorted(n for n in names if _TEMP_MARKER not in n)

    def modified_time(self, path: str) -> Optional[float]:
        try:
            modified = self.fs.modified(self._fs_path(path))
        except Exception:  # directories and some filesystems have no modification time
            return None
        return float(modified.timestamp()) if hasattr(modified, "timestamp") else None

    def delete(self, path: str) -> None:
        target = self._fs_path(path)
        if self.fs.exists(target):
            self.fs.rm(target, recursive=True)

    def move(self, source: str, target: str) -> None:
        # A rename on HDFS and local filesystems; object stores copy and delete.
        self.fs.mv(self._fs_path(source), self._fs_path(target), recursive=True)

    def spark_url(self, path: str) -> str:
        scheme = _SPARK_SCHEMES.get(self.protocol)
        if scheme is None:
            raise ValueError(
                f"Spark cannot write Parquet to {self.protocol}:// (store {self.prefix!r}): expected a "
                f"filesystem Spark can reach ({', '.join(sorted(set(_SPARK_SCHEMES.values())))}); "
                "fix: use a store on shared storage, e.g. Store.create('hdfs://...') or a local path "
                "in local mode")
        rest = path.split("://", 1)[1]
        if scheme == "abfss" and "@" not in rest.split("/", 1)[0]:
            account = self._storage_options.get("account_name")
            if not account:
                raise ValueError(
                    f"cannot name {path!r} for Spark: Azure URLs need the storage account; fix: pass "
                    "storage_options={'account_name': ...} or use 'abfs://container@account.dfs.core.windows.net/path'")
            container, _, key = rest.partition("/")
            rest = f"{container}@{account}.dfs.core.windows.net/{key}"
        return f"{scheme}://{rest}"


class HDFSStore(FsspecStore):
    """A store on HDFS, with Horovod's ``HDFSStore`` arguments: ``prefix_path`` an ``hdfs://`` URL,
    or a path with ``host`` and ``port`` of the namenode (``host='default'``: the cluster's
    configured one); ``user``, ``kerb_ticket`` and ``extra_conf`` go to the HDFS client."""

    def __init__(self, prefix_path: str, host: Optional[str] = None, port: Optional[int] = None,
                 user: Optional[str] = None, kerb_ticket: Optional[str] = None, driver: str = "libhdfs",
                 extra_conf: Optional[Mapping[str, str]] = None, temp_dir: Optional[str] = None,
                 storage_options: Optional[Mapping[str, Any]] = None, **layout: Any) -> None:
        if driver != "libhdfs":
            raise ValueError(f"driver={driver!r} is not valid: spark-hvd reaches HDFS through pyarrow's libhdfs "
                             "client; leave driver unset")
        if "://" not in prefix_path:
            if not prefix_path.startswith("/"):
                raise ValueError(f"HDFSStore prefix_path={prefix_path!r} is not valid: expected 'hdfs://host:port/path' "
                                 "or an absolute path with host= and port=")
            authority = "" if host in (None, "default") else (host if port is None else f"{host}:{port}")
            prefix_path = f"hdfs://{authority}{prefix_path}"
        elif not prefix_path.startswith(("hdfs://", "viewfs://")):
            raise ValueError(f"HDFSStore prefix_path={prefix_path!r} is not an HDFS URL: expected 'hdfs://...'; "
                             "use Store.create for other filesystems")
        options: Dict[str, Any] = dict(storage_options or {})
        for name, value in (("user", user), ("kerb_ticket", kerb_ticket), ("extra_conf", extra_conf)):
            if value is not None:
                options[name] = dict(value) if name == "extra_conf" else value
        self.temp_dir = temp_dir
        super().__init__(prefix_path, options, **layout)

    def get_localized_path(self, path: str) -> str:
        """The path on HDFS, without the scheme and the namenode: ``/user/t``."""
        return "/" + super().get_localized_path(path).partition("/")[2]
