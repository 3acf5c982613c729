"""The handwritten digits data set (1797 8x8 images, 10 classes), bundled to need no download.

``digits.csv.gz`` is a copy of scikit-learn's ``sklearn/datasets/data/digits.csv.gz``
(BSD 3-Clause License, Copyright (c) 2007-2026 The scikit-learn developers), itself the test
set of the UCI "Optical Recognition of Handwritten Digits" data (E. Alpaydin, 1998). Each row
holds 64 pixel counts in 0..16 followed by the label.
"""

from __future__ import annotations

import gzip
from importlib import resources
from typing import Tuple

import numpy as np

__all__ = ["load_digits", "DIGITS_ROWS", "DIGITS_FEATURES", "DIGITS_CLASSES"]

DIGITS_ROWS = 1797
DIGITS_FEATURES = 64
DIGITS_CLASSES = 10


def load_digits() -> Tuple[np.ndarray, np.ndarray]:
    """The digits data as ``(X, y)``: ``X`` float32 of shape [1797, 64] with pixel counts 0..16,
    ``y`` int64 of shape [1797] with labels 0..9, in the file's fixed order."""
    raw = resources.files(__package__).joinpath("digits.csv.gz").read_bytes()
    table = np.loadtxt(gzip.decompress(raw).decode("ascii").splitlines(), delimiter=",", dtype=np.float64)
    if table.shape != (DIGITS_ROWS, DIGITS_FEATURES + 1):
        raise ValueError(
            f"digits.csv.gz has shape {table.shape}, expected ({DIGITS_ROWS}, {DIGITS_FEATURES + 1}); "
            "the packaged file is damaged: reinstall spark-hvd."
        )
    features = np.ascontiguousarray(table[:, :DIGITS_FEATURES], dtype=np.float32)
    labels = table[:, DIGITS_FEATURES].astype(np.int64)
    return features, labels
