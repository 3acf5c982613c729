"""Models of the scoring tests, importable by the tests, Spark's Python workers and a nightly job's
own process (a saved model refers to its classes by module, as a user's package would)."""

from __future__ import annotations

import numpy as np
import pytorch_lightning as pl
import torch

WEIGHTS = np.array([0.75, -1.25, 0.5])
BIAS = 0.125


def _linear() -> torch.nn.Linear:
    layer = torch.nn.Linear(3, 1)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor(WEIGHTS[None, :], dtype=torch.float32))
        layer.bias.fill_(BIAS)
    return layer


class ThreeInputs(torch.nn.Module):
    """One forward() argument per scalar feature column."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = _linear()

    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.cat([a, b, c], dim=1))


class LinearModule(pl.LightningModule):
    """A LightningModule scored like a torch model."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = _linear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def training_step(self, batch, batch_idx):  # pragma: no cover - scoring only
        return torch.nn.functional.binary_cross_entropy_with_logits(self(batch["features"]).reshape(-1),
                                                                    batch["label"].float())

    def configure_optimizers(self):  # pragma: no cover - scoring only
        return torch.optim.SGD(self.parameters(), lr=0.1)


def torch_linear() -> torch.nn.Linear:
    """The linear model with the fixed weights."""
    return _linear()


def keras_linear():
    """The same linear model in Keras 3."""
    import keras

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.set_weights([WEIGHTS.reshape(3, 1).astype(np.float32), np.array([BIAS], dtype=np.float32)])
    return model


def logits(x: np.ndarray) -> np.ndarray:
    """What every model above gives for rows ``x``."""
    return x @ WEIGHTS + BIAS
