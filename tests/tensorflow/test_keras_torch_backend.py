"""spark_hvd.keras on Keras 3's torch backend (KERAS_BACKEND=torch) in a world of two: the same
fit equivalence, accumulation and callbacks as on tensorflow, without importing TensorFlow."""

import subprocess
import sys

import pytest

from keras_checks import (
    check_adasum_optimizer_step,
    check_backward_passes_per_step,
    check_callbacks,
    check_fit_matches_single_process,
    check_flat_gradients_of_mixed_dtypes,
    check_sync_batch_normalization,
    check_sync_batch_normalization_in_fit,
    check_keras_values_and_state,
)
from tf_world import assert_passed, launch


def check_torch_backend_without_tensorflow(hvd, rank, size):
    """The world runs Keras on torch through spark_hvd.torch; spark_hvd.tensorflow was never imported
    (keras.utils.set_random_seed itself imports tensorflow when it is installed)."""
    import keras

    assert keras.config.backend() == "torch"
    assert "spark_hvd.torch" in sys.modules and "spark_hvd.tensorflow" not in sys.modules


CHECKS = [
    check_torch_backend_without_tensorflow,
    check_fit_matches_single_process,
    check_flat_gradients_of_mixed_dtypes,
    check_sync_batch_normalization,
    check_sync_batch_normalization_in_fit,
    check_backward_passes_per_step,
    check_callbacks,
    check_keras_values_and_state,
    check_adasum_optimizer_step,
    check_torch_backend_without_tensorflow,
]


@pytest.fixture(scope="module")
def world():
    return launch(CHECKS, 2, framework="keras", env={"KERAS_BACKEND": "torch"})


@pytest.mark.parametrize("check", CHECKS[:-1], ids=lambda c: c.__name__)
def test_torch_backend(world, check):
    """Each check passes on both ranks of the torch-backend world (see the check's docstring)."""
    assert_passed(world, check)


def test_bindings_import_only_their_framework():
    """spark_hvd.tensorflow imports no torch, and spark_hvd.keras on the torch backend no tensorflow."""
    code = ("import sys, spark_hvd.tensorflow\n"
            "assert 'torch' not in sys.modules, 'spark_hvd.tensorflow imported torch'\n")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    code = ("import os, sys; os.environ['KERAS_BACKEND'] = 'torch'\n"
            "import spark_hvd.keras, keras\n"
            "assert keras.config.backend() == 'torch'\n"
            "assert 'tensorflow' not in sys.modules, 'spark_hvd.keras imported tensorflow'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
