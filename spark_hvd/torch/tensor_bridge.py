"""Passage of torch tensors to the numpy runtime and back, without copies where memory allows.

A contiguous CPU tensor of a dtype the runtime knows travels as a numpy view of its own memory;
bfloat16 as a view of its 16-bit storage marked ``dtype="bfloat16"``; complex tensors as their
real/imaginary pairs. Non-contiguous tensors are packed into a contiguous copy first (and
unpacked afterwards for in-place operations). CUDA tensors are staged through host memory until
a device backend plugs in behind this module; the first time that happens a warning says so.
Data-movement operations (broadcast, allgather, alltoall) also accept dtypes no reduction is
defined for (unsigned 16/32/64-bit integers, float8 ...), moved as raw bytes.
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import numpy as np
import torch

__all__ = ["Staged", "stage", "from_array", "dtype_supported"]

# torch dtypes whose numpy view the runtime reduces directly.
_NATIVE = frozenset(
    {
        torch.float16,
        torch.float32,
        torch.float64,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint8,
        torch.bool,
    }
)
_COMPLEX = frozenset({torch.complex64, torch.complex128})

_staging_warned = False
_warn_lock = threading.Lock()


def _warn_device_staging(device: torch.device) -> None:
    global _staging_warned
    with _warn_lock:
        if _staging_warned:
            return
        _staging_warned = True
    from spark_hvd.torch.device import device_problem

    why = device_problem() or "NCCL has no type for this dtype"
    warnings.warn(
        f"spark_hvd.torch: tensors on {device} are copied through host memory for collectives because "
        f"NCCL cannot be used ({why}); expect lower throughput than on the GPU.",
        RuntimeWarning,
        stacklevel=4,
    )


@dataclass(frozen=True)
class _Codec:
    """How one torch dtype is represented to the runtime."""

    encode: Callable[[torch.Tensor], torch.Tensor]
    decode: Callable[[torch.Tensor], torch.Tensor]
    wire: Optional[str]
    reducible: bool


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


_NATIVE_CODEC = _Codec(_identity, _identity, None, True)
_BF16_CODEC = _Codec(
    lambda t: t.view(torch.uint16),
    lambda t: t.view(torch.bfloat16),
    "bfloat16",
    True,
)


def _complex_codec(dtype: torch.dtype) -> _Codec:
    return _Codec(torch.view_as_real, lambda t: torch.view_as_complex(t.contiguous()), None, True)


def _bytes_codec(dtype: torch.dtype) -> _Codec:
    # A trailing axis of itemsize bytes keeps dimension 0 (the axis allgather/alltoall split on).
    return _Codec(
        lambda t: t.unsqueeze(-1).view(torch.uint8),
        lambda t: t.view(dtype).squeeze(-1),
        None,
        False,
    )


def _codec(dtype: torch.dtype) -> _Codec:
    if dtype in _NATIVE:
        return _NATIVE_CODEC
    if dtype == torch.bfloat16:
        return _BF16_CODEC
    if dtype in _COMPLEX:
        return _complex_codec(dtype)
    return _bytes_codec(dtype)


def dtype_supported(dtype: torch.dtype, reduction: bool) -> bool:
    """Whether tensors of ``dtype`` can take part in a reduction (or, if not, a data movement)."""
    return _codec(dtype).reducible or not reduction


@dataclass
class Staged:
    """A tensor prepared for the runtime: ``array`` is what the runtime reads (and, in place, writes)."""

    target: torch.Tensor
    """The caller's tensor."""
    host: torch.Tensor
    """Contiguous CPU tensor whose memory ``array`` views: an alias of ``target`` when possible."""
    array: np.ndarray
    """The numpy view handed to the runtime."""
    wire: Optional[str]
    """``"bfloat16"`` for bfloat16 storage, else None (the runtime reads the numpy dtype)."""
    codec: _Codec
    copied: bool
    """Whether ``array`` lives in a staging copy rather than the caller's memory."""

    def write_back(self) -> torch.Tensor:
        """After an in-place operation, make ``target`` hold the result; return ``target``."""
        if self.copied:
            with torch.no_grad():
                self.target.copy_(self.host)
        return self.target

    def result(self, array: np.ndarray) -> torch.Tensor:
        """A tensor of the caller's dtype and device over a result array from the runtime."""
        return from_array(array, self.target.dtype, self.target.device, self.codec)

    def empty_like(self) -> Tuple[torch.Tensor, np.ndarray]:
        """A fresh host tensor shaped like the staged input, and the numpy view to pass as ``out``."""
        host = torch.empty_like(self.host)
        return host, _numpy_view(self.codec.encode(host))

    def finish_out(self, host: torch.Tensor) -> torch.Tensor:
        """The caller-facing form of an ``empty_like`` host tensor the runtime has filled."""
        if self.target.device.type != "cpu":
            return host.to(self.target.device)
        return host


def _numpy_view(encoded: torch.Tensor) -> np.ndarray:
    if encoded.dim() == 0:
        # The runtime splits and concatenates along dimension 0; give scalars one.
        encoded = encoded.reshape(1)
    return encoded.numpy()


def stage(tensor: torch.Tensor, *, reduction: bool, what: str = "tensor") -> Staged:
    """Prepare ``tensor`` for the runtime; raise ValueError for dtypes the operation cannot take."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    codec = _codec(tensor.dtype)
    if reduction and not codec.reducible:
        raise ValueError(
            f"{what} has dtype {tensor.dtype}, which cannot be reduced; expected one of float16, "
            "bfloat16, float32, float64, complex64, complex128, int8, int16, int32, int64, uint8 or "
            "bool. Convert it first, e.g. tensor.to(torch.int64)."
        )
    if tensor.layout != torch.strided:
        raise ValueError(
            f"{what} has layout {tensor.layout}; collectives take dense tensors. Pass "
            "tensor.to_dense(), or use sparse_allreduce_async() for sparse gradients."
        )
    source = tensor.detach()
    if source.device.type != "cpu":
        _warn_device_staging(source.device)
        host = source.to("cpu", memory_format=torch.contiguous_format, copy=True)
    elif not source.is_contiguous() or source.is_conj() or source.is_neg():
        host = source.resolve_conj().resolve_neg().contiguous()
        if host.data_ptr() == source.data_ptr():
            host = host.clone()
    else:
        host = source
    array = _numpy_view(codec.encode(host))
    return Staged(target=tensor, host=host, array=array, wire=codec.wire, codec=codec, copied=host is not source)


def from_array(array: np.ndarray, dtype: torch.dtype, device: torch.device, codec: Optional[_Codec] = None) -> torch.Tensor:
    """Wrap a runtime result as a tensor of ``dtype`` on ``device`` (no copy on CPU)."""
    codec = codec or _codec(dtype)
    if not array.flags.writeable:
        array = array.copy()
    tensor = codec.decode(torch.from_numpy(np.ascontiguousarray(array)))
    if tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    if device.type != "cpu":
        tensor = tensor.to(device)
    return tensor
