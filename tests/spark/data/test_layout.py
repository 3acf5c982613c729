"""The raw-row encoding of array columns: written from Arrow list columns, read back as views."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spark_hvd.spark.data import layout
from spark_hvd.spark.data.layout import arrow_to_numpy, encode_row_bytes, rows_as_bytes, scan_parquet


@pytest.mark.parametrize("dtype, arrow_type", [("float32", pa.float32()), ("float64", pa.float64()),
                                               ("int32", pa.int32()), ("int64", pa.int64()), ("int8", pa.int8()),
                                               ("bool", pa.bool_())])
def test_list_column_round_trips_through_raw_rows(dtype, arrow_type):
    """Every numeric element type comes back with the same values, shape and dtype."""
    rng = np.random.default_rng(0)
    values = (rng.standard_normal((7, 4)) * 10).astype(dtype)
    column = pa.array(list(values), type=pa.list_(arrow_type))
    encoded = encode_row_bytes(column, dtype)
    assert encoded.type == pa.binary() and len(encoded) == 7
    assert encoded[0].as_py() == values[0].astype(np.dtype(dtype).newbyteorder("<")).tobytes()
    back = arrow_to_numpy(encoded, (2, 2), "x", dtype)
    assert back.dtype == np.dtype(dtype) and back.shape == (7, 2, 2)
    np.testing.assert_array_equal(back.reshape(7, 4), values)
    np.testing.assert_array_equal(arrow_to_numpy(encoded, None, "x", dtype), values)


def test_values_are_converted_to_the_stored_dtype_and_read_as_a_view():
    """A float64 list stored as float32 rows is converted once; reading is a view of the column's data."""
    column = pa.array([[1.5, 2.5], [3.5, 4.5], [5.5, 6.5]], type=pa.list_(pa.float64()))
    encoded = encode_row_bytes(column, "float32")
    back = arrow_to_numpy(encoded, (2,), "x", "float32")
    assert back.dtype == np.float32 and not back.flags.owndata
    np.testing.assert_array_equal(back, [[1.5, 2.5], [3.5, 4.5], [5.5, 6.5]])


def test_sliced_columns_and_null_rows_keep_their_rows():
    """A slice of a list column (an Arrow offset) and a null row are encoded in place: the null stays null
    and the rows around it keep their values."""
    column = pa.array([[9.0, 9.0], [1.0, 2.0], None, [5.0, 6.0]], type=pa.list_(pa.float32()))
    encoded = encode_row_bytes(column.slice(1), "float32")
    assert encoded.to_pylist()[1] is None
    assert np.frombuffer(encoded[0].as_py(), "<f4").tolist() == [1.0, 2.0]
    assert np.frombuffer(encoded[2].as_py(), "<f4").tolist() == [5.0, 6.0]
    with pytest.raises(ValueError, match=r"column 'x' has 1 null rows"):
        arrow_to_numpy(encoded, (2,), "x", "float32")
    valid = encode_row_bytes(column.slice(1, 1), "float32")
    np.testing.assert_array_equal(arrow_to_numpy(valid.slice(0, 1), (2,), "x", "float32"), [[1.0, 2.0]])


def test_rows_of_other_lengths_are_refused_naming_the_column():
    """Ragged rows, or rows that do not match the given shape, raise a ValueError naming the column."""
    ragged = encode_row_bytes(pa.array([[1.0, 2.0], [3.0]], type=pa.list_(pa.float32())), "float32")
    with pytest.raises(ValueError, match=r"column 'f' has raw rows of 4 to 8 bytes: expected one length"):
        arrow_to_numpy(ragged, None, "f", "float32")
    even = encode_row_bytes(pa.array([[1.0, 2.0], [3.0, 4.0]], type=pa.list_(pa.float32())), "float32")
    with pytest.raises(ValueError, match=r"column 'f' has raw rows of 8 to 8 bytes: expected 12 bytes \(3 values\)"):
        arrow_to_numpy(even, (3,), "f", "float32")


def test_a_batch_over_the_byte_limit_leaves_in_slices(monkeypatch):
    """rows_as_bytes cuts a record batch whose raw rows would pass the limit into slices, the other columns
    sliced with them, every row kept in order."""
    monkeypatch.setattr(layout, "_MAX_BATCH_BYTES", 3 * 8)
    batch = pa.RecordBatch.from_arrays([pa.array([[float(i), -float(i)] for i in range(10)],
                                                 type=pa.list_(pa.float32())), pa.array(range(10))],
                                       names=["f", "id"])
    out = list(rows_as_bytes(iter([batch, batch.slice(0, 0)]), {"f": "float32"}))
    assert [b.num_rows for b in out] == [3, 3, 3, 1]
    ids = np.concatenate([b.column(1).to_numpy() for b in out])
    rows = np.concatenate([arrow_to_numpy(b.column(0), (2,), "f", "float32") for b in out])
    assert ids.tolist() == list(range(10))
    np.testing.assert_array_equal(rows, [[i, -i] for i in range(10)])


def test_scan_finds_marked_columns_in_the_spark_schema_of_the_footer(tmp_path):
    """Columns marked in the Spark schema a footer carries are known as raw rows with their dtype;
    files without that schema have none."""
    marked = ('{"type":"struct","fields":[{"name":"f","type":"binary","nullable":true,"metadata":'
              '{"%s":"float32"}},{"name":"y","type":"double","nullable":true,"metadata":{}}]}' % layout.ROW_BYTES_KEY)
    table = pa.table({"f": encode_row_bytes(pa.array([[1.0, 2.0]], type=pa.list_(pa.float32())), "float32"),
                      "y": [1.0]})
    pq.write_table(table.replace_schema_metadata({"org.apache.spark.sql.parquet.row.metadata": marked}),
                   tmp_path / "a.parquet")
    assert scan_parquet(str(tmp_path)).row_bytes == {"f": "float32"}
    plain = tmp_path / "plain"
    plain.mkdir()
    pq.write_table(table, plain / "a.parquet")
    assert scan_parquet(str(plain)).row_bytes == {}
