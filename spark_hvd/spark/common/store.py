"""Horovod's ``horovod.spark.common.store``: the stores of :mod:`spark_hvd.spark.data.store`.

``FilesystemStore`` is Horovod's name for a store on any filesystem; here that is the fsspec store
(``Store.create`` picks the right class from the path or URL, as Horovod's does).
"""

from spark_hvd.spark.data.store import DBFSLocalStore, FsspecStore, HDFSStore, LocalStore, Store, VolumeStore

FilesystemStore = FsspecStore

__all__ = ["Store", "LocalStore", "HDFSStore", "DBFSLocalStore", "FilesystemStore", "FsspecStore", "VolumeStore"]
