"""Reduction kernels and dtype handling, bfloat16 included."""

import numpy as np
import pytest

from spark_hvd.runtime.ops import (ReduceOp, average_inplace, check_op, reduce_into, scale_inplace,
                                   wire_dtype)


def bf16(values):
    return (np.asarray(values, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def from_bf16(raw):
    return (raw.astype(np.uint32) << 16).view(np.float32)


def test_bfloat16_sum_rounds_to_nearest_even():
    """bfloat16 storage is reduced in float32 and rounded back correctly."""
    acc = bf16([1.0, 256.0, -2.5, 3.0e38])
    reduce_into(acc, bf16([2.0, 1.0, 0.5, 3.0e38]), ReduceOp.Sum, "bfloat16")
    got = from_bf16(acc)
    assert got[0] == 3.0
    assert got[1] == 256.0  # 257 is not representable: ties to even
    assert got[2] == -2.0
    assert np.isinf(got[3])


def test_bfloat16_nan_stays_nan():
    """A NaN input does not turn into infinity through rounding."""
    acc = bf16([np.nan])
    reduce_into(acc, bf16([1.0]), ReduceOp.Sum, "bfloat16")
    assert np.isnan(from_bf16(acc))[0]


@pytest.mark.parametrize("op,want", [(ReduceOp.Min, [1, -4]), (ReduceOp.Max, [3, 2]), (ReduceOp.Product, [3, -8])])
def test_reductions_on_integers(op, want):
    """Min/Max/Product are exact on integer arrays."""
    acc = np.array([1, 2], np.int16)
    reduce_into(acc, np.array([3, -4], np.int16), op, "int16")
    assert acc.tolist() == want


def test_integer_average_and_scaling_truncate():
    """Integer averages and scale factors round toward zero and keep the dtype."""
    values = np.array([7, -7, 5], np.int32)
    average_inplace(values, 2, "int32")
    assert values.tolist() == [3, -3, 2] and values.dtype == np.int32
    scaled = np.array([3, -3], np.int64)
    scale_inplace(scaled, 0.5, "int64")
    assert scaled.tolist() == [1, -1]


def test_bool_sum_is_logical_or():
    """Sum over bool arrays means logical or."""
    acc = np.array([True, False, False])
    reduce_into(acc, np.array([False, False, True]), ReduceOp.Sum, "bool")
    assert acc.tolist() == [True, False, True]


def test_float16_scaling_is_computed_in_float32():
    """A factor that float16 cannot hold exactly still scales float16 data as float32 would."""
    data = np.array([1.0, 3.0, 1000.0], dtype=np.float16)
    factor = 1.0 / 3.0  # float16(1/3) is off by 2e-4 relative; the product must not inherit that
    want = (data.astype(np.float32) * np.float32(factor)).astype(np.float16)
    scale_inplace(data, factor, "float16")
    assert data.tolist() == want.tolist()


def test_unsupported_inputs_are_named():
    """Unsupported dtypes, Adasum and mismatched bfloat16 storage give errors with the fix."""
    with pytest.raises(ValueError, match="complex128 are not supported"):
        wire_dtype(np.zeros(2, np.complex128))
    with pytest.raises(ValueError, match="op=Adasum combines floating-point arrays .* got int32; use op=Sum"):
        check_op(ReduceOp.Adasum, "int32")
    assert check_op(ReduceOp.Adasum, "bfloat16") == ReduceOp.Adasum
    with pytest.raises(ValueError, match="needs 2-byte elements"):
        wire_dtype(np.zeros(2, np.float32), "bfloat16")
    with pytest.raises(ValueError, match="not defined for bool"):
        check_op(ReduceOp.Average, "bool")
