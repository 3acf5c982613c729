"""Gradient compression applied around allreduce: none, or float16 on the wire."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "Compression"]


class Compressor:
    """Turns a tensor into what travels (``compress``) and back into the caller's form (``decompress``)."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        """Return ``(tensor_to_send, context)``; ``context`` is handed to ``decompress``."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Return the received tensor in the form the caller passed to ``compress``."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors unchanged."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class FP16Compressor(Compressor):
    """Sends floating-point tensors as float16, halving the bytes of float32 gradients.

    Other dtypes (integers, bool) travel unchanged. The reduction happens in float16, so sums
    beyond float16's range (about 65504) overflow: scale gradients down first if that can occur.
    """

    @staticmethod
    def compress(tensor: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.dtype]]:
        if tensor.dtype.is_floating_point and tensor.dtype != torch.float16:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Optional[torch.dtype]) -> torch.Tensor:
        return tensor if ctx is None else tensor.to(ctx)


class Compression:
    """The compression algorithms, by Horovod's names: ``Compression.none`` and ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
