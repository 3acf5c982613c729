"""Reduction operators and wire data types, including bfloat16 held in 16-bit storage."""

from __future__ import annotations

import enum
from typing import Callable, Dict, Optional

import numpy as np

__all__ = [
    "ReduceOp",
    "Average",
    "Sum",
    "Adasum",
    "Min",
    "Max",
    "Product",
    "DTYPES",
    "wire_dtype",
    "storage_dtype",
    "reduce_into",
    "scale_inplace",
    "check_op",
    "adasum",
    "ADASUM_WIRES",
]


class ReduceOp(enum.IntEnum):
    """How allreduce and reducescatter combine the ranks' values (Horovod's numbering)."""

    Average = 0
    Sum = 1
    Adasum = 2
    Min = 3
    Max = 4
    Product = 5


Average = ReduceOp.Average
Sum = ReduceOp.Sum
Adasum = ReduceOp.Adasum
Min = ReduceOp.Min
Max = ReduceOp.Max
Product = ReduceOp.Product

# Wire name -> numpy storage dtype. bfloat16 travels as its 16 raw bits.
DTYPES: Dict[str, np.dtype] = {
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(np.uint16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "int8": np.dtype(np.int8),
    "int16": np.dtype(np.int16),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "uint8": np.dtype(np.uint8),
    "bool": np.dtype(np.bool_),
}


def wire_dtype(array: np.ndarray, dtype: Optional[str] = None) -> str:
    """The wire name of ``array``'s element type; ``dtype='bfloat16'`` marks 16-bit storage."""
    if dtype is not None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is not supported; expected one of {sorted(DTYPES)}")
        if array.dtype.itemsize != DTYPES[dtype].itemsize:
            raise ValueError(
                f"dtype={dtype!r} needs {DTYPES[dtype].itemsize}-byte elements, but the array holds "
                f"{array.dtype} ({array.dtype.itemsize} bytes); pass a view of the raw storage"
            )
        return dtype
    known = _WIRE_BY_DTYPE.get(array.dtype)
    if known is not None:
        return known
    name = array.dtype.name
    if name == "bfloat16":  # ml_dtypes arrays
        return "bfloat16"
    if name not in DTYPES or name == "bfloat16":
        raise ValueError(
            f"arrays of dtype {array.dtype} are not supported; expected one of "
            f"{sorted(k for k in DTYPES if k != 'bfloat16')} (or 16-bit storage with dtype='bfloat16')"
        )
    return name


def storage_dtype(wire: str) -> np.dtype:
    return DTYPES[wire]


ADASUM_WIRES = ("float16", "bfloat16", "float32", "float64")
"""The wire dtypes Adasum combines (it scales by ratios of dot products: floating point only)."""

_VALID = {(int(op), wire): op for op in ReduceOp for wire in DTYPES
          if not (wire == "bool" and op in (ReduceOp.Average, ReduceOp.Product))
          and not (op == ReduceOp.Adasum and wire not in ADASUM_WIRES)}
_WIRE_BY_DTYPE = {dtype: name for name, dtype in DTYPES.items() if name != "bfloat16"}


def check_op(op: int, wire: str) -> ReduceOp:
    """Validate a reduction for a dtype before any communication starts."""
    valid = _VALID.get((op, wire)) if isinstance(op, int) else None
    if valid is not None:
        return valid
    try:
        op = ReduceOp(op)
    except ValueError:
        raise ValueError(f"op={op!r} is not a reduction; expected one of {[o.name for o in ReduceOp]}") from None
    if op == ReduceOp.Adasum:
        raise ValueError(f"op=Adasum combines floating-point arrays ({', '.join(ADASUM_WIRES)}), got {wire}; "
                         "use op=Sum or op=Average for other dtypes")
    if wire == "bool" and op in (ReduceOp.Average, ReduceOp.Product):
        raise ValueError(f"op={op.name} is not defined for bool arrays; use Sum (logical or), Min or Max")
    return op


def _bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    return (raw.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16(values: np.ndarray, out: np.ndarray) -> None:
    bits = values.view(np.uint32)
    # Round to nearest even; keep NaNs quiet NaNs instead of letting rounding turn them into inf.
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    nan = np.isnan(values)
    if nan.any():
        rounded[nan] = 0x7FC0
    np.copyto(out.view(np.uint16), rounded.astype(np.uint16), casting="unsafe")


_REDUCERS: Dict[ReduceOp, Callable] = {
    ReduceOp.Sum: np.add,
    ReduceOp.Average: np.add,
    ReduceOp.Min: np.minimum,
    ReduceOp.Max: np.maximum,
    ReduceOp.Product: np.multiply,
}


def reduce_into(acc: np.ndarray, other: np.ndarray, op: ReduceOp, wire: str) -> None:
    """acc = op(acc, other), elementwise, in place; both hold ``wire`` storage."""
    if acc.size == 0:
        return
    with np.errstate(over="ignore", invalid="ignore"):  # inf/nan follow IEEE rules, as in frameworks
        _reduce(acc, other, op, wire)


def combine_into(out: np.ndarray, first: np.ndarray, second: np.ndarray, op: ReduceOp, wire: str) -> None:
    """out = op(first, second), elementwise, in one pass where numpy can (``out`` may be either
    operand); all hold ``wire`` storage."""
    if out.size == 0:
        return
    if wire in ("bfloat16", "bool"):
        if out is not first:
            np.copyto(out, first)
        reduce_into(out, second, op, wire)
        return
    with np.errstate(over="ignore", invalid="ignore"):
        _REDUCERS[op](first, second, out=out)


def _reduce(acc: np.ndarray, other: np.ndarray, op: ReduceOp, wire: str) -> None:
    if wire == "bfloat16":
        result = _REDUCERS[op](_bf16_to_f32(acc), _bf16_to_f32(other))
        _f32_to_bf16(result, acc)
    elif wire == "bool":
        func = np.logical_or if op == ReduceOp.Sum else _REDUCERS[op]
        func(acc, other, out=acc)
    else:
        _REDUCERS[op](acc, other, out=acc)


def scale_inplace(array: np.ndarray, factor: float, wire: str) -> None:
    """array *= factor in place; integers keep their dtype (truncating toward zero)."""
    if factor == 1.0 or array.size == 0:
        return
    if wire == "bfloat16":
        _f32_to_bf16(_bf16_to_f32(array) * np.float32(factor), array)
    elif wire == "float16":
        # The factor would lose precision rounded to float16 first; scale in float32 instead.
        np.copyto(array, array.astype(np.float32) * np.float32(factor), casting="same_kind")
    elif wire in ("float32", "float64"):
        np.multiply(array, array.dtype.type(factor), out=array)
    elif wire == "bool":
        raise ValueError("prescale/postscale factors are not defined for bool arrays")
    else:
        scaled = array * factor
        np.copyto(array, np.trunc(scaled), casting="unsafe")


def average_inplace(array: np.ndarray, count: int, wire: str) -> None:
    """Divide a sum by ``count``; integer averages round toward zero like torch's division."""
    if count == 1 or array.size == 0:
        return
    if wire in ("float16", "float32", "float64"):
        np.divide(array, array.dtype.type(count), out=array)
    elif wire == "bfloat16":
        _f32_to_bf16(_bf16_to_f32(array) / np.float32(count), array)
    else:
        np.copyto(array, np.trunc(array / count), casting="unsafe")


def _to_float64(array: np.ndarray, wire: str) -> np.ndarray:
    return (_bf16_to_f32(array) if wire == "bfloat16" else array).astype(np.float64)


def adasum(contributions: np.ndarray, wire: str, out: np.ndarray) -> None:
    """Combine the ranks' vectors (``contributions[r]`` is rank r's, in ``wire`` storage) with
    Adasum (Maleki et al., 2020) into ``out``.

    Two vectors a and b combine as ``(1 - a.b / (2 a.a)) a + (1 - a.b / (2 b.b)) b``: their sum
    when orthogonal, their average when equal, and in between the sum with the part they share
    counted once. The ranks combine pairwise as a binary tree over rank order: (0, 1), (2, 3), ...
    first, then the pairs of those results, and so on (for a power-of-two count, the pairs at
    distance 1, 2, 4, ... of the recursive halving Horovod runs); an odd one out moves up a level
    unchanged. Dot products and the combination are computed in float64, then rounded once to
    ``wire``. A zero vector leaves the other unchanged.
    """
    level = [_to_float64(c, wire) for c in contributions]
    while len(level) > 1:
        paired = [_combine(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            paired.append(level[-1])
        level = paired
    result = level[0].reshape(out.shape)
    if wire == "bfloat16":
        _f32_to_bf16(result.astype(np.float32), out)
    else:
        with np.errstate(over="ignore", invalid="ignore"):
            np.copyto(out, result, casting="unsafe")


def _combine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    dot, aa, bb = float(np.dot(a, b)), float(np.dot(a, a)), float(np.dot(b, b))
    ca = 1.0 - dot / (2.0 * aa) if aa > 0.0 else 1.0
    cb = 1.0 - dot / (2.0 * bb) if bb > 0.0 else 1.0
    return ca * a + cb * b
