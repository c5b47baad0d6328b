"""GRPO for code LLMs: `torchrun --nproc-per-node 8 train_grpo.py --model ... --data ...`.

Every rank holds an FSDP2 shard of the policy and its own rollout engine. One step, in `train_step()`:
rollouts -> rewards -> advantages -> (old/ref logprobs) -> minibatch updates -> metrics and checkpoints.
The same code runs on a 2-core CPU (gloo, HF engine, tiny model) and on 8 GPUs (nccl, vLLM).
"""
from __future__ import annotations

import dataclasses
import json
import math
import random
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

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
    model: str = "runs/demo/sft/hf"
    """policy to train: a Hugging Face folder or hub name (default: the SFT'd tiny model `make demo` builds)"""
    data: str = "runs/demo/train.parquet"
    """training rows (parquet / jsonl / HF dataset name) in kiln's row schema"""
    eval_data: str | None = None
    """held-out rows, evaluated greedily every `eval_every` steps"""
    output_dir: str = "runs/grpo"
    """where metrics.jsonl, samples.jsonl and checkpoints/ go"""
    engine: Literal["hf", "vllm"] = "hf"
    """rollout engine: colocated vLLM on GPUs, or generation with the policy itself (CPU, debugging)"""
    seed: int = 0
    """seed for data order, sampling and initialisation"""

    prompts_per_step: int = 8
    """prompts per step across all ranks (must divide by the world size)"""
    group_size: int = 4
    """samples per prompt (the GRPO group)"""
    max_prompt_tokens: int = 512
    """rows whose prompt is longer are skipped at load (and counted in the log)"""
    max_new_tokens: int = 256
    """generation budget per sample"""
    temperature: float = 1.0
    """sampling temperature; the trainer scores tokens under the same temperature"""
    top_p: float = 1.0
    """nucleus sampling (keep 1.0 for unbiased policy gradients)"""

    advantage: Literal["grpo", "drgrpo", "rloo", "reinforce++"] = "grpo"
    """advantage estimator"""
    dynamic_sampling: bool = False
    """drop groups whose rewards are all equal (they carry no GRPO signal)"""
    policy_loss: Literal["clip", "gspo"] = "clip"
    """token-level clipped ratio (PPO/GRPO) or sequence-level ratio (GSPO)"""
    clip_low: float = 0.2
    """lower clip range: ratio >= 1 - clip_low"""
    clip_high: float = 0.2
    """upper clip range: ratio <= 1 + clip_high (DAPO clip-higher: e.g. 0.28)"""
    dual_clip: float | None = None
    """dual-clip constant c (> 1) bounding the loss of negative advantages; None = off"""
    tis_cap: float | None = None
    """truncated importance sampling: cap on exp(old - engine logprob); None = off"""
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """how token losses become one number (verl's names)"""
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
    vllm_gpu_memory_utilization: float = 0.5
    """fraction of GPU memory vLLM may take while awake"""
    vllm_max_model_len: int = 4096
    """vLLM context length"""
    vllm_tensor_parallel_size: int = 1
    """ranks per vLLM engine (consecutive ranks form a group)"""

    total_steps: int = 100
    """training steps"""
    save_every: int = 50
    """checkpoint every N steps (0 = only at the end)"""
    keep_checkpoints: int = 2
    """how many recent checkpoints to keep"""
    eval_every: int = 0
    """evaluate on eval_data every N steps (0 = only before and after training)"""
    sample_every: int = 10
    """write sample completions to samples.jsonl every N steps"""
    resume: bool = False
    """continue from the newest checkpoint in output_dir"""
    wandb_project: str | None = None
    """log to wandb too (WANDB_MODE=offline works without network)"""
    dry_run: bool = False
    """print the resolved Args and exit"""

    tools: Literal["none", "python"] = "none"
    """multi-turn agent rollouts with these tools (python: a stateful sandboxed interpreter per trajectory)"""
    max_turns: int = 4
    """assistant turns per trajectory (tools on)"""
    max_total_tokens: int = 2048
    """prompt + all turns and tool outputs per trajectory (tools on)"""
    max_tool_response_tokens: int = 512
    """longer tool outputs are cut and marked (tools on)"""
    check_tito: bool = False
    """compare every trajectory with the chat template's rendering of its messages; log the drifting fraction
    (tools/tito_drift_frac) and the first drift of each step (tools on)"""


ScoreFn = Callable[[list[dict], list[str]], list["rewards.Reward"]]


@dataclass
class Trainer:
    """Everything a step touches, built once by `setup()`."""

    args: Args
    rank: int
    world: int
    model: torch.nn.Module
    ref_model: torch.nn.Module | None
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    engine: rollout.Engine
    tokenizer: object
    sampling: rollout.Sampling
    rows: list[dict]
    eval_rows: list[dict]
    score_fn: ScoreFn
    step: int = 0
    data_pos: int = 0


def main(args: Args, score_fn: ScoreFn = rewards.score_batch) -> Trainer:
    if args.dry_run:
        print(json.dumps(dataclasses.asdict(args), indent=2))
        return None
    t = setup(args, score_fn)
    out = Path(args.output_dir)
    if t.step == 0 and t.eval_rows:
        log(t, evaluate(t) | {"step": 0})
    bar = tqdm(total=args.total_steps, initial=t.step, desc="grpo", disable=t.rank != 0)
    while t.step < args.total_steps:
        metrics = train_step(t)
        t.step += 1
        if args.eval_every and t.step % args.eval_every == 0 and t.step < args.total_steps and t.eval_rows:
            metrics |= evaluate(t)
        log(t, metrics | {"step": t.step})
        bar.update(1)
        bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}")
        if t.step % (args.save_every or args.total_steps) == 0 or t.step == args.total_steps:
            save(t)
    bar.close()
    if t.eval_rows:
        log(t, evaluate(t) | {"step": t.step})
    if t.rank == 0:
        print(f"done: metrics in {out / 'metrics.jsonl'}, checkpoints in {out / 'checkpoints'}")
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
    torch.manual_seed(args.seed + rank)
    random.seed(args.seed + rank)
    tokenizer = policy.load_tokenizer(args.model)
    rows = load_rows_within(args.data, tokenizer, args.max_prompt_tokens, rank)
    eval_rows = load_rows_within(args.eval_data, tokenizer, args.max_prompt_tokens, rank) if args.eval_data else []
    # vLLM takes its memory before the FSDP model does (its allocator must see a clean device).
    engine = None
    if args.engine == "vllm":
        engine = rollout.VLLMEngine(
            args.model, seed=args.seed, gpu_memory_utilization=args.vllm_gpu_memory_utilization,
            max_model_len=args.vllm_max_model_len, tensor_parallel_size=args.vllm_tensor_parallel_size)
        engine.sleep()
    model = policy.shard_model(policy.load_model(args.model, attn_implementation=args.attn_implementation).to(device),
                               mixed_precision=args.mixed_precision,
                               activation_checkpointing=args.activation_checkpointing,
                               compile_layers=args.compile_layers)
    ref_model = None
    if args.kl_coef > 0:
        ref_model = policy.shard_model(policy.load_model(args.model, attn_implementation=args.attn_implementation)
                                       .to(device), mixed_precision=args.mixed_precision)
        ref_model.requires_grad_(False)
    if engine is None:
        engine = rollout.HFEngine(model, pad_token_id=tokenizer.pad_token_id)
    # foreach: torch's default for GPU tensors; on CPU it would step one tensor at a time in Python
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, foreach=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(args, s))
    sampling = rollout.Sampling(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                                stop_token_ids=policy.stop_token_ids(tokenizer, args.model))
    t = Trainer(args, rank, world, model, ref_model, optimizer, scheduler, engine, tokenizer, sampling, rows, eval_rows,
                score_fn)
    checkpoint = policy.latest_checkpoint(args.output_dir) if args.resume else None
    if checkpoint is not None:
        state = policy.load_checkpoint(checkpoint, model, optimizer)
        scheduler.load_state_dict(state["scheduler"])
        t.step, t.data_pos = state["step"], state["data_pos"]
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
    args, metrics, timer = t.args, {}, Timer()

    # 1. This rank's prompts for the step (a seeded shuffle per epoch, so resuming replays the same order).
    rows = next_rows(t)

    # 2-4. Rollouts: wake the engine, give it the current weights, generate, put it back to sleep.
    with timer("wake_and_sync"):  # a level-2 sleep drops the engine's weights: every wake-up needs a sync
        t.engine.wake_up()
        t.engine.load_weights(policy.iter_full_weights(t.model))
    with timer("rollout"):
        samples, rollout_metrics = rollout_samples(t, rows, args.group_size, t.sampling)
        t.engine.sleep()
    metrics |= rollout_metrics | getattr(t.engine, "last_metrics", {})

    # 5. Rewards, in parallel in the sandbox.
    with timer("reward"):
        results = t.score_fn([s.row for s in samples], [s.text for s in samples])
        for s, r in zip(samples, results):
            s.reward, s.info = r.score, r.info
    metrics |= reward_metrics(t, samples)

    # 6. Advantages over the global batch (groups never straddle ranks; REINFORCE++ normalises globally).
    reward = torch.tensor([s.reward for s in samples])
    group = torch.tensor([s.group for s in samples])
    all_reward, all_group = gather(reward, t.world), gather(group, t.world)
    advantage = losses.scalar_advantages(args.advantage, all_reward, all_group)[t.rank * len(samples):][:len(samples)]
    keep = torch.ones(len(samples), dtype=torch.bool)
    if args.dynamic_sampling:
        keep = losses.nonconstant_groups(reward, group)
        metrics["batch/kept_frac"] = mean_over_ranks(keep.float().mean().item(), t.world)
    batch = [(s, a.item()) for s, a, k in zip(samples, advantage, keep) if k]

    # 7. Old and reference logprobs (no grad) where the loss needs them.
    with timer("old_ref_logprobs"):
        old_logprobs = logprobs_no_grad(t, t.model, batch) if args.minibatches * args.epochs_per_step > 1 else None
        ref_logprobs = logprobs_no_grad(t, t.ref_model, batch) if t.ref_model is not None else None

    # 8. Minibatch updates: packed forward -> loss -> backward -> clip -> step.
    with timer("update"):
        update_metrics = defaultdict(list)
        for _ in range(args.epochs_per_step):
            for mb in range(args.minibatches):
                for k, v in update(t, batch, mb, old_logprobs, ref_logprobs).items():
                    update_metrics[k].append(v)
        t.scheduler.step()
    metrics |= {k: sum(v) / len(v) for k, v in update_metrics.items()}

    # 9. Metrics and sample completions.
    seconds = timer.seconds
    metrics |= {f"time/{k}": v for k, v in seconds.items()}
    tokens = mean_over_ranks(sum(len(s.ids) for s in samples), t.world) * t.world
    metrics["perf/tokens_per_s"] = tokens / sum(seconds.values())
    metrics["lr"] = t.scheduler.get_last_lr()[0]
    if args.sample_every and (t.step + 1) % args.sample_every == 0:
        write_samples(t, samples)
    return metrics


def update(t: Trainer, batch: list, minibatch: int, old_logprobs, ref_logprobs) -> dict:
    """One optimizer step on this rank's share of one minibatch, packed into micro-batches of bounded tokens."""
    args = t.args
    index = policy.minibatch([s.group for s, _ in batch], args.minibatches, minibatch)
    # Global normalisers make the sum of micro-batch losses on every rank equal the global-batch loss; FSDP
    # averages gradients over ranks, hence the factor `world`.
    tokens = sum_over_ranks(sum(sum(batch[i][0].loss_mask) for i in index), t.world)
    seqs = sum_over_ranks(len(index), t.world)
    if seqs == 0:  # no rank has a sample in this minibatch (dynamic sampling dropped them): no step
        return {}
    micro_batches = micro_batches_of(t, index, [batch[i][0] for i in index])
    stats = defaultdict(float)
    t.optimizer.zero_grad(set_to_none=True)
    for micro in micro_batches:
        # An empty micro-batch (this rank has fewer) runs a masked-out dummy: FSDP collectives must stay in step.
        samples = [batch[i][0] for i in micro] or [dummy_sample(t)]
        logprobs, entropy = completion_logprobs(t, t.model, samples, with_entropy=True)
        logprobs, entropy = completion_part(logprobs, samples), completion_part(entropy, samples)
        device = logprobs.device
        mask = padded([s.loss_mask for s in samples], device)
        engine = padded([s.engine_logprobs for s in samples], device)
        adv = torch.tensor([batch[i][1] for i in micro] or [0.0], device=device)[:, None].expand_as(mask)
        on_policy = old_logprobs is None or not micro
        old = logprobs.detach() if on_policy else padded([old_logprobs[i] for i in micro], device)
        if args.policy_loss == "gspo":
            token_loss, pstats = losses.gspo_loss(logprobs, old, adv, mask, clip_low=args.clip_low,
                                                  clip_high=args.clip_high)
        else:
            token_loss, pstats = losses.clipped_policy_loss(
                logprobs, old, adv, mask, clip_low=args.clip_low, clip_high=args.clip_high, dual_clip=args.dual_clip,
                engine_logprobs=engine if args.tis_cap else None, tis_cap=args.tis_cap)
        if ref_logprobs is not None and micro:
            kl = losses.kl_penalty(logprobs, padded([ref_logprobs[i] for i in micro], device),
                                   args.kl_estimator)
            token_loss = token_loss + args.kl_coef * kl
            stats["kl"] += losses.masked_sum(kl.detach(), mask).item() / tokens
        loss = losses.aggregate(token_loss, mask, args.loss_agg, num_tokens=tokens, num_seqs=seqs,
                                max_len=args.max_new_tokens) * t.world
        loss.backward()
        share = mask.sum().item() / tokens  # this micro-batch's share of the global tokens
        stats["loss"] += loss.item() / t.world
        stats["entropy"] += losses.masked_sum(entropy.detach(), mask).item() / tokens
        stats["mismatch/engine_abs"] += losses.masked_sum((old - engine).abs(), mask).item() / tokens
        for k, v in pstats.items():
            stats[k] += v * share
    stats["grad_norm"] = policy.clip_grad_norm(t.model, args.max_grad_norm)
    t.optimizer.step()
    grad_norm = stats.pop("grad_norm")
    return sum_dicts_over_ranks(stats, t.world) | {"grad_norm": grad_norm}


def logprobs_no_grad(t: Trainer, model, batch: list) -> list[torch.Tensor]:
    """Completion-token logprobs of every sample in `batch` under `model`, micro-batched, no grad."""
    out = []
    index = list(range(len(batch)))
    with torch.no_grad():
        for micro in micro_batches_of(t, index, [s for s, _ in batch]):
            samples = [batch[i][0] for i in micro] or [dummy_sample(t)]
            flat, _ = completion_logprobs(t, model, samples)
            if micro:
                out += split_completions(flat, samples)
    return out


def evaluate(t: Trainer) -> dict:
    """Greedy pass@1 and mean reward on the held-out rows, by data source and difficulty."""
    rows = t.eval_rows[t.rank :: t.world]
    greedy = dataclasses.replace(t.sampling, temperature=0.0)
    t.engine.wake_up()
    t.engine.load_weights(policy.iter_full_weights(t.model))
    samples, _ = rollout_samples(t, rows, 1, greedy)
    t.engine.sleep()
    results = t.score_fn([s.row for s in samples], [s.text for s in samples])
    totals = defaultdict(lambda: [0.0, 0.0, 0.0])  # key -> [count, reward sum, passes]
    for s, r in zip(samples, results):
        keys = ["all", s.row["data_source"]]
        if s.row.get("extra_info", {}).get("difficulty") is not None:
            keys.append(f"{s.row['data_source']}/{s.row['extra_info']['difficulty']}")
        for key in keys:
            totals[key][0] += 1
            totals[key][1] += r.score
            totals[key][2] += float(r.score >= 1.0)
    merged = [None] * t.world if t.world > 1 else [dict(totals)]
    if t.world > 1:
        dist.all_gather_object(merged, dict(totals))
    summed = defaultdict(lambda: [0.0, 0.0, 0.0])
    for part in merged:
        for key, (n, reward_sum, passes) in part.items():
            summed[key] = [a + b for a, b in zip(summed[key], (n, reward_sum, passes))]
    metrics = {}
    for key, (n, reward_sum, passes) in summed.items():
        metrics[f"eval/{key}/pass_rate"] = passes / n
        metrics[f"eval/{key}/reward"] = reward_sum / n
    return metrics


def rollout_samples(t: Trainer, rows: list[dict], group_size: int, sampling: rollout.Sampling) -> tuple[list, dict]:
    """Single-turn rollouts, or multi-turn agent rollouts when tools are on (tool metrics averaged over ranks)."""
    args = t.args
    if args.tools == "none":
        return rollout.run(t.engine, t.tokenizer, rows, group_size, sampling, first_group=t.rank * len(rows))
    limits = rollout.AgentLimits(args.max_turns, args.max_total_tokens, args.max_tool_response_tokens)
    samples, metrics = rollout.run_agent(t.engine, t.tokenizer, rows, group_size, sampling, rollout.python_toolbox,
                                         limits, first_group=t.rank * len(rows))
    if args.check_tito:  # a sampled tokenization the template would not produce is drift too: logged, not fatal
        drifts = [(s, rollout.check_tito(t.tokenizer, s, s.info["messages"], s.info["tools"])) for s in samples]
        metrics["tools/tito_drift_frac"] = sum(bool(d) for _, d in drifts) / len(drifts)
        first = next(((s, d) for s, d in drifts if d), None)
        if first is not None:
            tqdm.write(f"rank {t.rank}, task {data_prep.row_id(first[0].row)}: {first[1][0]}")
    for k in [k for k in metrics if k.startswith("tools/")]:
        metrics[k] = mean_over_ranks(metrics[k], t.world)
    return samples, metrics


def reward_metrics(t: Trainer, samples: list[rollout.Sample]) -> dict:
    """Reward mean/std (overall and by data source), pass rate, response lengths; global over ranks."""
    local = [(s.row["data_source"], s.reward, len(s.completion_ids), s.info.get("error")) for s in samples]
    everything = [None] * t.world if t.world > 1 else [local]
    if t.world > 1:
        dist.all_gather_object(everything, local)
    records = [r for part in everything for r in part]
    rewards_all = torch.tensor([r[1] for r in records])
    lengths = torch.tensor([float(r[2]) for r in records])
    metrics = {
        "reward/mean": rewards_all.mean().item(),
        "reward/std": rewards_all.std().item() if len(records) > 1 else 0.0,
        "reward/pass_rate": (rewards_all >= 1.0).float().mean().item(),
        "response/length_mean": lengths.mean().item(),
        "response/length_max": lengths.max().item(),
    }
    by_source = defaultdict(list)
    for source, reward, _, _ in records:
        by_source[source].append(reward)
    for source, values in by_source.items():
        metrics[f"reward/{source}/mean"] = sum(values) / len(values)
    errors = defaultdict(int)
    for *_, error in records:
        if error:
            errors[error] += 1
    metrics |= {f"reward/error/{k}": v / len(records) for k, v in errors.items()}
    return metrics


def next_rows(t: Trainer) -> list[dict]:
    """This rank's prompts for the next step; a fresh seeded permutation each epoch."""
    per_rank = t.args.prompts_per_step // t.world
    start = t.data_pos
    t.data_pos += t.args.prompts_per_step
    picked = []
    for pos in range(start + t.rank * per_rank, start + (t.rank + 1) * per_rank):
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
    micro-batch where they are shared."""
    return policy.pack(index, [s.ids for s in samples], t.args.micro_batch_tokens,
                       [len(s.prompt_ids) for s in samples], t.model)


def completion_logprobs(t: Trainer, model, samples: list[rollout.Sample], with_entropy: bool = False):
    """`policy.packed_logprobs` of the samples, scored from each completion's first token (the prompts are not); a
    group's common prompt runs once where the model can share it."""
    return policy.packed_logprobs(model, [s.ids for s in samples], temperature=t.args.temperature,
                                  chunk_size=t.args.logprob_chunk_size, with_entropy=with_entropy,
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


def padded(values: list, device: torch.device) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence([torch.as_tensor(v, dtype=torch.float32, device=device) for v in values],
                                           batch_first=True)


def lr_factor(args: Args, step: int) -> float:
    if step < args.warmup_steps:
        return (step + 1) / args.warmup_steps
    if args.lr_schedule == "cosine":
        progress = (step - args.warmup_steps) / max(1, args.total_steps - args.warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return 1.0


def gather(x: torch.Tensor, world: int) -> torch.Tensor:
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x)
    return torch.cat(parts)


def sum_over_ranks(value: float, world: int) -> float:
    if world == 1:
        return value
    x = torch.tensor(float(value), dtype=torch.float64)
    dist.all_reduce(x)
    return x.item()


def sum_dicts_over_ranks(stats: dict, world: int) -> dict:
    """Key-wise sum over ranks; one collective whatever keys each rank has."""
    if world == 1:
        return dict(stats)
    parts = [None] * world
    dist.all_gather_object(parts, dict(stats))
    total = defaultdict(float)
    for part in parts:
        for k, v in part.items():
            total[k] += v
    return dict(total)


def mean_over_ranks(value: float, world: int) -> float:
    return sum_over_ranks(value, world) / world


class Timer:
    """`with timer("phase"):` accumulates wall seconds per phase."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._name = None

    def __call__(self, name: str):
        self._name = name
        return self

    def __enter__(self):
        self._start = time.perf_counter()

    def __exit__(self, *exc):
        self.seconds[self._name] = self.seconds.get(self._name, 0.0) + time.perf_counter() - self._start


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
    everything = [None] * t.world if t.world > 1 else [records]
    if t.world > 1:
        dist.all_gather_object(everything, records)
    if t.rank == 0:
        with open(Path(t.args.output_dir) / "samples.jsonl", "a") as f:
            for part in everything:
                for record in part:
                    f.write(json.dumps(record) + "\n")


def save(t: Trainer) -> None:
    state = {"step": t.step, "data_pos": t.data_pos, "scheduler": t.scheduler.state_dict()}
    path = policy.save_checkpoint(t.args.output_dir, t.step, t.model, t.optimizer, state, hf_source_dir=t.args.model,
                                  keep_last=t.args.keep_checkpoints)
    if t.rank == 0:
        tqdm.write(f"step {t.step}: checkpoint {path}")


if __name__ == "__main__":
    main(tyro.cli(Args))
    policy.exit_distributed()
