# kiln: `make demo` trains the embedded default on CPU, `make test` runs the whole CPU test suite.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kiln-installed

.PHONY: venv test test-fast demo bench test-vllm clean

venv: $(STAMP)

# torch first (the local CPU build), then everything else under a constraint that keeps it.
$(STAMP): requirements-cpu.txt constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -r requirements-cpu.txt
	touch $(STAMP)

test: venv
	$(PY) -m pytest -q tests

test-fast: venv
	$(PY) -m pytest -q -m "not slow" tests

demo: venv
	$(PY) demo.py

clean:
	rm -rf $(VENV) runs
