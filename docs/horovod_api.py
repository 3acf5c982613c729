"""Horovod 0.28's Spark API, as data: the arguments of ``horovod.spark.run`` and ``run_elastic``
and the constructor Params of its three estimators, in Horovod's order.

``docs/generate.py`` writes the Param table of ``docs/migrating-from-horovod.md`` from these lists
and the estimators' own Param tables; ``tests/spark/test_horovod_migration.py`` checks that every
name is accepted. Read from Horovod's ``horovod/spark/runner.py``, ``horovod/spark/common/params.py``,
``horovod/spark/{torch,keras,lightning}/estimator.py``.
"""

from __future__ import annotations

from typing import Dict, List

RUN: List[str] = ["fn", "args", "kwargs", "num_proc", "start_timeout", "use_mpi", "use_gloo", "extra_mpi_args", "env",
                  "stdout", "stderr", "verbose", "nics", "prefix_output_with_timestamp", "executable"]
RUN_ELASTIC: List[str] = ["fn", "args", "kwargs", "num_proc", "min_num_proc", "max_num_proc", "start_timeout",
                          "elastic_timeout", "reset_limit", "env", "stdout", "stderr", "verbose", "nics",
                          "prefix_output_with_timestamp", "min_np", "max_np"]
TORCH: List[str] = [
    "num_proc", "data_module", "model", "backend", "store", "optimizer", "loss", "loss_constructors", "metrics",
    "loss_weights", "sample_weight_col", "gradient_compression", "feature_cols", "continuous_cols",
    "categorical_cols", "input_shapes", "validation", "label_cols", "callbacks", "batch_size", "val_batch_size",
    "epochs", "verbose", "random_seed", "shuffle_buffer_size", "shuffle", "partitions_per_process", "run_id",
    "train_minibatch_fn", "train_steps_per_epoch", "validation_steps_per_epoch", "transformation_fn",
    "train_reader_num_workers", "val_reader_num_workers", "reader_pool_type", "label_shapes", "inmemory_cache_all",
    "use_gpu", "mp_start_method", "backward_passes_per_step"]
KERAS: List[str] = [
    "num_proc", "data_module", "model", "backend", "store", "custom_objects", "optimizer", "loss", "loss_weights",
    "sample_weight_col", "gradient_compression", "metrics", "feature_cols", "label_cols", "continuous_cols",
    "categorical_cols", "validation", "callbacks", "batch_size", "val_batch_size", "epochs", "verbose",
    "random_seed", "shuffle_buffer_size", "shuffle", "partitions_per_process", "run_id", "train_steps_per_epoch",
    "validation_steps_per_epoch", "transformation_fn", "train_reader_num_workers", "val_reader_num_workers",
    "reader_pool_type", "label_shapes", "checkpoint_callback", "inmemory_cache_all", "backend_env", "use_gpu",
    "mp_start_method", "tensorflow_dataset_prefetch_buffer_size"]
LIGHTNING: List[str] = [
    "num_proc", "model", "backend", "store", "optimizer", "loss", "loss_constructors", "metrics", "loss_weights",
    "sample_weight_col", "gradient_compression", "feature_cols", "input_shapes", "validation", "label_cols",
    "callbacks", "batch_size", "val_batch_size", "epochs", "verbose", "random_seed", "shuffle_buffer_size",
    "shuffle", "partitions_per_process", "run_id", "train_minibatch_fn", "train_steps_per_epoch",
    "validation_steps_per_epoch", "transformation_fn", "transformation_edit_fields",
    "transformation_removed_fields", "train_reader_num_workers", "trainer_args", "val_reader_num_workers",
    "reader_pool_type", "label_shapes", "inmemory_cache_all", "num_gpus", "logger", "log_every_n_steps",
    "data_module", "loader_num_epochs", "terminate_on_nan", "profiler", "debug_data_loader",
    "train_async_data_loader_queue_size", "val_async_data_loader_queue_size", "use_gpu", "mp_start_method"]

ESTIMATORS: Dict[str, List[str]] = {"TorchEstimator": TORCH, "KerasEstimator": KERAS,
                                    "Lightning TorchEstimator": LIGHTNING}
"""Each Horovod estimator (Lightning's is ``horovod.spark.lightning.TorchEstimator``) and its Params."""
