"""Producing samples: single- and multi-turn rollouts (token-in-token-out, loss masks; chat.py holds the template
side, tools.py the toolboxes), and rollouts of external agents through agent_server's endpoint. Their command lines
are generate.py (a model's samples for a data set) and serve.py (the endpoint alone).

Images: a trajectory holds one unexpanded image placeholder per image (as the chat template renders it) and its images
in placeholder order (the row's, then the tools'); the engine gets them with the ids from the first turn on. Length
budgets count the tokens the model will see: `count_image`, the model's own count (`vision.image_counter`), gives the
tokens a placeholder expands to; without one each image is its placeholder alone, as a text-only model sees it.
"""
from __future__ import annotations

import dataclasses
import inspect
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tqdm import tqdm

import agent_server
import chat
import collectives
import containers
import data_prep
from engines import Engine, Sampling
from tools import TOOL_SCHEMAS, TOOLBOXES, ToolBox, call_tool, check_swe_rows, tool_message


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
    shaped_reward: float = 0.0  # what advantages are computed from: the reward plus the trainer's shaping, if any
    advantage: float = 0.0  # the sample's share of the signal, set by the trainer from the rewards of its batch
    info: dict = field(default_factory=dict)
    images: list[bytes] = field(default_factory=list)  # encoded images, one per placeholder in `ids`, in that order

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids


def placeholder_only(image: bytes) -> int:
    """The count_image of a text-only model: an image is its placeholder token and nothing more."""
    return 1


def check_images(sample: Sample, pad_id: int | None) -> None:
    """Every image has its placeholder and every placeholder its image. Placeholders the policy sampled itself are
    not counted here: the engines ban them."""
    rendered = sum(t == pad_id for t in sample.prompt_ids) + sum(
        t == pad_id and not m for t, m in zip(sample.completion_ids, sample.loss_mask))
    if rendered != len(sample.images):
        task = data_prep.row_id(sample.row) if "extra_info" in sample.row else "a row"
        raise RuntimeError(f"{task}: the trajectory has {len(sample.images)} images but {rendered} image placeholders")


def load_rows_within(source: str, tokenizer, max_prompt_tokens: int, verbose: bool = True,
                     tools: str = "none", count_image: Callable[[bytes], int] = placeholder_only) -> list[dict]:
    """`data_prep.load_rows(source)` less the rows whose prompt, as the rollout renders it (with the signatures of the
    toolbox `tools`, each image placeholder counted as `count_image` tokens), is longer than `max_prompt_tokens`
    (counted, and printed when verbose); a source with none left is refused."""
    rows = data_prep.load_rows(source)
    check_swe_rows(rows, tools, source)
    schemas = TOOL_SCHEMAS[tools] if tools != "none" else None

    def length(row: dict) -> int:
        text = chat.render(tokenizer, row["prompt"], schemas, add_generation_prompt=True)
        return len(tokenizer(text, add_special_tokens=False)["input_ids"]) + sum(
            count_image(image) - 1 for image in data_prep.row_images(row))

    kept = [r for r in rows if length(r) <= max_prompt_tokens]
    if not kept:
        raise ValueError(f"{source}: no row has a prompt within --max-prompt-tokens {max_prompt_tokens}")
    if len(kept) < len(rows) and verbose:
        print(f"{source}: skipped {len(rows) - len(kept)} of {len(rows)} rows longer than {max_prompt_tokens} tokens")
    return kept


def collect(engine: Engine, tokenizer, rows: list[dict], group_size: int, sampling: Sampling, tools: str = "none",
            limits: AgentLimits | None = None, first_group: int = 0, check: bool = False,
            eot: str | None = None,
            count_image: Callable[[bytes], int] = placeholder_only) -> tuple[list[Sample], dict]:
    """`group_size` samples of each row: single-turn, or multi-turn agent rollouts with the toolbox `tools` names
    (TOOLBOXES) whose turns end with the token `eot` (default: end_of_turn's), budgets counting each image as
    `count_image` tokens. check: compare every trajectory with the chat template's rendering of its messages; the
    drifting fractions go to the metrics (tools/tito_drift_frac: any finding; tools/tito_mask_drift_frac: a loss mask
    or text that is wrong, not only split otherwise) and the first drift to the console: logged, not fatal. Returns
    samples and this rank's metrics."""
    if tools == "none":
        return single_turn(engine, tokenizer, rows, group_size, sampling, first_group)
    eot = eot or chat.end_of_turn(tokenizer)
    samples, metrics = multi_turn(engine, tokenizer, rows, group_size, sampling, TOOLBOXES[tools],
                                  limits or AgentLimits(), first_group, eot, count_image)
    if check:
        drifts = [(s, chat.check_tito(tokenizer, s, s.info["messages"], s.info["tools"], eot)) for s in samples]
        metrics["tools/tito_drift_frac"] = sum(bool(d) for _, d in drifts) / len(drifts)
        metrics["tools/tito_mask_drift_frac"] = sum(chat.mask_drifted(d) for _, d in drifts) / len(drifts)
        first = next(((s, d) for s, d in drifts if chat.mask_drifted(d)), None) or next(
            ((s, d) for s, d in drifts if d), None)
        if first is not None:
            tqdm.write(f"rank {collectives.rank()}, task {data_prep.row_id(first[0].row)}: {'; '.join(first[1])}")
    return samples, metrics


def single_turn(engine: Engine, tokenizer, rows: list[dict], group_size: int, sampling: Sampling,
                first_group: int = 0) -> tuple[list[Sample], dict]:
    """Each row's prompt (and images) sampled `group_size` times, one completion each. Returns samples and metrics."""
    start = time.perf_counter()
    prompts = [chat.encode_prompt(tokenizer, row["prompt"]) for row in rows]
    repeated = [p for p in prompts for _ in range(group_size)]
    images = [data_prep.row_images(row) for row in rows for _ in range(group_size)]
    completions = _generate(engine, repeated, sampling, images)
    samples, pad_id = [], chat.image_pad_id(tokenizer)
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
            images=images[i],
        ))
        check_images(samples[-1], pad_id)
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
class AgentLimits:
    max_turns: int = 4  # assistant turns per trajectory
    max_total_tokens: int = 4096  # prompt + everything after it
    max_tool_response_tokens: int = 512  # longer tool outputs are cut and marked
    max_seconds: float = 1800.0  # wall clock per trajectory, checked before each turn's tools run


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
    images: list[bytes] = field(default_factory=list)  # one per image placeholder, in order: the row's, the tools'
    prompt_images: int = 0  # how many of them are the row's
    image_tokens: int = 0  # what the placeholders add when expanded: sum of (tokens per image - 1)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_seconds: float = 0.0
    truncated_responses: int = 0
    tool_log: list[dict] = field(default_factory=list)  # per call: turn, name, arguments, output, error, seconds,
    # images
    finish_reason: str = ""  # "stop", "submit", "length" (a turn ran out of tokens), "max_turns", "max_total_tokens",
    # "max_seconds"
    started: float = field(default_factory=time.monotonic)
    seconds: float = 0.0  # wall clock from the start to the end of its last turn

    @property
    def length(self) -> int:
        """Tokens as the model sees them: image placeholders expanded."""
        return len(self.prompt_ids) + len(self.completion_ids) + self.image_tokens


def multi_turn(engine: Engine, tokenizer, rows: list[dict], group_size: int, sampling: Sampling,
               new_toolbox: Callable[[dict], ToolBox], limits: AgentLimits = AgentLimits(),
               first_group: int = 0, eot: str | None = None,
               count_image: Callable[[bytes], int] = placeholder_only) -> tuple[list[Sample], dict]:
    """Multi-turn rollout: each row's prompt (and images) `group_size` times; every turn is generated for all live
    trajectories in one engine call, then all their tool calls run concurrently; a turn that ends with the token `eot`
    (default: end_of_turn's), or (tag protocol) stops on </code>, can call tools. Lengths count each image as
    `count_image` tokens; an observation that does not fit ends the trajectory before it, images and all. Returns
    samples (info: messages, the images the tools returned, tool schemas, turn and tool counts) and metrics.
    Toolboxes are always closed, each even when another's close fails. A prompt that leaves no room under
    max_total_tokens is refused (ValueError) before anything is generated."""
    start = time.perf_counter()
    eot = eot or chat.end_of_turn(tokenizer)
    trajectories: list[Trajectory] = []
    start_failures = []  # trajectories whose container the daemon would not start, even after retries
    try:
        for i in range(len(rows) * group_size):
            row = rows[i // group_size]
            try:
                box = new_toolbox(row)
            except containers.ContainerStartFailed as e:  # lost, but counted (swe/start_failures), never scored
                start_failures.append(e)
                continue
            images = data_prep.row_images(row)
            prompt_text = chat.render(tokenizer, row["prompt"], box.schemas, add_generation_prompt=True)
            traj = Trajectory(row, first_group + i // group_size, box, list(row["prompt"]),
                              tokenizer(prompt_text, add_special_tokens=False)["input_ids"], images=images,
                              prompt_images=len(images), image_tokens=sum(count_image(im) - 1 for im in images))
            trajectories.append(traj)
            if traj.length >= limits.max_total_tokens:
                task = data_prep.row_id(row) if "extra_info" in row else f"rows[{i // group_size}]"
                raise ValueError(f"{task}: the prompt is {traj.length} tokens with the tool signatures and its "
                                 f"images, no room for an answer within max_total_tokens {limits.max_total_tokens}")
        with ThreadPoolExecutor(max_workers=16) as pool:
            while collectives.any_rank(live := [traj for traj in trajectories if not traj.finish_reason]):
                _agent_turn(engine, tokenizer, live, sampling, limits, eot, pool, count_image)
    finally:
        close_all([traj.box for traj in trajectories])
    samples, pad_id = [], chat.image_pad_id(tokenizer)
    for traj in trajectories:
        samples.append(Sample(
            prompt_ids=traj.prompt_ids, completion_ids=traj.completion_ids, loss_mask=traj.loss_mask,
            engine_logprobs=traj.logprobs, row=traj.row, group=traj.group, finish_reason=traj.finish_reason,
            text=traj.box.info.pop("completion", "\n".join(
                m["content"] for m in traj.messages[len(traj.row["prompt"]):] if m["role"] == "assistant")),
            info={"messages": traj.messages, "images": traj.images[traj.prompt_images:], "tools": traj.box.schemas,
                  "turns": traj.turns, "tool_calls": traj.tool_calls, "tool_errors": traj.tool_errors,
                  "agent_seconds": traj.seconds, "tool_log": traj.tool_log} | traj.box.info,
            images=traj.images))
        check_images(samples[-1], pad_id)
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
    if start_failures:
        tqdm.write(f"rank {collectives.rank()}: {len(start_failures)} of {len(rows) * group_size} trajectories had no "
                   f"container (left out): {start_failures[0]}")
        metrics["swe/start_failures"] = float(len(start_failures))
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


def _agent_turn(engine: Engine, tokenizer, live: list[Trajectory], sampling: Sampling, limits: AgentLimits,
                eot: str, pool: ThreadPoolExecutor, count_image: Callable[[bytes], int] = placeholder_only) -> None:
    if not live:  # other ranks still turn: one throwaway token keeps this rank's collectives in step
        _generate(engine, [[tokenizer.pad_token_id]], dataclasses.replace(sampling, max_new_tokens=1), [[]])
        return
    budget = min(max(limits.max_total_tokens - traj.length for traj in live), sampling.max_new_tokens)
    turn_sampling = dataclasses.replace(sampling, max_new_tokens=max(budget, 1))
    if all(traj.box.protocol == "codev" for traj in live):  # the engine stops on </code> (chat.code_stop decides)
        turn_sampling.stop = [*sampling.stop, chat.CODE_STOP]
    completions = _generate(engine, [traj.prompt_ids + traj.completion_ids for traj in live], turn_sampling,
                            [list(traj.images) for traj in live])
    pending, eot_id = [], tokenizer.convert_tokens_to_ids(eot)
    for traj, c in zip(live, completions):
        room = limits.max_total_tokens - traj.length
        ids, logprobs = c.token_ids[:room], c.logprobs[:room]  # the batch budget follows the longest trajectory
        # The tag protocol stops on </code>: what an engine generated after it is dropped, the ids kept as sampled.
        cut = chat.code_stop(tokenizer, ids) if traj.box.protocol == "codev" else None
        ids, logprobs = (ids[:cut], logprobs[:cut]) if cut else (ids, logprobs)
        traj.completion_ids += ids
        traj.loss_mask += [1] * len(ids)
        traj.logprobs += logprobs
        traj.turns += 1
        ended = bool(ids) and ids[-1] == eot_id  # only a turn closed by the template's token can take tool results
        stopped = ended or bool(cut) or (c.finish_reason == "stop" and len(ids) == len(c.token_ids))
        content = tokenizer.decode(ids[:-1] if stopped and not cut else ids, skip_special_tokens=False)
        traj.messages.append({"role": "assistant", "content": content})
        if traj.box.protocol == "codev":
            calls = chat.parse_code_action(content) if cut else []
        else:
            calls = chat.parse_tool_calls(content, set(traj.box.tools)) if ended else []
        traj.seconds = time.monotonic() - traj.started
        if not calls:
            truncated = len(ids) < len(c.token_ids) and not cut
            traj.finish_reason = "stop" if stopped else ("max_total_tokens" if truncated else "length")
        elif traj.turns >= limits.max_turns:
            traj.finish_reason = "max_turns"
        elif traj.seconds >= limits.max_seconds:
            traj.finish_reason = "max_seconds"
        else:
            pending.append((traj, calls, [pool.submit(call_tool, traj.box, call) for call in calls]))
    for traj, calls, futures in pending:
        results, submitted = [], False
        for call, future in zip(calls, futures):
            result, seconds = future.result()
            submitted |= result.stop
            result.text, cut = chat.truncate_tool_text(tokenizer, result.text, limits.max_tool_response_tokens)
            traj.tool_log.append({"turn": traj.turns, "name": call["name"] if isinstance(call, dict) else None,
                                  "arguments": call["arguments"] if isinstance(call, dict) else call,
                                  "output": result.text, "error": result.error, "seconds": seconds,
                                  "images": result.images})
            results.append(result)
            traj.tool_calls += 1
            traj.tool_errors += result.error
            traj.tool_seconds += seconds
            traj.truncated_responses += cut
        traj.seconds = time.monotonic() - traj.started
        if submitted:  # end on the policy's own turn: nothing after it is learned from
            traj.finish_reason = "submit"
            continue
        images = [image for result in results for image in result.images]
        if traj.box.protocol == "codev":
            new_messages = [chat.observation_message("\n".join(r.text for r in results), len(images))]
        else:
            new_messages = [tool_message(result) for result in results]
        ids = chat.template_suffix_ids(tokenizer, traj.messages, new_messages, traj.box.schemas, eot,
                                       after_eot=traj.box.protocol != "codev")
        added = sum(count_image(image) - 1 for image in images)
        if traj.length + len(ids) + added >= limits.max_total_tokens:  # no room to answer: end on the policy's turn,
            traj.finish_reason = "max_total_tokens"  # without the observation or its images
            continue
        traj.messages += new_messages
        traj.completion_ids += ids
        traj.loss_mask += [0] * len(ids)
        traj.logprobs += [0.0] * len(ids)
        traj.images += images
        traj.image_tokens += added


def _generate(engine: Engine, prompts: list[list[int]], sampling: Sampling, images: list[list[bytes]]):
    """Images (each prompt's, in placeholder order) go to engines that take them; a text-only engine sees only their
    placeholder tokens."""
    if any(images) and "images" in inspect.signature(engine.generate).parameters:
        return engine.generate(prompts, sampling, images=[i or None for i in images])
    return engine.generate(prompts, sampling)


# External agents (--agent-cmd): one agent process per trajectory, talking to this rank's endpoint; each segment of
# its session becomes a Sample, trained on the ids the policy sampled and rewarded on the result the agent left.


def external_agents(agent_cmd: str, engine: Engine, tokenizer, rows: list[dict], group_size: int, sampling: Sampling,
                    tools: str = "none", limits: AgentLimits | None = None, first_group: int = 0,
                    check: bool = False, eot: str | None = None,
                    keep_failed: bool = False, train_side_queries: bool = False) -> tuple[list[Sample], dict]:
    """`group_size` runs of `agent_cmd` (agent_server.start_agent's placeholders) per row, all at once, each killed
    (its process group) past limits.max_seconds; the rank's engine serves them (agent_server.AgentServer, sampling
    fixed to `sampling`, replies within limits.max_total_tokens) until every agent on every rank has ended.
    Collective under torchrun. Each recorded segment is a Sample of the row's group whose text is the agent's result
    file (what the reward grades; for swebench rows its patch). An agent that exits non-zero or is killed ends its
    session: its samples are dropped, or kept with keep_failed. `tools` names the rows' kind only (the agent brings
    its own tools). check: check_tito on every sample (tools/tito_drift_frac). Side segments (agent_server: another
    system prompt or other tools) are recorded and train only with train_side_queries."""
    limits = limits or AgentLimits()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kiln-agents-") as workdir, \
            open(Path(workdir) / "agents.log", "wb") as log, \
            agent_server.AgentServer(engine, tokenizer, sampling, eot, limits.max_total_tokens,
                                     train_side_queries=train_side_queries) as server:
        agents = [agent_server.start_agent(agent_cmd, server.base_url, rows[i // group_size],
                                           first_group + i // group_size, Path(workdir), log)
                  for i in range(len(rows) * group_size)]
        try:
            while server.step(busy=any([agent.poll(limits.max_seconds) for agent in agents])):
                pass
        finally:
            for agent in agents:
                if agent.status == "running":
                    agent_server.kill_group(agent.process)
        log.flush()
        failures = Path(workdir, "agents.log").read_text(errors="replace")[-2000:]
        segments = [server.end_session(agent.key) for agent in agents]
        results = [agent.completion() for agent in agents]
    if tools == "swe":  # containers of killed agents: their owner process is gone
        containers.sweep(containers.shared_client())
    samples = []
    for agent, recorded, text in zip(agents, segments, results):
        if agent.status != "ok" and not keep_failed:
            continue
        trained = [segment for segment in recorded if segment.trains]  # side queries only with train_side_queries
        for k, segment in enumerate(trained):
            samples.append(Sample(
                prompt_ids=segment.prompt_ids, completion_ids=segment.completion_ids, loss_mask=segment.loss_mask,
                engine_logprobs=segment.logprobs, row=agent.row, group=agent.group, text=text,
                finish_reason=segment.finish_reason,
                info={"messages": segment.messages, "tools": segment.tools, "agent_status": agent.status,
                      "agent_returncode": agent.process.returncode, "agent_seconds": agent.seconds,
                      "session": agent.key, "segment": k, "segments": len(trained), "opened": segment.opened,
                      "open_turns": segment.open_turns}))
    n = max(1, len(agents))
    seconds = time.perf_counter() - start
    metrics = {
        "rollout/seconds": seconds,
        "rollout/tokens_per_s": sum(sum(s.loss_mask) for s in samples) / max(seconds, 1e-9),
        "agents/failed_frac": sum(agent.status == "failed" for agent in agents) / n,
        "agents/timeout_frac": sum(agent.status == "timeout" for agent in agents) / n,
        "agents/segments_mean": sum(len(r) for r in segments) / n,
        "agents/requests": float(server.requests),
        "agents/generate_calls": float(server.generate_calls),
        "agents/seconds_mean": sum(agent.seconds for agent in agents) / n,
    }
    if any(agent.status != "ok" for agent in agents):
        tqdm.write(f"rank {collectives.rank()}: {sum(agent.status != 'ok' for agent in agents)} of {len(agents)} agents failed or "
                   f"timed out ({'kept' if keep_failed else 'dropped'}); the end of their output:\n{failures}")
    if not collectives.any_rank(samples):  # nothing to train on or grade on any rank: the command is broken
        raise RuntimeError(f"--agent-cmd: no agent of this round left a session to learn from ({len(agents)} agents on "
                         f"this rank: {metrics['agents/failed_frac']:.0%} exited non-zero, "
                         f"{metrics['agents/timeout_frac']:.0%} were killed at the wall limit); the end of their "
                         f"output:\n{failures}")
    if check and samples:
        drifts = [chat.check_tito(tokenizer, s, s.info["messages"], s.info["tools"], eot,
                                  s.info.get("open_turns", ())) for s in samples]
        metrics["tools/tito_drift_frac"] = sum(bool(d) for d in drifts) / len(drifts)
        metrics["tools/tito_mask_drift_frac"] = sum(chat.mask_drifted(d) for d in drifts) / len(drifts)
    return samples, metrics
