"""PPO with a critic for code LLMs: `torchrun --nproc-per-node 4 train_ppo.py --data data/apps_train.parquet ...`.

Args defaults are the VeRL APPS pipeline's it replaces (Qwen2.5-3B-Instruct actor and critic, 64 prompts per step,
5 epochs, actor LR 1e-6, critic LR 1e-5, 4 GPUs per node, reward = passed / total tests). The launchers work too, with
their GRPO defaults overridden: `GPUS_PER_NODE=4 SCRIPT=train_ppo.py ./run_h200.sh --model Qwen/Qwen2.5-3B-Instruct
--group-size 1 --total-steps None --output-dir runs/ppo-apps --eval-data data/apps_test.parquet`.

A step (`train_step()`): rollouts -> rewards -> old/reference logprobs and values -> token rewards (the score on the
last policy token, minus the KL penalty) -> GAE -> advantages whitened over the global batch -> minibatch updates of
the critic and, after its warm-up, the actor. Values and advantages exist on loss-masked tokens only, so multi-turn
samples work unchanged. Evaluation (pass@1 overall and by difficulty) goes to metrics.jsonl and eval_report.json/.md;
the best policy so far is kept as a Hugging Face folder in <output_dir>/best (step and metrics in best.json). The
critic's checkpoints sit in <output_dir>/critic/checkpoints/, under the policy's step names.
"""
from __future__ import annotations

import dataclasses
import json
import math
import random
import shutil
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
import tyro
from tqdm import tqdm

import data_prep
import losses
import policy
import rewards
import rollout


@dataclass
class Args:
    model: str = "Qwen/Qwen2.5-3B-Instruct"
    """actor (policy) to train: a Hugging Face folder or hub name"""
    critic_model: str | None = None
    """critic initialisation (a value head is added to it); None = the actor's model"""
    data: str = "data/apps_train.parquet"
    """training rows (parquet / jsonl / HF dataset name) in kiln's row schema (`data_prep.py apps`)"""
    eval_data: str | None = "data/apps_test.parquet"
    """held-out rows, evaluated every `eval_every` steps; None = no evaluation"""
    output_dir: str = "runs/ppo-apps"
    """where metrics.jsonl, samples.jsonl, eval_report.*, best/ and checkpoints go"""
    engine: Literal["hf", "vllm"] = "vllm"
    """rollout engine: colocated vLLM on GPUs, or generation with the policy itself (CPU, debugging)"""
    seed: int = 0
    """seed for data order, sampling and initialisation"""

    prompts_per_step: int = 64
    """prompts per step across all ranks (the PPO batch; must divide by the world size)"""
    group_size: int = 1
    """samples per prompt (1 = classic PPO; the critic is the baseline)"""
    epochs: int = 5
    """passes over the training rows, when total_steps is None"""
    total_steps: int | None = None
    """training steps; None = epochs * rows / prompts_per_step"""
    max_prompt_tokens: int = 1024
    """rows whose prompt is longer are skipped at load (and counted in the log)"""
    max_new_tokens: int = 1024
    """generation budget per sample"""
    temperature: float = 1.0
    """sampling temperature; the trainer scores tokens under the same temperature"""
    tools: Literal["none", "python"] = "none"
    """multi-turn agent rollouts with these tools (python: a stateful sandboxed interpreter per trajectory)"""
    max_turns: int = 4
    """assistant turns per trajectory (tools on)"""
    max_total_tokens: int = 4096
    """prompt + all turns and tool outputs per trajectory (tools on)"""
    max_tool_response_tokens: int = 512
    """longer tool outputs are cut and marked (tools on)"""

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
    epochs_per_step: int = 1
    """passes over each batch of rollouts"""
    micro_batch_tokens: int = 8192
    """tokens packed into one forward/backward (gradient accumulation beyond that)"""
    logprob_chunk_size: int = 512
    """rows of the output layer computed at once for logprobs (each holds rows x vocab fp32 values)"""

    mixed_precision: bool = False
    """bf16 parameters with fp32 reductions (use on GPUs)"""
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    """recompute in backward to save memory: full (decoder layers from their inputs) or selective (keeps matmul and
    attention outputs, recomputes only elementwise work)"""
    attn_implementation: str = "packed_sdpa"
    """attention of the trained models: packed_sdpa (policy.py: sdpa per packed sequence), flex_attention (faster on
    GPUs), flash_attention_2 when installed; plain sdpa masks the whole micro-batch, quadratic in its tokens"""
    compile_layers: bool = False
    """torch.compile each decoder layer of the trained models (GPUs: fuses norms, rotary and activations)"""
    vllm_gpu_memory_utilization: float = 0.4
    """fraction of GPU memory vLLM may take while awake"""
    vllm_max_model_len: int = 2048
    """vLLM context length"""
    vllm_tensor_parallel_size: int = 1
    """ranks per vLLM engine (consecutive ranks form a group)"""

    save_every: int = 50
    """checkpoint every N steps (0 = only at the end)"""
    keep_checkpoints: int = 2
    """how many recent checkpoints to keep (of each model)"""
    eval_every: int = 25
    """evaluate every N steps, and at step 0 and the last step (0 = only those two)"""
    eval_temperature: float = 0.0
    """0 = greedy evaluation; > 0 samples eval_samples completions per problem"""
    eval_samples: int = 1
    """completions per eval problem (pass@1 = mean pass rate over them)"""
    sample_every: int = 10
    """write sample completions to samples.jsonl every N steps"""
    resume: bool = False
    """continue from the newest checkpoint in output_dir"""
    wandb_project: str | None = None
    """log to wandb too (WANDB_MODE=offline works without network)"""
    dry_run: bool = False
    """print the resolved Args and exit"""


ScoreFn = Callable[[list[dict], list[str]], list["rewards.Reward"]]


@dataclass
class Trainer:
    """Everything a step touches, built once by `setup()`."""

    args: Args
    rank: int
    world: int
    total_steps: int
    model: torch.nn.Module
    value_model: torch.nn.Module
    ref_model: torch.nn.Module | None
    optimizer: torch.optim.Optimizer
    critic_optimizer: torch.optim.Optimizer
    engine: rollout.Engine
    tokenizer: object
    sampling: rollout.Sampling
    rows: list[dict]
    eval_rows: list[dict]
    score_fn: ScoreFn
    step: int = 0
    data_pos: int = 0
    kl_coef: float = 0.0
    best: dict = field(default_factory=dict)  # {"step", "score": [pass@1, reward]} of the policy kept in best/
    evals: list[dict] = field(default_factory=list)  # every eval's rewards.report summary and step, for the report


@dataclass
class Experience:
    """One rank's rollouts and what PPO derives from them once, without grad: [B, T] over completion tokens."""

    samples: list[rollout.Sample]
    mask: torch.Tensor  # the samples' loss masks (1 = policy token)
    old_logprobs: torch.Tensor
    values: torch.Tensor  # V(state before each token), 0 off-mask
    advantages: torch.Tensor  # GAE (whitened with whiten_advantages); 0 off-mask
    returns: torch.Tensor  # GAE advantages + values, the critic's targets; 0 off-mask


def main(args: Args, score_fn: ScoreFn = rewards.score_batch) -> Trainer | None:
    if args.dry_run:
        print(json.dumps(dataclasses.asdict(args), indent=2))
        return None
    t = setup(args, score_fn)
    if t.step == 0 and t.eval_rows:
        log(t, evaluate(t) | {"step": 0})
    bar = tqdm(total=t.total_steps, initial=t.step, desc="ppo", disable=t.rank != 0)
    while t.step < t.total_steps:
        metrics = train_step(t)
        t.step += 1
        last = t.step == t.total_steps
        if t.eval_rows and (last or (args.eval_every and t.step % args.eval_every == 0)):
            metrics |= evaluate(t)
        log(t, metrics | {"step": t.step})
        bar.update(1)
        bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}")
        if last or (args.save_every and t.step % args.save_every == 0):
            save(t)
    bar.close()
    if t.rank == 0:
        print(f"done: metrics, eval report and best/ in {args.output_dir}")
    if t.rank == 0 and args.wandb_project:
        import wandb

        wandb.finish()  # here, not at interpreter exit: the script leaves through policy.exit_distributed
    return t


def setup(args: Args, score_fn: ScoreFn) -> Trainer:
    rank, world, device = policy.init_distributed()
    if args.prompts_per_step % world:
        raise SystemExit(f"--prompts-per-step {args.prompts_per_step} must divide by the world size {world}")
    if args.prompts_per_step // world < args.minibatches:  # a minibatch takes whole groups
        raise SystemExit(f"--minibatches {args.minibatches} needs as many prompts per rank; --prompts-per-step "
                         f"{args.prompts_per_step} over {world} ranks gives {args.prompts_per_step // world}")
    if args.kl_target is not None and args.kl_coef <= 0:
        raise SystemExit("--kl-target needs a starting --kl-coef > 0")
    torch.manual_seed(args.seed + rank)
    random.seed(args.seed + rank)
    tokenizer = policy.load_tokenizer(args.model)
    rows = load_rows_within(args.data, tokenizer, args.max_prompt_tokens, rank)
    eval_rows = load_rows_within(args.eval_data, tokenizer, args.max_prompt_tokens, rank) if args.eval_data else []
    if 0 < len(eval_rows) < world:  # a rank without eval rows would leave the others' collectives hanging
        raise SystemExit(f"{args.eval_data}: {len(eval_rows)} eval rows for {world} ranks; need at least one each")
    total_steps = args.total_steps or max(1, args.epochs * len(rows) // args.prompts_per_step)
    # vLLM takes its memory before the FSDP models do (its allocator must see a clean device).
    engine = None
    if args.engine == "vllm":
        engine = rollout.VLLMEngine(
            args.model, seed=args.seed, gpu_memory_utilization=args.vllm_gpu_memory_utilization,
            max_model_len=args.vllm_max_model_len, tensor_parallel_size=args.vllm_tensor_parallel_size)
        engine.sleep()

    def shard(model, train: bool = True):
        return policy.shard_model(model.to(device), mixed_precision=args.mixed_precision,
                                  activation_checkpointing=args.activation_checkpointing if train else "none",
                                  compile_layers=train and args.compile_layers)

    model = shard(policy.load_model(args.model, attn_implementation=args.attn_implementation))
    value_model = shard(policy.load_value_model(args.critic_model or args.model,
                                                attn_implementation=args.attn_implementation))
    ref_model = None
    if args.kl_coef > 0:
        ref_model = shard(policy.load_model(args.model, attn_implementation=args.attn_implementation), train=False)
        ref_model.requires_grad_(False)
    if engine is None:
        engine = rollout.HFEngine(model, pad_token_id=tokenizer.pad_token_id)
    # foreach: torch's default for GPU tensors; on CPU it would step one tensor at a time in Python
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, foreach=True)
    critic_optimizer = torch.optim.AdamW(value_model.parameters(), lr=args.critic_lr, weight_decay=args.weight_decay,
                                         foreach=True)
    sampling = rollout.Sampling(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                stop_token_ids=policy.stop_token_ids(tokenizer, args.model))
    t = Trainer(args, rank, world, total_steps, model, value_model, ref_model, optimizer, critic_optimizer, engine,
                tokenizer, sampling, rows, eval_rows, score_fn, kl_coef=args.kl_coef)
    checkpoint = policy.latest_checkpoint(args.output_dir) if args.resume else None
    if checkpoint is not None:
        critic_checkpoint = Path(args.output_dir) / "critic" / "checkpoints" / checkpoint.name  # saved first
        if not (critic_checkpoint / "trainer_state.json").is_file():
            raise SystemExit(f"{checkpoint} has no critic checkpoint at {critic_checkpoint}")
        policy.load_checkpoint(critic_checkpoint, value_model, critic_optimizer)
        state = policy.load_checkpoint(checkpoint, model, optimizer)
        t.step, t.data_pos, t.kl_coef = state["step"], state["data_pos"], state["kl_coef"]
        t.best, t.evals = state["best"], state["evals"]
        if rank == 0:
            print(f"resumed from {checkpoint} at step {t.step}")
    elif rank == 0:
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        for name in ("metrics.jsonl", "samples.jsonl"):
            (Path(args.output_dir) / name).unlink(missing_ok=True)
    if rank == 0 and args.wandb_project:
        import wandb

        wandb.init(project=args.wandb_project, config=dataclasses.asdict(args), dir=args.output_dir,
                   resume="allow" if args.resume else None)
    return t


def train_step(t: Trainer) -> dict:
    args, metrics, seconds = t.args, {}, {}

    # 1. This rank's prompts for the step (a seeded shuffle per epoch, so resuming replays the same order).
    rows = next_rows(t)

    # 2-4. Rollouts: wake the engine, give it the current weights (a level-2 sleep dropped them), generate, sleep.
    with timed(seconds, "wake_and_sync"):
        t.engine.wake_up()
        t.engine.load_weights(policy.iter_full_weights(t.model))
    with timed(seconds, "rollout"):
        samples, rollout_metrics = rollout_samples(t, rows, args.group_size, t.sampling)
        t.engine.sleep()
    metrics |= rollout_metrics | getattr(t.engine, "last_metrics", {})  # vLLM's sync/generation timings

    # 5. Rewards, in parallel in the sandbox.
    with timed(seconds, "reward"):
        results = t.score_fn([s.row for s in samples], [s.text for s in samples])
        for s, r in zip(samples, results):
            s.reward, s.info = r.score, r.info
    metrics |= reward_metrics(t, samples)

    # 6-7. Old/reference logprobs and values, token rewards, GAE, whitened advantages.
    with timed(seconds, "experience"):
        exp, experience_metrics = make_experience(t, samples)
    metrics |= experience_metrics

    # 8. Minibatch updates: the critic every step, the actor once the critic has warmed up.
    frozen = t.step < args.critic_warmup_steps
    with timed(seconds, "update"):
        update_metrics = defaultdict(list)
        for _ in range(args.epochs_per_step):
            for mb in range(args.minibatches):
                stats = update_critic(t, exp, mb) | ({} if frozen else update_actor(t, exp, mb))
                for k, v in stats.items():
                    update_metrics[k].append(v)
    metrics |= {k: sum(v) / len(v) for k, v in update_metrics.items()}
    metrics |= {"actor/frozen": float(frozen), "kl/coef": t.kl_coef}
    if args.kl_target is not None:  # adaptive KL: nudge the coefficient toward the target, at most 20% per horizon
        error = max(-0.2, min(0.2, metrics["kl/ref"] / args.kl_target - 1))
        t.kl_coef *= 1 + error * len(samples) * t.world / args.kl_horizon

    # 9. Metrics and sample completions.
    metrics |= {f"time/{k}": v for k, v in seconds.items()}
    metrics["perf/tokens_per_s"] = sum_over_ranks(sum(len(s.ids) for s in samples)) / sum(seconds.values())
    if args.sample_every and (t.step + 1) % args.sample_every == 0:
        write_samples(t, samples)
    return metrics


def rollout_samples(t: Trainer, rows: list[dict], group_size: int, sampling: rollout.Sampling) -> tuple[list, dict]:
    """Single-turn rollouts, or multi-turn agent rollouts when tools are on: tool output between the turns is outside
    the loss mask, so it gets no value, no advantage and no loss. Tool metrics are averaged over ranks."""
    args, first = t.args, t.rank * len(rows)
    if args.tools == "none":
        return rollout.run(t.engine, t.tokenizer, rows, group_size, sampling, first_group=first)
    limits = rollout.AgentLimits(args.max_turns, args.max_total_tokens, args.max_tool_response_tokens)
    samples, metrics = rollout.run_agent(t.engine, t.tokenizer, rows, group_size, sampling, rollout.python_toolbox,
                                         limits, first_group=first)
    return samples, metrics | {k: sum_over_ranks(v) / t.world for k, v in metrics.items() if k.startswith("tools/")}


def make_experience(t: Trainer, samples: list[rollout.Sample]) -> tuple[Experience, dict]:
    """Old/reference logprobs and values of `samples`, then token rewards (the score on the last policy token, minus
    kl_coef * KL to the reference on every policy token), GAE over the policy tokens and whitened advantages."""
    args = t.args
    mask = padded([s.loss_mask for s in samples])

    def per_token(forward):  # [B, T] over the completion tokens, 0 off-mask
        return completion_no_grad(t, forward, samples) * mask

    old = per_token(lambda batch: completion_logprobs(t, t.model, batch)[0])
    values = per_token(lambda batch: completion_values(t, batch))
    token_rewards = losses.outcome_token_rewards(torch.tensor([s.reward for s in samples]), mask)
    kl = torch.zeros_like(mask)
    if t.ref_model is not None:
        ref = per_token(lambda batch: completion_logprobs(t, t.ref_model, batch)[0])
        kl = losses.kl_penalty(old, ref, args.kl_estimator) * mask
        token_rewards = token_rewards - t.kl_coef * kl
    advantages, returns = losses.gae(token_rewards, values, mask, args.gamma, args.lam)
    adv_mean, adv_var = global_mean_var(advantages, mask)
    if args.whiten_advantages:
        advantages = torch.where(mask.bool(), (advantages - adv_mean) / math.sqrt(adv_var + 1e-8), 0)
    returns_mean, returns_var = global_mean_var(returns, mask)
    _, error_var = global_mean_var(returns - values, mask)
    engine = padded([s.engine_logprobs for s in samples])
    metrics = {
        "critic/values_mean": global_mean_var(values, mask)[0],
        "critic/returns_mean": returns_mean,
        "critic/explained_var": 1 - error_var / returns_var if returns_var > 0 else 0.0,
        "advantages/mean": adv_mean, "advantages/std": math.sqrt(adv_var),
        "kl/ref": global_mean_var(kl, mask)[0],
        "mismatch/engine_abs": global_mean_var((old - engine).abs(), mask)[0],
    }
    return Experience(samples, mask, old, values, advantages, returns), metrics


def update_actor(t: Trainer, exp: Experience, minibatch: int) -> dict:
    """One actor optimizer step on this rank's share of one minibatch: clipped surrogate on the whitened advantages."""
    args = t.args
    micro_batches, tokens = minibatch_plan(t, exp, minibatch)
    stats = defaultdict(float)
    t.optimizer.zero_grad(set_to_none=True)
    for micro in micro_batches:
        samples = [exp.samples[i] for i in micro] or [dummy_sample(t)]
        logprobs, entropy = completion_logprobs(t, t.model, samples, with_entropy=True)
        logprobs, entropy = completion_part(logprobs, samples), completion_part(entropy, samples)
        mask, old, adv = (rows_of(x, micro, logprobs) for x in (exp.mask, exp.old_logprobs, exp.advantages))
        token_loss, pstats = losses.clipped_policy_loss(logprobs, old, adv, mask, clip_low=args.clip_low,
                                                        clip_high=args.clip_high)
        token_loss = token_loss - args.entropy_coef * entropy
        loss = losses.masked_sum(token_loss, mask) / tokens * t.world  # token mean; FSDP averages over ranks
        loss.backward()
        share = mask.sum().item() / tokens  # this micro-batch's share of the global tokens
        stats["actor/loss"] += loss.item() / t.world
        stats["actor/entropy"] += losses.masked_sum(entropy.detach(), mask).item() / tokens
        for k in ("approx_kl", "clip_frac_low", "clip_frac_high", "ratio_mean"):
            stats[f"actor/{k}"] += pstats[k] * share
    grad_norm = policy.clip_grad_norm(t.model, args.max_grad_norm)
    t.optimizer.step()
    return sum_dicts_over_ranks(stats) | {"actor/grad_norm": grad_norm}


def update_critic(t: Trainer, exp: Experience, minibatch: int) -> dict:
    """One critic optimizer step on this rank's share of one minibatch: clipped value loss toward the GAE returns."""
    args = t.args
    micro_batches, tokens = minibatch_plan(t, exp, minibatch)
    stats = defaultdict(float)
    t.critic_optimizer.zero_grad(set_to_none=True)
    for micro in micro_batches:
        samples = [exp.samples[i] for i in micro] or [dummy_sample(t)]
        values = completion_part(completion_values(t, samples), samples)
        mask, old, returns = (rows_of(x, micro, values) for x in (exp.mask, exp.values, exp.returns))
        token_loss, clip_frac = losses.value_loss(values, old, returns, mask, clip=args.value_clip)
        loss = losses.masked_sum(token_loss, mask) / tokens * t.world
        loss.backward()
        stats["critic/loss"] += loss.item() / t.world
        stats["critic/vf_clip_frac"] += clip_frac * mask.sum().item() / tokens
    grad_norm = policy.clip_grad_norm(t.value_model, args.max_grad_norm)
    t.critic_optimizer.step()
    return sum_dicts_over_ranks(stats) | {"critic/grad_norm": grad_norm}


def minibatch_plan(t: Trainer, exp: Experience, minibatch: int) -> tuple[list[list[int]], float]:
    """The micro-batches of this rank's share of one minibatch (same count on every rank: FSDP collectives must stay
    in step) and the global count of policy tokens, so that micro-batch token means add up to the batch's."""
    index = policy.minibatch([s.group for s in exp.samples], t.args.minibatches, minibatch)
    tokens = max(1.0, sum_over_ranks(exp.mask[index].sum().item()))
    return micro_batches_of(t, index, [exp.samples[i] for i in index]), tokens


def rows_of(x: torch.Tensor, micro: list[int], like: torch.Tensor) -> torch.Tensor:
    """Rows `micro` of an Experience tensor (kept on the CPU) cut to the micro-batch's width, on `like`'s device;
    zeros (masked out) for a dummy."""
    return x[micro][:, : like.shape[1]].to(like.device) if micro else torch.zeros(like.shape, device=like.device)


def completion_no_grad(t: Trainer, forward: Callable, samples: list[rollout.Sample]) -> torch.Tensor:
    """`forward(samples) -> flat per-token tensor` over `samples`, micro-batched without grad, as padded [B, T]
    completion tensors."""
    out = []
    with torch.no_grad():
        for micro in micro_batches_of(t, list(range(len(samples))), samples):
            batch = [samples[i] for i in micro] or [dummy_sample(t)]
            flat = forward(batch).float().cpu()
            if micro:
                out += split_completions(flat, batch)
    return padded(out)


def evaluate(t: Trainer) -> dict:
    """pass@1 and mean reward on the held-out rows, overall, by data source and by difficulty; updates the report and
    keeps the policy in <output_dir>/best when it is the best so far. Collective."""
    args = t.args
    rows = t.eval_rows[t.rank :: t.world]
    sampling = dataclasses.replace(t.sampling, temperature=args.eval_temperature)
    t.engine.wake_up()
    t.engine.load_weights(policy.iter_full_weights(t.model))
    samples, _ = rollout_samples(t, rows, args.eval_samples, sampling)
    t.engine.sleep()
    results = t.score_fn([s.row for s in samples], [s.text for s in samples])
    parts = [None] * t.world
    dist.all_gather_object(parts, [(data_prep.row_id(s.row), r.score, r.info.get("error"))
                                   for s, r in zip(samples, results)])
    graded = [record for part in parts for record in part]
    summary = rewards.report({data_prep.row_id(row): row for row in t.eval_rows}, [task for task, _, _ in graded],
                             [rewards.Reward(score, {"error": error}) for _, score, error in graded])
    metrics = {f"eval/{group}/{k}": v for group, table in summary["pass"].items() for k, v in table.items()}
    metrics["eval/reward"] = summary["mean_reward"]
    metrics |= {f"eval/error/{kind}": n / len(graded) for kind, n in summary["errors"].items()}
    score = [metrics["eval/all/pass@1"], metrics["eval/reward"]]
    if not t.best or score > t.best["score"]:
        t.best = {"step": t.step, "score": score}
        save_best(t, metrics)
    t.evals.append({"step": t.step} | summary)
    if t.rank == 0:
        write_eval_report(t)
    return metrics


def save_best(t: Trainer, metrics: dict) -> None:
    """The current policy as a Hugging Face folder in <output_dir>/best, swapped in whole. Collective."""
    out = Path(t.args.output_dir)
    policy.save_hf(t.model, t.args.model, out / ".best_tmp")
    if t.rank == 0:
        (out / ".best_tmp" / "best.json").write_text(json.dumps({"step": t.step, "metrics": metrics}, indent=1))
        shutil.rmtree(out / "best", ignore_errors=True)
        (out / ".best_tmp").rename(out / "best")
    dist.barrier()


def write_eval_report(t: Trainer) -> None:
    """eval_report.json (each eval's pass@k by group, mean reward and errors; the best step) and eval_report.md (a
    table of pass@1 by group, difficulties in APPS order, per eval step)."""
    out = Path(t.args.output_dir)
    (out / "eval_report.json").write_text(json.dumps({"best": t.best, "evals": t.evals}, indent=1))
    order = {"introductory": 0, "interview": 1, "competition": 2}
    groups = sorted(t.evals[-1]["pass"],
                    key=lambda g: (g != "all", g.split("/")[0], "/" in g, order.get(g.split("/")[-1], 3), g))
    lines = [f"# pass@1 on {t.args.eval_data}; best policy (kept in best/): step {t.best['step']}", "",
             "| step | " + " | ".join(f"{g} ({t.evals[-1]['pass'][g]['tasks']})" for g in groups) + " | reward |",
             "|---:|" + "---:|" * (len(groups) + 1)]
    for e in t.evals:
        cells = [f"{e['pass'][g]['pass@1']:.3f}" if g in e["pass"] else "-" for g in groups]
        best = " (best)" if e["step"] == t.best["step"] else ""
        lines.append(f"| {e['step']}{best} | " + " | ".join(cells) + f" | {e['mean_reward']:.3f} |")
    (out / "eval_report.md").write_text("\n".join(lines) + "\n")


def save(t: Trainer) -> None:
    """Critic first, then the policy: the policy's checkpoint marks the step complete, so the newest one always has its
    critic (keep_checkpoints keeps at least as many critic steps)."""
    args, critic = t.args, Path(t.args.output_dir) / "critic"
    policy.save_checkpoint(critic, t.step, t.value_model, t.critic_optimizer, {"step": t.step},
                           hf_source_dir=args.critic_model or args.model, keep_last=args.keep_checkpoints)
    state = {"step": t.step, "data_pos": t.data_pos, "kl_coef": t.kl_coef, "best": t.best, "evals": t.evals}
    path = policy.save_checkpoint(args.output_dir, t.step, t.model, t.optimizer, state, hf_source_dir=args.model,
                                  keep_last=args.keep_checkpoints)
    if t.rank == 0:
        tqdm.write(f"step {t.step}: checkpoint {path} (critic: {critic / 'checkpoints'})")


# ---------------------------------------------------------------- helpers (copied from train_grpo.py, kept in step)


def reward_metrics(t: Trainer, samples: list[rollout.Sample]) -> dict:
    """Reward mean/std (overall and by data source), pass rate, response lengths, reward errors; global over ranks."""
    local = [(s.row["data_source"], s.reward, len(s.completion_ids), s.info.get("error")) for s in samples]
    parts = [None] * t.world
    dist.all_gather_object(parts, local)
    records = [r for part in parts for r in part]
    scores = torch.tensor([r[1] for r in records])
    lengths = torch.tensor([float(r[2]) for r in records])
    metrics = {"reward/mean": scores.mean().item(), "reward/std": scores.std().item() if len(records) > 1 else 0.0,
               "reward/pass_rate": (scores >= 1.0).float().mean().item(),
               "response/length_mean": lengths.mean().item(), "response/length_max": lengths.max().item()}
    by_source, errors = defaultdict(list), defaultdict(int)
    for source, score, _, error in records:
        by_source[source].append(score)
        if error:
            errors[error] += 1
    metrics |= {f"reward/{source}/mean": sum(v) / len(v) for source, v in by_source.items()}
    return metrics | {f"reward/error/{k}": v / len(records) for k, v in errors.items()}


def next_rows(t: Trainer) -> list[dict]:
    """This rank's prompts for the next step; a fresh seeded permutation each epoch."""
    per_rank = t.args.prompts_per_step // t.world
    start = t.data_pos + t.rank * per_rank
    t.data_pos += t.args.prompts_per_step
    picked = []
    for pos in range(start, start + per_rank):
        epoch, offset = divmod(pos, len(t.rows))
        order = torch.randperm(len(t.rows), generator=torch.Generator().manual_seed(t.args.seed + epoch))
        picked.append(t.rows[order[offset]])
    return picked


def load_rows_within(source: str, tokenizer, max_prompt_tokens: int, rank: int) -> list[dict]:
    rows = data_prep.load_rows(source)
    kept = [r for r in rows if len(rollout.encode_prompt(tokenizer, r["prompt"])) <= max_prompt_tokens]
    if not kept:
        raise SystemExit(f"{source}: no row has a prompt within --max-prompt-tokens {max_prompt_tokens}")
    if len(kept) < len(rows) and rank == 0:
        print(f"{source}: skipped {len(rows) - len(kept)} of {len(rows)} rows longer than {max_prompt_tokens} tokens")
    return kept


def micro_batches_of(t: Trainer, index: list[int], samples: list[rollout.Sample]) -> list[list[int]]:
    """`policy.pack` of the samples `index` into micro-batches of `micro_batch_tokens`, prompts counted once per
    micro-batch where they are shared (the actor and the critic use the same attention)."""
    return policy.pack(index, [s.ids for s in samples], t.args.micro_batch_tokens,
                       [len(s.prompt_ids) for s in samples], t.model)


def completion_logprobs(t: Trainer, model, samples: list[rollout.Sample], with_entropy: bool = False):
    """`policy.packed_logprobs` of the samples, scored from each completion's first token (the prompts are not); a
    group's common prompt runs once where the model can share it."""
    return policy.packed_logprobs(model, [s.ids for s in samples], temperature=t.args.temperature,
                                  chunk_size=t.args.logprob_chunk_size, with_entropy=with_entropy,
                                  score_from=[len(s.prompt_ids) for s in samples], share_prefixes=True)


def completion_values(t: Trainer, samples: list[rollout.Sample]) -> torch.Tensor:
    """`policy.packed_values` of the samples on their completion tokens, a group's common prompt run once where the
    critic can share it."""
    return policy.packed_values(t.value_model, [s.ids for s in samples],
                                score_from=[len(s.prompt_ids) for s in samples], share_prefixes=True)


def dummy_sample(t: Trainer) -> rollout.Sample:
    pad = t.tokenizer.pad_token_id
    return rollout.Sample(prompt_ids=[pad], completion_ids=[pad], loss_mask=[0], engine_logprobs=[0.0], row={},
                          group=-1)


def split_completions(flat: torch.Tensor, samples: list[rollout.Sample]) -> list[torch.Tensor]:
    """Per-sample completion slices of a flat packed tensor aligned with the concatenated ids."""
    out, start = [], 0
    for s in samples:
        out.append(flat[start + len(s.prompt_ids) : start + len(s.ids)])
        start += len(s.ids)
    return out


def completion_part(flat: torch.Tensor, samples: list[rollout.Sample]) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(split_completions(flat, samples), batch_first=True)


def padded(values: list) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence([torch.as_tensor(v, dtype=torch.float32) for v in values], batch_first=True)


def global_mean_var(x: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """Mean and unbiased variance of x's masked-in entries over every rank's batch."""
    on = mask.bool()
    moments = torch.stack([on.sum().double(), torch.where(on, x, 0).double().sum()])
    dist.all_reduce(moments)
    mean = (moments[1] / moments[0].clamp(min=1)).item()
    square = torch.where(on, x.double() - mean, 0).pow(2).sum()
    dist.all_reduce(square)
    return mean, (square / (moments[0] - 1).clamp(min=1)).item()


def sum_over_ranks(value: float) -> float:
    x = torch.tensor(float(value), dtype=torch.float64)
    dist.all_reduce(x)
    return x.item()


def sum_dicts_over_ranks(stats: dict) -> dict:
    """Key-wise sum over ranks; one collective whatever keys each rank has."""
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, dict(stats))
    total = defaultdict(float)
    for part in parts:
        for k, v in part.items():
            total[k] += v
    return dict(total)


@contextmanager
def timed(seconds: dict, name: str):
    """`with timed(seconds, "phase"):` adds the block's wall time to seconds["phase"]."""
    start = time.perf_counter()
    yield
    seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - start


def log(t: Trainer, metrics: dict) -> None:
    if t.rank != 0:
        return
    with open(Path(t.args.output_dir) / "metrics.jsonl", "a") as f:
        f.write(json.dumps(metrics) + "\n")
    if t.args.wandb_project:
        import wandb

        wandb.log(metrics, step=metrics["step"])


def write_samples(t: Trainer, samples: list[rollout.Sample]) -> None:
    records = [{"step": t.step + 1, "task_id": data_prep.row_id(s.row), "reward": s.reward, "completion": s.text,
                "error": s.info.get("error")} for s in samples]
    parts = [None] * t.world
    dist.all_gather_object(parts, records)
    if t.rank == 0:
        with open(Path(t.args.output_dir) / "samples.jsonl", "a") as f:
            f.writelines(json.dumps(record) + "\n" for part in parts for record in part)


if __name__ == "__main__":
    main(tyro.cli(Args))
    policy.exit_distributed()
