"""Gradient compression applied around allreduce: none, or float16 on the wire."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import tensorflow as tf

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "Compression"]


class Compressor:
    """Turns a tensor into what travels (``compress``) and back into the caller's form (``decompress``)."""

    @staticmethod
    def compress(tensor: tf.Tensor) -> Tuple[tf.Tensor, Any]:
        """Return ``(tensor_to_send, context)``; ``context`` is handed to ``decompress``."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        """Return the received tensor in the form the caller passed to ``compress``."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors unchanged."""

    @staticmethod
    def compress(tensor: tf.Tensor) -> Tuple[tf.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        return tensor


class FP16Compressor(Compressor):
    """Sends floating-point tensors as float16, halving the bytes of float32 gradients.

    Other dtypes (integers, bool) travel unchanged. The reduction happens in float16, so sums
    beyond float16's range (about 65504) overflow: scale gradients down first if that can occur.
    """

    @staticmethod
    def compress(tensor: tf.Tensor) -> Tuple[tf.Tensor, Optional[tf.dtypes.DType]]:
        tensor = tf.convert_to_tensor(tensor)
        if tensor.dtype.is_floating and tensor.dtype != tf.float16:
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Optional[tf.dtypes.DType]) -> tf.Tensor:
        return tensor if ctx is None else tf.cast(tensor, ctx)


class Compression:
    """The compression algorithms, by Horovod's names: ``Compression.none`` and ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
