"""The system parts `make test` needs beyond the venv, and what a test does without one.

`make system` installs and starts them all (setup_system.sh: as root, or as a user with sudo). Without a part, its
tests skip with a reason that names it, and conftest.py's summary prints one line per missing part: how many tests it
skipped and the command that brings it in. Under CI=true a missing part fails its tests instead: CI must run them.
"""
import os

import pytest

BRING_IN = "make system"
PARTS = {  # part -> what it is, as the summary line names it
    "docker": "a running Docker daemon (docker.io), for the SWE-bench containers",
    "browser": "headless chromium + chromium-driver, for the run board's tests",
    "agent-clis": "the agent CLIs qwen-code, claude-code and codex (Node 20 + npm, installed into .npm-tools)",
    "sandbox": "root (or unprivileged user namespaces), for the reward sandbox's full isolation",
}
MARKER = "missing system part"


def require(part: str, detail: str, module: bool = False) -> None:
    """Skip the calling test (or module) for lack of `part`, or fail it under CI=true. `detail` says what is wrong."""
    message = f"{MARKER} {part}: {detail}; `{BRING_IN}` brings it in"
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true and {message}", pytrace=False)
    pytest.skip(message, allow_module_level=module)


def summary_lines(skip_reasons: list[str]) -> list[str]:
    """One line per missing part among the skip reasons: the part, how many tests it skipped, the command."""
    counts: dict[str, int] = {}
    for reason in skip_reasons:
        if MARKER in reason:
            part = reason.split(MARKER, 1)[1].split(":", 1)[0].strip()
            counts[part] = counts.get(part, 0) + 1
    return [f"skipped {n} test{'s' * (n != 1)} for lack of {PARTS.get(part, part)}: run `{BRING_IN}`"
            for part, n in counts.items()]
