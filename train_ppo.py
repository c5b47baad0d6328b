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
import json
import math
import random
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from tqdm import tqdm

import chat
import cli
import collectives
import containers
import engines
import eval_report
import losses
import policy
import rewards
import rollout
import runlog
import sandbox
import swe_grading
import task_rows
from checkpoint import check_best_metric, keep_best, load_checkpoint, load_newest_checkpoint, save_checkpoint


@dataclass
class Args:
    model: str = "runs/demo/sft/hf"
    """policy to train: a Hugging Face folder or hub name (default: the SFT'd tiny model `make demo` builds)"""
    critic_model: str | None = None
    """critic initialisation (a value head is added to it); None = the actor's model"""
    data: str = "runs/demo/train.parquet"
    """training rows (parquet / jsonl / HF dataset name) in kiln's row schema"""
    eval_data: str | None = None
    """held-out rows, evaluated greedily every `eval_every` steps"""
    output_dir: str = "runs/ppo"
    """where metrics.jsonl, samples.jsonl, eval_report.json/.md/.png, best/ and checkpoints/ go"""
    engine: Literal["hf", "vllm"] = "hf"
    """rollout engine: colocated vLLM on GPUs, or generation with the policy itself (CPU, debugging)"""
    seed: int = 0
    """seed for data order, sampling and initialisation"""

    prompts_per_step: int = 8
    """prompts per step across all ranks (must divide by the world size)"""
    group_size: int = 1
    """samples per prompt (1 = classic PPO; the critic is the baseline)"""
    epochs: int = 5
    """passes over the training rows, when total_steps is None"""
    total_steps: int | None = None
    """training steps; None = epochs * rows / prompts_per_step"""
    max_prompt_tokens: int = 512
    """rows whose prompt is longer are skipped at load (and counted in the log)"""
    max_new_tokens: int = 256
    """generation budget per sample"""
    temperature: float = 1.0
    """sampling temperature; the trainer scores tokens under the same temperature"""
    top_p: float = 1.0
    """nucleus sampling (keep 1.0: below it the samples and the engine logprobs that --tis-cap uses come from the
    truncated distribution while the trainer scores the full one, a bias nothing corrects; see losses.py's TIS)"""
    end_of_turn: str | None = None
    """token that closes an assistant turn (default: found in the chat template, e.g. <|im_end|>, <|eot_id|>)"""
    sandbox_isolation: Literal["full", "userns", "plain"] = "full"
    """the weakest isolation allowed for reward programs and the python tool (full: namespaces, filesystem view, no
    network, a uid per run; see docs/sandbox.md); the run stops at start if the machine allows less"""
    tools: Literal["none", "python", "swe"] = "none"
    """multi-turn agent rollouts with these tools (python: a stateful sandboxed interpreter per trajectory; swe: bash,
    an editor and submit in a Docker container per trajectory, for swebench rows, graded on the container's diff)"""
    max_turns: int = 4
    """assistant turns per trajectory (tools on)"""
    max_total_tokens: int = 2048
    """prompt + all turns and tool outputs per trajectory (tools on)"""
    max_tool_response_tokens: int = 512
    """longer tool outputs are cut and marked (tools on)"""
    max_agent_seconds: float = 1800.0
    """wall clock per trajectory; checked before each turn's tools run (tools on; docs/swebench.md's budget table)"""
    check_tito: bool = False
    """compare every trajectory with the chat template's rendering of its messages; log the drifting fraction
    (tools/tito_drift_frac) and the first drift of each step (tools on)"""

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
    vllm_gpu_memory_utilization: float = 0.5
    """fraction of GPU memory vLLM may take while awake"""
    vllm_max_model_len: int = 4096
    """vLLM context length"""
    vllm_tensor_parallel_size: int = 1
    """ranks per vLLM engine (consecutive ranks form a group)"""

    save_every: int = 50
    """checkpoint every N steps (0 = only at the end)"""
    keep_checkpoints: int = 2
    """how many recent checkpoints to keep (of each model)"""
    eval_every: int = 0
    """evaluate on eval_data every N steps (0 = only before and after training)"""
    best_metric: str = "val-core/all/test_pass_rate"
    """evaluation metric (higher is better) that picks the policy kept as a Hugging Face folder in <output_dir>/best
    (e.g. val-core/all/pass@1, val-core/apps/interview/test_pass_rate); "" = keep none"""
    eval_temperature: float = 0.0
    """0 = greedy evaluation; > 0 samples eval_samples completions per problem"""
    eval_samples: int = 1
    """completions per eval problem (pass@1 = mean pass rate over them)"""
    sample_every: int = 10
    """write sample completions to samples.jsonl every N steps and at the last step (0 = never)"""
    rich_samples: bool = False
    """samples.jsonl also keeps each sample's tokens, loss mask, engine and trainer logprobs, advantage, group, reward
    components, tool calls and images (sample_images/), for board.py (docs/board.md: its cost per sample)"""
    samples_max_mb: float = 1024.0
    """samples.jsonl rotates to samples.old.jsonl past half of this, so the two stay within it (0 = never)"""
    resume: bool = False
    """continue from the newest checkpoint in output_dir"""
    overwrite: bool = False
    """replace an earlier run in output_dir (without it or --resume, a non-empty output_dir is refused)"""
    wandb_project: str | None = None
    """log to wandb too (WANDB_MODE=offline works without network)"""
    dry_run: bool = False
    """print the resolved Args and exit"""


@dataclass
class Run:
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
    engine: engines.Engine
    tokenizer: object
    sampling: engines.Sampling
    limits: rollout.AgentLimits  # of multi-turn rollouts (--tools)
    rows: list[dict]
    eval_rows: list[dict]
    score_fn: rewards.ScoreFn
    log: runlog.RunLog
    step: int = 0
    data_pos: int = 0
    kl_coef: float = 0.0
    best: dict = field(default_factory=dict)  # {"step", "metric", "value"} of the policy kept in best/
    evals: list[dict] = field(default_factory=list)  # every eval's eval_report.report summary and step, for the report


@dataclass
class Experience:
    """One rank's rollouts and what PPO derives from them once, without grad: [B, T] over completion tokens."""

    samples: list[rollout.Sample]
    mask: torch.Tensor  # the samples' loss masks (1 = policy token)
    old_logprobs: torch.Tensor
    values: torch.Tensor  # V(state before each token), 0 off-mask
    advantages: torch.Tensor  # GAE (whitened with whiten_advantages); 0 off-mask
    returns: torch.Tensor  # GAE advantages + values, the critic's targets; 0 off-mask
    kl_mean: float  # mean KL to the reference over every rank's policy tokens (0 without one): adaptive KL's input


def main(args: Args, score_fn: rewards.ScoreFn = rewards.score_batch) -> Run | None:
    if args.dry_run:
        print(json.dumps(dataclasses.asdict(args), indent=2))
        return None
    run = setup(args, score_fn)
    if run.step == 0 and run.eval_rows:
        run.log.metrics(runlog.announced_eval(evaluate, run) | {"step": 0})
    bar = tqdm(total=run.total_steps, initial=run.step, desc="ppo", disable=run.rank != 0)
    while run.step < run.total_steps:
        metrics = train_step(run)
        run.step += 1
        last = run.step == run.total_steps
        if run.eval_rows and (last or (args.eval_every and run.step % args.eval_every == 0)):
            metrics |= runlog.announced_eval(evaluate, run)
        run.log.metrics(metrics | {"step": run.step})
        bar.update(1)
        bar.set_postfix(score=f"{metrics['critic/score/mean']:.3f}")
        if last or (args.save_every and run.step % args.save_every == 0):
            save(run)
    bar.close()
    if run.rank == 0:
        print("done: metrics" + (", eval report and best/" if run.eval_rows else "") + f" in {args.output_dir}")
    run.log.finish()
    return run


def check_args(args: Args, world: int) -> None:
    """Refuse settings that would fail or train nothing, before anything loads (vLLM start-up and model loads take
    minutes on GPUs)."""
    for name in ("prompts_per_step", "group_size", "max_new_tokens", "minibatches", "epochs_per_step", "eval_samples"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.total_steps is not None and args.total_steps < 0:
        raise ValueError(f"--total-steps must be >= 0, got {args.total_steps}")
    if args.temperature <= 0:
        raise ValueError(f"--temperature must be > 0 (the trainer scores tokens under it), got {args.temperature}")
    if args.prompts_per_step % world:
        raise ValueError(f"--prompts-per-step {args.prompts_per_step} must divide by the world size {world}")
    if args.prompts_per_step // world < args.minibatches:  # a minibatch takes whole groups
        raise ValueError(f"--minibatches {args.minibatches} needs as many prompts per rank; --prompts-per-step "
                         f"{args.prompts_per_step} over {world} ranks gives {args.prompts_per_step // world}")
    if args.kl_target is not None and args.kl_coef <= 0:
        raise ValueError("--kl-target needs a starting --kl-coef > 0")
    check_best_metric(args.best_metric)
    runlog.check_output_dir(args.output_dir, args.resume, args.overwrite, dataclasses.asdict(args))
    policy.check_model_path(args.model)
    if args.critic_model:
        policy.check_model_path(args.critic_model, "--critic-model")
    policy.check_attention(args.model, args.attn_implementation)
    engines.check_engine(args.engine)


def setup(args: Args, score_fn: rewards.ScoreFn) -> Run:
    rank, world, device = policy.init_distributed()
    check_args(args, world)
    # Decided once, before any model loads (IsolationError names what the machine lacks); every sample is graded at
    # this level.
    isolation = sandbox.require(args.sandbox_isolation, sessions=args.tools == "python")
    if rank == 0:
        print(sandbox.describe(isolation))
    torch.manual_seed(args.seed + rank)
    random.seed(args.seed + rank)
    tokenizer = policy.load_tokenizer(args.model)
    rows = rollout.load_rows_within(args.data, tokenizer, args.max_prompt_tokens, verbose=rank == 0, tools=args.tools)
    eval_rows = (rollout.load_rows_within(args.eval_data, tokenizer, args.max_prompt_tokens, verbose=rank == 0,
                                          tools=args.tools) if args.eval_data else [])
    if 0 < len(eval_rows) < world:  # a rank without eval rows would leave the others' collectives hanging
        raise ValueError(f"{args.eval_data}: {len(eval_rows)} eval rows for {world} ranks; need at least one each")
    if score_fn is rewards.score_batch:  # a caller's own score function decides which sources it knows
        rewards.check_sources(rows, args.data)
        rewards.check_sources(eval_rows, args.eval_data)
    total_steps = (args.total_steps if args.total_steps is not None  # 0: evaluate only
                   else max(1, args.epochs * len(rows) // args.prompts_per_step))
    # vLLM takes its memory before the FSDP models do (its allocator must see a clean device).
    engine = None
    if args.engine == "vllm":
        engine = engines.VLLMEngine(
            args.model, seed=args.seed, gpu_memory_utilization=args.vllm_gpu_memory_utilization,
            max_model_len=args.vllm_max_model_len, tensor_parallel_size=args.vllm_tensor_parallel_size)
        engine.sleep()
    model = policy.shard_model(policy.load_model(args.model, attn_implementation=args.attn_implementation).to(device),
                               mixed_precision=args.mixed_precision,
                               activation_checkpointing=args.activation_checkpointing,
                               compile_layers=args.compile_layers)
    value_model = policy.shard_model(policy.load_value_model(args.critic_model or args.model,
                                                             attn_implementation=args.attn_implementation).to(device),
                                     mixed_precision=args.mixed_precision,
                                     activation_checkpointing=args.activation_checkpointing,
                                     compile_layers=args.compile_layers)
    ref_model = None
    if args.kl_coef > 0:
        ref_model = policy.shard_model(policy.load_model(args.model, attn_implementation=args.attn_implementation)
                                       .to(device), mixed_precision=args.mixed_precision)
        ref_model.requires_grad_(False)
    if engine is None:
        engine = engines.HFEngine(model, pad_token_id=tokenizer.pad_token_id)
    optimizer = policy.adamw(model, args.lr, args.weight_decay)
    critic_optimizer = policy.adamw(value_model, args.critic_lr, args.weight_decay)
    sampling = engines.Sampling(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                                stop_token_ids=policy.stop_token_ids(tokenizer, args.model,
                                                                     chat.end_of_turn(tokenizer, args.end_of_turn)))
    limits = rollout.AgentLimits(args.max_turns, args.max_total_tokens, args.max_tool_response_tokens,
                                 args.max_agent_seconds)
    if args.tools == "swe":  # containers of dead kiln processes go; this one's go when it ends, however it ends
        containers.sweep(containers.shared_client())
        containers.remove_owned_at_exit(containers.shared_client())
    def load_both(checkpoint: Path) -> dict:  # the critic's checkpoint of the step, saved before the policy's
        critic_checkpoint = Path(args.output_dir) / "critic" / "checkpoints" / checkpoint.name
        if not (critic_checkpoint / "trainer_state.json").is_file():
            raise FileNotFoundError(f"{checkpoint} has no critic checkpoint at {critic_checkpoint}")
        load_checkpoint(critic_checkpoint, value_model, critic_optimizer)
        return load_checkpoint(checkpoint, model, optimizer)

    checkpoint, state = load_newest_checkpoint(args.output_dir, load_both) if args.resume else (None, None)
    if checkpoint is None:
        state = {"step": 0, "data_pos": 0, "kl_coef": args.kl_coef, "best": {}, "evals": []}
    elif rank == 0:
        print(f"resumed from {checkpoint} at step {state['step']}")
    log = runlog.start(args.output_dir, rank, dataclasses.asdict(args), args.wandb_project,
                       resume_step=state["step"] if args.resume else None, samples_max_mb=args.samples_max_mb)
    return Run(args=args, rank=rank, world=world, total_steps=total_steps, model=model, value_model=value_model,
               ref_model=ref_model, optimizer=optimizer, critic_optimizer=critic_optimizer, engine=engine,
               tokenizer=tokenizer, sampling=sampling, limits=limits, rows=rows, eval_rows=eval_rows,
               score_fn=score_fn, log=log, step=state["step"], data_pos=state["data_pos"], kl_coef=state["kl_coef"],
               best=state["best"], evals=state["evals"])


def train_step(run: Run) -> dict:
    """One PPO step, phase by phase; each phase is the function of that name right below, in this order."""
    seconds = {}
    # 1-5. Prompts -> rollouts -> rewards (tool output between turns is outside the loss mask: no value, no loss).
    samples, metrics = collect_samples(run, seconds)
    # 6-7. Old/reference logprobs and values, token rewards, GAE, whitened advantages.
    with runlog.timed(seconds, "experience"):
        exp, experience_metrics = make_experience(run, samples)
    # 8. Minibatch updates: the critic every step, the actor once the critic has warmed up; then adaptive KL.
    with runlog.timed(seconds, "update"):
        update_metrics = update_epochs(run, exp)
    # 9. Throughput, timings and sample records.
    return metrics | experience_metrics | update_metrics | step_metrics(run, exp, seconds)


def collect_samples(run: Run, seconds: dict) -> tuple[list[rollout.Sample], dict]:
    """Phases 1-5: this rank's prompts (a seeded shuffle per epoch, so resuming replays the same order), the engine
    woken with the current weights (a level-2 sleep dropped them), `group_size` rollouts of each, the engine asleep
    again, and every sample's reward from the sandbox; a non-finite reward stops every rank naming the task."""
    args, per_rank = run.args, run.args.prompts_per_step // run.world
    rows = task_rows.in_epoch_order(run.rows, run.data_pos + run.rank * per_rank, per_rank, args.seed)
    run.data_pos += args.prompts_per_step
    with runlog.timed(seconds, "wake_and_sync"):
        run.engine.wake_up()
        run.engine.load_weights(policy.iter_full_weights(run.model))
    with runlog.timed(seconds, "rollout"):
        # Each sample's tokens come from its own seed (step, group, index, turn): a resumed run repeats them.
        sampling = dataclasses.replace(run.sampling, seed=engines.derive_seed(args.seed, run.step))
        samples, rollout_metrics = rollout.collect(run.engine, run.tokenizer, rows, args.group_size, sampling,
                                                   args.tools, run.limits, first_group=run.rank * len(rows),
                                                   check=args.check_tito, eot=args.end_of_turn)
        run.engine.sleep()
    with runlog.timed(seconds, "reward"):
        for s, r in zip(samples, run.score_fn([s.row for s in samples], [s.text for s in samples])):
            s.reward, s.info = r.score, s.info | r.info  # the rollout's info (multi-turn messages) stays
    rewards.refuse_nonfinite(collectives.gather_objects(  # every rank gets every offender: all stop together
        [(task_rows.row_id(s.row), s.reward) for s in samples if not math.isfinite(s.reward)]), run.step + 1)
    tool_metrics = {k: v for k, v in rollout_metrics.items() if k.startswith(("tools/", "swe/", "agents/"))}
    metrics = (rollout_metrics | collectives.mean_dicts_over_ranks(tool_metrics)
               | getattr(run.engine, "last_metrics", {}))
    sources, scores, errors, lengths, isolations = zip(*collectives.gather_objects(
        [(s.row["data_source"], s.reward, s.info.get("error"), len(s.completion_ids), s.info.get("sandbox_isolation"))
         for s in samples]))
    metrics |= rewards.batch_metrics(sources, scores, errors, lengths, isolations)
    if args.tools == "swe":
        metrics |= swe_grading.swe_metrics(collectives.gather_objects([s.info for s in samples]))
    return samples, metrics


def make_experience(run: Run, samples: list[rollout.Sample]) -> tuple[Experience, dict]:
    """Old/reference logprobs and values of `samples`, then token rewards (the score on the last policy token, minus
    kl_coef * KL to the reference on every policy token), GAE over the policy tokens and whitened advantages."""
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
    adv_mean, adv_var = collectives.global_mean_var(advantages, mask)
    if args.whiten_advantages:
        advantages = torch.where(mask.bool(), (advantages - adv_mean) / math.sqrt(adv_var + 1e-8), 0)
    returns_mean, returns_var = collectives.global_mean_var(returns, mask)
    _, error_var = collectives.global_mean_var(returns - values, mask)
    engine_logprobs = policy.padded([s.engine_logprobs for s in samples])
    metrics = {
        "critic/values/mean": collectives.global_mean_var(values, mask)[0],
        "critic/returns/mean": returns_mean,
        "critic/vf_explained_var": 1 - error_var / returns_var if returns_var > 0 else 0.0,
        "critic/advantages/mean": adv_mean, "critic/advantages/std": math.sqrt(adv_var),
        "actor/reward_kl_penalty": collectives.global_mean_var(kl, mask)[0],
        "mismatch/engine_abs": collectives.global_mean_var((old - engine_logprobs).abs(), mask)[0],
    }
    return Experience(samples, mask, old, values, advantages, returns, metrics["actor/reward_kl_penalty"]), metrics


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
        run.kl_coef *= 1 + error * len(exp.samples) * run.world / args.kl_horizon
    return metrics


def step_metrics(run: Run, exp: Experience, seconds: dict) -> dict:
    """Phase 9: seconds per phase, sample tokens per second over all ranks; every --sample-every steps (and at the
    last) every sample of the step goes to samples.jsonl (with --rich-samples, its old logprobs and per-token
    advantages too)."""
    samples = exp.samples
    metrics = {f"timing_s/{k}": v for k, v in seconds.items()}
    metrics["perf/tokens_per_s"] = (collectives.sum_over_ranks(sum(len(s.ids) for s in samples))
                                    / sum(seconds.values()))
    if runlog.writes_samples(run.step + 1, run.args.sample_every, run.total_steps):
        rich = dict(tokenizer=run.tokenizer, trainer_logprobs=exp.old_logprobs,
                    token_advantages=exp.advantages) if run.args.rich_samples else {}
        run.log.samples(collectives.gather_objects(runlog.sample_records(run.step + 1, samples, **rich)))
    return metrics


def update_actor(run: Run, exp: Experience, minibatch: int) -> dict:
    """One actor optimizer step on this rank's share of one minibatch: per micro-batch, packed forward -> clipped
    surrogate on the whitened advantages (- entropy bonus) -> backward; then clip and step."""
    args = run.args
    micro_batches, global_tokens = minibatch_plan(run, exp, minibatch)
    stats = defaultdict(float)
    run.optimizer.zero_grad(set_to_none=True)
    for micro in micro_batches:
        logprobs, entropy = policy.completion_logprobs(run.model, [exp.samples[i] for i in micro], args.temperature,
                                                       args.logprob_chunk_size, with_entropy=True)
        mask, old, adv = (policy.rows_of(x, micro, logprobs) for x in (exp.mask, exp.old_logprobs, exp.advantages))
        token_loss, loss_stats = losses.clipped_policy_loss(logprobs, old, adv, mask, clip_low=args.clip_low,
                                                            clip_high=args.clip_high)
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


def evaluate(run: Run) -> dict:
    """pass@1 and mean reward on the held-out rows, overall, by data source and by difficulty; updates the report and
    keeps the policy in <output_dir>/best when it is the best so far. Collective."""
    args = run.args
    rows = run.eval_rows[run.rank :: run.world]
    sampling = dataclasses.replace(run.sampling, temperature=args.eval_temperature,
                                   seed=engines.derive_seed(args.seed, "eval", run.step))
    run.engine.wake_up()
    run.engine.load_weights(policy.iter_full_weights(run.model))
    samples, _ = rollout.collect(run.engine, run.tokenizer, rows, args.eval_samples, sampling, args.tools,
                                 run.limits, first_group=run.rank * len(rows), check=args.check_tito,
                                 eot=args.end_of_turn)
    run.engine.sleep()
    results = run.score_fn([s.row for s in samples], [s.text for s in samples])
    graded = collectives.gather_objects([(task_rows.row_id(s.row), rewards.for_report(r))
                                         for s, r in zip(samples, results)])
    summary = eval_report.report({task_rows.row_id(row): row for row in run.eval_rows}, [task for task, _ in graded],
                             [reward for _, reward in graded])
    metrics = eval_report.report_metrics(summary)
    run.evals.append({"step": run.step} | summary)
    run.best = keep_best(run.best, args.best_metric, metrics, run.step, run.model, args.model, args.output_dir)
    if run.rank == 0:
        eval_report.write_eval_report(args.output_dir, run.evals, run.best, args.eval_data)
    return metrics


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
