# kiln: `make demo` trains the embedded default on CPU, `make test` runs the whole CPU test suite.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kiln-installed

.PHONY: venv test test-fast demo demo-agent bench test-vllm clean

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

demo-agent: venv
	$(PY) demo_agent.py

clean:
	rm -rf $(VENV) runs

# `make test-vllm`: kiln's vLLM calls checked against the real vllm==0.32.0 API (5.8 GB venv, ~5 min the first
# time). No engine can start on a CPU, but everything kiln passes to vLLM is validated against its signatures.
# torchvision/torchaudio/torchcodec come as CUDA builds that break `from vllm import LLM` on a CPU torch, and kiln
# uses none of them, so they are removed.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.kiln-installed

$(VLLM_STAMP): requirements-vllm.txt constraints.txt
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q torch==2.13.0
	$(VLLM_PY) -m pip install -q -c constraints.txt -r requirements-vllm.txt
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -q tests/vllm
