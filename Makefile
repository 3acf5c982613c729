# The single entry point: `make demo` runs the main job, `make test` runs the whole suite.
# Both create .venv when it is missing and are safe to run again.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
PETASTORM_VENV := .venv-petastorm
PETASTORM_STAMP := $(PETASTORM_VENV)/.installed
# pyspark's classes as one class-data-sharing archive for the tests' JVMs (tests/jvm_classes.py).
JVM_CLASSES := $(VENV)/spark-hvd-jvm-classes.jsa

.PHONY: demo cluster-demo test test-main suite-spark suite-rest suite-petastorm test-quick quick-processes quick-frameworks test-petastorm venv bench lint clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints/ci.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade "pip>=23"
	$(PIP) install -q -c constraints/ci.txt -e ".[dev,torch,spark,connect,mlflow,notebook,tensorflow-cpu,mpi,lightning]"
	# Keras 2 (the keras2 extra) without its dependency on the tensorflow package, which would
	# install TensorFlow a second time over tensorflow-cpu.
	$(PIP) install -q -c constraints/ci.txt --no-deps tf-keras
	touch $(STAMP)

$(PETASTORM_STAMP): pyproject.toml constraints/petastorm.txt
	test -x $(PETASTORM_VENV)/bin/python || $(PYTHON) -m venv $(PETASTORM_VENV)
	$(PETASTORM_VENV)/bin/python -m pip install -q --upgrade "pip>=23"
	$(PETASTORM_VENV)/bin/python -m pip install -q -c constraints/petastorm.txt -e ".[dev,torch,spark,petastorm]"
	touch $(PETASTORM_STAMP)

# Only a saving: when no archive can be written, the tests' JVMs start without one.
$(JVM_CLASSES): $(STAMP) tests/jvm_classes.py
	$(PY) tests/jvm_classes.py $@ > $(VENV)/jvm-classes.log 2>&1 || \
		(tail -20 $(VENV)/jvm-classes.log; echo "no JVM class archive: the tests' JVMs start without one")

# The OpenSSH server the launcher's tests across hosts run in each network-namespace host
# (tests/cluster/test_launcher_hosts.py), from Debian's packages. A temporary policy-rc.d keeps the
# package from starting a server on this machine.
SSHD := /usr/sbin/sshd
$(SSHD):
	@policy=/usr/sbin/policy-rc.d; added=; \
	if [ ! -e $$policy ]; then printf '#!/bin/sh\nexit 101\n' > $$policy && chmod +x $$policy && added=1; fi; \
	install() { DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends openssh-server > /dev/null; }; \
	install || { apt-get update -q > /dev/null && install; }; status=$$?; \
	if [ -n "$$added" ]; then rm -f $$policy; fi; exit $$status

# The main job: the fraud-detection Spark ML pipeline with TorchEstimator on local[2].
demo: $(STAMP)
	$(PY) examples/fraud_detection.py

# The main job on two hosts of the test cluster (network namespaces; root), next to local[2].
cluster-demo: $(STAMP)
	$(PY) tests/cluster/demo.py

# The whole suite: the linter, then three pytest runs, two at a time (each test waits on purpose
# for part of its time, rank deaths, network cuts and timeouts, and the other run uses the CPU
# meanwhile): the Spark layer's tests, every other test of the main environment, and the
# petastorm run once either is done. Each run's output is printed when it ends.
# The class archive is written while the petastorm environment installs.
test: $(STAMP) $(SSHD)
	$(MAKE) --no-print-directory -j2 $(PETASTORM_STAMP) $(JVM_CLASSES)
	$(VENV)/bin/ruff check .
	$(MAKE) --no-print-directory -j2 --output-sync=target suite-spark suite-rest suite-petastorm

# The main environment's tests in one pytest run, one after another.
test-main: $(STAMP) $(JVM_CLASSES) $(SSHD)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q tests -m "not petastorm"

suite-spark: $(STAMP)
	$(PY) -m pytest -q tests/spark -m "not petastorm"

suite-rest: $(STAMP) $(SSHD)
	$(PY) -m pytest -q tests --ignore=tests/spark -m "not petastorm"

suite-petastorm: test-petastorm

# The edit-test loop: every test that starts no Spark and forms no network-namespace host.
# Two pytest runs side by side: the runtime and the launcher (they wait on purpose for a good part
# of their time), and the framework bindings with the other top-level tests.
QUICK := -m "not spark and not cluster and not petastorm"
test-quick: $(STAMP)
	$(VENV)/bin/ruff check .
	$(MAKE) --no-print-directory -j2 --output-sync=target quick-processes quick-frameworks

quick-processes: $(STAMP)
	$(PY) -m pytest -q tests/runtime tests/runner $(QUICK)

quick-frameworks: $(STAMP)
	$(PY) -m pytest -q tests --ignore=tests/spark --ignore=tests/cluster --ignore=tests/runtime --ignore=tests/runner $(QUICK)

# The data and estimator tests again, on the pinned versions petastorm needs (pyarrow<15, numpy<2).
test-petastorm: $(PETASTORM_STAMP)
	$(PETASTORM_VENV)/bin/python -m pytest -q tests/spark/data/test_data.py tests/spark/data/test_reader.py tests/spark/torch/test_estimator_readers.py -m "petastorm or not petastorm"

lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	$(PY) benchmarks/collectives.py
	$(PY) benchmarks/training_scaling.py
	$(PY) benchmarks/estimator.py

clean:
	rm -rf $(VENV) $(PETASTORM_VENV) build *.egg-info
