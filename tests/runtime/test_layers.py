"""The runtime is its own layer: importing it pulls in no framework."""

import subprocess
import sys


def test_runtime_import_pulls_no_framework():
    """A fresh interpreter importing spark_hvd.runtime has no torch, tensorflow or pyspark loaded."""
    code = (
        "import sys, spark_hvd.runtime\n"
        "bad = sorted(m for m in ('torch', 'tensorflow', 'pyspark', 'keras') if m in sys.modules)\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"runtime import loaded {out.stdout.strip()}"


def test_only_config_reads_the_environment():
    """No runtime module other than config.py reads os.environ (STYLE: configuration in one place)."""
    import pathlib

    import spark_hvd.runtime as rt

    root = pathlib.Path(rt.__file__).parent
    offenders = [p.name for p in root.glob("*.py") if p.name != "config.py" and "os.environ" in p.read_text()]
    assert offenders == []
