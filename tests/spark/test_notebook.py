"""The Databricks-style fraud notebook runs headless (nbclient) against an embedded local Spark."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "notebooks" / "fraud_detection.ipynb"


def _text(cell) -> str:
    parts = []
    for output in cell.get("outputs", []):
        if output.get("output_type") == "stream" and output.get("name") == "stdout":
            parts.append(output.get("text", ""))  # stderr carries the JVM's and libraries' logs
        elif "data" in output:
            parts.append(str(output["data"].get("text/plain", "")))
    return "".join(parts)


def test_the_fraud_notebook_runs_headless_and_scores_registers_and_reloads(tmp_path):
    """Every cell runs without error on a small data set; the notebook evaluates with Spark's
    evaluators, plots the history, registers the MLflow model and reloads the saved pipeline."""
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(NOTEBOOK, as_version=4)
    with pytest.MonkeyPatch.context() as patch:
        # Read by the kernel the client starts: a small, quick run on loopback with this Python.
        # Training takes a fraction of a second at this size; the kernel, Spark and MLflow set the
        # pace. Epochs 1 and 2 give the history and its plot two points.
        patch.setenv("FRAUD_ROWS", "5000")
        patch.setenv("FRAUD_EPOCHS", "2")
        patch.setenv("FRAUD_RATE", "0.05")  # enough frauds in a small set to learn them (AUC-ROC 0.93)
        patch.setenv("SPARK_LOCAL_IP", "127.0.0.1")
        patch.setenv("PYSPARK_PYTHON", sys.executable)
        patch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
        NotebookClient(notebook, timeout=600, kernel_name="python3",
                       resources={"metadata": {"path": str(tmp_path)}}).execute()
    printed = "\n".join(_text(cell) for cell in notebook.cells if cell.cell_type == "code")
    assert "held-out: AUC-PR" in printed and "AUC-ROC" in printed
    assert "registered fraud_detector version 1" in printed
    assert "saved to" in printed and "reloaded" in printed
    history = next(c for c in notebook.cells if "history_frame()" in c.source)
    assert "val_loss" in _text(history)
    # The fit shows a live widget bar per epoch (tqdm's notebook bar), not tqdm's text fallback.
    outputs = [o for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in outputs)
    assert "IProgress not found" not in "\n".join(str(o.get("text", "")) for o in outputs)
    plot = next(c for c in notebook.cells if "plot_history()" in c.source)
    assert any(o.get("output_type") == "display_data" and "image/png" in o.get("data", {}) for o in plot.outputs)
