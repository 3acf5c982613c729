"""CUDA tensors through NCCL: the device operations torch gives the runtime, and the enqueue path
that keeps data on the GPU (no host copy) when NCCL can be used.

When it cannot (no NCCL library, no GPU, a dtype NCCL has no type for), CUDA tensors are staged
through host memory by :mod:`spark_hvd.torch.tensor_bridge`, with a one-time warning that says why.
"""

from __future__ import annotations

import math
import threading
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import torch

import spark_hvd.runtime as _rt
from spark_hvd.runtime.device import nccl_status, register_device_ops
from spark_hvd.runtime.ops import storage_dtype
from spark_hvd.runtime.kinds import ALLREDUCE, ALLTOALL, BROADCAST

__all__ = ["TorchCudaOps", "device_problem", "use_device", "enqueue_device"]

_WIRE = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float64: "float64",
         torch.int8: "int8", torch.uint8: "uint8", torch.int32: "int32", torch.int64: "int64"}
_TORCH = {wire: dtype for dtype, wire in _WIRE.items()}
_TORCH["bool"] = torch.bool

_registered = False
_lock = threading.Lock()


class TorchCudaOps:
    """The runtime's :class:`~spark_hvd.runtime.device.DeviceOps` for CUDA tensors; every
    operation is queued on the default stream of the tensor's device (the engine thread's current one)."""

    def ptr(self, tensor: torch.Tensor) -> int:
        return tensor.data_ptr()

    def empty(self, shape: Tuple[int, ...], wire: str, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(shape, dtype=_TORCH[wire], device=like.device)

    @staticmethod
    def _bytes(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.reshape(-1).view(torch.uint8)

    def copy(self, dst: torch.Tensor, dst_byte: int, src: torch.Tensor, src_byte: int, nbytes: int) -> None:
        if nbytes:
            self._bytes(dst)[dst_byte:dst_byte + nbytes].copy_(self._bytes(src)[src_byte:src_byte + nbytes])

    def scale(self, tensor: torch.Tensor, first: int, count: int, wire: str, factor: float) -> None:
        part = tensor.reshape(-1).view(_TORCH[wire])[first:first + count]
        if wire in ("float16", "bfloat16"):
            part.copy_(part.float().mul_(factor))
        elif wire in ("float32", "float64"):
            part.mul_(factor)
        else:
            part.copy_(torch.trunc(part.double() * factor).to(part.dtype))

    def view(self, tensor: torch.Tensor, first: int, shape: Tuple[int, ...], wire: str) -> torch.Tensor:
        count = math.prod(shape)
        return tensor.reshape(-1).view(_TORCH[wire])[first:first + count].view(shape)

    def stream(self, like: torch.Tensor) -> int:
        return torch.cuda.default_stream(like.device).cuda_stream

    def synchronize(self, like: torch.Tensor) -> None:
        torch.cuda.default_stream(like.device).synchronize()

    def to_host(self, tensor: torch.Tensor, first: int, count: int, wire: str) -> np.ndarray:
        item = storage_dtype(wire).itemsize
        raw = self._bytes(tensor)[first * item:(first + count) * item].cpu().numpy()
        return raw.view(storage_dtype(wire))

    def from_host(self, tensor: torch.Tensor, first: int, array: np.ndarray) -> None:
        item = array.dtype.itemsize
        raw = torch.from_numpy(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
        self._bytes(tensor)[first * item:first * item + raw.numel()].copy_(raw)

    def activate(self, like: torch.Tensor) -> None:
        if torch.cuda.current_device() != like.device.index:
            torch.cuda.set_device(like.device)


def device_problem() -> Optional[str]:
    """Why CUDA tensors cannot go through NCCL here, or None when they can."""
    if not torch.cuda.is_available():
        return "no CUDA device is visible to torch"
    lib, problem = nccl_status()
    return problem if lib is None else None


def use_device(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether these tensors take the NCCL path: all on CUDA, of a dtype NCCL has, NCCL usable."""
    global _registered
    if not tensors or not all(t.is_cuda and t.dtype in _WIRE for t in tensors):
        return False
    if device_problem() is not None:
        return False
    with _lock:
        if not _registered:
            register_device_ops("cuda", TorchCudaOps())
            _registered = True
    return True


def _order_after_caller(device: torch.device) -> None:
    """The engine queues its work on the device's default stream; when the caller produced the
    tensors on another stream, make the default stream wait for that work (without blocking the
    caller) so NCCL reads finished values."""
    current = torch.cuda.current_stream(device)
    default = torch.cuda.default_stream(device)
    if current != default:
        default.wait_stream(current)


def enqueue_device(kind: str, tensors: List[torch.Tensor], *, grouped: bool, inplace: bool, name: Optional[str],
                   op: int, prescale_factor: float, postscale_factor: float, root_rank: Optional[int], splits: Any,
                   process_set: Any) -> Tuple[Any, Any]:
    """Start ``kind`` on CUDA tensors; returns the runtime handle and how to turn its results into
    the grid's (tensors, or (tensor, received splits) for alltoall)."""
    wires = {_WIRE[t.dtype] for t in tensors}
    if len(wires) != 1:
        raise ValueError(f"grouped_{kind} got tensors of dtypes {sorted(wires)}; expected one dtype per group")
    wire = wires.pop()
    sources = [t.detach() if t.is_contiguous() else t.detach().contiguous() for t in tensors]
    _order_after_caller(sources[0].device)
    if kind in (ALLREDUCE, BROADCAST):
        outs = [s if inplace else torch.empty_like(s) for s in sources]
    else:
        outs = [None] * len(sources)
    split_list = None
    if kind == ALLTOALL:
        n = process_set.size() if process_set is not None else _rt.size()
        rows = sources[0].shape[0]
        split_list = [rows // n] * n if splits is None else \
            [int(x) for x in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
        if len(split_list) != n or sum(split_list) != rows or min(split_list) < 0:
            raise ValueError(f"alltoall splits={split_list} must give one non-negative row count per rank ({n}) "
                             f"adding up to dim 0 of the tensor ({rows})")
    handle = _rt.device_async(kind, sources, outs, wire=wire, name=name, op=op, prescale_factor=prescale_factor,
                              postscale_factor=postscale_factor, root_rank=-1 if root_rank is None else root_rank,
                              splits=split_list, process_set=process_set, grouped=grouped)

    def finish(raw: List[Any]) -> Any:
        value = raw[0]  # one tensor, or a list for grouped requests
        if kind == ALLTOALL:
            received, received_splits = value
            dtype = splits.dtype if isinstance(splits, torch.Tensor) else torch.int32
            return received, torch.from_numpy(np.asarray(received_splits, dtype=np.int64)).to(dtype)
        if inplace:
            for target, source in zip(tensors, sources):
                if source.data_ptr() != target.data_ptr():
                    with torch.no_grad():
                        target.copy_(source)
            return list(tensors) if grouped else tensors[0]
        return value

    return handle, finish
