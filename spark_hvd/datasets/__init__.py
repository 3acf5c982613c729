"""Small data sets shipped inside the package, for examples and tests that must not download."""

from spark_hvd.datasets.digits import DIGITS_CLASSES, DIGITS_FEATURES, DIGITS_ROWS, load_digits

__all__ = ["load_digits", "DIGITS_ROWS", "DIGITS_FEATURES", "DIGITS_CLASSES"]
