"""The fingerprint of a KerasEstimator run (see :mod:`spark_hvd.spark.estimator.fingerprint`): the model's
layers and their settings and weight shapes (not names, which Keras numbers per session, and not
values), the optimizer's class and settings, the losses and their weights, and the data."""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

from spark_hvd.spark.estimator.fingerprint import data_digest, digest

__all__ = ["run_fingerprint"]


def _without_name(config: Any) -> Any:
    return {k: v for k, v in config.items() if k != "name"} if isinstance(config, dict) else config


def _layer(layer: Any) -> Any:
    try:
        config = layer.get_config()
    except Exception:  # a custom layer without get_config is described by its class
        config = None
    return [type(layer).__qualname__, _without_name(config)]


def _describe(fn: Any) -> Any:
    if isinstance(fn, str):
        return fn
    if hasattr(fn, "get_config"):
        try:
            return [type(fn).__qualname__, _without_name(fn.get_config())]
        except Exception:  # a loss object without a serializable config
            pass
    # A function's repr holds its address, which changes every session.
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"


def run_fingerprint(model: Any, optimizer: Any, losses: Sequence[Any], loss_weights: Optional[Sequence[float]],
                    df: Any, columns: Sequence[str], validation: Any) -> Dict[str, str]:
    """One short hash per part of the run."""
    weights = [(list(w.shape), str(w.dtype)) for w in model.weights]
    return {
        "model architecture": digest([type(model).__qualname__, [_layer(layer) for layer in model.layers], weights]),
        "optimizer": digest([type(optimizer).__qualname__, _without_name(optimizer.get_config())]),
        "loss": digest([_describe(fn) for fn in losses] + [list(loss_weights or [])]),
        "data": data_digest(df, columns, validation),
    }
