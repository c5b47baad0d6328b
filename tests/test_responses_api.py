"""The endpoint's OpenAI Responses API (`POST /v1/responses`) over real HTTP on 127.0.0.1: the real OpenAI client's
`responses.create`, streamed and not, with function and custom tool calls round-tripped as codex sends them (the
developer prompt, function_call and function_call_output items, reasoning items it may echo) extends one segment with
mask 1 exactly on the sampled ids; the stream has the events codex needs; what kiln cannot honour is refused with a
400. Then the real codex CLI inside an offline instance's container (harness_agent.py, no network) against the tiny
model: its session passes check_tito and no container is left."""
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
import chat  # noqa: E402
import engines  # noqa: E402
import harness_agent  # noqa: E402
import policy  # noqa: E402
import rollout  # noqa: E402
import tiny  # noqa: E402
import system_parts  # noqa: E402
from test_agent_server import RuleEngine, Served  # noqa: E402
from test_mini_swe_agent import left_behind  # noqa: E402
from test_multiturn import CORPUS, ScriptedEngine  # noqa: E402
from test_swebench import M1359, docker_client, swe_rows  # noqa: E402,F401 -- fixtures

EXEC = {"type": "function", "name": "exec_command", "description": "run a shell command", "strict": False,
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}
PATCH = {"type": "custom", "name": "apply_patch", "description": "apply a patch",
         "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}


def call(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return policy.load_tokenizer(tiny.make_tiny_model(tmp_path_factory.mktemp("tiny"), CORPUS))


def developer(text: str) -> dict:
    return {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": text}]}


def user(text: str) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def history(response) -> list[dict]:
    """A response's output items as codex sends them back (plus a reasoning item another server could have sent)."""
    return [item.model_dump(exclude_none=True) for item in response.output]


@pytest.mark.parametrize("stream", [False, True])
def test_a_codex_shaped_conversation_extends_one_segment_with_an_exact_mask(tokenizer, stream):
    engine = RuleEngine(tokenizer, [("kiln-task", "I look.\n" + call("exec_command", {"cmd": "ls"})),
                                    ("KILN-LISTED", "I patch.\n" + call("apply_patch", {"input": "*** Begin"})),
                                    ("KILN-PATCHED", "Done.")])
    with Served(engine, tokenizer) as served:
        client = served.client("codex-1")
        kwargs = dict(model="kiln", tools=[EXEC, PATCH], store=False, include=["reasoning.encrypted_content"],
                      parallel_tool_calls=True, tool_choice="auto")
        items = [developer("You are codex."), developer("Skills: none."), user("<environment_context/>"),
                 user("kiln-task: look around")]

        def ask(items):
            if not stream:
                return client.responses.create(input=items, **kwargs)
            with client.responses.stream(input=items, **kwargs) as events:
                kinds = [event.type for event in events]
                response = events.get_final_response()
            assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
            for kind in ("response.output_item.added", "response.output_text.delta", "response.output_item.done"):
                assert kind in kinds
            return response

        first = ask(items)
        assert first.status == "completed" and [o.type for o in first.output] == ["message", "function_call"]
        assert first.output[0].content[0].text == "I look." and json.loads(first.output[1].arguments) == {"cmd": "ls"}
        items += history(first) + [{"type": "reasoning", "id": "rs_1", "summary": [],
                                    "encrypted_content": "another server's"},
                                   {"type": "function_call_output", "call_id": first.output[1].call_id,
                                    "output": "Process exited with code 0\nKILN-LISTED"}]
        second = ask(items)
        assert [o.type for o in second.output] == ["message", "custom_tool_call"]
        assert second.output[1].input == "*** Begin"  # a custom tool's call carries its input string
        items += history(second) + [{"type": "custom_tool_call_output", "call_id": second.output[1].call_id,
                                     "output": "KILN-PATCHED"}]
        third = ask(items)
        assert third.output_text == "Done." and third.usage.output_tokens == len(engine.emitted[2])
        record = served.session("codex-1")
    (segment,) = record["segments"]  # every request extended the one segment
    assert segment["turns"] == 3 and segment["tito"] == {}
    assert [i for i, m in zip(segment["completion_ids"], segment["loss_mask"]) if m] == [
        i for ids in engine.emitted for i in ids]
    assert segment["messages"][0] == {"role": "system", "content": "You are codex.\n\nSkills: none."}
    assert [m["role"] for m in segment["messages"][1:]] == ["user", "user", "assistant", "tool", "assistant",
                                                            "tool", "assistant"]
    assert {t["function"]["name"] for t in segment["tools"]} == {"exec_command", "apply_patch"}


def test_a_reply_cut_by_the_budget_is_incomplete_and_streamed_with_the_same_ids(tokenizer):
    reply = "a long reply that the budget cuts short"
    engine = ScriptedEngine(tokenizer, {"kiln": [reply]})
    with Served(engine, tokenizer) as served:
        plain = served.client("cut-1").responses.create(model="kiln", input="kiln", store=False, max_output_tokens=5)
        events = list(served.client("cut-2").responses.create(model="kiln", input="kiln", store=False,
                                                              max_output_tokens=5, stream=True))
        kinds, streamed = [e.type for e in events], events[-1].response  # the SDK's helper waits for completed only
    assert plain.status == streamed.status == "incomplete" and kinds[-1] == "response.incomplete"
    assert plain.incomplete_details.reason == "max_output_tokens" and plain.usage.output_tokens == 5
    assert plain.model_extra["token_ids"] == streamed.model_extra["token_ids"] == tokenizer(
        reply, add_special_tokens=False)["input_ids"][:5]


@pytest.mark.parametrize("body, says", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "store": True}, "store"),
    ({"input": [{"type": "image_generation_call", "id": "x"}]}, "image_generation_call"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "web_search"),
    ({"input": []}, "input must be"),
])
def test_what_kiln_cannot_honour_is_refused_naming_it(tokenizer, body, says):
    with Served(RuleEngine(tokenizer, [("hi", "hello")]), tokenizer) as served:
        request = urllib.request.Request(served.server.base_url + "/responses", data=json.dumps(
            {"model": "kiln"} | body).encode(), headers={"Authorization": "Bearer refused"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request)
    assert refused.value.code == 400 and says in json.loads(refused.value.read())["error"]["message"]


@pytest.mark.docker
@pytest.mark.slow  # codex's first request is about 20,000 tokens through the tiny model, in a container: ~1 minute
def test_codex_in_the_container_against_the_tiny_model_leaves_tito_clean_segments_and_no_container(
        docker_client, swe_rows, tmp_path):
    if not harness_agent.NEEDS["codex"].exists():
        system_parts.require("agent-clis", f"codex is not installed ({harness_agent.NEEDS['codex']})")
    model_dir = tiny.make_tiny_model(tmp_path / "tiny", CORPUS, max_position_embeddings=65536)
    tokenizer = policy.load_tokenizer(model_dir)
    engine = engines.HFEngine(policy.load_model(model_dir).eval(), pad_token_id=tokenizer.pad_token_id)
    sampling = engines.Sampling(max_new_tokens=16, temperature=0.0,  # greedy: random bytes rarely decode as UTF-8
                                stop_token_ids=policy.stop_token_ids(tokenizer, model_dir, chat.end_of_turn(tokenizer)))
    driver = (f"{sys.executable} {ROOT / 'harness_agent.py'} --harness codex --base-url {{base_url}} "
              "--api-key {api_key} --row {row_file} --result {result}")
    samples, metrics = rollout.external_agents(driver, engine, tokenizer, [swe_rows[M1359]], 1, sampling, "swe",
                                               rollout.AgentLimits(max_total_tokens=65536, max_seconds=400),
                                               check=True, keep_failed=True)
    assert metrics["agents/timeout_frac"] == 0 and samples and metrics["agents/requests"] >= 1
    for s in samples:
        assert chat.check_tito(tokenizer, s, s.info["messages"], s.info["tools"], None, s.info["open_turns"]) == {}
        assert sum(s.loss_mask) >= 1 and s.info["tools"][0]["function"]["name"] == "exec_command"
    # codex fails its turn on response.incomplete (a reply cut at 16 tokens) and goes on after a finished one
    assert (samples[-1].finish_reason == "length") == (samples[-1].info["agent_status"] == "failed")
    assert left_behind(docker_client, {s.session for s in samples}) == []
