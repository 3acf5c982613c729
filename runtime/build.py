"""What this installation was built with, as Horovod's ``*_built`` and ``*_enabled`` probes ask it:
the answers every framework binding gives alike (the bindings add their own for CUDA and NCCL)."""

from __future__ import annotations

import importlib.util

from . import api

__all__ = ["mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled", "ddl_built",
           "ccl_built", "rocm_built"]


def _module_available(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def mpi_built() -> bool:
    """Whether the MPI backend can be used here (mpi4py is installed)."""
    return _module_available("mpi4py")


def mpi_enabled() -> bool:
    """Whether the running job moves data through MPI."""
    return bool(api.mpi_enabled())


def mpi_threads_supported() -> bool:
    """Whether MPI is in use with multi-threading support (False when MPI is not in use)."""
    return mpi_enabled()


def gloo_built() -> bool:
    """Always False: spark-hvd has its own ring transport and does not include Gloo."""
    return False


def gloo_enabled() -> bool:
    """Always False: see :func:`gloo_built`."""
    return False


def ddl_built() -> bool:
    """Always False: IBM DDL is not supported."""
    return False


def ccl_built() -> bool:
    """Always False: oneCCL is not supported."""
    return False


def rocm_built() -> bool:
    """Always False: ROCm is not supported."""
    return False
