"""The proof with the SWE pipeline's own agent: qwen-code from npm (qwen_code.py, headless `qwen --yolo -p`, every
turn streamed) on an offline SWE-bench instance, pointed at kiln's endpoint through rollout.external_agents, as
`train_grpo.py --agent-cmd` runs it. Its shell runs in the instance's container. With a scripted engine that emits the
gold fix the diff it leaves is graded resolved in a fresh container and exactly the sampled ids carry mask 1; with the
tiny model the run completes and every recorded segment passes check_tito. No container outlives its agent.
Needs qwen-code installed: npm install --prefix .npm-tools @qwen-code/qwen-code@0.15.10 (CI installs it)."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
import agent_server  # noqa: E402
import chat  # noqa: E402
import engines  # noqa: E402
import policy  # noqa: E402
import qwen_code  # noqa: E402
import rewards  # noqa: E402
import rollout  # noqa: E402
import tiny  # noqa: E402
from test_agent_server import RuleEngine  # noqa: E402
from test_mini_swe_agent import left_behind, tagged  # noqa: E402
from test_multiturn import CORPUS  # noqa: E402
from test_swebench import M1359, docker_client, swe_rows  # noqa: E402,F401 -- fixtures
import system_parts  # noqa: E402

if not qwen_code.INSTALLED.exists():
    system_parts.require("agent-clis", f"qwen-code is not installed ({qwen_code.INSTALLED})", module=True)
pytestmark = [pytest.mark.docker, pytest.mark.slow]
DRIVER = (f"{sys.executable} {ROOT / 'qwen_code.py'} --base-url {{base_url}} --api-key {{api_key}} "
          "--row {row_file} --result {result} --short")


def call(command: str) -> str:
    return f"<tool_call>\n{json.dumps({'name': 'run_shell_command', 'arguments': {'command': command}})}\n</tool_call>"


def requests_seen(monkeypatch) -> list:
    """Every request the endpoint is sent, as parsed."""
    seen, submit = [], agent_server.AgentServer.submit
    monkeypatch.setattr(agent_server.AgentServer, "submit", lambda self, request: seen.append(request) or submit(
        self, request))
    return seen


def test_scripted_gold_fix_through_qwen_code_is_rewarded_and_only_sampled_ids_are_trained(docker_client, swe_rows,
                                                                                            tmp_path, monkeypatch):
    seen = requests_seen(monkeypatch)
    row = tagged(swe_rows[M1359], "task-gold")
    gold = json.loads(row["reward_model"]["ground_truth"])["patch"]
    engine = RuleEngine(policy.load_tokenizer(tiny.make_tiny_model(tmp_path / "tiny", CORPUS)), [
        ("[task-gold]", "I apply the fix.\n" + call(f"cat > /tmp/fix.patch <<'KILN_EOF'\n{gold}KILN_EOF\n"
                                                    "git apply /tmp/fix.patch && echo KILN-APPLIED")),
        ("KILN-APPLIED\n", "The fix is applied.")])
    tokenizer = engine.tokenizer
    samples, metrics = rollout.external_agents(DRIVER, engine, tokenizer, [row], 1,
                                               engines.Sampling(max_new_tokens=4096), "swe",
                                               rollout.AgentLimits(max_total_tokens=65536, max_seconds=300),
                                               check=True)
    (sample,) = samples  # both streamed turns extend one segment
    assert sample.info["agent_status"] == "ok", sample.info
    assert metrics["agents/requests"] == 2 and metrics["tools/tito_drift_frac"] == 0.0
    assert [(r.stream, r.include_usage) for r in seen] == [(True, True)] * 2  # qwen-code streamed both turns
    assert [i for i, m in zip(sample.completion_ids, sample.loss_mask) if m] == engine.emitted[0] + engine.emitted[1]
    assert "run_shell_command" in {t["function"]["name"] for t in sample.info["tools"]}  # qwen-code's, via the template
    assert "KILN-APPLIED" in sample.info["messages"][-2]["content"]  # the command ran in the container
    assert rewards.score(row, sample.text).score == 1.0  # its diff, graded in a fresh container
    assert left_behind(docker_client, [sample.session]) == []


def test_tiny_model_run_through_qwen_code_completes_and_every_segment_passes_check_tito(docker_client, swe_rows,
                                                                                         tmp_path):
    model_dir = tiny.make_tiny_model(tmp_path / "tiny", CORPUS)
    tokenizer = policy.load_tokenizer(model_dir)
    engine = engines.HFEngine(policy.load_model(model_dir).eval(), pad_token_id=tokenizer.pad_token_id)
    sampling = engines.Sampling(max_new_tokens=16, temperature=0.0,  # greedy: random bytes rarely decode as UTF-8
                                stop_token_ids=policy.stop_token_ids(tokenizer, model_dir, chat.end_of_turn(tokenizer)))
    samples, metrics = rollout.external_agents(f"{DRIVER} --max-session-turns 2", engine, tokenizer,
                                               [swe_rows[M1359]], 1, sampling, "swe",
                                               rollout.AgentLimits(max_total_tokens=65536, max_seconds=300), check=True)
    assert metrics["agents/failed_frac"] == metrics["agents/timeout_frac"] == 0
    assert samples and metrics["agents/requests"] >= 1
    for s in samples:
        assert chat.check_tito(tokenizer, s, s.info["messages"], s.info["tools"], None, s.info["open_turns"]) == {}
        assert sum(s.loss_mask) >= 1
    assert left_behind(docker_client, {s.session for s in samples}) == []
