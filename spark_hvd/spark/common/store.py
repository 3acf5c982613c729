"""Horovod's ``horovod.spark.common.store``: the stores of :mod:`spark_hvd.spark.data.store`.

``FilesystemStore`` is, as in Horovod, the base of the stores on a filesystem; constructing it
builds the store for the path (``Store.create`` picks the right class too, as Horovod's does).
"""

from spark_hvd.spark.data.store import (DBFSLocalStore, FilesystemStore, FsspecStore, HDFSStore, LocalStore, Store,
                                        VolumeStore)

__all__ = ["Store", "LocalStore", "HDFSStore", "DBFSLocalStore", "FilesystemStore", "FsspecStore", "VolumeStore"]
