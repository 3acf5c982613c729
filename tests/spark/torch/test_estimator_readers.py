"""TorchEstimator with array and scalar features, several inputs and outputs, input_shapes, and both
Parquet readers ('builtin', and 'petastorm' in the pinned petastorm environment)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from spark_hvd.spark import Store
from spark_hvd.spark.torch import TorchEstimator

ROWS = 64


class TwoHeads(torch.nn.Module):
    """forward(grid, scale): a (2, 2) grid per row and a scalar; returns a 2-vector and a scalar."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(5, 8)
        self.pair = torch.nn.Linear(8, 2)
        self.single = torch.nn.Linear(8, 1)

    def forward(self, grid, scale):
        assert grid.shape[1:] == (2, 2) and scale.shape[1:] == (1,), (grid.shape, scale.shape)
        hidden = torch.tanh(self.body(torch.cat([grid.flatten(1), scale], dim=1)))
        return self.pair(hidden), self.single(hidden)


@pytest.fixture(scope="module")
def frame(spark):
    """grid: array<float> of 4, scale: double, targets pair (array<double> of 2) and single (double)."""
    rng = np.random.default_rng(1)
    grid = rng.normal(size=(ROWS, 4)).astype(np.float32)
    scale = rng.normal(size=ROWS)
    pdf = pd.DataFrame({
        "grid": grid.tolist(),
        "scale": scale,
        "pair": np.stack([grid[:, 0] + grid[:, 1], grid[:, 2] - grid[:, 3]], axis=1).astype(np.float64).tolist(),
        "single": 2.0 * scale,
    })
    return spark.createDataFrame(pdf, "grid array<float>, scale double, pair array<double>, single double").cache()


@pytest.mark.parametrize("reader", ["builtin", pytest.param("petastorm", marks=pytest.mark.petastorm)])
def test_array_and_scalar_features_with_two_outputs(frame, tmp_path, reader):
    """Each feature column is one forward() argument shaped by input_shapes; each label has its own
    loss; transform writes the 2-value output as a Vector and the scalar one as a double, equal to
    a local forward pass."""
    torch.manual_seed(0)
    model = TwoHeads()
    est = TorchEstimator(
        num_proc=2, model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.02),
        loss=[torch.nn.MSELoss(), torch.nn.functional.mse_loss], loss_weights=[1.0, 0.5],
        feature_cols=["grid", "scale"], label_cols=["pair", "single"], input_shapes=[[2, -1], [1]],
        batch_size=8, epochs=4, reader=reader, store=Store.create(str(tmp_path / "store")), random_seed=2,
        verbose=0)
    fitted = est.fit(frame)
    history = fitted.getHistory()
    assert len(history) == 4 and history[-1]["loss"] < history[0]["loss"]
    assert fitted.getInputShapes() == [[2, 2], [1]]

    out = fitted.transform(frame)
    assert dict(out.dtypes)["pair__output"] == "vector" and dict(out.dtypes)["single__output"] == "double"
    rows = out.orderBy("scale").collect()
    grid = torch.tensor(np.array([r["grid"] for r in rows]), dtype=torch.float32).reshape(-1, 2, 2)
    scale = torch.tensor([[r["scale"]] for r in rows], dtype=torch.float32)
    with torch.no_grad():
        pair, single = fitted.getModel()(grid, scale)
    np.testing.assert_allclose(np.array([r["pair__output"].toArray() for r in rows]), pair.numpy(),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.array([r["single__output"] for r in rows]), single.reshape(-1).numpy(),
                               rtol=1e-5, atol=1e-6)
