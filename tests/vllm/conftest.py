"""tests/vllm/ checks kiln's vLLM calls against the real vllm==0.32.0 package; run them with `make test-vllm`.

They are collected only where vllm is installed. A plain `make test` venv has no vllm, and this very folder
(tests/vllm, no __init__.py) would otherwise pass for an empty namespace package called `vllm`.
"""
import importlib.util


def _real_vllm_installed() -> bool:
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None  # a namespace package (a bare folder) has no origin


collect_ignore_glob = [] if _real_vllm_installed() else ["test_*.py"]
