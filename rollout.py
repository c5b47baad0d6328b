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
import functools
import inspect
import itertools
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from tqdm import tqdm

import agent_server
import chat
import collectives
import containers
import engines
import task_rows
from engines import Engine, Sampling
from tools import TOOL_SCHEMAS, TOOLBOXES, ToolBox, call_tool, check_swe_rows, tool_message


# Sample.info: what a rollout leaves beside the tokens, for check_tito, the judge, samples.jsonl and the board. The
# trainers never read it (what they read is a typed field of Sample); each key is written in one place, named here.
INFO_KEYS = {
    # rollout.multi_turn (kiln's own agent loop)
    "messages": "the conversation as chat messages: the prompt, each turn, each tool result (external agents too)",
    "tools": "the tool schemas the chat template rendered (external agents too)",
    "images": "the images the tools returned, in order (Sample.images holds the row's first)",
    "turns": "assistant turns taken",
    "tool_calls": "tool calls made",
    "tool_errors": "tool calls that failed (a bad call, an exception, a timeout)",
    "agent_seconds": "wall seconds of the trajectory (external agents: of the agent process)",
    "tool_log": "per tool call: turn, name, arguments, output, error, seconds, images",
    # tools.py's ToolBox.info (the swe toolbox), copied in by multi_turn
    "container_seconds": "seconds spent in Docker: start, commands, the diff, removal",
    "diff_error": "why the container's diff could not be taken (the completion is then empty)",
    "container_wait": "of container_seconds, the wait for the container (none when the pool had it running)",
    "infra_failed": "why the infrastructure failed under the trajectory (its container or the daemon): not scored, "
    "not trained on, counted in swe/infra_failed",
    # rollout.external_agents
    "agent_status": "the agent process: ok, failed (non-zero exit) or timeout (killed at --max-agent-seconds)",
    "agent_returncode": "the agent process's exit status",
    "opened": "when the segment's first request arrived (seconds since the session opened)",
    "open_turns": "assistant turns the agent left open (a reply it never sent back), which check_tito allows",
    "harness": "what --agent-cmd's {harness} was for the trajectory (mixed harnesses in one run)",
}


@dataclass
class Sample:
    """One trajectory: the prompt, everything after it, and what the trainer needs to learn from it. `info` holds the
    rollout's extras (INFO_KEYS says what each key is), `reward_info` the Reward's (rewards.py's families say theirs)."""

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
    info: dict = field(default_factory=dict)  # the rollout's extras: INFO_KEYS
    reward_info: dict = field(default_factory=dict)  # the Reward's info: error kind, test counts, judge verdicts, ...
    session: str | None = None  # an external agent's session (its segments are samples that share one result)
    segment: int = 0  # this sample's place among its session's segments
    segments: int = 1  # how many segments its session has
    images: list[bytes] = field(default_factory=list)  # encoded images, one per placeholder in `ids`, in that order
    versions: list[int] = field(default_factory=list)  # multi-turn, per completion token: the policy version (the
    # trainer's step) whose weights sampled it, or, outside the loss mask, in force when it was appended

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
        task = task_rows.row_id(sample.row) if "extra_info" in sample.row else "a row"
        raise RuntimeError(f"{task}: the trajectory has {len(sample.images)} images but {rendered} image placeholders")


def load_rows_within(source: str, tokenizer, max_prompt_tokens: int, verbose: bool = True,
                     tools: str = "none", count_image: Callable[[bytes], int] = placeholder_only) -> Sequence[dict]:
    """`task_rows.load_rows(source)` less the rows whose prompt, as the rollout renders it (with the signatures of the
    toolbox `tools`, each image placeholder counted as `count_image` tokens), is longer than `max_prompt_tokens`
    (counted, and printed when verbose); a source with none left is refused."""
    rows = task_rows.load_rows(source)
    check_swe_rows(rows, tools, source)
    lengths = prompt_lengths(rows, tokenizer, TOOL_SCHEMAS[tools] if tools != "none" else None, count_image)
    kept = task_rows.subset(rows, [i for i, n in enumerate(lengths) if n <= max_prompt_tokens])
    if not kept:
        raise ValueError(f"{source}: no row has a prompt within --max-prompt-tokens {max_prompt_tokens}")
    if len(kept) < len(rows) and verbose:
        print(f"{source}: skipped {len(rows) - len(kept)} of {len(rows)} rows longer than {max_prompt_tokens} tokens")
    return kept


def prompt_lengths(rows: Sequence[dict], tokenizer, schemas: list[dict] | None,
                   count_image: Callable[[bytes], int] = placeholder_only) -> list[int]:
    """Each row's prompt length in tokens as the rollout renders it (with the tool `schemas`, each image counted as
    `count_image` tokens). A parquet file's rows (task_rows.Rows) render and tokenize once per tokenizer, template and
    tool signatures (chat.rendering_key), and count images once per image processor (a `count_image` with a `key`,
    vision.ImageCounter): the lengths stay beside the file's Arrow copy, where the other ranks and later starts read
    them instead of tokenizing the whole set again."""
    lengths = task_rows.per_row(rows, "prompt-tokens", chat.rendering_key(tokenizer, schemas),
                                functools.partial(_text_lengths, tokenizer=tokenizer, schemas=schemas))
    if count_image is not placeholder_only:  # images are read only to be counted: a text model counts none
        lengths = lengths + task_rows.per_row(rows, "image-tokens", getattr(count_image, "key", None),
                                              functools.partial(_image_tokens, count_image=count_image))
    return lengths.tolist()


def _text_lengths(rows: Sequence[dict], tokenizer, schemas: list[dict] | None) -> list[int]:
    lengths, prompts = [], task_rows.values(rows, "prompt")
    while chunk := list(itertools.islice(prompts, 1024)):  # a chunk at a time: a rank never holds every prompt's ids
        texts = [chat.render(tokenizer, prompt, schemas, add_generation_prompt=True) for prompt in chunk]
        lengths += map(len, tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"])
    return lengths


def _image_tokens(rows: Sequence[dict], count_image: Callable[[bytes], int]) -> list[int]:
    """What each row's images add to its prompt beyond their placeholders."""
    return [sum(count_image(task_rows.image_bytes(image)) - 1 for image in images or [])
            for images in task_rows.values(rows, "images")]


def collect(engine: Engine, tokenizer, rows: list[dict], group_size: int, sampling: Sampling, tools: str = "none",
            limits: AgentLimits | None = None, first_group: int = 0, check: bool = False,
            eot: str | None = None, count_image: Callable[[bytes], int] = placeholder_only,
            in_flight=None, version: int = 0) -> tuple[list[Sample], dict]:
    """`group_size` samples of each row: single-turn, or multi-turn agent rollouts with the toolbox `tools` names
    (TOOLBOXES) whose turns end with the token `eot` (default: end_of_turn's), budgets counting each image as
    `count_image` tokens (in_flight, for partial rollouts, and version: multi_turn's). check: compare every
    trajectory with the chat template's rendering of its messages; the drifting fractions go to the metrics
    (tools/tito_drift_frac: any finding; tools/tito_split_frac: ids that split the text otherwise;
    tools/tito_mask_drift_frac: a loss mask or text that is wrong) and the first drift to the console: logged, not
    fatal. Returns samples and this rank's metrics."""
    if tools == "none":
        return single_turn(engine, tokenizer, rows, group_size, sampling, first_group)
    eot = eot or chat.end_of_turn(tokenizer)
    samples, metrics = multi_turn(engine, tokenizer, rows, group_size, sampling, TOOLBOXES[tools],
                                  limits or AgentLimits(), first_group, eot, count_image, in_flight=in_flight,
                                  version=version)
    if check and samples:
        drifts = [(s, chat.check_tito(tokenizer, s, s.info["messages"], s.info["tools"], eot)) for s in samples]
        metrics |= tito_metrics([d for _, d in drifts])
        first = next(((s, d) for s, d in drifts if chat.mask_drifted(d)), None) or next(
            ((s, d) for s, d in drifts if d), None)
        if first is not None:
            task, findings = task_rows.row_id(first[0].row), "; ".join(first[1].values())
            tqdm.write(f"rank {collectives.rank()}, task {task}: check_tito: {findings} ({tito_meaning(first[1])})")
    return samples, metrics


def single_turn(engine: Engine, tokenizer, rows: list[dict], group_size: int, sampling: Sampling,
                first_group: int = 0) -> tuple[list[Sample], dict]:
    """Each row's prompt (and images) sampled `group_size` times, one completion each. Returns samples and metrics."""
    start = time.perf_counter()
    prompts = [chat.encode_prompt(tokenizer, row["prompt"]) for row in rows]
    repeated = [p for p in prompts for _ in range(group_size)]
    images = [task_rows.row_images(row) for row in rows for _ in range(group_size)]
    seeds = sample_seeds(sampling, [(first_group + i // group_size, i % group_size, 0) for i in range(len(repeated))])
    completions = _generate(engine, repeated, sampling, images, seeds)
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
# messages as the chat template formats them (only that suffix is tokenized, never the trajectory), continue. Each
# trajectory goes at its own pace: no reply waits for another's tools, no tool call for another's reply.


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
    index: int  # in its group
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
    # "max_seconds", "infra" (its container or the daemon failed: dropped)
    started: float = field(default_factory=time.monotonic)  # moved on by the time it spent paused
    seconds: float = 0.0  # wall clock from the start to the end of its last turn
    versions: list[int] = field(default_factory=list)  # per completion token (Sample.versions)

    @property
    def length(self) -> int:
        """Tokens as the model sees them: image placeholders expanded."""
        return len(self.prompt_ids) + len(self.completion_ids) + self.image_tokens


def tito_meaning(findings: dict) -> str:
    """What check_tito's findings mean for training, said beside them: a sampled split of the template's text is
    trained as sampled (harmless); a mask or text drift would train the wrong tokens."""
    if chat.mask_drifted(findings):
        return "a mask or text drift: tokens other than the policy's would be trained"
    return "another split of the same text: harmless, the ids are trained as sampled"


def tito_metrics(drifts: list[dict]) -> dict:
    """Fractions of trajectories by chat.check_tito's findings (one dict each): any finding, ids that split the text
    otherwise than the tokenizer (trained as sampled), a loss mask or text that is wrong."""
    return {"tools/tito_drift_frac": sum(bool(d) for d in drifts) / len(drifts),
            "tools/tito_split_frac": sum("ids" in d for d in drifts) / len(drifts),
            "tools/tito_mask_drift_frac": sum(chat.mask_drifted(d) for d in drifts) / len(drifts)}


def multi_turn(engine: Engine, tokenizer, rows: list[dict], group_size: int, sampling: Sampling,
               new_toolbox: Callable[[dict], ToolBox], limits: AgentLimits = AgentLimits(),
               first_group: int = 0, eot: str | None = None,
               count_image: Callable[[bytes], int] = placeholder_only, lockstep: bool = False,
               version: int = 0, in_flight=None) -> tuple[list[Sample], dict]:
    """Multi-turn rollout: each row's prompt (and images) `group_size` times, every trajectory on its own
    (`run_trajectories`): its next turn goes to the engine as soon as its tool results are in, its tool calls start as
    soon as its reply is parsed. lockstep: the reference the tests and bench/agent_rollout.py compare against, every
    engine call waiting for every live trajectory. A turn that ends with the token `eot` (default: end_of_turn's), or
    (tag protocol) stops on </code>, can call tools. Lengths count each image as `count_image` tokens; an observation
    that does not fit ends the trajectory before it, images and all. Every token appended is of policy `version`
    (Sample.versions). Returns samples (info: messages, the images the tools returned, tool schemas, turn and tool
    counts) and metrics. Toolboxes are closed once their trajectories are returned, and all of them on an error or
    Ctrl-C, each even when another's close fails. A prompt that leaves no room under max_total_tokens is refused
    (ValueError) before anything is generated. Ranks do not meet here (but for a tensor-parallel engine's peers, at
    each engine call).
    in_flight (partial rollouts: partial_rollouts.InFlight) drives the same loop its own way (`run_phase`): it adds
    the trajectories it carries, ends the rollout once it has its groups, and keeps the trajectories it does not
    return."""
    start = time.perf_counter()
    eot = eot or chat.end_of_turn(tokenizer)
    starts = [(first_group + i // group_size, i % group_size, rows[i // group_size])
              for i in range(len(rows) * group_size)]  # (group, index in the group, row) to start from the prompt
    run = functools.partial(_start_and_run, engine, tokenizer, sampling, new_toolbox, limits, eot, count_image,
                            lockstep, version, first_group)
    trajectories, run_metrics = (run(starts) if in_flight is None
                                 else in_flight.run_phase(run, starts, group_size, version))
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
            images=traj.images, versions=traj.versions))
        check_images(samples[-1], pad_id)
    seconds = time.perf_counter() - start
    n = max(1, len(trajectories))  # a rank can run a round without rows of its own
    generated = sum(sum(traj.loss_mask) for traj in trajectories)
    metrics = {
        "rollout/seconds": seconds,
        "rollout/tokens_per_s": generated / max(seconds, 1e-9),
        "rollout/truncated_frac": sum(traj.finish_reason not in ("stop", "submit", "infra")
                                      for traj in trajectories) / n,
        "tools/turns_mean": sum(traj.turns for traj in trajectories) / n,
        "tools/calls_mean": sum(traj.tool_calls for traj in trajectories) / n,
        "tools/errors_mean": sum(traj.tool_errors for traj in trajectories) / n,
        "tools/seconds": sum(traj.tool_seconds for traj in trajectories),
        "tools/truncated_responses": sum(traj.truncated_responses for traj in trajectories),
        "tools/agent_seconds_mean": sum(traj.seconds for traj in trajectories) / n,
    } | run_metrics
    if any("container_seconds" in traj.box.info for traj in trajectories):
        metrics["swe/container_seconds"] = sum(traj.box.info.get("container_seconds", 0.0) for traj in trajectories)
        metrics["swe/container_wait_max_s"] = max(traj.box.info.get("container_wait", 0.0) for traj in trajectories)
        metrics["swe/diff_errors"] = sum("diff_error" in traj.box.info for traj in trajectories)
        metrics["swe/infra_failed"] = float(sum("infra_failed" in traj.box.info for traj in trajectories))
        if metrics["swe/infra_failed"]:
            failed = next(traj.box.info["infra_failed"] for traj in trajectories if "infra_failed" in traj.box.info)
            tqdm.write(f"rank {collectives.rank()}: the infrastructure failed under {metrics['swe/infra_failed']:.0f} "
                       f"trajectories (dropped, not scored): {failed}")
    for reason in ("length", "max_turns", "max_total_tokens", "max_seconds", "submit", "infra"):
        metrics[f"rollout/finish_{reason}_frac"] = sum(traj.finish_reason == reason for traj in trajectories) / n
    return samples, metrics


def _start_and_run(engine: Engine, tokenizer, sampling: Sampling, new_toolbox: Callable[[dict], ToolBox],
                   limits: AgentLimits, eot: str, count_image: Callable[[bytes], int], lockstep: bool, version: int,
                   first_group: int, starts: list[tuple[int, int, dict]], carried: Sequence[Trajectory] = (),
                   stop_when: Callable[[list[Trajectory]], bool] | None = None) -> tuple[list[Trajectory], dict]:
    """multi_turn's loop: a trajectory on a fresh toolbox for each (group, index in the group, row) of `starts`, run
    with `carried` (trajectories started in an earlier call) by `run_trajectories` (with its `stop_when`). Returns
    them all, by group and index, and the schedule's metrics with swe/start_failures: trajectories whose container
    the daemon would not start, even after retries, are left out (never scored) and counted. On an error or Ctrl-C
    every toolbox, the carried ones' too, is closed."""
    trajectories, start_failures = list(carried), []
    try:
        for group, index, row in starts:
            try:
                box = new_toolbox(row)
            except containers.ContainerStartFailed as e:  # lost, but counted (swe/start_failures), never scored
                start_failures.append(e)
                continue
            images = task_rows.row_images(row)
            prompt_text = chat.render(tokenizer, row["prompt"], box.schemas, add_generation_prompt=True)
            traj = Trajectory(row, group, index, box, list(row["prompt"]),
                              tokenizer(prompt_text, add_special_tokens=False)["input_ids"], images=images,
                              prompt_images=len(images), image_tokens=sum(count_image(im) - 1 for im in images))
            trajectories.append(traj)
            if traj.length >= limits.max_total_tokens:
                task = task_rows.row_id(row) if "extra_info" in row else f"rows[{group - first_group}]"
                raise ValueError(f"{task}: the prompt is {traj.length} tokens with the tool signatures and its "
                                 f"images, no room for an answer within max_total_tokens {limits.max_total_tokens}")
        trajectories.sort(key=lambda traj: (traj.group, traj.index))
        metrics = run_trajectories(engine, tokenizer, trajectories, sampling, limits, eot, count_image, lockstep,
                                   version, stop_when)
    except BaseException:
        close_all([traj.box for traj in trajectories])
        raise
    if start_failures:
        tqdm.write(f"rank {collectives.rank()}: {len(start_failures)} of {len(starts)} trajectories had no container "
                   f"(left out): {start_failures[0]}")
        metrics["swe/start_failures"] = float(len(start_failures))
    return trajectories, metrics


def close_all(boxes: list[ToolBox]) -> None:
    """Close every toolbox, at once on a thread pool (a task's close runs its tests), even when some fail or a Ctrl-C
    interrupts the wait; a failure is raised afterwards. (Containers that a second Ctrl-C leaves go at the trainer's
    exit, their TTL or the next start's sweep.)"""
    failures = []

    def close(box: ToolBox) -> None:
        try:
            box.close()
        except BaseException as e:  # noqa: B036 -- the rest must still be closed; re-raised below
            failures.append(e)
    if boxes:
        with ThreadPoolExecutor(max_workers=min(len(boxes), MAX_TOOL_THREADS), thread_name_prefix="kiln-close") as pool:
            list(pool.map(close, boxes))
    if failures:
        raise failures[0]


MAX_TOOL_THREADS = 64  # tool calls running at once on a rank (SWE: docker execs, mostly waiting on the daemon)


def run_trajectories(engine: Engine, tokenizer, trajectories: list[Trajectory], sampling: Sampling,
                     limits: AgentLimits, eot: str, count_image: Callable[[bytes], int] = placeholder_only,
                     lockstep: bool = False, version: int = 0,
                     stop_when: Callable[[list[Trajectory]], bool] | None = None) -> dict:
    """Drive every trajectory to its finish_reason. A continuously batching engine (`engines.continuous`) gets each
    trajectory's turn as soon as it is ready (its prompt, or its tool results, are in) and gives the reply back at the
    decoding step that ends it; any other engine's call takes every trajectory that is ready, in trajectory order.
    Meanwhile the tools of the others run on a thread pool, and the main thread waits only when nothing is
    generating. lockstep: an engine call waits until no tool call is running (every live trajectory is ready), as one
    turn of all trajectories at a time. Every token appended gets `version` (Trajectory.versions). stop_when(the
    trajectories), asked each time tool results are in, ends the rollout early (partial rollouts:
    partial_rollouts.Ending): while it holds no turn starts, the turns and tool calls running end and are appended,
    and once none runs the unfinished trajectories are left ready for their next turn. The engine's peers
    (`engines.call_group`, a tensor-parallel vLLM engine's ranks) agree before each call, a peer with nothing ready
    calling with no prompts; other ranks never meet here. Returns the schedule's metrics: engine and tool busy
    fractions of the wall time, engine calls (steps, for a continuous engine) and trajectories per call, most tool
    calls running at once."""
    start, eot_id, group = time.monotonic(), tokenizer.convert_tokens_to_ids(eot), engines.call_group(engine)
    stepping = engines.continuous(engine) and not lockstep
    order = {id(traj): k for k, traj in enumerate(trajectories)}
    submitted: dict[int, Trajectory] = {}  # turns in a continuous engine, by id(trajectory)
    ready = [traj for traj in trajectories if not traj.finish_reason]
    held: list[Trajectory] = []  # ready, but no turn may start while stop_when holds
    running: list[tuple[Trajectory, list[Future]]] = []  # trajectories whose tool calls have not all returned
    engine_seconds, calls, batched, spans, most_running = 0.0, 0, 0, [], 0
    pool = ThreadPoolExecutor(max_workers=MAX_TOOL_THREADS, thread_name_prefix="kiln-tools")
    try:
        while True:
            done = [all(f.done() for f in futures) for _, futures in running]  # once: futures finish meanwhile
            returned = [entry for entry, d in zip(running, done) if d]
            running = [entry for entry, d in zip(running, done) if not d]
            for traj, futures in returned:
                results = [f.result() for f in futures]
                spans += [(began, ended) for *_, began, ended in results]
                if _take_tool_results(tokenizer, traj, [(call, r, s) for call, r, s, _, _ in results], limits, eot,
                                      count_image):
                    ready.append(traj)
            stop = stop_when is not None and stop_when(trajectories)
            ready, held = ([], held + ready) if stop else (held + ready, [])
            if stepping:
                for traj in ready:
                    _submit(engine, traj, sampling, limits)
                    submitted[id(traj)] = traj
                ready = []
                generating, live = bool(submitted), bool(running or submitted)
            else:
                batch = sorted(ready, key=lambda t: order[id(t)]) if not (lockstep and running) else []
                generating, live = bool(batch), bool(running or ready)
                if group is not None:
                    generating, live = collectives.any_ranks(generating, live, group=group)
            if not live:
                break
            if not generating:
                futures_wait([f for _, futures in running for f in futures], return_when=FIRST_COMPLETED)
                continue
            began = time.monotonic()
            if stepping:
                batched += len(submitted)
                replies = [(submitted.pop(key), completion) for key, completion in engine.step()]
            else:
                batched += len(batch)
                replies = list(zip(batch, _generate_turn(engine, tokenizer, batch, sampling, limits)))
                ready = ready if not batch else []  # a batch is everything that was ready
            engine_seconds, calls = engine_seconds + time.monotonic() - began, calls + 1
            for traj, completion in replies:
                tool_calls = _take_reply(tokenizer, traj, completion, limits, eot_id)
                if tool_calls:
                    running.append((traj, [pool.submit(_timed_call, traj.box, c) for c in tool_calls]))
            most_running = max(most_running, sum(len(futures) for _, futures in running))
    finally:  # on an error or Ctrl-C, calls not started are dropped; the running ones end before the boxes close
        pool.shutdown(wait=True, cancel_futures=True)
        if submitted:  # turns left in a continuous engine: it must be empty for the next weights
            engine.abort()
    for traj in trajectories:
        traj.versions += [version] * (len(traj.completion_ids) - len(traj.versions))
    seconds = max(time.monotonic() - start, 1e-9)
    return {"rollout/engine_busy_frac": engine_seconds / seconds, "tools/busy_frac": _covered(spans) / seconds,
            "rollout/engine_calls": float(calls), "rollout/in_flight_mean": batched / max(1, calls),
            "tools/running_max": float(most_running)}


def _timed_call(box: ToolBox, call: dict | str) -> tuple:
    """The call, call_tool's result and seconds, and when it began and ended (time.monotonic) for the busy
    fraction."""
    began = time.monotonic()
    result, seconds = call_tool(box, call)
    return call, result, seconds, began, time.monotonic()


def _covered(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of (begin, end) spans."""
    total, reach = 0.0, float("-inf")
    for began, ended in sorted(spans):
        total += max(0.0, ended - max(began, reach))
        reach = max(reach, ended)
    return total


def _generate_turn(engine: Engine, tokenizer, batch: list[Trajectory], sampling: Sampling, limits: AgentLimits):
    """One engine call for the next turn of `batch` (possibly empty: a tensor-parallel peer's share of a call)."""
    return _generate(engine, [traj.prompt_ids + traj.completion_ids for traj in batch],
                     _turn_sampling(batch, sampling, limits), [list(traj.images) for traj in batch],
                     sample_seeds(sampling, [(traj.group, traj.index, traj.turns) for traj in batch]))


def _submit(engine: engines.ContinuousEngine, traj: Trajectory, sampling: Sampling, limits: AgentLimits) -> None:
    """The next turn of `traj` to a continuous engine, named by id(traj)."""
    seeds = sample_seeds(sampling, [(traj.group, traj.index, traj.turns)])
    extra = {"images": list(traj.images)} if traj.images and _takes_images(engine.submit) else {}
    engine.submit(id(traj), traj.prompt_ids + traj.completion_ids, _turn_sampling([traj], sampling, limits),
                  None if seeds is None else seeds[0], **extra)


def _turn_sampling(batch: list[Trajectory], sampling: Sampling, limits: AgentLimits) -> Sampling:
    """A turn's budget: the room of the trajectory with the most (_take_reply cuts each reply to its own). The tag
    protocol's turn stops on </code> (chat.code_stop decides)."""
    budget = min(max((limits.max_total_tokens - traj.length for traj in batch), default=1), sampling.max_new_tokens)
    turn_sampling = dataclasses.replace(sampling, max_new_tokens=max(budget, 1))
    if batch and all(traj.box.protocol == "codev" for traj in batch):
        turn_sampling.stop = [*sampling.stop, chat.CODE_STOP]
    return turn_sampling


def _take_reply(tokenizer, traj: Trajectory, c, limits: AgentLimits, eot_id: int) -> list:
    """Append a generated turn to its trajectory; returns the tool calls to run, or [] when the turn ended it (its
    finish_reason set). What it sets depends only on the trajectory and the reply, never on the rest of the call."""
    room = limits.max_total_tokens - traj.length
    ids, logprobs = c.token_ids[:room], c.logprobs[:room]
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
    if not calls:  # a reply that filled the trajectory's room ran out of total tokens, whatever else was batched
        traj.finish_reason = "stop" if stopped else ("max_total_tokens" if len(ids) >= room else "length")
        if traj.finish_reason == "max_total_tokens":  # half a turn, cut by the trajectory's budget: kept, not trained
            traj.loss_mask[len(traj.loss_mask) - len(ids):] = [0] * len(ids)
    elif traj.turns >= limits.max_turns:
        traj.finish_reason = "max_turns"
    elif traj.seconds >= limits.max_seconds:
        traj.finish_reason = "max_seconds"
    else:
        return calls
    return []


def _take_tool_results(tokenizer, traj: Trajectory, returned: list[tuple], limits: AgentLimits, eot: str,
                       count_image: Callable[[bytes], int]) -> bool:
    """Append a turn's tool results ((call, result, seconds) in call order) as the template formats them (only that
    suffix is tokenized), and log each call; returns whether the trajectory goes on (else its finish_reason is set)."""
    results, submitted = [], False
    for call, result, seconds in returned:
        submitted |= result.stop
        if result.infra_failure:  # the trajectory ends here, dropped: its box's info says why
            traj.box.info.setdefault("infra_failed", result.infra_failure)
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
    if "infra_failed" in traj.box.info:
        traj.finish_reason = "infra"
        return False
    if submitted:  # end on the policy's own turn: nothing after it is learned from
        traj.finish_reason = "submit"
        return False
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
        return False
    traj.messages += new_messages
    traj.completion_ids += ids
    traj.loss_mask += [0] * len(ids)
    traj.logprobs += [0.0] * len(ids)
    traj.images += images
    traj.image_tokens += added
    return True


def sample_seeds(sampling: Sampling, turns: list[tuple[int, int, int]]) -> list[int] | None:
    """The seed of each (group, index in the group, turn) under the rollout's seed `sampling.seed` (None without one):
    a sample's tokens then depend on it alone, never on which samples share its engine call, the schedule or the rank.
    Single-turn samples are turn 0."""
    return None if sampling.seed is None else [engines.derive_seed(sampling.seed, *turn) for turn in turns]


def _takes_images(method) -> bool:
    """Whether an engine's `generate`/`submit` takes images; a text-only engine sees only their placeholder tokens."""
    return "images" in inspect.signature(method).parameters


def _generate(engine: Engine, prompts: list[list[int]], sampling: Sampling, images: list[list[bytes]],
              seeds: list[int] | None = None):
    """Images (each prompt's, in placeholder order) go to engines that take them; a text-only engine sees only their
    placeholder tokens. Seeds (one per prompt) go to every engine when the rollout has them."""
    extra = {} if seeds is None else {"seeds": seeds}
    if any(images) and _takes_images(engine.generate):
        return engine.generate(prompts, sampling, images=[i or None for i in images], **extra)
    return engine.generate(prompts, sampling, **extra)


# External agents (--agent-cmd): one agent process per trajectory, talking to this rank's endpoint; each segment of
# its session becomes a Sample, trained on the ids the policy sampled and rewarded on the result the agent left.


def pick_harness(row: dict, group: int, trajectory: int, harnesses: Sequence[str], mix_groups: bool) -> str:
    """A trajectory's harness (what --agent-cmd's {harness} becomes): the row's extra_info.harness, else `harnesses`
    in turn by the run-wide group id, one per GRPO group (so a group's advantages compare runs of one harness) or,
    with mix_groups, by the run-wide trajectory id; "" when neither names one."""
    if row["extra_info"].get("harness"):
        return row["extra_info"]["harness"]
    if not harnesses:
        return ""
    return harnesses[(trajectory if mix_groups else group) % len(harnesses)]


def harness_metrics(runs: list[tuple[str, str, float, int]]) -> dict:
    """agents/harness/<name>/...: each harness's share of the trajectories, failed and timed-out fractions, seconds and
    segments per run, over (harness, status, seconds, segments) of every rank's agents."""
    metrics = {}
    for harness in sorted({h for h, *_ in runs if h}):
        mine = [r for r in runs if r[0] == harness]
        metrics |= {f"agents/harness/{harness}/frac": len(mine) / len(runs),
                    f"agents/harness/{harness}/failed_frac": sum(r[1] == "failed" for r in mine) / len(mine),
                    f"agents/harness/{harness}/timeout_frac": sum(r[1] == "timeout" for r in mine) / len(mine),
                    f"agents/harness/{harness}/seconds_mean": sum(r[2] for r in mine) / len(mine),
                    f"agents/harness/{harness}/segments_mean": sum(r[3] for r in mine) / len(mine)}
    return metrics


def external_agents(agent_cmd: str, engine: Engine, tokenizer, rows: list[dict], group_size: int, sampling: Sampling,
                    tools: str = "none", limits: AgentLimits | None = None, first_group: int = 0,
                    check: bool = False, eot: str | None = None,
                    keep_failed: bool = False, train_side_queries: bool = False, harnesses: Sequence[str] = (),
                    mix_groups: bool = False) -> tuple[list[Sample], dict]:
    """`group_size` runs of `agent_cmd` (agent_server.start_agent's placeholders) per row, all at once, each killed
    (its process group) past limits.max_seconds; the rank's engine serves them (agent_server.AgentServer, sampling
    fixed to `sampling`, replies within limits.max_total_tokens, each request as it arrives) until this rank's
    agents have ended. Collective under torchrun at the end only. Each recorded segment is a Sample of the row's group whose text is the agent's result
    file (what the reward grades; for swebench rows its patch). An agent that exits non-zero or is killed ends its
    session: its samples are dropped, or kept with keep_failed. `tools` names the rows' kind only (the agent brings
    its own tools). check: check_tito on every sample (tools/tito_drift_frac). Side segments (agent_server: another
    system prompt or other tools) are recorded and train only with train_side_queries. `harnesses`, mix_groups: what
    {harness} becomes per trajectory (pick_harness); agents/harness/ metrics over every rank."""
    limits = limits or AgentLimits()
    groups = [first_group + i // group_size for i in range(len(rows) * group_size)]
    chosen = [pick_harness(rows[i // group_size], g, g * group_size + i % group_size, harnesses, mix_groups)
              for i, g in enumerate(groups)]
    if "harness" in agent_server.placeholders(agent_cmd) and "" in chosen:
        row = rows[chosen.index("") // group_size]
        raise ValueError(f"--agent-cmd takes {{harness}}, but row {task_rows.row_id(row)} has no extra_info.harness "
                         "and no --agent-harnesses are given")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kiln-agents-") as workdir, \
            open(Path(workdir) / "agents.log", "wb") as log, \
            agent_server.AgentServer(engine, tokenizer, sampling, eot, limits.max_total_tokens,
                                     train_side_queries=train_side_queries) as server:
        agents = [agent_server.start_agent(agent_cmd, server.base_url, rows[i // group_size],
                                           first_group + i // group_size, Path(workdir), log, chosen[i])
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
                finish_reason=segment.finish_reason, session=agent.key, segment=k, segments=len(trained),
                info={"messages": segment.messages, "tools": segment.tools, "agent_status": agent.status,
                      "agent_returncode": agent.process.returncode, "agent_seconds": agent.seconds,
                      "opened": segment.opened, "open_turns": segment.open_turns} | (
                    {"harness": agent.harness} if agent.harness else {})))
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
    } | harness_metrics(collectives.gather_objects([(agent.harness, agent.status, agent.seconds, len(recorded))
                                                    for agent, recorded in zip(agents, segments)]))
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
        metrics |= tito_metrics(drifts)
    return samples, metrics
