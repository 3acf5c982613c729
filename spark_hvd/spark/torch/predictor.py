"""Batched inference over Arrow for TorchModel.transform: the torch :class:`~spark_hvd.spark.estimator.inference.Predictor`.

The UDF, its Arrow batches and the output columns are :mod:`spark_hvd.spark.estimator.inference`'s; this
module deserializes the torch model onto the task's GPU (when Spark assigned one) or the CPU,
and calls it on tensors built by the same rules as training (``batches.feature_tensors``).
"""

from __future__ import annotations

from typing import Any, List

import numpy as np

from spark_hvd.spark.estimator.inference import InferencePlan

__all__ = ["TorchPredictor"]


class TorchPredictor:
    """Loads a cloudpickled torch module and predicts with it in inference mode."""

    def device(self) -> str:
        import torch

        if not torch.cuda.is_available():
            return "cpu"
        try:
            from pyspark import TaskContext

            context = TaskContext.get()
            gpus = context.resources().get("gpu") if context is not None else None
        except Exception:  # no task context or no resource support: treat as no GPU assigned
            gpus = None
        if gpus is not None and gpus.addresses:
            return f"cuda:{int(gpus.addresses[0])}"
        return "cpu"

    def load(self, payload: Any, device: str) -> Any:
        import cloudpickle

        model = cloudpickle.loads(payload).to(device)
        model.eval()
        return model

    def predict(self, model: Any, device: str, plan: InferencePlan, columns: List[np.ndarray]) -> List[np.ndarray]:
        import torch

        from spark_hvd.spark.torch.batches import feature_tensors, outputs_list

        dtype = getattr(torch, plan.dtype)
        rows = len(columns[0])
        names = [str(i) for i in range(len(columns))]
        outputs: List[List[np.ndarray]] = [[] for _ in plan.output_cols]
        with torch.inference_mode():
            for start in range(0, rows, plan.batch_size):
                part = {n: c[start:start + plan.batch_size] for n, c in zip(names, columns)}
                inputs = feature_tensors(part, names, plan.input_shapes, dtype, torch.device(device))
                result = outputs_list(model(*inputs), len(plan.output_cols))
                for i, tensor in enumerate(result):
                    outputs[i].append(tensor.detach().to("cpu", torch.float64).numpy().reshape(tensor.shape[0], -1))
        return [np.concatenate(parts) if parts else np.zeros((0, 1)) for parts in outputs]

