"""The generated reference (docs/params.md, docs/api.md) matches the code it is generated from."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_reference_is_up_to_date():
    """Each file equals what docs/generate.py writes today; run the script after changing Params or docstrings."""
    spec = importlib.util.spec_from_file_location("docs_generate", ROOT / "docs" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for path, text in module.generated().items():
        assert path.read_text() == text, f"{path.name} is out of date: run .venv/bin/python docs/generate.py"
    params = (ROOT / "docs" / "params.md").read_text()
    assert "| `inference_batch_size` |" in params and "| `invalid_rows` |" in params


def test_the_docs_agree_on_how_cuda_tensors_travel():
    """Troubleshooting describes the NCCL path the README documents, not an older host-only one."""
    troubleshooting = (ROOT / "docs" / "troubleshooting.md").read_text()
    assert "NCCL is not used" not in troubleshooting
    assert "NCCL" in troubleshooting and "SPARK_HVD_NCCL_LIBRARY" in troubleshooting


def test_every_file_the_architecture_names_exists():
    """docs/architecture.md names files in its paths and change recipes; each one is there."""
    import re

    text = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`((?:runtime|spark_hvd|docs|tests)/[\w/]+\.(?:py|md))`", text))
    assert len(named) > 30
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert missing == []
