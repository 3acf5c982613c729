"""Gradient compression for Keras on any backend: none, or float16 on the wire (via keras.ops)."""

from __future__ import annotations

from typing import Any, Optional, Tuple

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "Compression"]


class Compressor:
    """Turns a tensor into what travels (``compress``) and back into the caller's form (``decompress``)."""

    @staticmethod
    def compress(tensor: Any) -> Tuple[Any, Any]:
        """Return ``(tensor_to_send, context)``; ``context`` is handed to ``decompress``."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        """Return the received tensor in the form the caller passed to ``compress``."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors unchanged."""

    @staticmethod
    def compress(tensor: Any) -> Tuple[Any, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor


class FP16Compressor(Compressor):
    """Sends floating-point tensors as float16; other dtypes travel unchanged.

    The reduction happens in float16, so sums beyond about 65504 overflow.
    """

    @staticmethod
    def compress(tensor: Any) -> Tuple[Any, Optional[str]]:
        import keras

        dtype = keras.backend.standardize_dtype(tensor.dtype)
        if "float" in dtype and dtype != "float16":
            return keras.ops.cast(tensor, "float16"), dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Optional[str]) -> Any:
        import keras

        return tensor if ctx is None else keras.ops.cast(tensor, ctx)


class Compression:
    """The compression algorithms, by Horovod's names: ``Compression.none`` and ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
