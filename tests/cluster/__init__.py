"""Tests on a Spark standalone cluster of network-namespace hosts (see conftest.py)."""
