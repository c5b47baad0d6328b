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
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from tqdm import tqdm

import data_prep
import sandbox
from engines import Engine, Sampling

END_OF_TURN = "<|im_end|>"
TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


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


def encode_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """Chat messages -> prompt token ids, ending with the assistant header (tokenized once, never again)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_conversation(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Chat messages -> (ids, loss mask), 1 exactly on assistant tokens (content and its end-of-turn token).

    Each message is tokenized alone as the text the template appends for it, so a conversation's ids are the
    concatenation a multi-turn rollout builds turn by turn: the same ids for training and for generation.
    """
    end_of_turn = tokenizer.convert_tokens_to_ids(END_OF_TURN)
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
        piece = tokenizer(text[len(rendered):], add_special_tokens=False)["input_ids"]
        if message["role"] == "assistant":
            # Trained: everything up to and including the end-of-turn token; the template's trailing glue is not.
            end = len(piece)
            while end > 0 and piece[end - 1] != end_of_turn:
                end -= 1
            mask += [1] * end + [0] * (len(piece) - end)
        else:
            mask += [0] * len(piece)
        ids += piece
        rendered = text
    return ids, mask


def load_rows_within(source: str, tokenizer, max_prompt_tokens: int, verbose: bool = True) -> list[dict]:
    """`data_prep.load_rows(source)` less the rows whose prompt is longer than `max_prompt_tokens` (counted, and
    printed when verbose); a source with none left is refused."""
    rows = data_prep.load_rows(source)
    kept = [r for r in rows if len(encode_prompt(tokenizer, r["prompt"])) <= max_prompt_tokens]
    if not kept:
        raise SystemExit(f"{source}: no row has a prompt within --max-prompt-tokens {max_prompt_tokens}")
    if len(kept) < len(rows) and verbose:
        print(f"{source}: skipped {len(rows) - len(kept)} of {len(rows)} rows longer than {max_prompt_tokens} tokens")
    return kept


def collect(engine: Engine, tokenizer, rows: list[dict], group_size: int, sampling: Sampling, tools: str = "none",
            limits: AgentLimits | None = None, first_group: int = 0, check: bool = False) -> tuple[list[Sample], dict]:
    """`group_size` samples of each row: single-turn, or multi-turn agent rollouts with the toolbox `tools` names
    (TOOLBOXES). check: compare every trajectory with the chat template's rendering of its messages; the drifting
    fraction goes to the metrics (tools/tito_drift_frac) and the first drift to the console: a tokenization the
    template would not produce is logged, not fatal. Returns samples and this rank's metrics."""
    if tools == "none":
        return single_turn(engine, tokenizer, rows, group_size, sampling, first_group)
    samples, metrics = multi_turn(engine, tokenizer, rows, group_size, sampling, TOOLBOXES[tools],
                                  limits or AgentLimits(), first_group)
    if check:
        drifts = [(s, check_tito(tokenizer, s, s.info["messages"], s.info["tools"])) for s in samples]
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
        "rollout/truncated_frac": sum(c.finish_reason == "length" for c in completions) / len(completions),
    }
    return samples, metrics


# Multi-turn agent rollouts: generate a turn, parse its Qwen2.5 tool calls, run them concurrently, append the tool
# messages as the chat template formats them (only that suffix is tokenized, never the trajectory), continue.


@dataclass
class ToolResult:
    text: str
    images: list[bytes] = field(default_factory=list)  # PNG bytes, shown to the model as image parts
    error: bool = False  # the call failed (bad arguments, exception, timeout): counted in the metrics


@dataclass
class ToolBox:
    """One trajectory's tools: name -> function(arguments) -> ToolResult, their JSON signatures for the prompt,
    and what releases their state when the trajectory ends."""

    tools: dict[str, Callable[[dict], ToolResult]]
    schemas: list[dict]
    close: Callable[[], None] = lambda: None


@dataclass
class AgentLimits:
    max_turns: int = 4  # assistant turns per trajectory
    max_total_tokens: int = 4096  # prompt + everything after it
    max_tool_response_tokens: int = 512  # longer tool outputs are cut and marked


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
                        schemas: list[dict] | None) -> list[int]:
    """Ids the chat template appends after a trajectory that ends on its last assistant turn's end-of-turn token,
    for `new_messages` plus the next assistant header: the template's glue after that token, then the new ones."""
    before = render(tokenizer, messages, schemas, add_generation_prompt=False)
    after = render(tokenizer, messages + new_messages, schemas, add_generation_prompt=True)
    if not after.startswith(before):
        raise ValueError("the chat template does not render the new messages as an extension of the conversation")
    cut = before.rindex(END_OF_TURN) + len(END_OF_TURN)  # the trajectory ends right after this token
    return tokenizer(after[cut:], add_special_tokens=False)["input_ids"]


def truncate_tool_text(tokenizer, text: str, max_tokens: int) -> tuple[str, bool]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
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
    finish_reason: str = ""  # "stop", "length" (a turn ran out of tokens), "max_turns", "max_total_tokens"

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


def multi_turn(engine: Engine, tokenizer, rows: list[dict], group_size: int, sampling: Sampling,
               new_toolbox: Callable[[dict], ToolBox], limits: AgentLimits = AgentLimits(),
               first_group: int = 0) -> tuple[list[Sample], dict]:
    """Multi-turn rollout: each row's prompt `group_size` times; every turn is generated for all live trajectories
    in one engine call, then all their tool calls run concurrently. Returns samples (info: messages, images, tool
    schemas, turn and tool counts) and metrics. Toolboxes are always closed."""
    start = time.perf_counter()
    eot = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    trajectories: list[Trajectory] = []
    try:
        for i in range(len(rows) * group_size):
            row = rows[i // group_size]
            box = new_toolbox(row)
            trajectories.append(Trajectory(row, first_group + i // group_size, box, list(row["prompt"]), []))
            prompt_text = render(tokenizer, row["prompt"], box.schemas, add_generation_prompt=True)
            trajectories[-1].prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
        with ThreadPoolExecutor(max_workers=16) as pool:
            while _any_live_anywhere(live := [traj for traj in trajectories if not traj.finish_reason]):
                _agent_turn(engine, tokenizer, live, sampling, limits, eot, pool)
    finally:
        for traj in trajectories:
            traj.box.close()
    samples = [Sample(
        prompt_ids=traj.prompt_ids, completion_ids=traj.completion_ids, loss_mask=traj.loss_mask,
        engine_logprobs=traj.logprobs, row=traj.row, group=traj.group, finish_reason=traj.finish_reason,
        text="\n".join(m["content"] for m in traj.messages[len(traj.row["prompt"]):] if m["role"] == "assistant"),
        info={"messages": traj.messages, "images": traj.images, "tools": traj.box.schemas, "turns": traj.turns,
              "tool_calls": traj.tool_calls, "tool_errors": traj.tool_errors})
        for traj in trajectories]
    seconds = time.perf_counter() - start
    n = len(trajectories)
    generated = sum(sum(traj.loss_mask) for traj in trajectories)
    metrics = {
        "rollout/seconds": seconds,
        "rollout/tokens_per_s": generated / max(seconds, 1e-9),
        "rollout/truncated_frac": sum(traj.finish_reason != "stop" for traj in trajectories) / n,
        "tools/turns_mean": sum(traj.turns for traj in trajectories) / n,
        "tools/calls_mean": sum(traj.tool_calls for traj in trajectories) / n,
        "tools/errors_mean": sum(traj.tool_errors for traj in trajectories) / n,
        "tools/seconds": sum(traj.tool_seconds for traj in trajectories),
        "tools/truncated_responses": sum(traj.truncated_responses for traj in trajectories),
    }
    for reason in ("length", "max_turns", "max_total_tokens"):
        metrics[f"rollout/finish_{reason}_frac"] = sum(traj.finish_reason == reason for traj in trajectories) / n
    return samples, metrics


def _any_live_anywhere(live: list) -> bool:
    """Whether any rank still has a live trajectory. Under torchrun every rank must make the same number of engine
    calls (HFEngine's load_weights streams FSDP parameters; a TP-sharded vLLM engine is a collective), so ranks turn
    together."""
    flag = torch.tensor(float(bool(live)))
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() > 0


def _agent_turn(engine: Engine, tokenizer, live: list[Trajectory], sampling: Sampling, limits: AgentLimits,
                eot: int, pool: ThreadPoolExecutor) -> None:
    if not live:  # other ranks still turn: one throwaway token keeps this rank's collectives in step
        _generate(engine, [[tokenizer.pad_token_id]], dataclasses.replace(sampling, max_new_tokens=1), [[]])
        return
    budget = min(max(limits.max_total_tokens - traj.length for traj in live), sampling.max_new_tokens)
    turn_sampling = dataclasses.replace(sampling, max_new_tokens=max(budget, 1))
    completions = _generate(engine, [traj.prompt_ids + traj.completion_ids for traj in live], turn_sampling,
                            [traj.images for traj in live])
    pending = []
    for traj, c in zip(live, completions):
        room = limits.max_total_tokens - traj.length
        ids, logprobs = c.token_ids[:room], c.logprobs[:room]  # the batch budget follows the longest trajectory
        traj.completion_ids += ids
        traj.loss_mask += [1] * len(ids)
        traj.logprobs += logprobs
        traj.turns += 1
        ended = bool(ids) and ids[-1] == eot  # only a turn closed by the template's token can take tool results
        stopped = ended or (c.finish_reason == "stop" and len(ids) == len(c.token_ids))
        content = tokenizer.decode(ids[:-1] if stopped else ids, skip_special_tokens=False)
        traj.messages.append({"role": "assistant", "content": content})
        calls = parse_tool_calls(content, set(traj.box.tools)) if ended else []
        if not calls:
            cut = len(ids) < len(c.token_ids)
            traj.finish_reason = "stop" if stopped else ("max_total_tokens" if cut else "length")
        elif traj.turns >= limits.max_turns:
            traj.finish_reason = "max_turns"
        else:
            pending.append((traj, [pool.submit(call_tool, traj.box, call) for call in calls]))
    for traj, futures in pending:
        new_messages = []
        for future in futures:
            result, seconds = future.result()
            text, cut = truncate_tool_text(tokenizer, result.text, limits.max_tool_response_tokens)
            result.text = text
            new_messages.append(tool_message(result))
            traj.images += result.images
            traj.tool_calls += 1
            traj.tool_errors += result.error
            traj.tool_seconds += seconds
            traj.truncated_responses += cut
        ids = template_suffix_ids(tokenizer, traj.messages, new_messages, traj.box.schemas)
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


def check_tito(tokenizer, sample: Sample, messages: list[dict], tools: list[dict] | None = None) -> list[str]:
    """Drift between a trajectory and the chat template's rendering of the same messages (tokenized whole): ids that
    differ, and loss-mask positions that are not exactly the assistant turns' content plus their end-of-turn token.
    Returns human-readable findings; [] = no drift."""
    text = render(tokenizer, messages, tools, add_generation_prompt=False)
    end_of_turn = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    if messages[-1]["role"] == "assistant" and sample.ids and sample.ids[-1] == end_of_turn:
        text = text[: text.rindex(END_OF_TURN) + len(END_OF_TURN)]  # the trajectory ends on the policy's token
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    want, offsets = encoded["input_ids"], encoded["offset_mapping"]
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
            end = render(tokenizer, messages[: i + 1], tools, add_generation_prompt=False).rindex(END_OF_TURN)
            spans.append((begin, end + len(END_OF_TURN)))
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


TOOLBOXES: dict[str, Callable[[dict], ToolBox]] = {"python": python_toolbox}
