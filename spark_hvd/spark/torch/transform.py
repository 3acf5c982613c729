"""Batched inference over Arrow for TorchModel.transform.

The driver broadcasts the serialized model once; each Python worker deserializes it once (and
keeps it while the worker is reused), then predicts ``batch_size`` rows at a time on the
Arrow record batches of ``mapInArrow``: one forward pass per batch, not one per row.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["InferencePlan", "predict_partition", "output_is_scalar", "plan_inputs"]

_CACHE_SIZE = 2
_models: "OrderedDict[Tuple[str, str], Any]" = OrderedDict()
"""Deserialized models of this worker process, by (model key, device)."""


@dataclass(frozen=True)
class InferencePlan:
    """What the workers need besides the model; plain values, shipped in the task closure."""

    key: str
    """Identity of the serialized model, for the per-worker cache."""
    input_cols: Tuple[str, ...]
    """Columns (in the mapInArrow input) holding the features, one per forward() argument."""
    input_shapes: Tuple[Tuple[int, ...], ...]
    """Per-row shape of each input."""
    drop_cols: Tuple[str, ...]
    """Helper columns added for the inference only; removed from the output."""
    output_cols: Tuple[str, ...]
    scalar_outputs: Tuple[bool, ...]
    """Per output: one value per row (a double column) or several (an array column)."""
    batch_size: int
    dtype: str
    """torch dtype name of the model's parameters, e.g. 'float32'."""
    sys_path: Tuple[str, ...]
    """The driver's sys.path, so model classes imported there import here too."""


def output_is_scalar(row_shape: Sequence[int]) -> bool:
    """Whether an output with per-row shape ``row_shape`` becomes one double per row."""
    size = 1
    for d in row_shape:
        size *= int(d)
    return size == 1


def _device() -> Any:
    import torch

    if not torch.cuda.is_available():
        return torch.device("cpu")
    try:
        from pyspark import TaskContext

        context = TaskContext.get()
        gpus = context.resources().get("gpu") if context is not None else None
    except Exception:  # no task context or no resource support: treat as no GPU assigned
        gpus = None
    if gpus is not None and gpus.addresses:
        return torch.device("cuda", int(gpus.addresses[0]))
    return torch.device("cpu")


def _load(plan: InferencePlan, payload: Any) -> Tuple[Any, Any]:
    import cloudpickle

    device = _device()
    key = (plan.key, str(device))
    if key in _models:
        _models.move_to_end(key)
        return _models[key], device
    sys.path.extend(p for p in plan.sys_path if p not in sys.path)
    model = cloudpickle.loads(payload.value).to(device)
    model.eval()
    _models[key] = model
    while len(_models) > _CACHE_SIZE:
        _models.popitem(last=False)
    return model, device


def _output_array(values: np.ndarray, scalar: bool) -> Any:
    import pyarrow as pa

    rows = values.shape[0]
    flat = values.reshape(rows, -1).astype(np.float64, copy=False)
    if scalar:
        return pa.array(flat[:, 0])
    width = flat.shape[1]
    offsets = np.arange(0, (rows + 1) * width, width, dtype=np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat.reshape(-1)))


def _predict(model: Any, device: Any, plan: InferencePlan, batch: Any) -> List[np.ndarray]:
    import torch

    from spark_hvd.spark.reader import _to_numpy
    from spark_hvd.spark.torch.batches import feature_tensors, outputs_list

    dtype = getattr(torch, plan.dtype)
    columns = {c: _to_numpy(batch.column(c), None, c) for c in plan.input_cols}
    outputs: List[List[np.ndarray]] = [[] for _ in plan.output_cols]
    rows = batch.num_rows
    with torch.inference_mode():
        for start in range(0, rows, plan.batch_size):
            part = {c: v[start:start + plan.batch_size] for c, v in columns.items()}
            inputs = feature_tensors(part, plan.input_cols, plan.input_shapes, dtype, device)
            result = outputs_list(model(*inputs), len(plan.output_cols))
            for i, tensor in enumerate(result):
                outputs[i].append(tensor.detach().float().cpu().numpy().reshape(tensor.shape[0], -1))
    return [np.concatenate(parts) if parts else np.zeros((0, 1), np.float64) for parts in outputs]


def predict_partition(plan: InferencePlan, payload: Any, batches: Iterator[Any]) -> Iterator[Any]:
    """mapInArrow function: each input record batch comes back without the helper columns and
    with one prediction column per output."""
    import pyarrow as pa

    model: Optional[Any] = None
    device: Any = None
    for batch in batches:
        if model is None:
            model, device = _load(plan, payload)
        names = [n for n in batch.schema.names if n not in plan.drop_cols]
        arrays = [batch.column(batch.schema.get_field_index(n)) for n in names]
        if batch.num_rows:
            predictions = _predict(model, device, plan, batch)
            extra = [_output_array(p, s) for p, s in zip(predictions, plan.scalar_outputs)]
        else:
            extra = [pa.array([], pa.float64()) if s else pa.array([], pa.list_(pa.float64()))
                     for s in plan.scalar_outputs]
        yield pa.RecordBatch.from_arrays(arrays + extra, names=names + list(plan.output_cols))


def plan_inputs(schema: Any, feature_cols: Sequence[str], dtype: str) -> Tuple[Dict[str, Any], List[str]]:
    """How the features reach the workers: ``(helpers, input_cols)``.

    Spark ML Vectors travel through Arrow as structs, so each Vector feature gets a helper
    column with its values as an array of ``dtype`` (``helpers``: name -> Spark expression);
    ``input_cols`` names the column read for each feature, helper or original.
    """
    from pyspark.ml.functions import vector_to_array
    from pyspark.ml.linalg import VectorUDT
    from pyspark.mllib.linalg import VectorUDT as OldVectorUDT
    from pyspark.sql import functions as F

    fields = {f.name: f.dataType for f in schema.fields}
    helpers: Dict[str, Any] = {}
    input_cols: List[str] = []
    for i, col in enumerate(feature_cols):
        if isinstance(fields[col], (VectorUDT, OldVectorUDT)):
            name = f"__spark_hvd_input_{i}"
            helpers[name] = vector_to_array(F.col("`" + col.replace("`", "``") + "`"),
                                            dtype="float64" if dtype == "float64" else "float32")
            input_cols.append(name)
        else:
            input_cols.append(col)
    return helpers, input_cols
