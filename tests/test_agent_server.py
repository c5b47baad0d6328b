"""agent_server's token-recording OpenAI endpoint over real HTTP on 127.0.0.1 with the real OpenAI client: prefix
extension keeps the sampled ids (never re-tokenized) and masks only them, a divergent history forks a segment,
tool calls round-trip, concurrent sessions share one engine call, and external agent processes that crash or hang
end their sessions without blocking the rank. The engine is scripted (known ids): the thing under test is the
endpoint."""
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import anthropic
import openai
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
import agent_server  # noqa: E402
import chat  # noqa: E402
import data_prep  # noqa: E402
import engines  # noqa: E402
import losses  # noqa: E402
import policy  # noqa: E402
import rollout  # noqa: E402
import rl_run  # noqa: E402
import task_rows  # noqa: E402
import tiny  # noqa: E402
import ranks  # noqa: E402
import train_grpo  # noqa: E402
from test_multiturn import CORPUS, ScriptedEngine  # noqa: E402

BASH = {"type": "function", "function": {"name": "bash", "description": "run a command", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}


def call(command: str) -> str:
    return f"<tool_call>\n{json.dumps({'name': 'bash', 'arguments': {'command': command}})}\n</tool_call>"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return policy.load_tokenizer(tiny.make_tiny_model(tmp_path_factory.mktemp("tiny"), CORPUS))


class Served:
    """An AgentServer whose engine loop runs on a thread (what a rank's main thread does), plus OpenAI clients."""

    def __init__(self, engine, tokenizer, max_new_tokens=200, max_total_tokens=4096):
        self.server = agent_server.AgentServer(engine, tokenizer, engines.Sampling(max_new_tokens=max_new_tokens),
                                               max_total_tokens=max_total_tokens)
        self.running = True
        self.loop = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        while self.running:
            self.server.step()

    def __enter__(self):
        self.server.__enter__()
        self.loop.start()
        return self

    def __exit__(self, *exc):
        self.running = False
        self.loop.join()
        self.server.close()

    def client(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.server.base_url, api_key=key, max_retries=0, timeout=60)

    def session(self, key: str) -> dict:
        with urllib.request.urlopen(f"{self.server.base_url[:-3]}/kiln/sessions/{key}") as response:
            return json.loads(response.read())


def echo(message) -> dict:
    """The assistant message as an OpenAI client sends it back (mini-swe-agent: message.model_dump())."""
    return message.model_dump(exclude_none=True)


def test_prefix_extension_keeps_sampled_ids_and_tool_calls_round_trip(tokenizer):
    scripts = {"task-A": ["Let me look.\n" + call("ls"), "Done: two files."]}
    engine = ScriptedEngine(tokenizer, scripts, split_tokens=True)  # non-canonical ids: re-tokenizing would change them
    with Served(engine, tokenizer) as served:
        client = served.client("session-1")
        assert [m.id for m in client.models.list().data] == ["kiln"]
        messages = [{"role": "system", "content": "You fix code."}, {"role": "user", "content": "task-A: list files"}]
        first = client.chat.completions.create(model="kiln", messages=messages, tools=[BASH], temperature=0.3,
                                               extra_body={"return_token_ids": True})
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Let me look."  # the call is in tool_calls, not in the text
        (tool_call,) = choice.message.tool_calls
        assert tool_call.id.startswith("call_") and tool_call.function.name == "bash"
        assert json.loads(tool_call.function.arguments) == {"command": "ls"}
        emitted_first = list(engine.emitted["task-A"])
        assert choice.model_extra["token_ids"] == emitted_first
        messages += [echo(choice.message), {"role": "tool", "tool_call_id": tool_call.id,
                                            "content": "<returncode>0</returncode>\na.py b.py <|im_end|>"}]
        second = client.chat.completions.create(model="kiln", messages=messages, tools=[BASH],
                                                extra_body={"return_token_ids": True})
        assert second.choices[0].finish_reason == "stop" and second.choices[0].message.content == "Done: two files."
        (segment,) = served.session("session-1")["segments"]
    prompt = first.model_extra["prompt_token_ids"]
    assert segment["prompt_ids"] == prompt
    # The second request's prompt is the first one's ids, the sampled ids as sampled, then the template's suffix.
    assert second.model_extra["prompt_token_ids"][: len(prompt) + len(emitted_first)] == prompt + emitted_first
    ids, mask = segment["completion_ids"], segment["loss_mask"]
    emitted = engine.emitted["task-A"]
    assert [i for i, m in zip(ids, mask) if m] == emitted  # mask 1 exactly on the sampled ids, in order
    suffix = ids[len(emitted_first): len(ids) - len(emitted) + len(emitted_first)]
    assert suffix == chat.template_suffix_ids(tokenizer, segment["messages"][:3], segment["messages"][3:4], [BASH])
    assert ids == emitted_first + suffix + emitted[len(emitted_first):]
    assert suffix.count(tokenizer.convert_tokens_to_ids("<|im_end|>")) == 1  # the template's; the tool's is plain text
    assert segment["logprobs"][: len(emitted_first)] == [-(1 + k / 1000) for k in range(len(emitted_first))]
    assert all(lp == 0.0 for lp, m in zip(segment["logprobs"], mask) if not m)
    # check_tito sees the template tokenize the replies differently: the recorded ids are the sampled ones.
    assert list(segment["tito"]) == ["ids"]


def test_canonical_segments_pass_check_tito_and_an_edited_turn_forks(tokenizer):
    scripts = {"task-B": ["Checking.\n" + call("cat a.py"), "Fixed.\n" + call("git diff"), "All done."]}
    engine = ScriptedEngine(tokenizer, scripts)
    with Served(engine, tokenizer) as served:
        client = served.client("session-2")
        messages = [{"role": "user", "content": "task-B: fix a.py"}]
        for result in ("print(1)", "diff --git a/a.py b/a.py"):
            reply = client.chat.completions.create(model="kiln", messages=messages, tools=[BASH]).choices[0].message
            messages += [echo(reply), {"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": result}]
        (whole,) = served.session("session-2")["segments"]
        assert whole["tito"] == {} and sum(whole["loss_mask"]) == len(engine.emitted["task-B"])
        # The client edits its first turn (a compaction, a rewrite): the history no longer extends the segment.
        edited = [messages[0], messages[1] | {"content": "Checking again."}] + messages[2:]
        forked = client.chat.completions.create(model="kiln", messages=edited, tools=[BASH],
                                                extra_body={"return_token_ids": True})
        assert forked.choices[0].message.content == "All done."
        first, second = served.session("session-2")["segments"]
    assert first == whole  # the closed segment is kept as it was
    assert second["tito"] == {}
    assert second["prompt_ids"] == forked.model_extra["prompt_token_ids"]
    assert second["completion_ids"] == forked.choices[0].model_extra["token_ids"]
    assert second["loss_mask"] == [1] * len(second["completion_ids"])  # the re-rendered history is prompt: untrained
    assert "Checking again." in tokenizer.decode(second["prompt_ids"])


def test_sixteen_concurrent_sessions_share_one_engine_call(tokenizer):
    scripts = {f"task-{k:02d}": [f"Session {k} looks.\n" + call(f"echo {k}"), f"Session {k} done."] for k in range(16)}
    engine = ScriptedEngine(tokenizer, scripts)
    sizes = []
    generate = engine.generate
    engine.generate = lambda prompts, sampling: sizes.append(len(prompts)) or generate(prompts, sampling)
    server = agent_server.AgentServer(engine, tokenizer, engines.Sampling(max_new_tokens=100))
    replies, errors = {}, []

    def agent(k):
        try:
            client = openai.OpenAI(base_url=server.base_url, api_key=f"key-{k}", max_retries=0, timeout=60)
            messages = [{"role": "user", "content": f"task-{k:02d}"}]
            first = client.chat.completions.create(model="kiln", messages=messages, tools=[BASH]).choices[0].message
            messages += [echo(first), {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": str(k)}]
            second = client.chat.completions.create(model="kiln", messages=messages, tools=[BASH])
            replies[k] = second.choices[0].message.content
        except Exception as e:  # noqa: BLE001 -- reported by the assertion below
            errors.append(e)

    with server:
        threads = [threading.Thread(target=agent, args=(k,)) for k in range(16)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while server.pending.qsize() < 16 and time.monotonic() < deadline:  # every agent's first request is queued
            time.sleep(0.01)
        while any(t.is_alive() for t in threads):
            server.step()
        records = {k: server.session_record(f"key-{k}") for k in range(16)}
    assert errors == []
    assert sizes[0] == 16  # the first turns of all sessions: one engine call
    assert sum(sizes) == 32 and len(sizes) < 32
    assert replies == {k: f"Session {k} done." for k in range(16)}
    for k, record in records.items():
        (segment,) = record["segments"]
        assert segment["tito"] == {}, k
        assert [i for i, m in zip(segment["completion_ids"], segment["loss_mask"]) if m] == engine.emitted[
            f"task-{k:02d}"]


def test_replies_cut_by_a_stop_string_or_max_tokens_are_continued_in_their_segment(tokenizer):
    engine = ScriptedEngine(tokenizer, {"task-S": ["Done: two files.", "Again and again and again.", "Fine."]})
    with Served(engine, tokenizer) as served:
        client = served.client("session-s")
        messages = [{"role": "user", "content": "task-S"}]
        first = client.chat.completions.create(model="kiln", messages=messages, stop=["two"]).choices[0]
        messages += [echo(first.message), {"role": "user", "content": "and?"}]
        second = client.chat.completions.create(model="kiln", messages=messages, max_tokens=3).choices[0]
        messages += [echo(second.message), {"role": "user", "content": "go on"}]
        third = client.chat.completions.create(model="kiln", messages=messages).choices[0]
        (segment,) = served.session("session-s")["segments"]  # one sample, not one per cut reply
    ids = first.model_extra["token_ids"]
    assert first.message.content == "Done: " and first.finish_reason == "stop"
    assert "two" in tokenizer.decode(ids) and "two" not in tokenizer.decode(ids[:-1])
    assert second.finish_reason == "length" and len(second.model_extra["token_ids"]) == 3
    assert third.message.content == "Fine." and third.finish_reason == "stop"
    sampled = ids + second.model_extra["token_ids"] + third.model_extra["token_ids"]
    completion, mask = segment["completion_ids"], segment["loss_mask"]
    assert [i for i, m in zip(completion, mask) if m] == sampled  # mask 1 exactly on what was sampled
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert completion[len(ids)] == eot and mask[len(ids)] == 0  # the template closes the cut reply, untrained
    assert segment["open_turns"] == [1, 3] and segment["turns"] == 3
    assert segment["tito"] == {}


class RuleEngine:
    """Replies chosen by a rule on the prompt's text (the last marker of `rules` found in it wins), canonical ids plus
    the end-of-turn token; `emitted` lists every call's ids in order."""

    def __init__(self, tokenizer, rules: list[tuple[str, str]], fail: bool = False):
        self.tokenizer, self.rules, self.fail, self.emitted = tokenizer, rules, fail, []
        self.eot = tokenizer.convert_tokens_to_ids(chat.end_of_turn(tokenizer))

    def generate(self, prompts, sampling):
        if self.fail:
            time.sleep(0.3)
            raise RuntimeError("the engine died")
        out = []
        for prompt in prompts:
            text = self.tokenizer.decode(prompt)
            reply = max(((text.rfind(marker), reply) for marker, reply in self.rules if marker in text))[1]
            ids = self.tokenizer(reply, add_special_tokens=False)["input_ids"][: sampling.max_new_tokens - 1]
            ids += [self.eot]
            self.emitted.append(ids)
            out.append(engines.Completion(ids, [-0.5] * len(ids), "stop"))
        return out


class SteppedRuleEngine(RuleEngine):
    """RuleEngine's replies from a continuous engine: one token per step(), each reply returned at the step that
    draws its last token; `finished` lists (step, reply ids) in order."""

    continuous = True

    def __init__(self, tokenizer, rules):
        super().__init__(tokenizer, rules)
        self.drawing, self.steps, self.finished = {}, 0, []

    def submit(self, key, prompt, sampling, seed=None):
        self.drawing[key] = [self.generate([prompt], sampling)[0], 0]

    def step(self):
        self.steps += 1
        time.sleep(0.002)  # a decoding step takes time
        done = []
        for key, entry in list(self.drawing.items()):
            entry[1] += 1
            if entry[1] == len(entry[0].token_ids):
                done.append((key, self.drawing.pop(key)[0]))
                self.finished.append((self.steps, entry[0].token_ids))
        return done

    def abort(self):
        self.drawing = {}


def test_a_continuous_engine_answers_each_request_when_its_reply_ends(tokenizer):
    """With a continuous engine a short reply asked while a long one is generating joins the running batch and is
    answered before the long one ends; each reply's ids are what the engine drew, recorded and masked as sampled."""
    long_reply, short_reply = "The answer is 3. " * 12, "Done."
    engine = SteppedRuleEngine(tokenizer, [("task-long", long_reply), ("task-short", short_reply)])
    answered = []

    def ask(served, key, task):
        reply = served.client(key).chat.completions.create(model="kiln", messages=[{"role": "user", "content": task}])
        answered.append((key, reply.choices[0].model_extra["token_ids"]))

    with Served(engine, tokenizer) as served:
        slow = threading.Thread(target=ask, args=(served, "session-long", "task-long"))
        slow.start()
        deadline = time.monotonic() + 30
        while not engine.drawing and time.monotonic() < deadline:
            time.sleep(0.001)
        ask(served, "session-short", "task-short")
        assert slow.is_alive()  # the short reply came back while the long one was still being drawn
        slow.join()
        records = {key: served.session(key) for key in ("session-long", "session-short")}
    long_ids, short_ids = (engine.emitted[i] for i in (0, 1))
    assert len(long_ids) > 5 * len(short_ids)
    assert answered == [("session-short", short_ids), ("session-long", long_ids)]
    assert engine.steps < len(long_ids) + len(short_ids)  # the two were drawn side by side
    for key, ids in (("session-long", long_ids), ("session-short", short_ids)):
        (segment,) = records[key]["segments"]
        completion, mask = segment["completion_ids"], segment["loss_mask"]
        assert [t for t, m in zip(completion, mask) if m] == ids  # mask 1 exactly on what was sampled


def test_streaming_records_the_same_ids_as_not_streaming(tokenizer):
    engine = ScriptedEngine(tokenizer, {"task-T": ["Let me look at the files first.\n" + call("ls -la /testbed"),
                                                   "Done."]})
    tools = [BASH]
    with Served(engine, tokenizer) as served:
        results = {}
        for key, streams in (("plain", (False, False)), ("streamed", (True, True)), ("mixed", (True, False))):
            client = served.client(key)
            messages = [{"role": "user", "content": "task-T"}]
            replies = []
            for stream in streams:
                if stream:
                    chunks = list(client.chat.completions.create(model="kiln", messages=messages, tools=tools,
                                                                 stream=True, stream_options={"include_usage": True}))
                    message, finish, usage = assemble(chunks)
                else:
                    completion = client.chat.completions.create(model="kiln", messages=messages, tools=tools)
                    message = echo(completion.choices[0].message)
                    finish, usage = completion.choices[0].finish_reason, completion.usage.model_dump()
                replies.append((message, finish, usage))
                messages = messages + [message] + [{"role": "tool", "tool_call_id": c["id"], "content": "a.py"}
                                                   for c in message.get("tool_calls", [])]
            results[key] = replies, served.session(key)["segments"]
    (plain, (plain_segment,)), (streamed, (streamed_segment,)) = results["plain"], results["streamed"]
    (_, (mixed_segment,)) = results["mixed"]  # one session, a streamed turn then a plain one
    for field in ("prompt_ids", "completion_ids", "loss_mask", "messages"):  # logprobs name the engine call
        assert plain_segment[field] == streamed_segment[field] == mixed_segment[field], field
    for (a, a_finish, a_usage), (b, b_finish, b_usage) in zip(plain, streamed):
        assert a_finish == b_finish and a_usage == b_usage
        assert a["content"] == b["content"]
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in a.get("tool_calls", [])] \
            == [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in b.get("tool_calls", [])]
    assert streamed[0][1] == "tool_calls" and streamed[1][1] == "stop"
    assert streamed_segment["tito"] == {}
    # The prompt's ids come back only when asked (vLLM's return_token_ids): 64K of them are ~20 ms of JSON a turn.
    assert "prompt_token_ids" not in completion.model_extra and completion.choices[0].model_extra["token_ids"]


def assemble(chunks) -> tuple[dict, str, dict]:
    """A streamed reply put together as a client does: content and tool-call deltas joined by index."""
    content, calls, finish, usage = "", {}, None, None
    assert chunks[0].choices[0].delta.role == "assistant"
    for chunk in chunks:
        if chunk.usage is not None:
            assert chunk.choices == []  # the usage chunk comes last and alone
            usage = chunk.usage.model_dump()
            continue
        (choice,) = chunk.choices
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": call.id, "type": "function",
                                                  "function": {"name": call.function.name, "arguments": ""}})
            entry["function"]["arguments"] += call.function.arguments or ""
        finish = choice.finish_reason or finish
    assert chunks[-1].usage is not None
    message = {"role": "assistant", "content": content} | ({"tool_calls": list(calls.values())} if calls else {})
    return message, finish, usage


def test_the_anthropic_sdk_streaming_and_not_with_tool_use_blocks(tokenizer):
    engine = ScriptedEngine(tokenizer, {"task-M": ["I will list.\n" + call("ls"), "Two files: a.py, b.py."]})
    with Served(engine, tokenizer) as served:
        client = anthropic.Anthropic(base_url=served.server.base_url[: -len("/v1")], api_key="claude-1",
                                     max_retries=0, timeout=60)
        tools = [{"name": "bash", "description": "run a command", "input_schema": BASH["function"]["parameters"]}]
        messages = [{"role": "user", "content": "task-M: what is here?"}]
        first = client.messages.create(model="kiln", max_tokens=200, system="You fix code.", messages=messages,
                                       tools=tools)
        assert first.stop_reason == "tool_use"
        text, use = first.content
        assert text.text == "I will list." and use.name == "bash" and use.input == {"command": "ls"}
        messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                   "content": "a.py b.py"}]}]
        with client.messages.stream(model="kiln", max_tokens=200, system="You fix code.", messages=messages,
                                    tools=tools, extra_body={"return_token_ids": True}) as stream:
            deltas = [event.delta.text for event in stream if event.type == "content_block_delta"]
            second = stream.get_final_message()
        (segment,) = served.session("claude-1")["segments"]
    assert second.stop_reason == "end_turn" and second.content[0].text == "Two files: a.py, b.py." == "".join(deltas)
    assert second.usage.output_tokens == len(second.model_extra["token_ids"])
    assert second.usage.input_tokens == len(second.model_extra["prompt_token_ids"])
    assert [i for i, m in zip(segment["completion_ids"], segment["loss_mask"]) if m] == engine.emitted["task-M"]
    assert segment["messages"][0] == {"role": "system", "content": "You fix code."}
    assert segment["messages"][3] == {"role": "tool", "content": "a.py b.py"}
    assert segment["tito"] == {}


def test_side_queries_retries_branches_and_rewrites(tokenizer):
    engine = RuleEngine(tokenizer, [("main-task", "Step one.\n" + call("ls")), ("listing", "Step two, done."),
                                    ("Summarize", '{"summary": "listed"}'), ("compressed", "Resumed.")])
    system = {"role": "system", "content": "You are the agent."}
    with Served(engine, tokenizer) as served:
        client = served.client("qwen-like")
        main = [system, {"role": "user", "content": "main-task"}]
        first = echo(client.chat.completions.create(model="kiln", messages=main, tools=[BASH]).choices[0].message)
        main += [first, {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": "listing"}]
        # A side query beside the main thread (another system prompt, no tools), as qwen-code's classifiers send.
        side = client.chat.completions.create(model="kiln", messages=[
            {"role": "system", "content": "You summarize."}, {"role": "user", "content": "main-task: Summarize it"}])
        assert side.choices[0].message.content == '{"summary": "listed"}'
        second = client.chat.completions.create(model="kiln", messages=main, tools=[BASH])
        retried = client.chat.completions.create(model="kiln", messages=main, tools=[BASH])  # the same request again
        assert retried.choices[0].message.content == second.choices[0].message.content == "Step two, done."
        session = served.session("qwen-like")
        assert session["opened"] == ["first", "side"]  # the side query did not fork the main thread
        main_segment, side_segment = session["segments"]
        assert main_segment["turns"] == 2 and main_segment["tito"] == {} and side_segment["tito"] == {}
        assert side_segment["trains"] is False and main_segment["trains"] is True
        sampled = [i for i, m in zip(main_segment["completion_ids"], main_segment["loss_mask"]) if m]
        assert sampled == engine.emitted[0] + engine.emitted[3]  # the retry replaced the orphan reply (call 2)
        # The agent goes back to its first reply and answers it otherwise: a branch whose prompt is the recorded ids.
        other = main[:3] + [{"role": "tool", "tool_call_id": "x", "content": "compressed listing"}]
        client.chat.completions.create(model="kiln", messages=other, tools=[BASH])
        # A rewritten history (compression): a new segment rendered by the template.
        rewrite = [system, {"role": "user", "content": "main-task, compressed: ls showed a.py"}]
        client.chat.completions.create(model="kiln", messages=rewrite, tools=[BASH])
        session = served.session("qwen-like")
    assert session["opened"] == ["first", "side", "branch", "rewrite"]
    main_segment, _, branch, rewritten = session["segments"]
    turn_one = main_segment["prompt_ids"] + main_segment["completion_ids"][: len(engine.emitted[0])]
    assert branch["prompt_ids"] == turn_one  # exact ids, trained where they were sampled (mask 0 here)
    assert [i for i, m in zip(branch["completion_ids"], branch["loss_mask"]) if m] == engine.emitted[4]
    assert branch["trains"] and rewritten["trains"] and branch["tito"] == {} and rewritten["tito"] == {}
    assert "compressed: ls showed" in tokenizer.decode(rewritten["prompt_ids"])
    assert served.server.retries == 1


def test_an_engine_failure_after_the_stream_opened_is_an_error_chunk(tokenizer, monkeypatch):
    monkeypatch.setattr(agent_server, "STREAM_WAIT_SECONDS", 0.05)
    monkeypatch.setattr(agent_server, "KEEPALIVE_SECONDS", 0.05)
    server = agent_server.AgentServer(RuleEngine(tokenizer, [], fail=True), tokenizer, engines.Sampling())
    with server:
        client = openai.OpenAI(base_url=server.base_url, api_key="k", max_retries=0, timeout=30)
        anthropic_client = anthropic.Anthropic(base_url=server.base_url[: -len("/v1")], api_key="k2", max_retries=0)
        errors = []

        def ask(send):
            try:
                send()
            except Exception as e:  # noqa: BLE001 -- what the client raises is the thing checked
                errors.append(e)

        threads = [threading.Thread(target=ask, args=(lambda: list(client.chat.completions.create(
                       model="kiln", messages=[{"role": "user", "content": "x"}], stream=True)),)),
                   threading.Thread(target=ask, args=(lambda: list(anthropic_client.messages.create(
                       model="kiln", max_tokens=5, messages=[{"role": "user", "content": "x"}], stream=True)),))]
        for t in threads:
            t.start()
        time.sleep(0.3)  # both streams opened (headers and keep-alives sent) before the engine runs
        with pytest.raises(RuntimeError, match="engine died"):
            while len(server.pending.queue) < 2:
                time.sleep(0.01)
            server.step()
        for t in threads:
            t.join(timeout=30)
    assert len(errors) == 2 and all("generation failed" in str(e) for e in errors)


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce++-baseline"])
def test_a_session_counts_once_in_its_group_however_many_segments(name):
    rewards, group = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.5, 0.5]), torch.tensor([0, 0, 0, 0, 1, 1])
    unit = torch.tensor([7, 7, 7, 3, 4, 5])  # session 7 has three segments (a branch, a rewrite), the others one
    advantage = losses.unit_advantages(name, rewards, group, unit)
    once = losses.scalar_advantages(name, torch.tensor([1.0, 0.0, 0.5, 0.5]), torch.tensor([0, 0, 1, 1]))
    assert advantage.tolist() == pytest.approx([once[0].item()] * 3 + once[1:].tolist())
    per_segment = losses.scalar_advantages(name, rewards, group)
    assert per_segment[0].item() != pytest.approx(once[0].item())  # counting each segment skews the statistics


def test_bad_requests_are_refused_with_a_reason(tokenizer):
    engine = ScriptedEngine(tokenizer, {"task-C": ["x"]})
    with Served(engine, tokenizer) as served:
        unkeyed = urllib.request.Request(f"{served.server.base_url}/chat/completions", method="POST",
                                         data=json.dumps({"messages": [{"role": "user", "content": "task-C"}]})
                                         .encode())
        with pytest.raises(urllib.error.HTTPError, match="401"):
            urllib.request.urlopen(unkeyed)
        with pytest.raises(openai.BadRequestError, match="n=2"):
            served.client("k").chat.completions.create(model="kiln", n=2,
                                                       messages=[{"role": "user", "content": "task-C"}])
        with pytest.raises(openai.BadRequestError, match="context_length_exceeded"):
            served.client("k").chat.completions.create(model="kiln",
                                                       messages=[{"role": "user", "content": "task-C " * 3000}])
        served.server.end_session("gone")
        with pytest.raises(openai.APIStatusError, match="ended") as ended:
            served.client("gone").chat.completions.create(model="kiln",
                                                          messages=[{"role": "user", "content": "task-C"}])
        assert ended.value.status_code == 410
    assert engine.calls == 0


AGENT = """import json, os, subprocess, sys, time
import openai
row = json.load(open(sys.argv[1]))
mode = row["prompt"][-1]["content"]
client = openai.OpenAI(base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"], max_retries=0)
reply = client.chat.completions.create(model="kiln", messages=row["prompt"]).choices[0].message.content
if mode == "task-hang":
    child = subprocess.Popen(["sleep", "300"])  # a child in the agent's process group: killed with it
    open(sys.argv[3], "w").write(str(child.pid))
    time.sleep(300)
if mode == "task-crash":
    sys.exit(3)
open(sys.argv[2], "w").write("answer: " + reply)
"""


@pytest.mark.parametrize("keep_failed", [False, True])
def test_agents_that_crash_or_hang_end_their_sessions_and_never_block(tokenizer, tmp_path, keep_failed):
    script = tmp_path / "agent.py"
    script.write_text(AGENT)
    scripts = {m: [f"reply for {m}"] for m in ("task-ok", "task-crash", "task-hang")}
    engine = ScriptedEngine(tokenizer, scripts)
    rows = [{"data_source": "toy", "prompt": [{"role": "user", "content": m}], "extra_info": {"index": i},
             "reward_model": {"ground_truth": "SECRET"}} for i, m in enumerate(scripts)]
    command = f"{sys.executable} {script} {{row_file}} {{result}} {tmp_path / 'child.pid'}"
    start = time.monotonic()
    samples, metrics = rollout.external_agents(command, engine, tokenizer, rows, 1, engines.Sampling(),
                                               limits=rollout.AgentLimits(max_seconds=8), check=True,
                                               keep_failed=keep_failed)
    assert time.monotonic() - start < 30  # the hung agent was killed at its wall limit, not waited for
    by_row = {s.row["prompt"][0]["content"]: s for s in samples}
    assert set(by_row) == ({"task-ok", "task-crash", "task-hang"} if keep_failed else {"task-ok"})
    assert by_row["task-ok"].text == "answer: reply for task-ok" and by_row["task-ok"].info["agent_status"] == "ok"
    assert all(set(s.info) <= set(rollout.INFO_KEYS) for s in samples)  # info keys: the documented ones
    assert all(s.session and s.segments == 1 and s.segment == 0 for s in samples)  # one segment per session here
    if keep_failed:
        assert by_row["task-crash"].info["agent_status"] == "failed" and by_row["task-crash"].text == ""
        assert by_row["task-hang"].info["agent_status"] == "timeout"
    for s in samples:
        assert s.loss_mask == [1] * len(s.completion_ids) and s.completion_ids == engine.emitted[s.row["prompt"][0]
                                                                                                 ["content"]]
    assert metrics["agents/failed_frac"] == metrics["agents/timeout_frac"] == 1 / 3
    assert metrics["tools/tito_drift_frac"] == 0.0
    child = int((tmp_path / "child.pid").read_text())
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]


HARNESS_AGENT = """import json, os, sys
import openai
client = openai.OpenAI(base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"], max_retries=0)
client.chat.completions.create(model="kiln", messages=json.load(open(sys.argv[1]))["prompt"])
open(sys.argv[2], "w").write(sys.argv[3])
"""


def test_mixed_harnesses_take_turns_per_group_or_per_trajectory_and_a_row_can_name_its_own(tokenizer, tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(HARNESS_AGENT)
    command = f"{sys.executable} {script} {{row_file}} {{result}} {{harness}}"
    rows = [{"data_source": "toy", "prompt": [{"role": "user", "content": f"task-{i}"}], "extra_info": {"index": i},
             "reward_model": {"ground_truth": "x"}} for i in range(3)]
    rows[2]["extra_info"]["harness"] = "mine"
    engine = ScriptedEngine(tokenizer, {f"task-{i}": ["ok"] * 4 for i in range(3)})
    runs = {}
    for mix in (False, True):
        samples, metrics = rollout.external_agents(command, engine, tokenizer, rows, 2, engines.Sampling(),
                                                   first_group=1, harnesses=("codex", "claude-code"), mix_groups=mix)
        runs[mix] = sorted((s.group, s.text, s.info["harness"]) for s in samples)
    # groups 1, 2, 3 (run-wide ids): by group codex takes the odd ones; by trajectory (ids 2-7) they alternate
    assert runs[False] == [(1, "claude-code", "claude-code")] * 2 + [(2, "codex", "codex")] * 2 + [
        (3, "mine", "mine")] * 2
    assert runs[True] == [(1, "claude-code", "claude-code"), (1, "codex", "codex"), (2, "claude-code", "claude-code"),
                          (2, "codex", "codex"), (3, "mine", "mine"), (3, "mine", "mine")]
    assert metrics["agents/harness/codex/frac"] == metrics["agents/harness/mine/frac"] == 1 / 3
    assert metrics["agents/harness/codex/failed_frac"] == 0 and metrics["agents/harness/codex/segments_mean"] == 1
    with pytest.raises(ValueError, match="task-0|toy/0"):  # {harness} with nothing to fill it: refused before a start
        rollout.external_agents(command, engine, tokenizer, rows[:1], 1, engines.Sampling())
    with pytest.raises(ValueError, match="no {harness} placeholder"):
        agent_server.check_agent_cmd("agent {base_url}", ("codex",))


def test_agents_see_no_answers_and_get_their_placeholders(tmp_path, monkeypatch):
    row = {"data_source": "swebench",
           "prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "bug"}],
           "extra_info": {"index": "x", "solutions": ["SOLVED"]}, "reward_model": {"ground_truth": json.dumps({
               "instance_id": "x", "repo": "r", "version": "1", "base_commit": "abc", "image": "img", "patch": "GOLD",
               "test_patch": "TESTS", "FAIL_TO_PASS": ["t"], "PASS_TO_PASS": [], "eval_script": "e"})}}
    view = agent_server.agent_view(row)
    assert not {"GOLD", "TESTS", "SOLVED", "reward_model"} & set(re.findall(r"\w+", json.dumps(view)))
    assert view["extra_info"] == {"index": "x"} and view["prompt"] == row["prompt"]
    assert view["instance"] == {"instance_id": "x", "repo": "r", "version": "1", "base_commit": "abc",
                                "image": "img", "problem_statement": "bug"}
    monkeypatch.setenv("KILN_JUDGE_API_KEY", "judge-secret")
    monkeypatch.setenv("RANK", "1")
    with open(tmp_path / "log", "wb") as log:
        agent = agent_server.start_agent("echo {base_url} {api_key} {row_json} > {result}; env > {result}.env",
                                         "http://h:1/v1", row, 0, tmp_path, log)
        agent.process.wait()
    env = dict(line.split("=", 1) for line in Path(f"{agent.result}.env").read_text().splitlines() if "=" in line)
    assert "KILN_JUDGE_API_KEY" not in env and "RANK" not in env and env["OPENAI_API_KEY"] == agent.key
    url, key, rest = agent.completion().split(" ", 2)
    assert url == "http://h:1/v1" and key == agent.key and json.loads(rest) == view
    with pytest.raises(ValueError, match="unknown placeholder"):
        agent_server.check_agent_cmd("run --url {url}")
    with pytest.raises(ValueError, match="unknown placeholder"):  # refused before anything loads
        rl_run.check_args(train_grpo.Args(agent_cmd="run --url {url}", output_dir=str(tmp_path / "run")), 1)


def served_url(process) -> str:
    """The endpoint `serve.py` announces on its first line."""
    line = process.stdout.readline()
    match = re.search(r"at (http://\S+/v1)", line)
    assert match, line + process.stdout.read()
    return match.group(1)


@pytest.mark.slow
def test_rollout_serve_answers_a_real_client(tmp_path):
    model = tiny.make_tiny_model(tmp_path / "tiny", CORPUS)
    process = subprocess.Popen([sys.executable, str(ROOT / "serve.py"), "--model", str(model), "--port", "0",
                                "--max-new-tokens", "6"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                               env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        url = served_url(process)
        client = openai.OpenAI(base_url=url, api_key="eval-1", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == [str(model)]
        messages = [{"role": "user", "content": "def add(a, b):"}]
        reply = client.chat.completions.create(model=str(model), messages=messages, temperature=0,
                                               extra_body={"return_token_ids": True})
        with urllib.request.urlopen(url[:-3] + "/kiln/sessions/eval-1") as response:
            (segment,) = json.loads(response.read())["segments"]
    finally:
        process.kill()
        process.wait()
    tokenizer = policy.load_tokenizer(model)
    assert reply.model_extra["prompt_token_ids"] == chat.encode_prompt(tokenizer, messages) == segment["prompt_ids"]
    assert reply.choices[0].model_extra["token_ids"] == segment["completion_ids"]
    assert 1 <= len(segment["completion_ids"]) <= 6 and segment["loss_mask"] == [1] * len(segment["completion_ids"])
    assert reply.usage.completion_tokens == len(segment["completion_ids"])


TRAIN_AGENT = """import json, os, sys, time
import openai
row = json.load(open(sys.argv[1]))
client = openai.OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY come from kiln
messages = row["prompt"]
for turn in range(2):
    reply = client.chat.completions.create(model="kiln", messages=messages, max_tokens=100).choices[0].message
    messages = messages + [{"role": "assistant", "content": reply.content}, {"role": "user", "content": "Go on."}]
    time.sleep(int(os.environ["OPENAI_API_KEY"][-1], 16) / 8)  # agents end at different times, ranks too
open(sys.argv[2], "w").write("def f(x):\\n    return x\\n")
"""


@pytest.mark.slow
def test_grpo_step_with_an_external_agent_on_two_ranks(tmp_path):
    """train_grpo --agent-cmd under torchrun: each rank serves its own agents and the ranks tick together until the
    last agent anywhere has ended; the step trains on the recorded segments and logs the agents' metrics."""
    train, _ = data_prep.toy_rows(8, 0, seed=0, max_ops=1)
    task_rows.write_rows(train, tmp_path / "train.parquet")
    model = tiny.make_tiny_model(tmp_path / "tiny", CORPUS + [r["prompt"][-1]["content"] for r in train])
    (tmp_path / "agent.py").write_text(TRAIN_AGENT)
    run = subprocess.run([*ranks.torchrun(2, ROOT / "train_grpo.py"), "--model", str(model), "--data", str(tmp_path / "train.parquet"),
                          "--output-dir", str(tmp_path / "run"), "--prompts-per-step", "2", "--group-size", "2",
                          "--max-new-tokens", "8", "--total-steps", "1", "--lr", "1e-3", "--best-metric", "",
                          "--agent-cmd", f"{sys.executable} {tmp_path / 'agent.py'} {{row_file}} {{result}}"],
                         capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false"))
    assert run.returncode == 0, run.stderr[-3000:]
    (metrics,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert metrics["agents/requests"] == 4  # per rank: 2 agents x 2 requests, averaged over the ranks
    assert metrics["agents/failed_frac"] == metrics["agents/timeout_frac"] == 0
    assert metrics["response_length/max"] >= 1 and "actor/pg_loss" in metrics
    table = (ROOT / "docs" / "metrics.md").read_text()
    assert [k for k in metrics if k.startswith("agents/") and f"`{k}`" not in table] == []  # documented
