"""codex, claude-code or qwen-code as a whole SWE agent inside the instance's container, its only way out kiln's
endpoint: a complete `--agent-cmd`.

    python harness_agent.py --harness codex|claude-code|qwen-code --base-url {base_url} --api-key {api_key} \
        --row {row_file} --result {result}

The container is kiln's (containers.Container: `--network none`, limits, labels, the repository without its future).
The CLI runs in it with all its own tools (file reading and editing, search, its shell) acting on /testbed, as root
(claude-code is told it is in a sandbox with IS_SANDBOX=1; codex's own sandbox is bypassed: the container is the
sandbox). Nothing is installed in the container and nothing there reaches a network:
- the CLIs and Node are mounted read-only from the host: npm's `.npm-tools` prefix at /opt/kiln/npm (qwen-code,
  claude-code's native binary), codex's static musl binary folder at /opt/kiln/codex, the host's `node` at
  /opt/kiln/bin/node (qwen-code; the image needs glibc >= 2.28);
- the endpoint is a unix socket: on the host this driver relays `<folder>/api.sock` to the endpoint's TCP port and
  mounts the folder read-only at /run/kiln; in the container relay.py (run by the image's python3) listens on
  127.0.0.1:8080, where the CLI's base URL points, and relays to the socket. The container's only interface is `lo`.
The CLI's home is a fresh folder on the container's tmpfs with its settings (telemetry, updates, usage statistics and
plugins off). When it ends, the container's diff against the base commit (new files included) goes to --result; the
driver exits with the CLI's status.
"""
from __future__ import annotations

import json
import shlex
import shutil
import socket
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import urlparse

import tyro

import cli
import containers
import relay

ROOT = Path(__file__).resolve().parent
NPM_TOOLS = ROOT / ".npm-tools"  # npm install --prefix .npm-tools (Makefile): qwen-code, claude-code, codex
VERSIONS = {"codex": "@openai/codex@0.171.0", "claude-code": "@anthropic-ai/claude-code@2.1.332",
            "qwen-code": "@qwen-code/qwen-code@0.15.10"}  # qwen-code 0.15.10: the newest on Node 20
CODEX_VENDOR = NPM_TOOLS / "node_modules/@openai/codex-linux-x64/vendor/x86_64-unknown-linux-musl"
CLAUDE = NPM_TOOLS / "node_modules/@anthropic-ai/claude-code/bin/claude.exe"
QWEN = NPM_TOOLS / "node_modules/@qwen-code/qwen-code/cli.js"
NEEDS = {"codex": CODEX_VENDOR / "bin/codex", "claude-code": CLAUDE, "qwen-code": QWEN}
HARNESSES = tuple(NEEDS)
PORT = 8080  # the relay's port on the container's loopback
HOME = "/tmp/kiln-home"  # the CLI's home, on the container's tmpfs
TASK = ("Fix this issue in the repository at /testbed (a sandbox with no network). Stop when it is fixed.\n\n"
        "{problem}")
# For small models that cannot read the CLIs' long system prompts: the same protocol in a few lines.
SHORT_SYSTEM = ("You are a coding agent. Use your tools to inspect and edit the repository at /testbed. Reply "
                "without a tool call when you are done.")
# Hosted and optional tools the endpoint cannot serve or the run must not use (codex 0.171.0 feature names).
CODEX_DISABLED = ("multi_agent", "goals", "image_generation", "view_image")
# claude-code's tools beyond reading, editing, searching and its shell: subagents, workflows, scheduling (about 18,000
# tokens of schemas in 2.1.332); --short leaves them out.
CLAUDE_ORCHESTRATION = ("Agent", "Workflow", "ScheduleWakeup", "ReportFindings", "ListAgents", "Skill")


@dataclass
class Args:
    harness: Literal["codex", "claude-code", "qwen-code"]
    """the CLI to run in the container"""
    base_url: str
    """kiln's endpoint ({base_url})"""
    api_key: str
    """the session key ({api_key})"""
    row: Path
    """the row as kiln gives it ({row_file})"""
    result: Path
    """where the patch goes ({result})"""
    short: bool = False
    """for tiny models and tests: a few-line system prompt instead of the CLI's own (codex: with a model catalog
    entry, which also offers its apply_patch tool), and claude-code without its orchestration tools"""
    max_turns: int = 50
    """model turns before the CLI stops (claude-code --max-turns, qwen-code --max-session-turns; codex has none)"""
    max_tokens: int = 2048
    """reply budget per model call (claude-code, qwen-code; the endpoint caps every harness at its own budget)"""
    agent_seconds: int = 3000
    """wall seconds the CLI runs in the container before it is killed"""
    container_seconds: int = 3600
    """the container's lifetime (its `sleep`, and kiln's expiry label)"""


def check_installed(harness: str) -> None:
    """FileNotFoundError naming the npm command that installs the harness (and Node for qwen-code)."""
    if not NEEDS[harness].exists():
        raise FileNotFoundError(f"{harness} is not installed at {NEEDS[harness]}: run `npm install --prefix "
                                f"{NPM_TOOLS} {VERSIONS[harness]}` (or `make .npm-tools/.kiln-installed-codex`)")
    if harness == "qwen-code" and shutil.which("node") is None:
        raise FileNotFoundError("qwen-code needs Node >= 20 on the host (it is mounted into the container): "
                                "`make system` installs it")


def mounts(harness: str, link: Path) -> dict[str, str]:
    """Host paths to bind read-only in the container: the relay script, the link folder (socket and settings), and
    the harness's CLI (codex: its static binary folder; the others: npm's prefix, plus node for qwen-code)."""
    bound = {str(ROOT / "relay.py"): "/opt/kiln/relay.py", str(link): "/run/kiln"}
    if harness == "codex":
        bound[str(CODEX_VENDOR.resolve())] = "/opt/kiln/codex"
    else:
        bound[str(NPM_TOOLS.resolve())] = "/opt/kiln/npm"
    if harness == "qwen-code":
        bound[str(Path(shutil.which("node")).resolve())] = "/opt/kiln/bin/node"
    return bound


def codex_catalog(instructions: str) -> dict:
    """A model catalog with an entry for `kiln` (codex 0.171.0's required fields): its system prompt, no websockets,
    codex's apply_patch file tool offered (as a custom tool). Without one codex uses its fallback prompt and metadata,
    which offer no apply_patch."""
    return {"models": [{"slug": "kiln", "display_name": "kiln", "base_instructions": instructions,
                        "prefer_websockets": False, "apply_patch_tool_type": "freeform", "shell_type": "shell_command",
                        "support_verbosity": False, "supported_reasoning_levels": [], "visibility": "list",
                        "truncation_policy": {"mode": "tokens", "limit": 10000}, "supported_in_api": True,
                        "priority": 1, "experimental_supported_tools": []}]}


def settings(harness: str, short: bool) -> dict[str, str]:
    """The CLI's settings files, by path relative to its home."""
    if harness == "codex":
        catalog = f'model_catalog_json = "{HOME}/.codex/catalog.json"\n' if short else ""
        return {".codex/config.toml": f"""model = "kiln"
model_provider = "kiln"
web_search = "disabled"
check_for_update_on_startup = false
{catalog}[model_providers.kiln]
name = "kiln"
base_url = "http://127.0.0.1:{PORT}/v1"
env_key = "KILN_API_KEY"
wire_api = "responses"
[features]
plugins = false
[analytics]
enabled = false
"""} | ({".codex/catalog.json": json.dumps(codex_catalog(SHORT_SYSTEM))} if short else {})
    if harness == "claude-code":
        accepted = json.dumps({"hasCompletedOnboarding": True, "bypassPermissionsModeAccepted": True})
        return {".claude.json": accepted, ".claude/settings.json": accepted}
    qwen = {"tools": {"shell": {"enableInteractiveShell": False}}, "privacy": {"usageStatisticsEnabled": False},
            "telemetry": {"enabled": False}, "security": {"auth": {"selectedType": "openai"}},
            "general": {"checkpointing": {"enabled": False}}}
    return {".qwen/settings.json": json.dumps(qwen)} | ({"system.md": SHORT_SYSTEM} if short else {})


def command(args: Args, problem: str) -> str:
    """The shell lines that run the CLI in the container: its environment, then the CLI on the task."""
    task = shlex.quote(TASK.format(problem=problem))
    endpoint = f"http://127.0.0.1:{PORT}"
    if args.harness == "codex":
        disabled = " ".join(f"--disable {feature}" for feature in CODEX_DISABLED)
        return (f"export CODEX_HOME={HOME}/.codex KILN_API_KEY={shlex.quote(args.api_key)} "
                f"PATH=/opt/kiln/codex/codex-path:$PATH\n"
                f"/opt/kiln/codex/bin/codex exec --dangerously-bypass-approvals-and-sandbox --skip-git-repo-check "
                f"--ephemeral --json {disabled} -C /testbed {task}")
    if args.harness == "claude-code":
        disallowed = ("WebFetch", "WebSearch") + (CLAUDE_ORCHESTRATION if args.short else ())
        system = f" --system-prompt {shlex.quote(SHORT_SYSTEM)}" if args.short else ""
        return (f"export ANTHROPIC_BASE_URL={endpoint} ANTHROPIC_API_KEY={shlex.quote(args.api_key)} IS_SANDBOX=1 "
                "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 DISABLE_TELEMETRY=1 DISABLE_AUTOUPDATER=1 "
                f"DISABLE_ERROR_REPORTING=1 CLAUDE_CODE_MAX_OUTPUT_TOKENS={args.max_tokens}\n"
                f"/opt/kiln/npm/node_modules/@anthropic-ai/claude-code/bin/claude.exe -p {task} --model kiln "
                f"--dangerously-skip-permissions --disallowedTools {' '.join(disallowed)} --max-turns {args.max_turns}"
                f"{system}")
    short = f" QWEN_SYSTEM_MD={HOME}/system.md" if args.short else ""
    return (f"export PATH=/opt/kiln/bin:$PATH OPENAI_BASE_URL={endpoint}/v1 OPENAI_API_KEY={shlex.quote(args.api_key)} "
            f"OPENAI_MODEL=kiln QWEN_CODE_MAX_OUTPUT_TOKENS={args.max_tokens}{short}\n"
            f"node /opt/kiln/npm/node_modules/@qwen-code/qwen-code/cli.js --yolo --max-session-turns {args.max_turns}"
            f" -p {task}")


def launcher(cli_lines: str) -> str:
    """The container-side script: the CLI's home from the mounted settings, the relay on the loopback (waited for),
    then the CLI in /testbed. The exec's process group, relay included, is killed when it ends."""
    return f"""set -e
command -v python3 >/dev/null || {{ echo "kiln: the image has no python3 for the endpoint's relay" >&2; exit 90; }}
rm -rf {HOME} && mkdir -p {HOME} && cp -a /run/kiln/home/. {HOME}/
export HOME={HOME}
python3 /opt/kiln/relay.py tcp:127.0.0.1:{PORT} unix:/run/kiln/api.sock --ready /tmp/kiln-relay.ready &
for i in $(seq 200); do [ -e /tmp/kiln-relay.ready ] && break; sleep 0.05; done
[ -e /tmp/kiln-relay.ready ] || {{ echo "kiln: the relay did not start" >&2; exit 91; }}
cd /testbed
set +e
{cli_lines}
"""


def link_endpoint(base_url: str, folder: Path) -> socket.socket:
    """A unix socket at folder/api.sock relayed (on daemon threads) to the endpoint's TCP port; close it to stop."""
    url = urlparse(base_url)
    server = relay.listen(f"unix:{folder / 'api.sock'}")
    threading.Thread(target=relay.serve, args=(server, f"tcp:{url.hostname}:{url.port}"), daemon=True).start()
    return server


def run(args: Args, limits: containers.ContainerLimits | None = None) -> int:
    """Run the harness on the row in a fresh container; write the diff to args.result; the CLI's exit status."""
    check_installed(args.harness)
    instance = json.loads(args.row.read_text())["instance"]
    limits = limits or containers.ContainerLimits(ttl=args.container_seconds, output_cap=200_000)
    with tempfile.TemporaryDirectory(prefix="kiln-harness-") as work:
        link = Path(work, "link")
        for path, text in settings(args.harness, args.short).items():
            (link / "home" / path).parent.mkdir(parents=True, exist_ok=True)
            (link / "home" / path).write_text(text)
        endpoint = link_endpoint(args.base_url, link)
        try:
            with containers.Container(containers.shared_client(), instance["image"], "agent", args.api_key, limits,
                                      mounts=mounts(args.harness, link)) as container:
                ran = container.exec(launcher(command(args, instance["problem_statement"])),
                                     timeout=args.agent_seconds)
                patch = containers.container_diff(container, instance["base_commit"])
        finally:
            endpoint.close()
    args.result.write_bytes(patch)
    print(ran.output[-20_000:])
    print(f"{args.harness}: exit {ran.exit_code}{' (killed at the wall limit)' if ran.timed_out else ''}, "
          f"{len(patch)} bytes of diff")
    return ran.exit_code


if __name__ == "__main__":
    with cli.one_line_errors():
        code = run(tyro.cli(Args))
    sys.exit(code)
