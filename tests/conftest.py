"""Make the shared check harness (tests/harness.py) importable from every test module and rank, and
mark what each test needs beyond this machine's processes.

``spark``: the test starts Spark (a local session, a cluster, or a program that starts one);
``cluster``: it forms network-namespace hosts (root). Tests under tests/spark and tests/cluster, and
those that take a ``spark*`` fixture, are marked here; a test elsewhere that starts Spark inside a
subprocess carries ``@pytest.mark.spark`` itself. ``make test-quick`` runs ``-m "not spark and not
cluster"``; ``make test`` runs everything.
"""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

_SPARK_FOLDERS = ("spark", "cluster")

# Every JVM the tests start (local sessions, Spark Connect servers, the cluster's masters, workers
# and executors, the example programs' sessions) compiles with the client compiler only: they live
# seconds to minutes, and the server compiler's threads cost more CPU than its code saves there
# (tests/spark/keras: 249 -> 198 busy core-seconds, 147 -> 132 s). The `java` launcher of JDK 9+
# reads JDK_JAVA_OPTIONS, and every process the tests start inherits it.
_CLIENT_COMPILER_ONLY = "-XX:TieredStopAtLevel=1"
if _CLIENT_COMPILER_ONLY not in os.environ.get("JDK_JAVA_OPTIONS", ""):
    os.environ["JDK_JAVA_OPTIONS"] = f"{os.environ.get('JDK_JAVA_OPTIONS', '')} {_CLIENT_COMPILER_ONLY}".strip()

# And they map pyspark's classes from the class-data-sharing archive `make test` writes into the
# environment (tests/jvm_classes.py) instead of loading and verifying them one by one: a local
# session that writes and reads Parquet used 11.3 core-seconds without it and 6.4 with it. A JVM
# that does not match the archive ignores it; without the file every JVM starts as before.
JVM_CLASS_ARCHIVE = os.path.join(sys.prefix, "spark-hvd-jvm-classes.jsa")
if os.path.isfile(JVM_CLASS_ARCHIVE) and not any(c.isspace() for c in JVM_CLASS_ARCHIVE) and \
        "-XX:SharedArchiveFile" not in os.environ.get("JDK_JAVA_OPTIONS", ""):
    os.environ["JDK_JAVA_OPTIONS"] = (f"{os.environ['JDK_JAVA_OPTIONS']} -XX:SharedArchiveFile={JVM_CLASS_ARCHIVE} "
                                      "-Xlog:cds=off -Xlog:cds+dynamic=off")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "spark: starts Spark (a session, a cluster, or a program that starts one)")
    config.addinivalue_line("markers", "cluster: forms network-namespace hosts; needs root")


def pytest_collection_modifyitems(config: pytest.Config, items) -> None:
    for item in items:
        parts = os.path.relpath(str(item.path), HERE).split(os.sep)
        if parts[0] in _SPARK_FOLDERS or any(name.startswith("spark") for name in getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.spark)
        if parts[0] == "cluster":
            item.add_marker(pytest.mark.cluster)
