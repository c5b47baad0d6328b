"""claude-code (npm @anthropic-ai/claude-code, a native binary) run headless (`claude -p`) against kiln's Anthropic
Messages endpoint over real HTTP on 127.0.0.1, with a scripted engine: its streamed turns, tool_use and tool_result
blocks and the system messages it sends between turns extend one segment whose ids pass check_tito, with mask 1
exactly on the sampled ids, and its Bash tool runs the scripted command. Nothing but the endpoint is contacted
(non-essential traffic, telemetry and the auto-updater are off). Needs claude-code installed:
npm install --prefix .npm-tools @anthropic-ai/claude-code@2.1.332 (CI installs it)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
import agent_server  # noqa: E402
import policy  # noqa: E402
import tiny  # noqa: E402
from test_agent_server import RuleEngine, Served  # noqa: E402
from test_multiturn import CORPUS  # noqa: E402
import system_parts  # noqa: E402

CLAUDE = ROOT / ".npm-tools" / "node_modules" / ".bin" / "claude"
if not CLAUDE.exists():
    system_parts.require("agent-clis", f"claude-code is not installed ({CLAUDE})", module=True)
pytestmark = pytest.mark.slow


def bash(command: str) -> str:
    return ("<tool_call>\n" + json.dumps({"name": "Bash", "arguments": {"command": command,
                                                                         "description": "write the file"}})
            + "\n</tool_call>")


def test_claude_code_streams_its_turns_into_one_segment(tmp_path, monkeypatch):
    tokenizer = policy.load_tokenizer(tiny.make_tiny_model(tmp_path / "tiny", CORPUS))
    engine = RuleEngine(tokenizer, [("kiln-task", "I write it.\n" + bash("echo hi > out.txt && echo KILN-WROTE")),
                                    ("KILN-WROTE", "Done, wrote out.txt.")])
    seen, submit = [], agent_server.AgentServer.submit
    monkeypatch.setattr(agent_server.AgentServer, "submit", lambda self, request: seen.append(request) or submit(
        self, request))
    (tmp_path / "home").mkdir()
    (tmp_path / "work").mkdir()
    with Served(engine, tokenizer, max_new_tokens=400, max_total_tokens=200_000) as served:
        run = subprocess.run(
            [str(CLAUDE), "-p", "kiln-task: write hi to out.txt", "--dangerously-skip-permissions", "--model", "kiln"],
            cwd=tmp_path / "work", stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300,
            env=dict(os.environ, HOME=str(tmp_path / "home"), ANTHROPIC_BASE_URL=served.server.base_url[: -len("/v1")],
                     ANTHROPIC_API_KEY="claude-session", CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
                     DISABLE_TELEMETRY="1", DISABLE_AUTOUPDATER="1", IS_SANDBOX="1"))
        record = served.session("claude-session")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert run.stdout.strip() == "Done, wrote out.txt."
    assert (tmp_path / "work" / "out.txt").read_text() == "hi\n"  # its Bash tool ran the scripted command
    assert [r.stream for r in seen] == [True, True]  # both turns streamed
    (segment,) = record["segments"]
    assert segment["opened"] == "first" and segment["turns"] == 2 and segment["tito"] == {}
    assert [i for i, m in zip(segment["completion_ids"], segment["loss_mask"]) if m] == engine.emitted[0] + \
        engine.emitted[1]
    assert segment["messages"][-2]["role"] == "tool" and "KILN-WROTE" in segment["messages"][-2]["content"]
    assert "Bash" in {t["function"]["name"] for t in segment["tools"]}
