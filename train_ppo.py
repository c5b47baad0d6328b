"""PPO with a critic for code LLMs: `torchrun --nproc-per-node 4 train_ppo.py --data data/apps_train.parquet ...`.

Args defaults are the VeRL APPS pipeline's it replaces (Qwen2.5-3B-Instruct actor and critic, 64 prompts per step,
5 epochs, actor LR 1e-6, critic LR 1e-5, 4 GPUs per node, reward = passed / total tests). The launchers work too, with
their GRPO defaults overridden: `GPUS_PER_NODE=4 SCRIPT=train_ppo.py ./run_h200.sh --model Qwen/Qwen2.5-3B-Instruct
--group-size 1 --total-steps None --output-dir runs/ppo-apps --eval-data data/apps_test.parquet`.

A step (`train_step()`): rollouts -> rewards -> old/reference logprobs and values -> token rewards (the score on the
last policy token, minus the KL penalty) -> GAE -> advantages whitened over the global batch -> minibatch updates of
the critic and, after its warm-up, the actor. Values and advantages exist on loss-masked tokens only, so multi-turn
samples work unchanged. Evaluation (pass@1, mean test pass rate and its bands, overall and by difficulty) goes to
metrics.jsonl and eval_report.json/.md/.png (the picture: the last evaluation's bands per difficulty); the best policy
so far is kept as a Hugging Face folder in <output_dir>/best (step and metrics in best.json). The critic's checkpoints
sit in <output_dir>/critic/checkpoints/, under the policy's step names.
"""
from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from tqdm import tqdm

import cli
import collectives
import engines
import losses
import policy
import rewards
import rl_run
import rollout
import runlog
import task_rows
from checkpoint import load_checkpoint, load_newest_checkpoint, save_checkpoint


@dataclass
class Args(rl_run.SharedArgs):
    """PPO with a critic for code LLMs: `torchrun --nproc-per-node 4 train_ppo.py --model ... --data ...`."""

    # The settings both trainers share (rows, sampling, engine, memory, checkpoints, evaluation, tools, judge) are
    # declared once, in rl_run.SharedArgs; here are this algorithm's own, and its defaults where it differs.
    critic_model: str | None = None
    """critic initialisation (a value head is added to it); None = the actor's model"""
    output_dir: str = "runs/ppo"
    """where metrics.jsonl, samples.jsonl, eval_report.json/.md/.png, best/ and checkpoints/ go"""

    group_size: int = 1
    """samples per prompt (1 = classic PPO; the critic is the baseline)"""
    epochs: int = 5
    """passes over the training rows, when total_steps is None"""
    total_steps: int | None = None
    """training steps; None = epochs * rows / prompts_per_step"""
    tools: Literal["none", "python", "swe"] = "none"
    """multi-turn agent rollouts with these tools (python: a stateful sandboxed interpreter per trajectory; swe: bash,
    an editor and submit in a Docker container per trajectory, for swebench rows, graded on the container's diff)"""

    gamma: float = 1.0
    """GAE discount"""
    lam: float = 1.0
    """GAE lambda"""
    whiten_advantages: bool = True
    """normalise advantages to mean 0, std 1 over the global batch (loss-masked tokens)"""
    clip_low: float = 0.2
    """policy ratio lower clip: ratio >= 1 - clip_low"""
    clip_high: float = 0.2
    """policy ratio upper clip: ratio <= 1 + clip_high"""
    value_clip: float | None = 0.5
    """new values stay within +-value_clip of the rollout's values in the clipped value loss; None = no clipping"""
    entropy_coef: float = 0.0
    """entropy bonus weight in the actor loss"""
    kl_coef: float = 0.0
    """weight of the KL(policy || reference) penalty subtracted from the token rewards; 0 = no reference model"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """KL estimator of the reward penalty"""
    kl_target: float | None = None
    """adaptive KL coefficient (Ziegler et al. 2019) steering the per-token KL to this; kl_coef is its start value"""
    kl_horizon: int = 10000
    """adaptive KL horizon, in samples"""

    lr: float = 1e-6
    """actor learning rate (AdamW)"""
    critic_lr: float = 1e-5
    """critic learning rate (AdamW)"""
    weight_decay: float = 0.0
    """AdamW weight decay of both (learning rates are constant, as in the APPS pipeline)"""
    critic_warmup_steps: int = 0
    """steps that train only the critic (the actor stays frozen) so the first advantages have a usable baseline"""
    max_grad_norm: float = 1.0
    """gradient clipping of both"""
    minibatches: int = 4
    """optimizer steps per batch of rollouts and per epoch (each model)"""

    keep_checkpoints: int = 2
    """how many recent checkpoints to keep (of each model)"""
    eval_temperature: float = 0.0
    """0 = greedy evaluation; > 0 samples eval_samples completions per problem"""
    eval_samples: int = 1
    """completions per eval problem (pass@1 = mean pass rate over them)"""


@dataclass(kw_only=True)
class Run(rl_run.Run):
    """Everything a step touches, built once by `setup()`: rl_run.Run's fields and PPO's own."""

    args: Args
    total_steps: int  # --total-steps, or --epochs over the rows
    value_model: torch.nn.Module  # the critic: the policy's architecture with a value head
    optimizer: torch.optim.Optimizer
    critic_optimizer: torch.optim.Optimizer
    kl_coef: float = 0.0  # the KL penalty's coefficient now (adaptive with --kl-target)


@dataclass
class Experience:
    """One rank's rollouts and what PPO derives from them once, without grad: [B, T] over completion tokens."""

    samples: list[rollout.Sample]
    mask: torch.Tensor  # the samples' loss masks (1 = policy token)
    correction: rl_run.Correction  # the actor's rollout-correction weights and mask (the loss mask less rejections)
    old_logprobs: torch.Tensor
    values: torch.Tensor  # V(state before each token), 0 off-mask
    advantages: torch.Tensor  # GAE (whitened with whiten_advantages); 0 off-mask
    returns: torch.Tensor  # GAE advantages + values, the critic's targets; 0 off-mask
    kl_mean: float  # mean KL to the reference over every rank's policy tokens (0 without one): adaptive KL's input


def main(args: Args, score_fn: rewards.ScoreFn = rewards.score_batch) -> Run:
    run = setup(args, score_fn)
    rl_run.train(run, train_step, save, run.total_steps, desc="ppo")
    return run


def check_args(args: Args, world: int) -> None:
    """PPO's own refusals, after rl_run.check_args' shared ones and before anything loads."""
    if args.eval_samples < 1:
        raise ValueError(f"--eval-samples must be > 0, got {args.eval_samples}")
    if args.kl_target is not None and args.kl_coef <= 0:
        raise ValueError("--kl-target needs a starting --kl-coef > 0")
    if args.critic_model:
        policy.check_model_path(args.critic_model, "--critic-model")


def setup(args: Args, score_fn: rewards.ScoreFn) -> Run:
    """Checks, rows and judge first (rl_run.prepare), then the engine, the actor (and reference), the critic with its
    value head, both optimizers, and the state of a resumed run (the critic's checkpoint of the same step)."""
    ready = rl_run.prepare(args, score_fn, check_args)
    total_steps = (args.total_steps if args.total_steps is not None  # 0: evaluate only
                   else max(1, args.epochs * len(ready.rows) // args.prompts_per_step))
    vllm_engine = rl_run.start_vllm(args, ready)
    model = rl_run.load_policy(args, ready.device)
    value_model = rl_run.spread(args, policy.shard_model(
        policy.load_value_model(args.critic_model or args.model, attn_implementation=args.attn_implementation)
        .to(ready.device), mixed_precision=args.mixed_precision, activation_checkpointing=args.activation_checkpointing,
        compile_layers=args.compile_layers))
    ref_model = rl_run.load_reference(args, ready.device)
    teacher = rl_run.load_teacher(args, ready.device)
    optimizer = policy.adamw(model, args.lr, args.weight_decay)
    critic_optimizer = policy.adamw(value_model, args.critic_lr, args.weight_decay)
    rl_run.start_tools(args)

    def load_both(checkpoint: Path) -> dict:  # the critic's checkpoint of the step, saved before the policy's
        critic_checkpoint = Path(args.output_dir) / "critic" / "checkpoints" / checkpoint.name
        if not (critic_checkpoint / "trainer_state.json").is_file():
            raise FileNotFoundError(f"{checkpoint} has no critic checkpoint at {critic_checkpoint}")
        load_checkpoint(critic_checkpoint, value_model, critic_optimizer)
        return load_checkpoint(checkpoint, model, optimizer)

    checkpoint, state = load_newest_checkpoint(args.output_dir, load_both) if args.resume else (None, None)
    if checkpoint is None:
        state = {"step": 0, "data_pos": 0, "kl_coef": args.kl_coef, "best": {}, "evals": []}
    elif ready.rank == 0:
        print(f"resumed from {checkpoint} at step {state['step']}")
    log = runlog.start(args.output_dir, ready.rank, dataclasses.asdict(args) | ready.model_names,
                       args.wandb_project, resume_step=state["step"] if args.resume else None,
                       samples_max_mb=args.samples_max_mb, log_to=args.log_to)
    return Run(args=args, rank=ready.rank, world=ready.world, total_steps=total_steps, model=model,
               value_model=value_model, ref_model=ref_model, teacher=teacher, optimizer=optimizer,
               critic_optimizer=critic_optimizer,
               engine=rl_run.rollout_engine(vllm_engine, model, ready.tokenizer), tokenizer=ready.tokenizer,
               sampling=ready.sampling, limits=ready.limits, rows=ready.rows, eval_rows=ready.eval_rows,
               score_fn=ready.score_fn, log=log, step=state["step"], data_pos=state["data_pos"],
               kl_coef=state["kl_coef"], best=state["best"], evals=state["evals"], judge=ready.judge)


def train_step(run: Run) -> dict:
    """One PPO step, phase by phase; each phase is the function of that name right below, in this order."""
    seconds = {}
    # 1-5. Prompts -> rollouts -> rewards (tool output between turns is outside the loss mask: no value, no loss).
    samples, batch, metrics = collect_samples(run, seconds)
    # 6-7. Old/reference logprobs and values, token rewards, GAE, whitened advantages; with --sequence-parallel over
    # the samples of the rank's group (its ranks train on them together).
    with runlog.timed(seconds, "experience"):
        together, mine = rl_run.sequence_group_batch(run, batch)
        exp, experience_metrics = make_experience(run, together, mine)
    # 8. Minibatch updates: the critic every step, the actor once the critic has warmed up; then adaptive KL.
    with runlog.timed(seconds, "update"):
        update_metrics = update_epochs(run, exp)
    # 9. Throughput, timings and the trained samples' records (with --rich-samples, old logprobs and advantages).
    rich = dict(trainer_logprobs=exp.old_logprobs[mine], token_advantages=exp.advantages[mine])
    return (metrics | experience_metrics | update_metrics
            | rl_run.step_metrics(run, batch, seconds, run.total_steps, **rich))


def collect_samples(run: Run, seconds: dict) -> tuple[list[rollout.Sample], list[rollout.Sample], dict]:
    """Phases 1-5: this rank's prompts (a seeded shuffle per epoch, so resuming replays the same order), the engine
    woken with the current weights (a level-2 sleep dropped them), `group_size` rollouts of each, the engine asleep
    again, and every sample's reward (rl_run.score); then every sample of the step, the batch it trains on (the samples
    that have a reward) and their metrics."""
    args, per_rank = run.args, run.args.prompts_per_step // run.world
    rows = task_rows.in_epoch_order(run.rows, run.data_pos + run.rank * per_rank, per_rank, args.seed)
    run.data_pos += args.prompts_per_step
    # Each sample's tokens come from its own seed (step, group, index, turn): a resumed run repeats them.
    sampling = dataclasses.replace(run.sampling, seed=engines.derive_seed(args.seed, run.step))
    with runlog.timed(seconds, "wake_and_sync"):
        rl_run.wake_with_current_weights(run)
    with runlog.timed(seconds, "rollout"):
        samples, rollout_metrics = rl_run.run_rollouts(run, rows, args.group_size, sampling,
                                                       first_group=run.rank * len(rows))
        run.engine.sleep()
    metrics = {}
    if run.judge is not None:
        run.judge.stats(reset=True)  # the step's judge metrics start here
    with runlog.timed(seconds, "reward"):
        rl_run.score(run, samples)
    nonfinite_dropped = rl_run.refuse_or_count_nonfinite(run, samples)
    if run.judge is not None:  # stops the run past --judge-max-failure-rate, before any update
        metrics |= rl_run.judge_metrics(run, samples)
    if args.nonfinite_rewards == "drop":
        metrics["critic/score/nonfinite_dropped"] = float(nonfinite_dropped)
    batch = [s for s in samples if math.isfinite(s.reward)]  # no reward (judge failures, dropped): not trained on
    return samples, batch, metrics | rl_run.reward_metrics(run, samples, rollout_metrics)


def make_experience(run: Run, samples: list[rollout.Sample], mine: slice = slice(None)) -> tuple[Experience, dict]:
    """Old/reference logprobs and values of `samples`, then token rewards (the score on the last policy token, minus
    kl_coef * KL to the reference on every policy token), GAE over the policy tokens and whitened advantages. The
    statistics over ranks take this rank's own samples, `samples[mine]` (with --sequence-parallel the others are its
    group's: each sample counts once)."""
    args = run.args
    mask = policy.padded([s.loss_mask for s in samples])
    old = policy.completion_logprobs_no_grad(run.model, samples, args.micro_batch_tokens, args.temperature,
                                             args.logprob_chunk_size) * mask
    values = policy.completion_values_no_grad(run.value_model, samples, args.micro_batch_tokens) * mask
    token_rewards = losses.outcome_token_rewards(torch.tensor([s.reward for s in samples]), mask)
    kl = torch.zeros_like(mask)
    if run.ref_model is not None:
        ref = policy.completion_logprobs_no_grad(run.ref_model, samples, args.micro_batch_tokens, args.temperature,
                                                 args.logprob_chunk_size) * mask
        kl = losses.kl_penalty(old, ref, args.kl_estimator) * mask
        token_rewards = token_rewards - run.kl_coef * kl
    advantages, returns = losses.gae(token_rewards, values, mask, args.gamma, args.lam)
    advantages, distill_metrics = rl_run.distill(run, old, samples, advantages)  # --teacher: before whitening
    adv_mean, adv_var = collectives.global_mean_var(advantages[mine], mask[mine])
    if args.whiten_advantages:
        advantages = torch.where(mask.bool(), (advantages - adv_mean) / math.sqrt(adv_var + 1e-8), 0)
    returns_mean, returns_var = collectives.global_mean_var(returns[mine], mask[mine])
    _, error_var = collectives.global_mean_var((returns - values)[mine], mask[mine])
    engine_logprobs = policy.padded([s.engine_logprobs for s in samples])
    correction = rl_run.rollout_correction(run, old, samples)
    metrics = correction.metrics | distill_metrics | {
        "critic/values/mean": collectives.global_mean_var(values[mine], mask[mine])[0],
        "critic/returns/mean": returns_mean,
        "critic/vf_explained_var": 1 - error_var / returns_var if returns_var > 0 else 0.0,
        "critic/advantages/mean": adv_mean, "critic/advantages/std": math.sqrt(adv_var),
        "actor/reward_kl_penalty": collectives.global_mean_var(kl[mine], mask[mine])[0],
        "mismatch/engine_abs": collectives.global_mean_var((old - engine_logprobs).abs()[mine], mask[mine])[0],
    }
    return Experience(samples, mask, correction, old, values, advantages, returns,
                      metrics["actor/reward_kl_penalty"]), metrics


def update_epochs(run: Run, exp: Experience) -> dict:
    """Phase 8: --epochs-per-step passes of --minibatches steps of the critic and, past --critic-warmup-steps, the
    actor (`update_actor`, `update_critic`, right below); metrics averaged over them. Then adaptive KL (--kl-target)
    nudges the coefficient toward the target, at most 20% per --kl-horizon samples."""
    args, frozen = run.args, run.step < run.args.critic_warmup_steps
    update_metrics = defaultdict(list)
    for _ in range(args.epochs_per_step):
        for minibatch in range(args.minibatches):
            stats = update_critic(run, exp, minibatch) | ({} if frozen else update_actor(run, exp, minibatch))
            for k, v in stats.items():
                update_metrics[k].append(v)
    metrics = {k: sum(v) / len(v) for k, v in update_metrics.items()}
    metrics |= {"actor/frozen": float(frozen), "actor/reward_kl_penalty_coeff": run.kl_coef}
    if args.kl_target is not None:
        error = max(-0.2, min(0.2, exp.kl_mean / args.kl_target - 1))
        samples_per_step = len(exp.samples) * run.world / args.sequence_parallel  # a group's ranks share theirs
        run.kl_coef *= 1 + error * samples_per_step / args.kl_horizon
    return metrics


def update_actor(run: Run, exp: Experience, minibatch: int) -> dict:
    """One actor optimizer step on this rank's share of one minibatch: per micro-batch, packed forward -> clipped
    surrogate on the whitened advantages (times rollout correction's weights, on the tokens it kept; - entropy bonus)
    -> backward; then clip and step."""
    args = run.args
    micro_batches, global_tokens = minibatch_plan(run, exp, minibatch)
    stats = defaultdict(float)
    run.optimizer.zero_grad(set_to_none=True)
    for micro in micro_batches:
        logprobs, entropy = policy.completion_logprobs(run.model, [exp.samples[i] for i in micro], args.temperature,
                                                       args.logprob_chunk_size, with_entropy=True)
        mask, old, adv = (policy.rows_of(x, micro, logprobs)
                          for x in (exp.correction.mask, exp.old_logprobs, exp.advantages))
        token_loss, loss_stats = losses.clipped_policy_loss(logprobs, old, adv, mask, clip_low=args.clip_low,
                                                            clip_high=args.clip_high)
        if exp.correction.weights is not None:
            token_loss = token_loss * policy.rows_of(exp.correction.weights, micro, logprobs)
        token_loss = token_loss - args.entropy_coef * entropy
        loss = losses.masked_sum(token_loss, mask) / global_tokens * run.world  # token mean; FSDP averages ranks
        loss.backward()
        share = mask.sum().item() / global_tokens  # this micro-batch's share of the global tokens
        stats["actor/pg_loss"] += loss.item() / run.world
        stats["actor/entropy"] += losses.masked_sum(entropy.detach(), mask).item() / global_tokens
        for k in ("ppo_kl", "pg_clipfrac", "pg_clipfrac_low", "pg_clipfrac_high", "ratio_mean"):
            stats[f"actor/{k}"] += loss_stats[k] * share
    grad_norm = policy.clip_grad_norm(run.model, args.max_grad_norm)
    return collectives.sum_dicts_over_ranks(stats) | policy.step_if_finite(run.optimizer, grad_norm, "actor")


def update_critic(run: Run, exp: Experience, minibatch: int) -> dict:
    """One critic optimizer step on this rank's share of one minibatch: clipped value loss toward the GAE returns."""
    args = run.args
    micro_batches, global_tokens = minibatch_plan(run, exp, minibatch)
    stats = defaultdict(float)
    run.critic_optimizer.zero_grad(set_to_none=True)
    for micro in micro_batches:
        values = policy.completion_values(run.value_model, [exp.samples[i] for i in micro])
        mask, old, returns = (policy.rows_of(x, micro, values) for x in (exp.mask, exp.values, exp.returns))
        token_loss, clip_frac = losses.value_loss(values, old, returns, mask, clip=args.value_clip)
        loss = losses.masked_sum(token_loss, mask) / global_tokens * run.world
        loss.backward()
        stats["critic/vf_loss"] += loss.item() / run.world
        stats["critic/vf_clipfrac"] += clip_frac * mask.sum().item() / global_tokens
    grad_norm = policy.clip_grad_norm(run.value_model, args.max_grad_norm)
    return collectives.sum_dicts_over_ranks(stats) | policy.step_if_finite(run.critic_optimizer, grad_norm, "critic")


def minibatch_plan(run: Run, exp: Experience, minibatch: int) -> tuple[list[list[int]], float]:
    """The micro-batches of this rank's share of one minibatch (same count on every rank: FSDP collectives must stay
    in step) and the global count of policy tokens, so that micro-batch token means add up to the batch's."""
    index = policy.minibatch([s.group for s in exp.samples], run.args.minibatches, minibatch)
    global_tokens = max(1.0, collectives.sum_over_ranks(exp.mask[index].sum().item()))
    # The actor's planning for both models: they share the attention, so a shared prompt counts once for either.
    return policy.completion_micro_batches(run.model, exp.samples, index, run.args.micro_batch_tokens), global_tokens


def save(run: Run) -> None:
    """Critic first, then the policy: the policy's checkpoint marks the step complete, so the newest one always has its
    critic (keep_checkpoints keeps at least as many critic steps)."""
    args, critic = run.args, Path(run.args.output_dir) / "critic"
    save_checkpoint(critic, run.step, run.value_model, run.critic_optimizer, {"step": run.step},
                    hf_source_dir=args.critic_model or args.model, keep_last=args.keep_checkpoints)
    state = {"step": run.step, "data_pos": run.data_pos, "kl_coef": run.kl_coef, "best": run.best, "evals": run.evals}
    path = save_checkpoint(args.output_dir, run.step, run.model, run.optimizer, state, hf_source_dir=args.model,
                           keep_last=args.keep_checkpoints)
    if run.rank == 0:
        tqdm.write(f"step {run.step}: checkpoint {path} (critic: {critic / 'checkpoints'})")


if __name__ == "__main__":
    with cli.one_line_errors():
        main(cli.parse_args(Args))
    policy.exit_distributed()
