# kiln: `make demo` trains the embedded default on CPU, `make test` runs the whole CPU test suite, `make system`
# installs and starts what the suite needs beyond the venv (Docker, debootstrap, chromium, Node; setup_system.sh).
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kiln-installed

.PHONY: venv system test test-fast test-long demo demo-agent demo-vision demo-distill bench test-vllm clean

venv: $(STAMP)

# torch first (the local CPU build), then everything else under a constraint that keeps it.
$(STAMP): requirements-cpu.txt constraints.txt
	@echo "venv: creating $(VENV) (once; about 2 minutes from an empty pip cache)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@echo "venv: torch 2.13.0, the CPU build"
	$(PY) -m pip install -q torch==2.13.0
	@echo "venv: requirements-cpu.txt under constraints.txt"
	$(PY) -m pip install -q -c constraints.txt -r requirements-cpu.txt
	touch $(STAMP)

# Docker, debootstrap, chromium, Node, the agent CLIs and the offline SWE-bench instances (root or sudo).
system:
	./setup_system.sh

# The agent CLIs the tests drive through kiln's endpoint (npm; qwen-code 0.15.10 is the newest that runs on Node 20;
# codex is a static binary that needs no Node). The stamp names the set, so a checkout without codex gets it.
# Without npm the suite still runs: the CLIs' tests skip and its summary says `make system`.
NPM_TOOLS := .npm-tools/.kiln-installed-codex
$(NPM_TOOLS):
	@if ! command -v npm >/dev/null; then echo "no npm: the agent CLIs' tests will skip (make system installs Node)"; \
	else npm install --no-audit --no-fund --loglevel=error --prefix .npm-tools @qwen-code/qwen-code@0.15.10 \
		@anthropic-ai/claude-code@2.1.332 @openai/codex@0.171.0 && touch $(NPM_TOOLS); fi

# The offline SWE-bench instances `make system` builds; the SWE tests build any that are missing there.
export KILN_SWE_DIR ?= $(CURDIR)/runs/swe-instances

# Three workers on two cores, a test file each at a time: many tests wait on subprocesses, containers or the Docker
# daemon, and with two workers a third of the CPU time went idle (10:13 with two, 8:11 with three, 8:08 with four on
# a 2-core AMD EPYC: bench/RESULTS.md).
WORKERS ?= 3
test: venv $(NPM_TOOLS)
	$(PY) -m pytest -q -n $(WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 -m "not after_suite" tests

# Tests too long for make test's 12 minutes (marked after_suite): the vision demo's loop shortened (about 6 minutes
# alone) and the 2-rank runs of the harnesses in containers, task directories, sequence parallelism and a SIGKILLed
# trainer with pre-started containers (1-3 minutes each). .ci/run runs them after make test; about 8 minutes.
test-long: venv $(NPM_TOOLS)
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=10 -m after_suite tests

test-fast: venv $(NPM_TOOLS)
	$(PY) -m pytest -q -n $(WORKERS) --dist loadfile --no-loadscope-reorder -m "not slow and not after_suite" tests

demo: venv
	$(PY) demo.py

demo-agent: venv
	$(PY) demo_agent.py

demo-vision: venv
	$(PY) demo_vision.py

demo-distill: venv
	$(PY) demo_distill.py

clean:
	rm -rf $(VENV) runs .npm-tools

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
