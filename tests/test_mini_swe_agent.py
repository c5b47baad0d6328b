"""The proof with a real client nobody here wrote: mini-swe-agent from PyPI (mini_swe_agent.py, its
DefaultAgent, LitellmModel and DockerEnvironment) on an offline SWE-bench instance, pointed at kiln's endpoint through
rollout.external_agents, as `train_grpo.py --agent-cmd` runs it. With the tiny model the run completes and every
recorded segment passes check_tito; with a scripted engine that emits the gold fix the submitted patch is graded
resolved in a fresh container and exactly the sampled ids carry mask 1; a hung agent is killed and its container
swept. No container outlives its agent."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
import chat  # noqa: E402
import containers  # noqa: E402
import engines  # noqa: E402
import policy  # noqa: E402
import rewards  # noqa: E402
import rollout  # noqa: E402
import tiny  # noqa: E402
from test_multiturn import CORPUS, ScriptedEngine  # noqa: E402
from test_swebench import M1359, docker_client, swe_rows  # noqa: E402,F401 -- fixtures

pytest.importorskip("minisweagent")
pytestmark = [pytest.mark.docker, pytest.mark.slow]
DRIVER = (f"LITELLM_LOCAL_MODEL_COST_MAP=True MSWEA_COST_TRACKING=ignore_errors {sys.executable} "
          f"{ROOT / 'mini_swe_agent.py'} --base-url {{base_url}} --api-key {{api_key}} "
          "--row {row_file} --result {result} --short")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny.make_tiny_model(tmp_path_factory.mktemp("tiny"), CORPUS)


def tagged(row: dict, marker: str) -> dict:
    system, user = row["prompt"]
    return row | {"prompt": [system, user | {"content": f"[{marker}]\n" + user["content"]}]}


def call(command: str) -> str:
    return f"<tool_call>\n{json.dumps({'name': 'bash', 'arguments': {'command': command}})}\n</tool_call>"


def left_behind(client, sessions) -> list[str]:
    """Containers of these agent sessions still on the host."""
    return [c.id for key in sessions  # sparse: no inspect of each, which races with a removal in progress
            for c in client.containers.list(all=True, sparse=True, filters={"label": f"{containers.RUN}={key}"})]


def test_tiny_model_run_completes_and_every_segment_passes_check_tito(docker_client, swe_rows, model_dir):
    tokenizer = policy.load_tokenizer(model_dir)
    engine = engines.HFEngine(policy.load_model(model_dir).eval(), pad_token_id=tokenizer.pad_token_id)
    sampling = engines.Sampling(max_new_tokens=16, temperature=0.0,  # greedy: random bytes rarely decode as UTF-8
                                stop_token_ids=policy.stop_token_ids(tokenizer, model_dir, chat.end_of_turn(tokenizer)))
    samples, metrics = rollout.external_agents(f"{DRIVER} --step-limit 3", engine, tokenizer, [swe_rows[M1359]], 1,
                                               sampling, "swe", rollout.AgentLimits(max_total_tokens=8192,
                                                                                    max_seconds=240), check=True)
    assert metrics["agents/failed_frac"] == metrics["agents/timeout_frac"] == 0  # mini-swe-agent ran to its end
    assert samples and all(s.info["agent_status"] == "ok" for s in samples)
    assert metrics["agents/requests"] == 3  # its step limit
    for s in samples:
        assert chat.check_tito(tokenizer, s, s.info["messages"], s.info["tools"]) == {}
        assert s.info["tools"][0]["function"]["name"] == "bash"  # mini-swe-agent's tool, through the template
    assert left_behind(docker_client, {s.session for s in samples}) == []


def test_scripted_gold_fix_is_rewarded_and_only_sampled_ids_are_trained(docker_client, swe_rows, model_dir):
    tokenizer = policy.load_tokenizer(model_dir)
    row = tagged(swe_rows[M1359], "task-gold")
    gold = json.loads(row["reward_model"]["ground_truth"])["patch"]
    engine = ScriptedEngine(tokenizer, {"task-gold": [
        "I apply the fix.\n" + call(f"cat > patch.txt <<'KILN_EOF'\n{gold}KILN_EOF\n"
                                    "git apply patch.txt && git status -s"),
        "Submitting.\n" + call("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat patch.txt")]})
    samples, metrics = rollout.external_agents(DRIVER, engine, tokenizer, [row], 1,
                                               engines.Sampling(max_new_tokens=4096), "swe",
                                               rollout.AgentLimits(max_total_tokens=16384, max_seconds=240))
    (sample,) = samples  # both turns extend one segment
    assert sample.info["agent_status"] == "ok" and sample.text == gold
    assert [i for i, m in zip(sample.completion_ids, sample.loss_mask) if m] == engine.emitted["task-gold"]
    assert sum(sample.loss_mask) == len(engine.emitted["task-gold"])
    assert chat.check_tito(tokenizer, sample, sample.info["messages"], sample.info["tools"]) == {}
    assert rewards.score(row, sample.text).score == 1.0  # graded in a fresh container from the instance image
    assert left_behind(docker_client, [sample.session]) == []


def test_a_hung_agent_is_killed_and_its_container_swept(docker_client, swe_rows, model_dir):
    tokenizer = policy.load_tokenizer(model_dir)
    row = tagged(swe_rows[M1359], "task-hang")
    engine = ScriptedEngine(tokenizer, {"task-hang": ["Waiting.\n" + call("sleep 300")]})
    samples, metrics = rollout.external_agents(DRIVER, engine, tokenizer, [row], 1,
                                               engines.Sampling(max_new_tokens=200), "swe",
                                               rollout.AgentLimits(max_total_tokens=8192, max_seconds=20),
                                               keep_failed=True)
    (sample,) = samples
    assert sample.info["agent_status"] == "timeout" and metrics["agents/timeout_frac"] == 1
    assert metrics["agents/requests"] == 1  # it had started its container and was running `sleep 300` in it
    assert left_behind(docker_client, [sample.session]) == []  # the sweep after the round removed it
