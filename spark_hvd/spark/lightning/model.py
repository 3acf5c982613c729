"""LightningModel: a trained LightningModule as a Spark ML Model, scored like a TorchModel."""

from __future__ import annotations

from spark_hvd.spark.torch.model import TorchModel

__all__ = ["LightningModel"]


class LightningModel(TorchModel):
    """A fitted LightningModule; ``transform(df)`` runs its ``forward`` over Arrow batches.

    A LightningModule is a torch.nn.Module, so everything :class:`spark_hvd.spark.torch.TorchModel`
    does applies unchanged: each feature column is one argument of ``forward``; ``task`` chooses
    Spark ML's prediction columns (``rawPrediction``, ``probability``, ``prediction``) or, with
    'none', one raw output column per label (``<label>__output`` unless ``output_cols`` is set);
    ``history`` holds one dict per epoch with the module's logged metrics averaged over the ranks;
    saved with ``write().save(path)`` and loaded with ``LightningModel.load(path)``, also inside a
    ``PipelineModel``. Loading unpickles the module: load only what you trust.
    """
