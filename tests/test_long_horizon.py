"""Trajectories as long as real SWE agents run (issue 47): 90 turns and ~64K tokens through kiln's own tool loop and
through the token-recording endpoint driven by the real OpenAI client over HTTP on 127.0.0.1 are check_tito-clean with
a loss mask exactly on the sampled tokens; `max_total_tokens` reached mid-episode ends the trajectory the documented
way; the pieces that keep a turn's cost flat (a template's suffix rendered after a window of the conversation, stop
strings matched on the reply's tail) give what the whole-history versions give. The engine is bench/long_horizon.py's
ForcedEngine (scripted replies: sampling 64K tokens with the tiny model would take minutes); the tokenizer and the
model folder are tiny.py's, built with room for 128K positions."""
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import chat  # noqa: E402
import engines  # noqa: E402
import long_horizon  # noqa: E402
import policy  # noqa: E402
import tiny  # noqa: E402
from transformers import AutoConfig  # noqa: E402

TURNS = 90


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    path, tokenizer = long_horizon.tiny_long_model(tmp_path_factory.mktemp("tiny-long"))
    return path, tokenizer, long_horizon.tool_outputs(tokenizer, TURNS, 660)


@pytest.fixture(scope="module")
def tool_loop(built):
    _, tokenizer, outputs = built
    engine = long_horizon.ForcedEngine(tokenizer, TURNS)
    sample, _ = long_horizon.tool_loop_trajectory(tokenizer, TURNS, outputs, engine=engine)
    return sample, engine


def sampled(ids: list[int], mask: list[int]) -> list[int]:
    return [i for i, m in zip(ids, mask) if m]


def test_the_tiny_model_has_room_for_the_trajectory(built, tool_loop):
    path, tokenizer, _ = built
    sample, _ = tool_loop
    assert len(sample.ids) >= 64_000
    assert AutoConfig.from_pretrained(path).max_position_embeddings >= len(sample.ids)
    assert tokenizer.model_max_length >= len(sample.ids)


def test_a_90_turn_64k_tool_loop_trajectory_is_exact(built, tool_loop):
    _, tokenizer, outputs = built
    sample, engine = tool_loop
    assert sample.info["turns"] == TURNS + 1 and sample.finish_reason == "stop"
    assert chat.check_tito(tokenizer, sample, sample.info["messages"], sample.info["tools"]) == {}
    # The loss mask is exactly the sampled tokens, every reply whole and in order; the rest is the template's.
    assert sampled(sample.completion_ids, sample.loss_mask) == [i for reply in engine.emitted for i in reply]
    assert all(lp == -1.0 for lp, m in zip(sample.engine_logprobs, sample.loss_mask) if m)
    assert all(lp == 0.0 for lp, m in zip(sample.engine_logprobs, sample.loss_mask) if not m)
    # The ids are the conversation's rendering message by message (chat.encode_conversation renders every prefix
    # whole): windowed suffixes changed nothing. Only the template's glue after the last turn is not the trajectory's.
    whole, mask = chat.encode_conversation(tokenizer, sample.info["messages"], tools=sample.info["tools"])
    n = len(sample.ids)
    assert whole[:n] == sample.ids and [0] * len(sample.prompt_ids) + sample.loss_mask == mask[:n]
    assert tokenizer.decode(whole[n:]) == "\n" and not any(mask[n:])
    assert [m["content"] for m in sample.info["messages"] if m["role"] == "tool"] == outputs[1: TURNS + 1]


def test_a_90_turn_64k_endpoint_session_is_exact(built, tool_loop):
    _, tokenizer, outputs = built
    engine = long_horizon.ForcedEngine(tokenizer, TURNS)
    segment, _, _, refused = long_horizon.endpoint_trajectory(tokenizer, TURNS, outputs, engine=engine)
    assert refused is None and len(segment.turns) == TURNS + 1 and segment.finish_reason == "stop"
    assert chat.check_tito(tokenizer, segment, segment.messages, segment.tools, open_turns=segment.open_turns) == {}
    assert sampled(segment.completion_ids, segment.loss_mask) == [i for reply in engine.emitted for i in reply]
    # The same conversation as the tool loop's, so the same ids and mask.
    sample, _ = tool_loop
    assert segment.ids == sample.ids and segment.loss_mask == sample.loss_mask


def boundaries(sample) -> list[int]:
    """The trajectory's length after each turn's tool output (where the next reply starts)."""
    ends, n = [], len(sample.prompt_ids)
    for k, m in enumerate(sample.loss_mask):
        if k and m and not sample.loss_mask[k - 1]:
            ends.append(n + k)
    return ends


def test_max_total_tokens_mid_episode_ends_on_the_policys_turn(built, tool_loop):
    """A tool output that does not fit ends the trajectory after the reply that called it, unanswered (finish
    max_total_tokens: --mask-truncated leaves it out of the loss); a reply that does not fit is cut at the limit,
    with the same finish, and kept untrained (half a turn). Nothing after the last sampled token is appended;
    check_tito stays clean."""
    _, tokenizer, outputs = built
    full, engine = tool_loop
    start = boundaries(full)[44]  # where reply 46 begins
    reply = len(engine.emitted[45])
    for limit, whole_reply in ((start + reply + 50, True), (start + 5, False)):
        forced = long_horizon.ForcedEngine(tokenizer, TURNS)
        sample, _ = long_horizon.tool_loop_trajectory(tokenizer, TURNS, outputs, max_total_tokens=limit, engine=forced)
        assert sample.finish_reason == "max_total_tokens" and len(sample.ids) <= limit
        assert sample.info["turns"] == 46 and sample.info["messages"][-1]["role"] == "assistant"
        # ends on the policy's own token (no tool output, no header after it); a reply cut by the budget is half a
        # turn: kept for check_tito, never trained
        assert sample.completion_ids[-1] == forced.emitted[-1][-1]
        assert sample.loss_mask[-1] == (1 if whole_reply else 0)
        trained = forced.emitted if whole_reply else forced.emitted[:-1]
        assert sampled(sample.completion_ids, sample.loss_mask) == [i for r in trained for i in r]
        assert forced.emitted[-1] == engine.emitted[45][: reply if whole_reply else 5]  # the turn's budget: the room
        assert sample.ids == full.ids[: len(sample.ids)]
        assert chat.check_tito(tokenizer, sample, sample.info["messages"], sample.info["tools"],
                               open_turns=() if whole_reply else (len(sample.info["messages"]) - 1,)) == {}


def test_max_total_tokens_at_the_endpoint_cuts_the_reply_then_refuses(built, tool_loop):
    """The endpoint gives a reply only the room left (finish "length" on the wire, the turn left open; the segment
    ends with finish max_total_tokens and the cut reply is kept but not trained, as in the tool loop); a request with
    no room is refused with context_length_exceeded, records nothing, and ends its segment the same way."""
    _, tokenizer, outputs = built
    full, engine = tool_loop
    start = boundaries(full)[44]
    forced = long_horizon.ForcedEngine(tokenizer, TURNS)
    segment, _, _, refused = long_horizon.endpoint_trajectory(tokenizer, TURNS, outputs, max_total_tokens=start + 5,
                                                              engine=forced)
    assert refused is None and len(segment.turns) == 46 and segment.finish_reason == "max_total_tokens"
    assert len(segment.ids) == start + 5 and segment.ids == full.ids[: start + 5]
    assert segment.loss_mask[-5:] == [0] * 5 and segment.loss_mask[-6] == 0  # the cut reply: half a turn, untrained
    assert sampled(segment.completion_ids, segment.loss_mask) == [i for r in forced.emitted[:-1] for i in r]
    assert segment.open_turns == [len(segment.messages) - 1]
    assert chat.check_tito(tokenizer, segment, segment.messages, segment.tools, open_turns=segment.open_turns) == {}
    forced = long_horizon.ForcedEngine(tokenizer, TURNS)
    segment, _, _, refused = long_horizon.endpoint_trajectory(tokenizer, TURNS, outputs, max_total_tokens=start,
                                                              engine=forced)
    assert refused == "context_length_exceeded" and len(segment.turns) == 45
    assert segment.finish_reason == "max_total_tokens"  # as the tool loop's: --mask-truncated leaves it out
    assert segment.ids == full.ids[: len(segment.ids)] and len(forced.emitted) == 45


@pytest.mark.parametrize("chat_format", ["qwen", "llama3"])
def test_windowed_suffixes_are_the_whole_historys(tmp_path, chat_format):
    """Both of tiny.py's chat formats render locally, and each turn's suffix ids after the window (tool results one
    or two at a time, with special-token text, and a user message) are those rendered after the whole history."""
    tokenizer = policy.load_tokenizer(tiny.make_tiny_model(tmp_path, long_horizon.CORPUS, chat_format=chat_format))
    eot = chat.end_of_turn(tokenizer)
    assert chat.renders_locally(tokenizer, [long_horizon.BASH])
    messages = long_horizon.long_row()["prompt"]
    for k in range(12):
        messages = messages + [{"role": "assistant", "content": long_horizon.reply_text(k, False)}]
        new = ([{"role": "tool", "content": f"output {k} {eot}"}] if k % 3 == 0 else
               [{"role": "tool", "content": f"a {k}"}, {"role": "tool", "content": f"b {k}"}] if k % 3 == 1 else
               [{"role": "user", "content": f"go on {k}"}])
        after, cut = chat._suffix_text(tokenizer, messages, new, [long_horizon.BASH], eot, True)
        plain = chat.tool_spans(tokenizer, messages + new, [long_horizon.BASH], True, after, first=len(messages))
        whole = chat.encode_text(tokenizer, after, plain, start=cut)[0]
        assert chat.template_suffix_ids(tokenizer, messages, new, [long_horizon.BASH], eot) == whole
        templates = after[cut:].count(eot) - sum(m["content"].count(eot) for m in new)  # a tool's eot text is plain
        assert whole.count(tokenizer.convert_tokens_to_ids(eot)) == templates
        messages = messages + new


def test_a_template_that_is_not_local_is_rendered_whole(built):
    """A template that numbers tool results by their place in the conversation fails the locality probe: its suffixes
    are rendered after the whole history, and check_tito places its turns exactly."""
    _, tokenizer, _ = built
    numbered = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    numbered.chat_template = tokenizer.chat_template.replace(
        "{{ '\\n<tool_response>\\n' + render", "{{ '\\n<tool_response ' + (loop.index | string) + '>\\n' + render")
    assert numbered.chat_template != tokenizer.chat_template
    assert chat.renders_locally(tokenizer, [long_horizon.BASH]) and not chat.renders_locally(numbered, None)
    messages = long_horizon.long_row()["prompt"]
    for k in range(4):
        messages = messages + [{"role": "assistant", "content": long_horizon.reply_text(k, False)},
                               {"role": "tool", "content": f"output {k}"}]
    new = [{"role": "tool", "content": "the last output"}]
    history = messages + [{"role": "assistant", "content": "done"}]
    suffix = chat.template_suffix_ids(numbered, history, new, None, "<|im_end|>")
    after = chat.render(numbered, history + new, None, True)
    cut = chat.render(numbered, history, None, False).rindex("<|im_end|>") + len("<|im_end|>")
    assert suffix == numbered(after[cut:], add_special_tokens=False)["input_ids"]
    assert f"<tool_response {len(history) + 1}>" in numbered.decode(suffix)
    ids, mask = chat.encode_conversation(numbered, history)
    ids, mask = ids[:-1], mask[:-1]  # a trajectory ends on the last turn's end-of-turn token, not the glue after it
    prompt = chat.encode_prompt(numbered, messages[:2])
    sample = type("Traj", (), {"ids": ids, "prompt_ids": prompt, "loss_mask": mask[len(prompt):]})()
    assert chat.check_tito(numbered, sample, history) == {}
    bad = type("Traj", (), {"ids": ids, "prompt_ids": prompt, "loss_mask": [0] + mask[len(prompt) + 1:]})()
    assert "mask" in chat.check_tito(numbered, bad, history)


def test_stop_strings_found_on_the_tail_as_on_the_whole_reply(built):
    """engines.completes_stop decodes only the reply's tail: at every step it says what decoding the whole reply says,
    on random replies over the whole vocabulary (partial UTF-8 tokens, special tokens) and stop strings of one to
    several characters, multi-byte ones included; the endpoint finds the token that completed a reply's earliest stop
    string by bisection."""
    _, tokenizer, _ = built
    rng = random.Random(0)
    stops = ["</code>", "ab", "\n\n", "é€", ")"]
    found = 0
    for _ in range(60):
        tokens = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 80))]
        for stop in ([rng.choice(stops)], stops):
            whole = next((k for k in range(1, len(tokens) + 1) if any(
                s in tokenizer.decode(tokens[:k], skip_special_tokens=False) for s in stop)), None)
            tail = next((k for k in range(1, len(tokens) + 1) if engines.completes_stop(tokenizer, tokens[:k], stop)),
                        None)
            assert tail == whole
            found += whole is not None
            # The endpoint's cut of a finished reply at its earliest stop string: the first token whose prefix holds it.
            cut = chat.stop_cut(tokenizer, tokens, stop)
            assert (cut is None) == (whole is None)
            if cut is not None:
                k, before, string = cut
                prefix = [tokenizer.decode(tokens[:n], skip_special_tokens=False) for n in (k - 1, k)]
                assert prefix[1].startswith(before + string) and not prefix[0].startswith(before + string)
    assert found > 10  # the replies do hit the stop strings
