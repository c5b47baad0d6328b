"""qwen-code (npm @qwen-code/qwen-code, the SWE pipeline's own agent) on one kiln swebench row through kiln's
endpoint: a complete `--agent-cmd`.

    python qwen_code.py --base-url {base_url} --api-key {api_key} --row {row_file} --result {result}

qwen-code runs headless (`qwen --yolo -p TASK`) on the host, pointed at the endpoint with OPENAI_BASE_URL,
OPENAI_API_KEY and OPENAI_MODEL; it streams its turns and sends side queries (memory, classifiers), which the endpoint
records as side segments. Its only tool is its shell (`run_shell_command`), and that shell executes in the instance's
container: qwen-code starts `bash -c COMMAND` from PATH, and the first `bash` on its PATH is a shim that runs the
command with `docker exec` in the container, in /testbed, with no network. Its file tools are off (they would read and
write the host), so everything the model does happens in the container. qwen-code's home (settings, sessions) is a
fresh temporary folder; usage statistics and telemetry are off. The container is labelled as a kiln agent container
of this process, so a kiln sweep removes it when this process is killed, and it is removed when the run ends. The
result is the container's diff against the base commit (new files included), written to --result.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import tyro

import containers

ROOT = Path(__file__).resolve().parent
QWEN_VERSION = "0.15.10"  # the newest release that runs on Node 20 (later ones need Node 22)
INSTALLED = ROOT / ".npm-tools" / "node_modules" / ".bin" / "qwen"  # npm install --prefix .npm-tools (docs/agents.md)
TASK = ("Fix this issue in the repository at /testbed. Your shell commands run in /testbed (a sandbox with no "
        "network); edit files with shell commands (sed, python, cat, git apply). Stop when it is fixed.\n\n{problem}")
# For small models that cannot read qwen-code's long system prompt: the same protocol in a few lines.
SHORT_SYSTEM = ("You are a coding agent. Use the run_shell_command tool to inspect and edit the repository at "
                "/testbed. Reply without a tool call when you are done.")
SHIM = """#!/bin/bash
# qwen-code runs its shell tool as `bash -c COMMAND`: here, in the instance's container.
if [ "$1" != "-c" ]; then exec /bin/bash "$@"; fi
exec docker exec -w /testbed {container} timeout -s KILL {timeout} /bin/bash -c "$2"
"""


@dataclass
class Args:
    base_url: str
    """kiln's endpoint ({base_url})"""
    api_key: str
    """the session key ({api_key})"""
    row: Path
    """the row as kiln gives it ({row_file})"""
    result: Path
    """where the patch goes ({result})"""
    short: bool = False
    """a few-line system prompt instead of qwen-code's own (tiny models, tests)"""
    max_session_turns: int = 50
    """qwen-code's --max-session-turns"""
    max_tokens: int = 2048
    """reply budget per model call (QWEN_CODE_MAX_OUTPUT_TOKENS)"""
    command_timeout: int = 120
    """seconds per shell command in the container"""
    container_seconds: int = 3600
    """the container's lifetime (its `sleep`, and kiln's expiry label)"""
    qwen: str = str(INSTALLED)
    """the qwen executable (default: the one npm installed into .npm-tools/)"""


def settings() -> dict:
    """qwen-code's settings.json: the shell as its only tool, no PTY, no memory-extraction side agent (it writes
    files on the host), nothing reported home."""
    return {"tools": {"core": ["run_shell_command"], "shell": {"enableInteractiveShell": False}},
            "privacy": {"usageStatisticsEnabled": False}, "telemetry": {"enabled": False},
            "security": {"auth": {"selectedType": "openai"}}, "general": {"checkpointing": {"enabled": False}},
            "memory": {"enableManagedAutoMemory": False}}


def check_qwen(qwen: str) -> str:
    """The path of the qwen executable; FileNotFoundError naming how to install it."""
    found = shutil.which(qwen)
    if found is None:
        raise FileNotFoundError(f"qwen-code is not installed at {qwen}: run `npm install --prefix "
                                f"{ROOT / '.npm-tools'} @qwen-code/qwen-code@{QWEN_VERSION}` (Node >= 20)")
    return found


def main(args: Args) -> None:
    qwen = check_qwen(args.qwen)
    instance = json.loads(args.row.read_text())["instance"]
    limits = containers.ContainerLimits(timeout=args.command_timeout, ttl=args.container_seconds)
    with tempfile.TemporaryDirectory(prefix="kiln-qwen-") as work, \
            containers.Container(containers.shared_client(), instance["image"], "agent", args.api_key,
                                 limits) as container:
        home, bin_dir, cwd = Path(work, "home"), Path(work, "bin"), Path(work, "cwd")
        for folder in (home / ".qwen", bin_dir, cwd):
            folder.mkdir(parents=True)
        (home / ".qwen" / "settings.json").write_text(json.dumps(settings()))
        (bin_dir / "bash").write_text(SHIM.format(container=container.name, timeout=args.command_timeout))
        (bin_dir / "bash").chmod(0o755)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "QWEN_", "DASHSCOPE_"))} | {
            "HOME": str(home), "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}", "OPENAI_BASE_URL": args.base_url,
            "OPENAI_API_KEY": args.api_key, "OPENAI_MODEL": "kiln",
            "QWEN_CODE_MAX_OUTPUT_TOKENS": str(args.max_tokens)}
        if args.short:
            (home / "system.md").write_text(SHORT_SYSTEM)
            env["QWEN_SYSTEM_MD"] = str(home / "system.md")
        run = subprocess.run([qwen, "--yolo", "--max-session-turns", str(args.max_session_turns), "-p",
                              TASK.format(problem=instance["problem_statement"])],
                             cwd=cwd, env=env, stdin=subprocess.DEVNULL, text=True)
        patch = containers.container_diff(container, instance["base_commit"]).decode(errors="surrogateescape")
    args.result.write_text(patch, errors="surrogateescape")
    print(f"qwen-code: exit {run.returncode}, {len(patch)} characters of diff")


if __name__ == "__main__":
    main(tyro.cli(Args))
