"""GRPO for code LLMs: `torchrun --nproc-per-node 8 train_grpo.py --model ... --data ...`.

Every rank holds an FSDP2 shard of the policy and its own rollout engine. One step, in `train_step()`:
rollouts -> rewards -> advantages -> (old/ref logprobs) -> minibatch updates (`update_policy`: forward -> loss ->
backward per micro-batch, then clip and step) -> metrics and checkpoints. The same code runs on a 2-core CPU (gloo,
HF engine, tiny model) and on 8 GPUs (nccl, vLLM).
"""
from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Literal

import torch
from tqdm import tqdm

import cli
import collectives
import engines
import losses
import partial_rollouts
import policy
import rewards
import rl_run
import rollout
import runlog
import task_rows
from checkpoint import load_checkpoint, load_newest_checkpoint, save_checkpoint

# Defaults that depend on the policy loss: GSPO clips a sequence-level ratio (its paper's ranges) and averages each
# sequence's tokens first.
LOSS_DEFAULTS = {"clip": {"clip_low": 0.2, "clip_high": 0.2, "loss_agg": "token-mean"},
                 "gspo": {"clip_low": 3e-4, "clip_high": 4e-4, "loss_agg": "seq-mean-token-mean"}}


@dataclass
class Args(rl_run.SharedArgs):
    """GRPO (and its variants) for code LLMs: `torchrun --nproc-per-node 8 train_grpo.py --model ... --data ...`."""

    # The settings both trainers share (rows, sampling, engine, memory, checkpoints, evaluation, tools, judge) are
    # declared once, in rl_run.SharedArgs; here are this algorithm's own, and its defaults where it differs.
    output_dir: str = "runs/grpo"
    """where metrics.jsonl, samples.jsonl, eval_report.json/.md/.png, best/ and checkpoints/ go"""

    group_size: int = 4
    """samples per prompt (the GRPO group)"""

    advantage: Literal["grpo", "drgrpo", "rloo", "reinforce++", "reinforce++-baseline"] = "grpo"
    """advantage estimator"""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal (no group-relative signal) and sample fresh
    prompts until every rank holds its share of groups that differ"""
    max_sampling_tries: int = 10
    """rounds of prompts per step that dynamic sampling may take; past them the step trains on the groups it has"""
    overlong_buffer: int = 0
    """DAPO soft overlong punishment: over the last N tokens before max_new_tokens the reward falls linearly by up to
    overlong_penalty; 0 = off"""
    overlong_penalty: float = 1.0
    """the largest overlong punishment (at max_new_tokens)"""
    mask_truncated: bool = False
    """DAPO overlong filtering: samples cut by a token limit count in their group's advantages but not in the loss"""
    policy_loss: Literal["clip", "gspo"] = "clip"
    """token-level clipped ratio (PPO/GRPO) or sequence-level ratio (GSPO)"""
    clip_low: float | None = None
    """lower clip range: ratio >= 1 - clip_low (default: 0.2; GSPO's sequence ratio 3e-4)"""
    clip_high: float | None = None
    """upper clip range: ratio <= 1 + clip_high (default: 0.2, DAPO's clip-higher 0.28; GSPO's sequence ratio 4e-4)"""
    dual_clip: float | None = None
    """dual-clip constant c (> 1) bounding the loss of negative advantages; None = off (not with GSPO)"""
    tis_cap: float | None = None
    """truncated importance sampling: cap on exp(old - engine logprob); None = off (--rollout-is token does the same
    with verl's metrics)"""
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm", None] = None
    """how token losses become one number (verl's names; default: token-mean, GSPO's seq-mean-token-mean)"""
    kl_coef: float = 0.0
    """weight of the KL(policy || reference) penalty in the loss; 0 = no reference model"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator used for the penalty and the logged KL"""

    lr: float = 1e-6
    """peak learning rate (AdamW)"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    warmup_steps: int = 0
    """linear warm-up steps"""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """learning-rate shape after warm-up"""
    max_grad_norm: float = 1.0
    """gradient clipping"""
    minibatches: int = 1
    """optimizer steps per batch of rollouts (1 = on-policy), each on whole groups"""

    total_steps: int = 100
    """training steps"""
    keep_checkpoints: int = 2
    """how many recent checkpoints to keep"""

    tools: Literal["none", "python", "codev", "swe"] = "none"
    """multi-turn agent rollouts with these tools (python: a stateful sandboxed interpreter per trajectory, called with
    <tool_call>; codev: the same on the row's images, called with CodeV's <code> tags; swe: bash, an editor and submit
    in a Docker container per trajectory, for swebench rows, graded on the container's diff)"""
    agent_cmd: str | None = None
    """an external agent per trajectory instead of kiln's own loop: a shell command with the placeholders {base_url}
    (this rank's OpenAI-compatible endpoint), {api_key} (the trajectory's session key), {row_json} or {row_file} (the
    row without its answers) and {result} (where the agent leaves what is graded: a swebench row's patch, else its
    answer); killed past --max-agent-seconds; replies within --max-total-tokens (docs/agents.md)"""
    agent_keep_failed: bool = False
    """with --agent-cmd: also train on the sessions of agents that exit non-zero or are killed (default: dropped)"""
    agent_harnesses: tuple[str, ...] = ()
    """with --agent-cmd: what its {harness} placeholder becomes, in turn per GRPO group (e.g. codex claude-code
    qwen-code with harness_agent.py); a row's extra_info.harness wins (docs/agents.md)"""
    agent_mix_groups: bool = False
    """with --agent-harnesses: take them in turn per trajectory, so that one group mixes harnesses"""
    partial_rollouts: bool = False
    """agent rollouts across steps (--tools; partial_rollouts.py): each rank keeps twice its groups in flight, a step's
    rollouts end once it holds its groups complete (never split), and the other trajectories pause between turns
    with their tokens, engine logprobs and live tools to go on next step under the new weights; combine with
    --rollout-is token (the engine's logprobs are the behaviour policy). A resumed run drops the paused ones (tool
    state is not checkpointed) and starts their groups again from their prompts"""
    max_staleness: int = 1
    """with --partial-rollouts: no token trains more than N steps after it was sampled. A step waits for an
    unfinished trajectory that would pass that (rollout/due_wait_seconds); a complete group left waiting that long
    restarts from its prompts on fresh tools (partial/restarted_stale)"""

    def __post_init__(self):
        for name, value in LOSS_DEFAULTS[self.policy_loss].items():  # unset: the policy loss's own default
            if getattr(self, name) is None:
                setattr(self, name, value)


@dataclass(kw_only=True)
class Run(rl_run.Run):
    """Everything a step touches, built once by `setup()`: rl_run.Run's fields and GRPO's own."""

    args: Args
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    in_flight: partial_rollouts.InFlight | None = None  # trajectories carried between steps (--partial-rollouts)


def main(args: Args, score_fn: rewards.ScoreFn = rewards.score_batch) -> Run:
    run = setup(args, score_fn)
    try:
        rl_run.train(run, train_step, save, args.total_steps, desc="grpo")
    finally:  # the paused trajectories' tools (sessions, containers) end with training, however it ends
        partial_rollouts.close(run.in_flight)
    return run


def check_args(args: Args, world: int) -> None:
    """GRPO's own refusals, after rl_run.check_args' shared ones and before anything loads: a group the advantage
    cannot compare within, and combinations the GRPO variants do not define."""
    if args.group_size < 2 and args.advantage != "reinforce++":  # a group of one is its own baseline: advantage 0
        raise ValueError(f"--advantage {args.advantage} compares samples of a group: --group-size must be >= 2, got "
                         f"{args.group_size} (or use --advantage reinforce++)")
    if args.policy_loss == "gspo" and args.dual_clip is not None:
        raise ValueError("--dual-clip bounds a token-level ratio; GSPO clips the sequence-level one (drop --dual-clip)")
    if args.dynamic_sampling and not args.distill_task_reward:
        raise ValueError("--dynamic-sampling keeps groups whose task rewards differ; --no-distill-task-reward "
                         "trains on none of them (drop one of the two)")
    if args.dynamic_sampling and args.advantage == "reinforce++":
        raise ValueError("--dynamic-sampling drops groups whose rewards are equal, which carry no signal only for "
                         "group-relative advantages; REINFORCE++ whitens over the batch, where they do (use "
                         "--advantage reinforce++-baseline)")
    if args.max_sampling_tries < 1:
        raise ValueError(f"--max-sampling-tries must be >= 1, got {args.max_sampling_tries}")
    if args.tis_cap is not None and (args.rollout_is or args.rollout_rs):
        raise ValueError("--tis-cap is rollout correction's token-level weight: use --rollout-is token "
                         "--rollout-is-threshold instead of combining them")
    if args.partial_rollouts and (args.tools == "none" or args.agent_cmd is not None or args.dynamic_sampling):
        raise ValueError("--partial-rollouts pauses kiln's own agent trajectories between turns: it needs --tools, and "
                         "takes neither --agent-cmd nor --dynamic-sampling")
    if args.max_staleness < 0:
        raise ValueError(f"--max-staleness must be >= 0, got {args.max_staleness}")
    if args.overlong_buffer and (args.tools != "none" or not 0 < args.overlong_buffer <= args.max_new_tokens):
        raise ValueError(f"--overlong-buffer {args.overlong_buffer} must be in (0, --max-new-tokens "
                         f"{args.max_new_tokens}] and measures single-turn answers (--tools none)")


def setup(args: Args, score_fn: rewards.ScoreFn) -> Run:
    """Checks, rows and judge first (rl_run.prepare), then the engine, the policy (and reference), the optimizer and
    its schedule, and the state of a resumed run."""
    ready = rl_run.prepare(args, score_fn, check_args)
    vllm_engine = rl_run.start_vllm(args, ready)
    model = rl_run.load_policy(args, ready.device)
    ref_model = rl_run.load_reference(args, ready.device)
    teacher = rl_run.load_teacher(args, ready.device)
    optimizer = policy.adamw(model, args.lr, args.weight_decay)
    scheduler = policy.lr_schedule(optimizer, args.warmup_steps, args.total_steps, args.lr_schedule)
    rl_run.start_tools(args)
    checkpoint, state = (load_newest_checkpoint(args.output_dir, lambda path: load_checkpoint(
        path, model, optimizer)) if args.resume else (None, None))
    state = state or {"step": 0, "data_pos": 0}  # a fresh run: no best policy or evaluations yet
    if checkpoint is not None:
        scheduler.load_state_dict(state["scheduler"])
        if ready.rank == 0:
            print(f"resumed from {checkpoint} at step {state['step']}")
    log = runlog.start(args.output_dir, ready.rank, dataclasses.asdict(args) | ready.model_names,
                       args.wandb_project, resume_step=state["step"] if args.resume else None,
                       samples_max_mb=args.samples_max_mb, log_to=args.log_to)
    return Run(args=args, rank=ready.rank, world=ready.world, model=model, ref_model=ref_model, teacher=teacher,
               optimizer=optimizer,
               scheduler=scheduler, engine=rl_run.rollout_engine(vllm_engine, model, ready.tokenizer),
               tokenizer=ready.tokenizer, sampling=ready.sampling, limits=ready.limits, rows=ready.rows,
               eval_rows=ready.eval_rows, score_fn=ready.score_fn, log=log, step=state["step"],
               data_pos=state["data_pos"], best=state.get("best", {}), evals=state.get("evals", []), judge=ready.judge,
               in_flight=partial_rollouts.setup(args, state, ready.rows, ready.rank, ready.world))


def train_step(run: Run) -> dict:
    """One GRPO step, phase by phase; each phase is the function of that name right below, in this order."""
    seconds = {}
    # 1-5. Prompts -> rollouts -> rewards, then the non-finite and dynamic-sampling filters.
    samples, batch, metrics = collect_batch(run, seconds)
    # 6. Advantages over the global batch (DAPO's truncation mask takes samples out of the loss after them).
    batch, advantage_metrics = assign_advantages(run, samples, batch)
    batch, _ = rl_run.sequence_group_batch(run, batch)  # --sequence-parallel: its ranks train on their samples together
    # 7. Old and reference logprobs (no grad) where the loss needs them; rollout correction's weights and mask; the
    # token advantages, with --teacher its logprobs' distillation term.
    with runlog.timed(seconds, "old_ref_logprobs"):
        old_logprobs, ref_logprobs = old_and_ref_logprobs(run, batch)
        recorded_logprobs = logprobs_to_record(run, samples)
        correction = rl_run.rollout_correction(run, old_logprobs, batch)
        advantages, distill_metrics = rl_run.distill(run, old_logprobs, batch, policy.padded(
            [[s.advantage] * len(s.loss_mask) for s in batch]))
    # 8. Minibatch updates: per micro-batch packed forward -> policy loss (+ KL) -> backward; then clip -> step.
    with runlog.timed(seconds, "update"):
        update_metrics = update_epochs(run, batch, old_logprobs, ref_logprobs, correction, advantages)
    # 9. Throughput, timings, the learning rate, staleness of the trained tokens and sample records.
    return (metrics | advantage_metrics | distill_metrics | update_metrics
            | partial_rollouts.staleness_metrics(run.in_flight, run.step, batch)
            | {"actor/lr": run.scheduler.get_last_lr()[0]}
            | rl_run.step_metrics(run, samples, seconds, run.args.total_steps, trainer_logprobs=recorded_logprobs))


def collect_batch(run: Run, seconds: dict) -> tuple[list[rollout.Sample], list[rollout.Sample], dict]:
    """Phases 1-5: every sample of the step (scored, each with its shaped reward), the batch it trains on, and their
    metrics. With --dynamic-sampling (DAPO) the phases run again on fresh prompts until every rank holds its share of
    groups whose rewards differ, at most --max-sampling-tries times (the condition is the same on all ranks)."""
    args = run.args
    per_rank = args.prompts_per_step // run.world
    samples, batch, tries, nonfinite_dropped, metrics = [], [], 0, 0, {}
    if run.judge is not None:
        run.judge.stats(reset=True)  # the step's judge metrics start here
    while tries == 0 or (args.dynamic_sampling and tries < args.max_sampling_tries
                         and collectives.any_rank(len({s.group for s in batch}) < per_rank)):
        new, rollout_metrics = sample_prompts(run, tries, seconds)
        tries += 1
        with runlog.timed(seconds, "reward"):
            rl_run.score(run, new)
            shape_rewards(run, new)
        nonfinite_dropped += rl_run.refuse_or_count_nonfinite(run, new)
        samples += new
        if run.judge is not None:  # stops the run past --judge-max-failure-rate, before any update
            metrics |= rl_run.judge_metrics(run, samples)
        new = [s for s in new if math.isfinite(s.reward)]  # no reward (judge failures, dropped): not trained on
        if args.dynamic_sampling:
            keep = losses.nonconstant_groups(torch.tensor([s.shaped_reward for s in new]),
                                             torch.tensor([s.group for s in new]))
            new = [s for s, k in zip(new, keep) if k]
        batch += new
    metrics |= rl_run.reward_metrics(run, samples, rollout_metrics)  # the last round's rollout metrics, every round's rewards
    if args.nonfinite_rewards == "drop":
        metrics["critic/score/nonfinite_dropped"] = float(nonfinite_dropped)
    if args.dynamic_sampling:  # each rank trains on its share of groups (a rank may have fewer after the last try)
        metrics["batch/kept_frac"] = collectives.sum_over_ranks(len(batch)) / collectives.sum_over_ranks(len(samples))
        metrics["batch/sampling_tries"] = tries
        kept_groups = set(list(dict.fromkeys(s.group for s in batch))[:per_rank])
        batch = [s for s in batch if s.group in kept_groups]
    return samples, batch, metrics


def sample_prompts(run: Run, tries: int, seconds: dict) -> tuple[list[rollout.Sample], dict]:
    """Phases 1-4: this rank's next prompts (a seeded shuffle per epoch, so resuming replays the same order), the
    engine woken with the current weights, `group_size` rollouts of each (seeded per sample and turn), the engine put
    back to sleep. With --partial-rollouts the rollouts go on with the groups in flight; a step with none on any rank
    (the first) takes two rounds of prompts."""
    args, per_rank = run.args, run.args.prompts_per_step // run.world
    count = partial_rollouts.prompts_per_rank(run.in_flight, per_rank)
    rows = task_rows.in_epoch_order(run.rows, run.data_pos + run.rank * count, count, args.seed)
    # Group ids are unique over ranks and rounds (and, with partial rollouts, over steps).
    first_group = (partial_rollouts.first_group(run.in_flight, run.data_pos, tries * args.prompts_per_step)
                   + run.rank * count)
    run.data_pos += count * run.world
    # Each sample's tokens come from its own seed (step, round, group, index, turn): a resumed run repeats them.
    sampling = dataclasses.replace(run.sampling, seed=engines.derive_seed(args.seed, run.step, tries))
    with runlog.timed(seconds, "wake_and_sync"):
        rl_run.wake_with_current_weights(run)
    with runlog.timed(seconds, "rollout"):
        samples, metrics = rl_run.run_rollouts(run, rows, args.group_size, sampling, first_group, in_flight=run.in_flight)
        run.engine.sleep()
    return samples, metrics


def shape_rewards(run: Run, samples: list[rollout.Sample]) -> None:
    """Phase 5, after rl_run.score: each sample's shaped reward, DAPO's overlong punishment with --overlong-buffer
    (the reward itself otherwise)."""
    penalty = [0.0] * len(samples)
    if run.args.overlong_buffer:
        penalty = losses.overlong_penalty(torch.tensor([len(s.completion_ids) for s in samples]),
                                          run.args.max_new_tokens, run.args.overlong_buffer,
                                          run.args.overlong_penalty).tolist()
    for s, p in zip(samples, penalty):
        s.shaped_reward = s.reward + p


def assign_advantages(run: Run, samples: list[rollout.Sample],
                      batch: list[rollout.Sample]) -> tuple[list[rollout.Sample], dict]:
    """Phase 6: each sample's advantage from the shaped rewards of the global batch (groups never straddle ranks;
    REINFORCE++ normalises over every rank). With --mask-truncated (DAPO overlong filtering) samples cut by a token
    limit count in their group's advantages but leave the batch the loss sees. The segments of an external agent's
    session share its one result: the session counts once, with its first segment's reward."""
    args, metrics = run.args, {}
    units = [s.session or f"{run.rank}:{k}" for k, s in enumerate(batch)]
    everyone = collectives.gather_objects([(s.shaped_reward, s.group, u) for s, u in zip(batch, units)])
    unit_ids = {u: k for k, u in enumerate(dict.fromkeys(u for _, _, u in everyone))}
    advantage = losses.unit_advantages(args.advantage, torch.tensor([r for r, _, _ in everyone]),
                                       torch.tensor([g for _, g, _ in everyone], dtype=torch.long),
                                       torch.tensor([unit_ids[u] for _, _, u in everyone]))
    first = sum(collectives.gather_objects([len(batch)])[: run.rank])  # ranks may hold different counts
    for s, a in zip(batch, advantage[first:]):
        s.advantage = a.item()
    if args.overlong_buffer:
        penalty = sum(s.shaped_reward - s.reward for s in samples if not math.isnan(s.reward))
        metrics["overlong/penalty_mean"] = (collectives.sum_over_ranks(penalty)
                                            / collectives.sum_over_ranks(len(samples)))
    if args.mask_truncated:
        truncated = [s.finish_reason in ("length", "max_total_tokens") for s in batch]
        metrics["overlong/masked_frac"] = (collectives.sum_over_ranks(sum(truncated))
                                           / max(collectives.sum_over_ranks(len(batch)), 1))
        batch = [s for s, cut in zip(batch, truncated) if not cut]
    return batch, metrics


def old_and_ref_logprobs(run: Run, batch: list[rollout.Sample]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Phase 7: [B, T] logprobs of the batch's completions under the policy before this step's updates (needed once
    a batch gets more than one update, by rollout correction and by distillation) and under the reference model (with
    --kl-coef)."""
    args, old_logprobs, ref_logprobs = run.args, None, None
    if args.minibatches * args.epochs_per_step > 1 or rl_run.corrects_rollouts(args) or run.teacher is not None:
        old_logprobs = policy.completion_logprobs_no_grad(run.model, batch, args.micro_batch_tokens,
                                                          args.temperature, args.logprob_chunk_size)
    if run.ref_model is not None:
        ref_logprobs = policy.completion_logprobs_no_grad(run.ref_model, batch, args.micro_batch_tokens,
                                                          args.temperature, args.logprob_chunk_size)
    return old_logprobs, ref_logprobs


def logprobs_to_record(run: Run, samples: list[rollout.Sample]) -> torch.Tensor | None:
    """With --rich-samples on a sample step: [B, T] logprobs of all the step's samples under the policy before this
    step's update (one more forward without grad), which the sample records set beside the engine's. Collective."""
    if not (run.args.rich_samples and runlog.writes_samples(run.step + 1, run.args.sample_every, run.args.total_steps)):
        return None
    together, mine = rl_run.sequence_group_batch(run, samples)
    return policy.completion_logprobs_no_grad(run.model, together, run.args.micro_batch_tokens, run.args.temperature,
                                              run.args.logprob_chunk_size)[mine]


def update_epochs(run: Run, batch: list[rollout.Sample], old_logprobs: torch.Tensor | None,
                  ref_logprobs: torch.Tensor | None, correction: rl_run.Correction, advantages: torch.Tensor) -> dict:
    """Phase 8: --epochs-per-step passes of --minibatches optimizer steps (`update_policy`, right below), then the
    learning-rate schedule's step; metrics averaged over the updates, and rollout correction's."""
    update_metrics = defaultdict(list)
    for _ in range(run.args.epochs_per_step):
        for minibatch in range(run.args.minibatches):
            for k, v in update_policy(run, batch, minibatch, old_logprobs, ref_logprobs, correction,
                                      advantages).items():
                update_metrics[k].append(v)
    run.scheduler.step()
    return {k: sum(v) / len(v) for k, v in update_metrics.items()} | correction.metrics


def update_policy(run: Run, batch: list[rollout.Sample], minibatch: int, old_logprobs: torch.Tensor | None,
                  ref_logprobs: torch.Tensor | None, correction: rl_run.Correction, advantages: torch.Tensor) -> dict:
    """One optimizer step on this rank's share of one minibatch (whole groups): for each micro-batch of bounded
    tokens, packed forward -> policy loss (times rollout correction's weights, on the tokens it kept) (+ KL to the
    reference) -> backward; then clip and step. `advantages`: [B, T] per token (the sample's, plus distillation's).
    Without `old_logprobs` the update is on-policy (the ratio's denominator is the forward's own, detached)."""
    args = run.args
    index = policy.minibatch([s.group for s in batch], args.minibatches, minibatch)
    # Global normalisers make the sum of micro-batch losses on every rank equal the global-batch loss; FSDP
    # averages gradients over ranks, hence the factor `world`.
    global_tokens = collectives.sum_over_ranks(sum(sum(batch[i].loss_mask) for i in index))
    global_seqs = collectives.sum_over_ranks(len(index))
    if global_seqs == 0:  # no rank has a sample in this minibatch (dynamic sampling dropped them): no step
        return {}
    mask = correction.mask
    engine_logprobs = policy.padded([s.engine_logprobs for s in batch])
    stats = defaultdict(float)
    run.optimizer.zero_grad(set_to_none=True)
    for micro in policy.completion_micro_batches(run.model, batch, index, args.micro_batch_tokens):
        # An idle micro-batch (this rank has fewer than another) is all zeros below: it only keeps FSDP in step.
        logprobs, entropy = policy.completion_logprobs(run.model, [batch[i] for i in micro], args.temperature,
                                                       args.logprob_chunk_size, with_entropy=True)
        micro_mask, micro_engine, micro_advantages = (policy.rows_of(x, micro, logprobs)
                                                      for x in (mask, engine_logprobs, advantages))
        old = logprobs.detach() if old_logprobs is None else policy.rows_of(old_logprobs, micro, logprobs)
        if args.policy_loss == "gspo":
            token_loss, loss_stats = losses.gspo_loss(
                logprobs, old, micro_advantages, micro_mask, clip_low=args.clip_low, clip_high=args.clip_high,
                engine_logprobs=micro_engine if args.tis_cap else None, tis_cap=args.tis_cap)
        else:
            token_loss, loss_stats = losses.clipped_policy_loss(
                logprobs, old, micro_advantages, micro_mask, clip_low=args.clip_low, clip_high=args.clip_high,
                dual_clip=args.dual_clip, engine_logprobs=micro_engine if args.tis_cap else None, tis_cap=args.tis_cap)
        if correction.weights is not None:  # elementwise, as --tis-cap's weight: after the clip, 0 off the mask
            token_loss = token_loss * policy.rows_of(correction.weights, micro, logprobs)
        loss = losses.aggregate(token_loss, micro_mask, args.loss_agg, num_tokens=global_tokens,
                                num_seqs=global_seqs, max_len=args.max_new_tokens) * run.world
        stats["actor/pg_loss"] += loss.item() / run.world
        if ref_logprobs is not None:  # aggregate is linear: the KL term adds to the loss on its own
            kl = losses.kl_penalty(logprobs, policy.rows_of(ref_logprobs, micro, logprobs), args.kl_estimator)
            loss = loss + args.kl_coef * losses.aggregate(kl, micro_mask, args.loss_agg, num_tokens=global_tokens,
                                                          num_seqs=global_seqs, max_len=args.max_new_tokens) * run.world
            stats["actor/kl_loss"] += losses.masked_sum(kl.detach(), micro_mask).item() / global_tokens
        loss.backward()
        share = micro_mask.sum().item() / global_tokens  # this micro-batch's share of the global tokens
        stats["actor/entropy"] += losses.masked_sum(entropy.detach(), micro_mask).item() / global_tokens
        stats["mismatch/engine_abs"] += losses.masked_sum((old - micro_engine).abs(), micro_mask).item() / global_tokens
        for k, v in loss_stats.items():
            stats[f"actor/{k}"] += v * share
    grad_norm = policy.clip_grad_norm(run.model, args.max_grad_norm)
    return collectives.sum_dicts_over_ranks(stats) | policy.step_if_finite(run.optimizer, grad_norm, "actor")


def save(run: Run) -> None:
    state = {"step": run.step, "data_pos": run.data_pos, "scheduler": run.scheduler.state_dict(), "best": run.best,
             "evals": run.evals} | partial_rollouts.checkpoint_state(run.in_flight)
    path = save_checkpoint(run.args.output_dir, run.step, run.model, run.optimizer, state,
                           hf_source_dir=run.args.model, keep_last=run.args.keep_checkpoints)
    if run.rank == 0:
        tqdm.write(f"step {run.step}: checkpoint {path}")


if __name__ == "__main__":
    with cli.one_line_errors():
        main(cli.parse_args(Args))
    policy.exit_distributed()
