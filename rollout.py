"""Producing samples: single- and multi-turn rollouts, token-in-token-out, loss masks, tool calls and toolboxes.

Token-in-token-out: prompts go to the engine as token ids, and a trajectory is the prompt ids, then generated ids
and (multi-turn) the chat template's ids for tool results, in turn. Nothing generated is ever decoded and encoded
again on the way to the trainer: text is decoded for the reward and the tools only. The loss mask is 1 exactly on
the tokens the policy generated. `check_tito` compares a trajectory with the template's rendering of its messages.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import re
import shlex
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal

import torch
import torch.distributed as dist
import tyro
from tqdm import tqdm

import containers
import data_prep
import merge
import policy
import sandbox
from engines import Engine, HFEngine, Sampling, VLLMEngine

SWE_CONTAINER = containers.ContainerLimits(timeout=60.0, output_cap=10_000)  # an agent's container; see README
SWE_MAX_COMMAND_SECONDS = 600  # the most a `bash` call may ask for (README's budget table)
TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
TOOL_OUTPUT_MARK = "\ue000kiln tool output\ue000"  # a private-use character no template or tool writes


@dataclass
class Sample:
    """One trajectory: the prompt, everything after it, and what the trainer needs to learn from it."""

    prompt_ids: list[int]
    completion_ids: list[int]  # generated tokens (and, multi-turn, tool/user tokens between turns)
    loss_mask: list[int]  # per completion token: 1 = produced by the policy, 0 = anything else
    engine_logprobs: list[float]  # per completion token; 0.0 where loss_mask is 0
    row: dict
    group: int  # samples of the same prompt share a group id
    text: str = ""  # decoded completion, for the reward
    finish_reason: str = ""
    reward: float = 0.0
    advantage: float = 0.0  # the sample's share of the signal, set by the trainer from the rewards of its batch
    info: dict = field(default_factory=dict)

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids


def end_of_turn(tokenizer, override: str | None = None) -> str:
    """The token that closes an assistant turn: `override` (checked to be one token), else the first special token
    the chat template writes after an assistant message's content (<|im_end|> in ChatML/Qwen, <|eot_id|> in Llama 3,
    <end_of_turn> in Gemma, </s> in Mistral). It stops generation, ends the loss mask and closes a tool-calling turn."""
    if override is not None:
        if len(tokenizer(override, add_special_tokens=False)["input_ids"]) != 1:
            raise ValueError(f"--end-of-turn {override!r} is not one token of the tokenizer")
        return override
    probe = "kiln end-of-turn probe"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": probe}],
                                         tokenize=False)
    after = text[text.rindex(probe) + len(probe):]
    special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    found = next((i for i in tokenizer(after, add_special_tokens=False)["input_ids"] if i in special), None)
    if found is None:
        raise ValueError(f"the chat template writes no special token after an assistant message (it writes {after!r}): "
                         "name the token that ends a turn with --end-of-turn")
    return tokenizer.convert_ids_to_tokens(found)


def encode_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """Chat messages -> prompt token ids, ending with the assistant header (tokenized once, never again)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_conversation(tokenizer, messages: list[dict], eot: str | None = None) -> tuple[list[int], list[int]]:
    """Chat messages -> (ids, loss mask), 1 exactly on assistant tokens (content and its end-of-turn token `eot`,
    default: end_of_turn's).

    Each message is tokenized alone as the text the template appends for it (tool output as plain text), so a
    conversation's ids are the concatenation a multi-turn rollout builds turn by turn: the same ids for training and
    for generation.
    """
    eot_id = tokenizer.convert_tokens_to_ids(eot or end_of_turn(tokenizer))
    ids, mask, rendered = [], [], ""
    for i, message in enumerate(messages):
        if message["role"] == "tool" and messages[i + 1 :] and messages[i + 1]["role"] == "tool":
            continue  # consecutive tool messages share one user turn: rendered together, with the last of them
        if message["role"] == "assistant":
            header = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
            glue = tokenizer(header[len(rendered):], add_special_tokens=False)["input_ids"]
            ids += glue
            mask += [0] * len(glue)
            rendered = header
        text = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not text.startswith(rendered):
            raise ValueError(f"chat template does not render message {i} as an extension of the ones before it")
        plain = tool_spans(tokenizer, messages[: i + 1], None, False, text) if message["role"] == "tool" else []
        piece, _ = encode_text(tokenizer, text, plain, start=len(rendered))
        if message["role"] == "assistant":
            # Trained: everything up to and including the end-of-turn token; the template's trailing glue is not.
            end = len(piece)
            while end > 0 and piece[end - 1] != eot_id:
                end -= 1
            mask += [1] * end + [0] * (len(piece) - end)
        else:
            mask += [0] * len(piece)
        ids += piece
        rendered = text
    return ids, mask


def tool_spans(tokenizer, messages: list[dict], schemas: list[dict] | None, add_generation_prompt: bool, text: str,
               first: int = 0) -> list[tuple[int, int]]:
    """Character spans in `text`, the template's rendering of `messages`, of the tool outputs (messages from index
    `first` on) that hold a special token's text; each found by rendering its message with the output replaced by a
    marker. Outputs without special-token text need no span: they tokenize the same either way."""
    specials = [token.content for token in tokenizer.added_tokens_decoder.values() if token.special]
    spans = []
    for k in range(first, len(messages)):
        message = messages[k]
        if message["role"] != "tool" or not any(t in _content_text(message["content"]) for t in specials):
            continue
        marked = {**message, "content": _with_text(message["content"], TOOL_OUTPUT_MARK)}
        head, _, tail = render(tokenizer, messages[:k] + [marked] + messages[k + 1 :], schemas,
                               add_generation_prompt).partition(TOOL_OUTPUT_MARK)
        if TOOL_OUTPUT_MARK in tail or len(head) + len(tail) > len(text) or not (
                text.startswith(head) and text.endswith(tail)):
            raise ValueError(f"the chat template does not render the output of tool message {k} where its marker goes")
        spans.append((len(head), len(text) - len(tail)))
    return spans


def encode_text(tokenizer, text: str, plain: list[tuple[int, int]],
                start: int = 0) -> tuple[list[int], list[tuple[int, int]]]:
    """Ids and character offsets (into `text`) of text[start:] as the tokenizer makes them, except that special tokens
    inside the character spans `plain` are ordinary text: a tool cannot end a turn or open one by printing the
    template's tokens. The tokenizer splits at special tokens anyway, so outside those spans nothing changes."""
    encoded = tokenizer(text[start:], add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"], [(a + start, b + start) for a, b in encoded["offset_mapping"]]
    special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    in_plain = [any(lo <= a < hi for lo, hi in plain) for a, _ in offsets]
    if not any(i in special and inside for i, inside in zip(ids, in_plain)):
        return ids, offsets
    out_ids, out_offsets, pos = [], [], start
    template_tokens = [(i, (a, b)) for i, (a, b), inside in zip(ids, offsets, in_plain) if i in special and not inside]
    for token, (a, b) in template_tokens + [(None, (len(text), len(text)))]:
        if a > pos:  # the text between two of the template's special tokens, special-token text in it split up
            piece = tokenizer(text[pos:a], add_special_tokens=False, split_special_tokens=True,
                              return_offsets_mapping=True)
            out_ids += piece["input_ids"]
            out_offsets += [(x + pos, y + pos) for x, y in piece["offset_mapping"]]
        if token is not None:
            out_ids.append(token)
            out_offsets.append((a, b))
        pos = b
    return out_ids, out_offsets


def _content_text(content) -> str:
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content or [])


def _with_text(content, text: str):
    """The content with its text replaced by `text` (its image parts kept)."""
    if isinstance(content, str):
        return text
    return [{"type": "text", "text": text} if p.get("type") == "text" else p for p in content]


def load_rows_within(source: str, tokenizer, max_prompt_tokens: int, verbose: bool = True,
                     tools: str = "none") -> list[dict]:
    """`data_prep.load_rows(source)` less the rows whose prompt, as the rollout renders it (with the signatures of the
    toolbox `tools`), is longer than `max_prompt_tokens` (counted, and printed when verbose); a source with none left
    is refused."""
    rows = data_prep.load_rows(source)
    check_swe_rows(rows, tools, source)
    schemas = TOOL_SCHEMAS[tools] if tools != "none" else None
    kept = [r for r in rows if len(tokenizer(render(tokenizer, r["prompt"], schemas, add_generation_prompt=True),
                                             add_special_tokens=False)["input_ids"]) <= max_prompt_tokens]
    if not kept:
        raise SystemExit(f"{source}: no row has a prompt within --max-prompt-tokens {max_prompt_tokens}")
    if len(kept) < len(rows) and verbose:
        print(f"{source}: skipped {len(rows) - len(kept)} of {len(rows)} rows longer than {max_prompt_tokens} tokens")
    return kept


def collect(engine: Engine, tokenizer, rows: list[dict], group_size: int, sampling: Sampling, tools: str = "none",
            limits: AgentLimits | None = None, first_group: int = 0, check: bool = False,
            eot: str | None = None) -> tuple[list[Sample], dict]:
    """`group_size` samples of each row: single-turn, or multi-turn agent rollouts with the toolbox `tools` names
    (TOOLBOXES) whose turns end with the token `eot` (default: end_of_turn's). check: compare every trajectory with
    the chat template's rendering of its messages; the drifting fraction goes to the metrics (tools/tito_drift_frac)
    and the first drift to the console: a tokenization the template would not produce is logged, not fatal. Returns
    samples and this rank's metrics."""
    if tools == "none":
        return single_turn(engine, tokenizer, rows, group_size, sampling, first_group)
    eot = eot or end_of_turn(tokenizer)
    samples, metrics = multi_turn(engine, tokenizer, rows, group_size, sampling, TOOLBOXES[tools],
                                  limits or AgentLimits(), first_group, eot)
    if check:
        drifts = [(s, check_tito(tokenizer, s, s.info["messages"], s.info["tools"], eot)) for s in samples]
        metrics["tools/tito_drift_frac"] = sum(bool(d) for _, d in drifts) / len(drifts)
        first = next(((s, d) for s, d in drifts if d), None)
        if first is not None:
            rank = dist.get_rank() if dist.is_initialized() else 0
            tqdm.write(f"rank {rank}, task {data_prep.row_id(first[0].row)}: {first[1][0]}")
    return samples, metrics


def single_turn(engine: Engine, tokenizer, rows: list[dict], group_size: int, sampling: Sampling,
                first_group: int = 0) -> tuple[list[Sample], dict]:
    """Each row's prompt sampled `group_size` times, one completion each. Returns samples and metrics."""
    start = time.perf_counter()
    prompts = [encode_prompt(tokenizer, row["prompt"]) for row in rows]
    repeated = [p for p in prompts for _ in range(group_size)]
    completions = engine.generate(repeated, sampling)
    samples = []
    for i, (prompt, completion) in enumerate(zip(repeated, completions)):
        samples.append(Sample(
            prompt_ids=prompt,
            completion_ids=completion.token_ids,
            loss_mask=[1] * len(completion.token_ids),
            engine_logprobs=completion.logprobs,
            row=rows[i // group_size],
            group=first_group + i // group_size,
            text=tokenizer.decode(completion.token_ids, skip_special_tokens=True),
            finish_reason=completion.finish_reason,
        ))
    seconds = time.perf_counter() - start
    new_tokens = sum(len(c.token_ids) for c in completions)
    metrics = {
        "rollout/seconds": seconds,
        "rollout/tokens_per_s": new_tokens / max(seconds, 1e-9),
        "rollout/truncated_frac": sum(c.finish_reason == "length" for c in completions) / max(1, len(completions)),
    }
    return samples, metrics


# Multi-turn agent rollouts: generate a turn, parse its Qwen2.5 tool calls, run them concurrently, append the tool
# messages as the chat template formats them (only that suffix is tokenized, never the trajectory), continue.


@dataclass
class ToolResult:
    text: str
    images: list[bytes] = field(default_factory=list)  # PNG bytes, shown to the model as image parts
    error: bool = False  # the call failed (bad arguments, exception, timeout): counted in the metrics
    stop: bool = False  # the trajectory ends after this call (swe's `submit`), on the policy's own turn


@dataclass
class ToolBox:
    """One trajectory's tools: name -> function(arguments) -> ToolResult, their JSON signatures for the prompt,
    and what releases their state when the trajectory ends. `info` goes into the sample's info once `close` has run;
    a "completion" there is what the reward grades instead of the assistant's text (swe: the container's diff)."""

    tools: dict[str, Callable[[dict], ToolResult]]
    schemas: list[dict]
    close: Callable[[], None] = lambda: None
    info: dict = field(default_factory=dict)


@dataclass
class AgentLimits:
    max_turns: int = 4  # assistant turns per trajectory
    max_total_tokens: int = 4096  # prompt + everything after it
    max_tool_response_tokens: int = 512  # longer tool outputs are cut and marked
    max_seconds: float = 1800.0  # wall clock per trajectory, checked before each turn's tools run


def parse_tool_calls(text: str, known: set[str]) -> list[dict | str]:
    """Qwen2.5 tool calls in an assistant turn, in order: {"name", "arguments"} for a valid call, an error message
    (str) for a malformed one, so the model is told instead of the rollout crashing."""
    calls: list[dict | str] = []
    for body in TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(f"Error: the tool call is not valid JSON ({e.msg} at position {e.pos}): {body.strip()[:200]}")
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append('Error: a tool call must be a JSON object {"name": <string>, "arguments": <object>}')
            continue
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            calls.append(f"Error: the arguments of {call['name']!r} must be a JSON object")
        elif call["name"] not in known:
            calls.append(f"Error: unknown tool {call['name']!r}; available: {', '.join(sorted(known))}")
        else:
            calls.append({"name": call["name"], "arguments": arguments})
    if text.count("<tool_call>") > len(TOOL_CALL.findall(text)):
        calls.append("Error: a <tool_call> was opened but not closed with </tool_call>")
    return calls


def render(tokenizer, messages: list[dict], schemas: list[dict] | None, add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tools=schemas or None, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def template_suffix_ids(tokenizer, messages: list[dict], new_messages: list[dict],
                        schemas: list[dict] | None, eot: str | None = None) -> list[int]:
    """Ids the chat template appends after a trajectory that ends on its last assistant turn's end-of-turn token `eot`
    (default: end_of_turn's), for `new_messages` plus the next assistant header: the template's glue after that token,
    then the new ones (tool output tokenized as plain text)."""
    eot = eot or end_of_turn(tokenizer)
    before = render(tokenizer, messages, schemas, add_generation_prompt=False)
    after = render(tokenizer, messages + new_messages, schemas, add_generation_prompt=True)
    if not after.startswith(before):
        raise ValueError("the chat template does not render the new messages as an extension of the conversation")
    cut = before.rindex(eot) + len(eot)  # the trajectory ends right after this token
    plain = tool_spans(tokenizer, messages + new_messages, schemas, True, after, first=len(messages))
    return encode_text(tokenizer, after, plain, start=cut)[0]


def truncate_tool_text(tokenizer, text: str, max_tokens: int) -> tuple[str, bool]:
    ids = tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]  # as it will be encoded
    if len(ids) <= max_tokens:
        return text, False
    return tokenizer.decode(ids[:max_tokens]) + f"\n[... truncated {len(ids) - max_tokens} tokens]", True


def tool_message(result: ToolResult) -> dict:
    if not result.images:
        return {"role": "tool", "content": result.text}
    parts = [{"type": "text", "text": result.text}] + [{"type": "image"}] * len(result.images)
    return {"role": "tool", "content": parts}


def call_tool(box: ToolBox, call: dict | str) -> tuple[ToolResult, float]:
    """One call (or a parse error) -> its result and wall seconds; a tool's exception becomes an error result."""
    if isinstance(call, str):
        return ToolResult(call, error=True), 0.0
    start = time.perf_counter()
    try:
        result = box.tools[call["name"]](call["arguments"])
    except Exception as e:  # a tool bug must not kill the rollout: the model sees it, the metrics count it
        result = ToolResult(f"Error: {call['name']} raised {type(e).__name__}: {e}", error=True)
    return result, time.perf_counter() - start


@dataclass
class Trajectory:
    row: dict
    group: int
    box: ToolBox
    messages: list[dict]
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    images: list[bytes] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_seconds: float = 0.0
    truncated_responses: int = 0
    finish_reason: str = ""  # "stop", "submit", "length" (a turn ran out of tokens), "max_turns", "max_total_tokens",
    # "max_seconds"
    started: float = field(default_factory=time.monotonic)
    seconds: float = 0.0  # wall clock from the start to the end of its last turn

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


def multi_turn(engine: Engine, tokenizer, rows: list[dict], group_size: int, sampling: Sampling,
               new_toolbox: Callable[[dict], ToolBox], limits: AgentLimits = AgentLimits(),
               first_group: int = 0, eot: str | None = None) -> tuple[list[Sample], dict]:
    """Multi-turn rollout: each row's prompt `group_size` times; every turn is generated for all live trajectories
    in one engine call, then all their tool calls run concurrently; a turn that ends with the token `eot` (default:
    end_of_turn's) can call tools. Returns samples (info: messages, images, tool schemas, turn and tool counts) and
    metrics. Toolboxes are always closed, each even when another's close fails. A prompt that leaves no room under
    max_total_tokens is refused (ValueError) before anything is generated."""
    start = time.perf_counter()
    eot = eot or end_of_turn(tokenizer)
    trajectories: list[Trajectory] = []
    try:
        for i in range(len(rows) * group_size):
            row = rows[i // group_size]
            box = new_toolbox(row)
            trajectories.append(Trajectory(row, first_group + i // group_size, box, list(row["prompt"]), []))
            prompt_text = render(tokenizer, row["prompt"], box.schemas, add_generation_prompt=True)
            trajectories[-1].prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
            if len(trajectories[-1].prompt_ids) >= limits.max_total_tokens:
                task = data_prep.row_id(row) if "extra_info" in row else f"rows[{i // group_size}]"
                raise ValueError(f"{task}: the prompt is {len(trajectories[-1].prompt_ids)} tokens with the tool "
                                 f"signatures, no room for an answer within max_total_tokens {limits.max_total_tokens}")
        with ThreadPoolExecutor(max_workers=16) as pool:
            while _any_live_anywhere(live := [traj for traj in trajectories if not traj.finish_reason]):
                _agent_turn(engine, tokenizer, live, sampling, limits, eot, pool)
    finally:
        close_all([traj.box for traj in trajectories])
    samples = [Sample(
        prompt_ids=traj.prompt_ids, completion_ids=traj.completion_ids, loss_mask=traj.loss_mask,
        engine_logprobs=traj.logprobs, row=traj.row, group=traj.group, finish_reason=traj.finish_reason,
        text=traj.box.info.pop("completion", "\n".join(
            m["content"] for m in traj.messages[len(traj.row["prompt"]):] if m["role"] == "assistant")),
        info={"messages": traj.messages, "images": traj.images, "tools": traj.box.schemas, "turns": traj.turns,
              "tool_calls": traj.tool_calls, "tool_errors": traj.tool_errors, "agent_seconds": traj.seconds}
        | traj.box.info)
        for traj in trajectories]
    seconds = time.perf_counter() - start
    n = max(1, len(trajectories))  # a rank can run a round without rows of its own
    generated = sum(sum(traj.loss_mask) for traj in trajectories)
    metrics = {
        "rollout/seconds": seconds,
        "rollout/tokens_per_s": generated / max(seconds, 1e-9),
        "rollout/truncated_frac": sum(traj.finish_reason not in ("stop", "submit") for traj in trajectories) / n,
        "tools/turns_mean": sum(traj.turns for traj in trajectories) / n,
        "tools/calls_mean": sum(traj.tool_calls for traj in trajectories) / n,
        "tools/errors_mean": sum(traj.tool_errors for traj in trajectories) / n,
        "tools/seconds": sum(traj.tool_seconds for traj in trajectories),
        "tools/truncated_responses": sum(traj.truncated_responses for traj in trajectories),
        "tools/agent_seconds_mean": sum(traj.seconds for traj in trajectories) / n,
    }
    if any("container_seconds" in traj.box.info for traj in trajectories):
        metrics["swe/container_seconds"] = sum(traj.box.info.get("container_seconds", 0.0) for traj in trajectories)
        metrics["swe/diff_errors"] = sum("diff_error" in traj.box.info for traj in trajectories)
    for reason in ("length", "max_turns", "max_total_tokens", "max_seconds", "submit"):
        metrics[f"rollout/finish_{reason}_frac"] = sum(traj.finish_reason == reason for traj in trajectories) / n
    return samples, metrics


def close_all(boxes: list[ToolBox]) -> None:
    """Close every toolbox even when some fail or a Ctrl-C interrupts one; the first failure is raised afterwards.
    (Containers that a second Ctrl-C leaves go at the trainer's exit, their TTL or the next start's sweep.)"""
    failure = None
    for box in boxes:
        try:
            box.close()
        except BaseException as e:  # noqa: B036 -- the rest must still be closed; re-raised below
            failure = failure or e
    if failure is not None:
        raise failure


def _any_live_anywhere(live: list) -> bool:
    """Whether any rank still has a live trajectory. Under torchrun every rank must make the same number of engine
    calls (HFEngine's load_weights streams FSDP parameters; a TP-sharded vLLM engine is a collective), so ranks turn
    together."""
    flag = torch.tensor(float(bool(live)))
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() > 0


def _agent_turn(engine: Engine, tokenizer, live: list[Trajectory], sampling: Sampling, limits: AgentLimits,
                eot: str, pool: ThreadPoolExecutor) -> None:
    if not live:  # other ranks still turn: one throwaway token keeps this rank's collectives in step
        _generate(engine, [[tokenizer.pad_token_id]], dataclasses.replace(sampling, max_new_tokens=1), [[]])
        return
    budget = min(max(limits.max_total_tokens - traj.length for traj in live), sampling.max_new_tokens)
    turn_sampling = dataclasses.replace(sampling, max_new_tokens=max(budget, 1))
    completions = _generate(engine, [traj.prompt_ids + traj.completion_ids for traj in live], turn_sampling,
                            [traj.images for traj in live])
    pending, eot_id = [], tokenizer.convert_tokens_to_ids(eot)
    for traj, c in zip(live, completions):
        room = limits.max_total_tokens - traj.length
        ids, logprobs = c.token_ids[:room], c.logprobs[:room]  # the batch budget follows the longest trajectory
        traj.completion_ids += ids
        traj.loss_mask += [1] * len(ids)
        traj.logprobs += logprobs
        traj.turns += 1
        ended = bool(ids) and ids[-1] == eot_id  # only a turn closed by the template's token can take tool results
        stopped = ended or (c.finish_reason == "stop" and len(ids) == len(c.token_ids))
        content = tokenizer.decode(ids[:-1] if stopped else ids, skip_special_tokens=False)
        traj.messages.append({"role": "assistant", "content": content})
        calls = parse_tool_calls(content, set(traj.box.tools)) if ended else []
        traj.seconds = time.monotonic() - traj.started
        if not calls:
            cut = len(ids) < len(c.token_ids)
            traj.finish_reason = "stop" if stopped else ("max_total_tokens" if cut else "length")
        elif traj.turns >= limits.max_turns:
            traj.finish_reason = "max_turns"
        elif traj.seconds >= limits.max_seconds:
            traj.finish_reason = "max_seconds"
        else:
            pending.append((traj, [pool.submit(call_tool, traj.box, call) for call in calls]))
    for traj, futures in pending:
        new_messages, submitted = [], False
        for future in futures:
            result, seconds = future.result()
            submitted |= result.stop
            text, cut = truncate_tool_text(tokenizer, result.text, limits.max_tool_response_tokens)
            result.text = text
            new_messages.append(tool_message(result))
            traj.images += result.images
            traj.tool_calls += 1
            traj.tool_errors += result.error
            traj.tool_seconds += seconds
            traj.truncated_responses += cut
        traj.seconds = time.monotonic() - traj.started
        if submitted:  # end on the policy's own turn: nothing after it is learned from
            traj.finish_reason = "submit"
            continue
        ids = template_suffix_ids(tokenizer, traj.messages, new_messages, traj.box.schemas, eot)
        if traj.length + len(ids) >= limits.max_total_tokens:  # no room left to answer: end on the policy's own turn
            traj.finish_reason = "max_total_tokens"
            continue
        traj.messages += new_messages
        traj.completion_ids += ids
        traj.loss_mask += [0] * len(ids)
        traj.logprobs += [0.0] * len(ids)


def _generate(engine: Engine, prompts: list[list[int]], sampling: Sampling, images: list[list[bytes]]):
    """Images go to engines that take them (VLLMEngine); a text-only engine sees only their placeholder tokens."""
    if any(images) and "images" in inspect.signature(engine.generate).parameters:
        return engine.generate(prompts, sampling, images=[i or None for i in images])
    return engine.generate(prompts, sampling)


def check_tito(tokenizer, sample: Sample, messages: list[dict], tools: list[dict] | None = None,
               eot: str | None = None) -> list[str]:
    """Drift between a trajectory and the chat template's rendering of the same messages (tokenized whole, tool output
    as plain text): ids that differ, and loss-mask positions that are not exactly the assistant turns' content plus
    their end-of-turn token `eot` (default: end_of_turn's). Returns human-readable findings; [] = no drift."""
    eot = eot or end_of_turn(tokenizer)
    text = render(tokenizer, messages, tools, add_generation_prompt=False)
    plain = tool_spans(tokenizer, messages, tools, False, text)
    if messages[-1]["role"] == "assistant" and sample.ids and sample.ids[-1] == tokenizer.convert_tokens_to_ids(eot):
        text = text[: text.rindex(eot) + len(eot)]  # the trajectory ends on the policy's token
    want, offsets = encode_text(tokenizer, text, plain)
    findings = []
    got = sample.ids
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    if first < max(len(got), len(want)):
        findings.append(f"ids drift at token {first} of {len(got)} (template: {len(want)} tokens): trajectory "
                        f"{tokenizer.decode(got[first:first + 8])!r} vs template "
                        f"{tokenizer.decode(want[first:first + 8])!r}")
        return findings
    spans = []  # character spans of each assistant turn: content + end-of-turn token
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            begin = len(render(tokenizer, messages[:i], tools, add_generation_prompt=True))
            end = render(tokenizer, messages[: i + 1], tools, add_generation_prompt=False).rindex(eot)
            spans.append((begin, end + len(eot)))
    want_mask = [int(any(b <= s and e <= c for b, c in spans)) for s, e in offsets]
    mask = [0] * len(sample.prompt_ids) + list(sample.loss_mask)
    wrong = [i for i, (a, b) in enumerate(zip(mask, want_mask)) if a != b]
    if wrong:
        findings.append(f"loss mask drift at {len(wrong)} tokens, first {wrong[0]} "
                        f"({tokenizer.decode(got[wrong[0]:wrong[0] + 1])!r}: mask {mask[wrong[0]]}, "
                        f"want {want_mask[wrong[0]]})")
    return findings


PYTHON_TOOL = {"type": "function", "function": {
    "name": "python",
    "description": "Run Python code in a persistent session (variables, imports and files are kept). The task's image "
    "is `image` (PIL) and input_image.png; images you show or save and matplotlib figures are returned.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}


def python_toolbox(row: dict) -> ToolBox:
    """The `python` tool: one sandbox.PythonSession per trajectory, given the row's first image."""
    session = sandbox.PythonSession(input_image=(row.get("images") or [None])[0])

    def python(arguments: dict) -> ToolResult:
        if not isinstance(arguments.get("code"), str):
            return ToolResult('Error: python needs {"code": <string>}', error=True)
        out = session.run(arguments["code"])
        text = out.stdout + out.stderr + (out.error or "")
        return ToolResult(text or "(no output)", images=out.images, error=out.error is not None)

    return ToolBox({"python": python}, [PYTHON_TOOL], close=session.close)


SWE_TOOLS = [
    {"type": "function", "function": {
        "name": "bash",
        "description": "Run one bash command in /testbed, without network. It is killed after `timeout` seconds; "
        "only files persist between calls (no cd, no variables, no background jobs); long output keeps its head and "
        "tail.",
        "parameters": {"type": "object", "properties": {
            "command": {"type": "string", "description": "the command, e.g. grep -rn 'def foo' src"},
            "timeout": {"type": "integer", "description": f"seconds before it is killed (default 60, at most "
                        f"{SWE_MAX_COMMAND_SECONDS})"}},
            "required": ["command"]}}},
    {"type": "function", "function": {
        "name": "str_replace_editor",
        "description": "View, create and edit files. view: a file with line numbers (view_range [first, last] "
        "optional, last -1 = to the end) or a directory two levels deep; create: write file_text to a new file; "
        "str_replace: replace old_str, which must occur exactly once in the file, with new_str; insert: insert "
        "new_str after line insert_line (0 = at the top).",
        "parameters": {"type": "object", "properties": {
            "command": {"type": "string", "enum": ["view", "create", "str_replace", "insert"]},
            "path": {"type": "string", "description": "absolute path, e.g. /testbed/src/module.py"},
            "file_text": {"type": "string"}, "old_str": {"type": "string"}, "new_str": {"type": "string"},
            "insert_line": {"type": "integer"}, "view_range": {"type": "array", "items": {"type": "integer"}}},
            "required": ["command", "path"]}}},
    {"type": "function", "function": {
        "name": "submit",
        "description": "End the episode once you are done: the final state of /testbed is graded.",
        "parameters": {"type": "object", "properties": {}}}},
]


def swe_toolbox(row: dict, limits: containers.ContainerLimits = SWE_CONTAINER) -> ToolBox:
    """`bash`, `str_replace_editor` and `submit` in one fresh container from the row's SWE-bench instance image. On
    close the container's diff since the base commit becomes the sample's completion (what rewards.score grades in a
    fresh container; "" and info["diff_error"] when the agent left no usable diff) and the container is removed,
    whatever happens. info["container_seconds"]: time spent in Docker (start, commands, diff, removal)."""
    truth = json.loads(row["reward_model"]["ground_truth"])
    start = time.perf_counter()
    container = containers.Container(containers.shared_client(), truth["image"], role="agent",
                                     run=truth["instance_id"], limits=limits)
    info = {"container_seconds": time.perf_counter() - start}

    def timed(tool: Callable[[dict], ToolResult]) -> Callable[[dict], ToolResult]:
        def run(arguments: dict) -> ToolResult:
            begin = time.perf_counter()
            try:
                return tool(arguments)
            finally:
                info["container_seconds"] += time.perf_counter() - begin
        return run

    def close() -> None:
        begin = time.perf_counter()
        try:
            diff = containers.container_diff(container, truth["base_commit"])
            info["completion"] = diff.decode(errors="surrogateescape")  # rewards.score encodes it back byte for byte
        except containers.DiffError as e:
            info["completion"], info["diff_error"] = "", str(e)
        finally:
            container.remove()
            info["container_seconds"] += time.perf_counter() - begin

    tools = {"bash": timed(lambda arguments: swe_bash(container, arguments)),
             "str_replace_editor": timed(lambda arguments: swe_editor(container, arguments)),
             "submit": lambda arguments: ToolResult("Submitted: /testbed will be graded.", stop=True)}
    return ToolBox(tools, SWE_TOOLS, close=close, info=info)


def swe_bash(container: containers.Container, arguments: dict) -> ToolResult:
    """One command, mini-swe-agent's observation format; a timeout is a tool error, a failing command is not."""
    command, timeout = arguments.get("command"), arguments.get("timeout", container.limits.timeout)
    if not isinstance(command, str) or not command.strip():
        return ToolResult('Error: bash needs {"command": <non-empty string>}', error=True)
    if not isinstance(timeout, (int, float)) or not 0 < timeout <= SWE_MAX_COMMAND_SECONDS:
        return ToolResult(f"Error: timeout must be a number of seconds in (0, {SWE_MAX_COMMAND_SECONDS}]", error=True)
    result = container.exec(command, timeout=timeout)
    killed = f"<warning>killed after {timeout} s</warning>\n" if result.timed_out else ""
    return ToolResult(f"<returncode>{result.exit_code}</returncode>\n{killed}<output>\n{result.output}</output>",
                      error=result.timed_out)


def swe_editor(container: containers.Container, arguments: dict) -> ToolResult:
    """SWE-agent's str_replace_editor (view, create, str_replace, insert) on the container's files."""
    command, path = arguments.get("command"), arguments.get("path")
    if not isinstance(path, str) or not path.startswith("/") or path == "/tmp" or path.startswith("/tmp/"):
        return ToolResult("Error: path must be an absolute path outside /tmp, e.g. /testbed/src/module.py", error=True)
    quoted = shlex.quote(path)
    if command == "view":
        view_range = arguments.get("view_range") or [1, -1]
        if not (isinstance(view_range, list) and len(view_range) == 2 and all(type(v) is int for v in view_range)):
            return ToolResult("Error: view_range must be two line numbers [first, last]", error=True)
        first, last = view_range
        shown = container.exec(f"if [ -d {quoted} ]; then find {quoted} -maxdepth 2 -not -path '*/.*' | sort; "
                               f"else awk -v a={first} -v b={last} 'NR >= a && (b < 0 || NR <= b) "
                               f"{{printf \"%6d\\t%s\\n\", NR, $0}}' {quoted}; fi")
        return ToolResult(shown.output or "(empty)", error=shown.exit_code != 0)
    if command == "create":
        if not isinstance(arguments.get("file_text"), str):
            return ToolResult("Error: create needs file_text", error=True)
        made = container.exec(f"test ! -e {quoted} && mkdir -p \"$(dirname {quoted})\"")
        if made.exit_code != 0:
            return ToolResult(f"Error: {path} exists already (edit it with str_replace or insert)", error=True)
        container.put_file(path, arguments["file_text"].encode())
        return ToolResult(f"Created {path}.")
    if command not in ("str_replace", "insert"):
        return ToolResult("Error: command must be one of view, create, str_replace, insert", error=True)
    mode = container.exec(f"test -f {quoted} && stat -c %a {quoted}")
    if mode.exit_code != 0:
        return ToolResult(f"Error: {path} is not a file", error=True)
    try:
        text = container.get_file(path).decode()
    except UnicodeDecodeError:
        return ToolResult(f"Error: {path} is not UTF-8 text; edit it with bash", error=True)
    new_str = arguments.get("new_str")
    if not isinstance(new_str, str):
        return ToolResult(f"Error: {command} needs new_str", error=True)
    if command == "str_replace":
        old_str = arguments.get("old_str")
        if not isinstance(old_str, str) or not old_str:
            return ToolResult("Error: str_replace needs a non-empty old_str", error=True)
        count = text.count(old_str)
        if count != 1:
            return ToolResult(f"Error: old_str occurs {count} times in {path}; it must occur exactly once", error=True)
        text = text.replace(old_str, new_str)
    else:
        lines, at = text.splitlines(keepends=True), arguments.get("insert_line")
        if not isinstance(at, int) or not 0 <= at <= len(lines):
            return ToolResult(f"Error: insert_line must be a line number in [0, {len(lines)}]", error=True)
        text = "".join(lines[:at]) + new_str + ("" if new_str.endswith("\n") else "\n") + "".join(lines[at:])
    container.put_file(path, text.encode(), mode=int(mode.output.split()[-1], 8))
    return ToolResult(f"Edited {path}.")


def check_swe_rows(rows: list[dict], tools: str, source: str) -> None:
    """swebench rows need the swe toolbox and it needs them; each row's image must be on the Docker host. Checked at
    load, before any model is."""
    swe = [r for r in rows if r["data_source"] == "swebench"]
    if swe and tools != "swe" or tools == "swe" and len(swe) < len(rows):
        raise SystemExit(f"{source}: swebench rows run with --tools swe and --tools swe runs only swebench rows "
                         f"({len(swe)} of {len(rows)} rows are swebench, --tools {tools})")
    if tools == "swe":
        client = containers.shared_client()
        missing = sorted({json.loads(r["reward_model"]["ground_truth"])["image"] for r in swe}
                         - {tag for image in client.images.list() for tag in image.tags})
        if missing:
            raise SystemExit(f"{source}: {len(missing)} instance images are not on this Docker host, e.g. "
                             f"{missing[0]}; pull or `docker load` them first (README, SWE-bench)")


TOOLBOXES: dict[str, Callable[[dict], ToolBox]] = {"python": python_toolbox, "swe": swe_toolbox}
TOOL_SCHEMAS: dict[str, list[dict]] = {"python": [PYTHON_TOOL], "swe": SWE_TOOLS}  # what each shows in the prompt


# `python rollout.py generate`: samples of a model (a Hugging Face folder or a kiln checkpoint) for every row of a data
# set, data-parallel under torchrun, in the file `python rewards.py score` grades. Rollouts are `collect`'s, as in
# training: multi-turn rows (--tools) go through the same agent loop.


@dataclass
class GenerateArgs:
    model: str
    """a Hugging Face folder or hub name, or a kiln checkpoint folder (<output_dir>/checkpoints/step_*)"""
    data: str
    """rows to answer (parquet / jsonl / HF dataset name) in kiln's row schema"""
    out: str = "samples.jsonl"
    """JSONL, one sample a line ({"task_id", "sample", "completion", ...}): what `python rewards.py score` reads"""
    n_samples: int = 1
    """samples per row, the n of pass@k (k <= n; needs a temperature > 0). Not `--n`: torchrun would take that for
    an abbreviation of its own --nnodes / --nproc-per-node"""
    engine: Literal["hf", "vllm"] = "hf"
    """vLLM on GPUs, or the model's own Hugging Face decoding loop (CPU, debugging)"""
    seed: int = 0
    """sampling seed (each rank draws from seed + rank)"""
    max_prompt_tokens: int = 1024
    """rows whose prompt is longer are skipped (and counted on the console)"""
    max_new_tokens: int = 1024
    """generation budget per sample (per turn with tools)"""
    temperature: float = 0.0
    """sampling temperature; 0 = greedy"""
    top_p: float = 1.0
    """nucleus sampling"""
    batch_size: int = 64
    """rows per rank in one engine call (the progress bar moves by batch_size x ranks)"""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """weights on GPUs (the HF engine on CPU always computes in float32)"""
    end_of_turn: str | None = None
    """token that closes an assistant turn (default: found in the chat template, e.g. <|im_end|>, <|eot_id|>)"""
    tools: Literal["none", "python", "swe"] = "none"
    """multi-turn agent rollouts with these tools, as in training (python: a sandboxed interpreter per trajectory;
    swe: bash and an editor in a container per trajectory, swebench rows, the completion is its diff)"""
    max_turns: int = 4
    """assistant turns per trajectory (tools on)"""
    max_total_tokens: int = 4096
    """prompt + all turns and tool outputs per trajectory (tools on)"""
    max_tool_response_tokens: int = 512
    """longer tool outputs are cut and marked (tools on)"""
    max_agent_seconds: float = 1800.0
    """wall clock per trajectory (tools on)"""
    vllm_gpu_memory_utilization: float = 0.85
    """fraction of GPU memory vLLM may take"""
    vllm_max_model_len: int = 4096
    """vLLM context length"""
    vllm_tensor_parallel_size: int = 1
    """ranks per vLLM engine (consecutive ranks form a group)"""


def check_generate_args(args: GenerateArgs) -> None:
    """Refuse what would waste a run, before any model is loaded."""
    if args.n_samples < 1 or args.batch_size < 1:
        raise SystemExit(f"--n-samples ({args.n_samples}) and --batch-size ({args.batch_size}) must be at least 1")
    if args.n_samples > 1 and args.temperature <= 0:
        raise SystemExit(f"--n-samples {args.n_samples} with --temperature {args.temperature}: greedy samples of a "
                         "row are all the same; sample with a temperature > 0 (e.g. 0.8) for pass@k")
    if not Path(args.out).resolve().parent.is_dir():
        raise SystemExit(f"--out {args.out}: its folder does not exist")


def is_checkpoint(path) -> bool:
    """Whether `path` is a kiln (DCP) checkpoint folder rather than a Hugging Face model."""
    return (Path(path) / ".metadata").is_file()


def load_generator(args: GenerateArgs, tokenizer, device: torch.device) -> Engine:
    """The engine that samples `args.model`. A kiln checkpoint is read as merge.py reads it (the model entries alone,
    fp32, whatever world size wrote it; its hf/ folder gives config and tokenizer) on every rank: for big models,
    `python merge.py` it once and generate from the Hugging Face folder."""
    checkpoint = Path(args.model) if is_checkpoint(args.model) else None
    dtype = getattr(torch, args.dtype) if device.type == "cuda" else torch.float32
    if args.engine == "vllm":
        engine = VLLMEngine(str(checkpoint / "hf") if checkpoint else args.model, seed=args.seed, dtype=args.dtype,
                            gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                            max_model_len=args.vllm_max_model_len, tensor_parallel_size=args.vllm_tensor_parallel_size,
                            **({"load_format": "dummy"} if checkpoint else {}))
        if checkpoint:  # random weights until the checkpoint's arrive through the trainers' weight path
            engine.load_weights(merge.read_model_state(checkpoint).items())
        return engine
    if checkpoint:
        model = merge.restore_model(checkpoint, merge.read_model_state(checkpoint))
    else:
        model = policy.load_model(args.model)
    model = model.to(device=device, dtype=dtype).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return HFEngine(model, pad_token_id=pad)


def sample_line(sample: Sample, index: int) -> dict:
    """One line of the samples file: task_id and completion (all `rewards.py score` reads), then which sample of the
    row it is, why it ended, its generated tokens and, with tools, its turns and tool calls."""
    line = {"task_id": data_prep.row_id(sample.row), "sample": index, "completion": sample.text,
            "finish_reason": sample.finish_reason, "completion_tokens": sum(sample.loss_mask)}
    return line | {k: sample.info[k] for k in ("turns", "tool_calls", "tool_errors") if k in sample.info}


def generate_lines(engine: Engine, tokenizer, rows: list[dict], args: GenerateArgs, sampling: Sampling) -> list[dict]:
    """`args.n_samples` samples of every row, as sample lines in row order, on every rank. Each round takes the next
    batch_size x world rows, this rank answers every world-th of them, and the lines are gathered. Every rank runs
    every round, with or without rows of its own: multi-turn rounds and tensor-parallel engines are collectives."""
    rank, world = dist.get_rank(), dist.get_world_size()
    limits = AgentLimits(args.max_turns, args.max_total_tokens, args.max_tool_response_tokens, args.max_agent_seconds)
    per_round = args.batch_size * world
    lines: list[tuple[int, dict]] = []
    bar = tqdm(total=len(rows), desc="generate", unit="row", disable=rank != 0)
    for start in range(0, len(rows), per_round):
        positions = list(range(start + rank, min(start + per_round, len(rows)), world))
        samples, _ = collect(engine, tokenizer, [rows[p] for p in positions], args.n_samples, sampling, args.tools,
                             limits, first_group=start + rank, eot=args.end_of_turn)
        lines += policy.gather_objects([(positions[i // args.n_samples], sample_line(s, i % args.n_samples))
                                        for i, s in enumerate(samples)])
        bar.update(min(per_round, len(rows) - start))
    bar.close()
    lines.sort(key=lambda pl: (pl[0], pl[1]["sample"]))
    return [line for _, line in lines]


def generate(args: GenerateArgs) -> Path:
    """Samples of args.model for every row of args.data in args.out (rank 0 writes it, once everything is done)."""
    check_generate_args(args)
    rank, world, device = policy.init_distributed()
    torch.manual_seed(args.seed + rank)
    seconds = {}
    start = time.perf_counter()
    hf_dir = Path(args.model) / "hf" if is_checkpoint(args.model) else args.model
    tokenizer = policy.load_tokenizer(hf_dir)
    rows = load_rows_within(args.data, tokenizer, args.max_prompt_tokens, verbose=rank == 0, tools=args.tools)
    if args.tools == "swe":  # containers of dead kiln processes go; this one's go when it ends, however it ends
        containers.sweep(containers.shared_client())
        containers.remove_owned_at_exit(containers.shared_client())
    engine = load_generator(args, tokenizer, device)
    sampling = Sampling(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                        stop_token_ids=policy.stop_token_ids(tokenizer, hf_dir,
                                                             end_of_turn(tokenizer, args.end_of_turn)))
    seconds["load"] = time.perf_counter() - start
    lines = generate_lines(engine, tokenizer, rows, args, sampling)
    seconds["generate"] = time.perf_counter() - start - seconds["load"]
    if rank == 0:
        data_prep.write_atomically(args.out, lines)
        print(f"{len(lines)} samples ({args.n_samples} per row, {len(rows)} rows, {world} ranks) in {args.out}; load "
              f"{seconds['load']:.1f}s, generate {seconds['generate']:.1f}s ({len(lines) / seconds['generate']:.1f} "
              f"samples/s). Grade them: python rewards.py score {args.out} --data {args.data}")
    return Path(args.out)


if __name__ == "__main__":
    generate(tyro.extras.subcommand_cli_from_dict({"generate": GenerateArgs}))
    policy.exit_distributed()
