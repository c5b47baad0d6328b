"""GRPO for code LLMs: `torchrun --nproc-per-node 8 train_grpo.py --model ... --data ...`.

Every rank holds an FSDP2 shard of the policy and its own rollout engine. One step, in `train_step()`:
rollouts -> rewards -> advantages -> (old/ref logprobs) -> minibatch updates (`update_policy`: forward -> loss ->
backward per micro-batch, then clip and step) -> metrics and checkpoints. The same code runs on a 2-core CPU (gloo,
HF engine, tiny model) and on 8 GPUs (nccl, vLLM).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import random
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Literal

import torch
from tqdm import tqdm

import agent_server
import chat
import cli
import collectives
import containers
import engines
import eval_report
import judge as judge_lib
import losses
import policy
import rewards
import rollout
import runlog
import sandbox
import swe_grading
import task_rows
import tools
import vision
from checkpoint import check_best_metric, keep_best, load_checkpoint, load_newest_checkpoint, save_checkpoint


# Defaults that depend on the policy loss: GSPO clips a sequence-level ratio (its paper's ranges) and averages each
# sequence's tokens first.
LOSS_DEFAULTS = {"clip": {"clip_low": 0.2, "clip_high": 0.2, "loss_agg": "token-mean"},
                 "gspo": {"clip_low": 3e-4, "clip_high": 4e-4, "loss_agg": "seq-mean-token-mean"}}


@dataclass
class Args:
    model: str = "runs/demo/sft/hf"
    """policy to train: a Hugging Face folder or hub name (default: the SFT'd tiny model `make demo` builds)"""
    data: str = "runs/demo/train.parquet"
    """training rows (parquet / jsonl / HF dataset name) in kiln's row schema"""
    eval_data: str | None = None
    """held-out rows, evaluated greedily every `eval_every` steps"""
    output_dir: str = "runs/grpo"
    """where metrics.jsonl, samples.jsonl, eval_report.json/.md/.png, best/ and checkpoints/ go"""
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
    """nucleus sampling (keep 1.0: below it the samples and the engine logprobs that --tis-cap uses come from the
    truncated distribution while the trainer scores the full one, a bias nothing corrects; see losses.py's TIS)"""
    end_of_turn: str | None = None
    """token that closes an assistant turn (default: found in the chat template, e.g. <|im_end|>, <|eot_id|>)"""

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
    """truncated importance sampling: cap on exp(old - engine logprob); None = off"""
    rollout_is: Literal["token", "sequence", None] = None
    """rollout correction (losses.rollout_correction, verl's): importance weights per token or per sequence, capped at
    --rollout-is-threshold; None = off (not with --tis-cap, which is --rollout-is token)"""
    rollout_is_threshold: float = 2.0
    """cap on the rollout-correction weights"""
    rollout_rs: Literal["token", "sequence", "geometric", None] = None
    """rollout correction's rejection: drop tokens, or sequences (by product or geometric mean), whose ratio leaves
    [--rollout-rs-threshold-lower, --rollout-rs-threshold]; dropped tokens count as 0 in the loss's normaliser"""
    rollout_rs_threshold: float | None = None
    """upper bound of the rejection band (default: --rollout-is-threshold)"""
    rollout_rs_threshold_lower: float | None = None
    """lower bound of the rejection band (default: 1 / the upper)"""
    rollout_veto_threshold: float | None = None
    """drop every sequence holding a token whose ratio is below this (e.g. 1e-4); None = off"""
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
    best_metric: str = "val-core/all/test_pass_rate"
    """evaluation metric (higher is better) that picks the policy kept as a Hugging Face folder in <output_dir>/best
    (e.g. val-core/all/pass@1, val-core/apps/interview/test_pass_rate); "" = keep none"""
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

    sandbox_isolation: Literal["full", "userns", "plain"] = "full"
    """the weakest isolation allowed for reward programs and the python tool (full: namespaces, filesystem view, no
    network, a uid per run; see docs/sandbox.md); the run stops at start if the machine allows less"""
    tools: Literal["none", "python", "codev", "swe"] = "none"
    """multi-turn agent rollouts with these tools (python: a stateful sandboxed interpreter per trajectory, called with
    <tool_call>; codev: the same on the row's images, called with CodeV's <code> tags; swe: bash, an editor and submit
    in a Docker container per trajectory, for swebench rows, graded on the container's diff)"""
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
    agent_cmd: str | None = None
    """an external agent per trajectory instead of kiln's own loop: a shell command with the placeholders {base_url}
    (this rank's OpenAI-compatible endpoint), {api_key} (the trajectory's session key), {row_json} or {row_file} (the
    row without its answers) and {result} (where the agent leaves what is graded: a swebench row's patch, else its
    answer); killed past --max-agent-seconds; replies within --max-total-tokens (docs/agents.md)"""
    agent_keep_failed: bool = False
    """with --agent-cmd: also train on the sessions of agents that exit non-zero or are killed (default: dropped)"""
    partial_rollouts: bool = False
    """agent rollouts across steps (--tools; rollout.InFlight): each rank keeps twice its groups in flight, a step's
    rollouts end once it holds its groups complete (never split), and the other trajectories pause between turns
    with their tokens, engine logprobs and live tools to go on next step under the new weights; combine with
    --rollout-is token (the engine's logprobs are the behaviour policy). A resumed run drops the paused ones (tool
    state is not checkpointed) and starts their groups again from their prompts"""
    max_staleness: int = 1
    """with --partial-rollouts: no token trains more than N steps after it was sampled. A step waits for an
    unfinished trajectory that would pass that (rollout/due_wait_seconds); a complete group left waiting that long
    restarts from its prompts on fresh tools (partial/restarted_stale)"""

    judge_url: str | None = None
    """OpenAI-compatible base URL of the LLM judge that vl_agent rows need, e.g. http://judge-node:8000/v1 (bearer
    token, if any, in $KILN_JUDGE_API_KEY)"""
    judge_model: str | None = None
    """the judge's model name (default: the first one the server lists)"""
    judge_max_concurrency: int = 32
    """judge requests in flight per rank"""
    judge_timeout_s: float = 60.0
    """wall seconds per judge question, retries included"""
    judge_max_failure_rate: float = 0.2
    """stop the run when more than this fraction of a step's judge questions fail (errors and unparsable replies)"""
    nonfinite_rewards: Literal["stop", "drop"] = "stop"
    """a NaN or infinite reward from the reward function (a bug: one would make every parameter NaN): stop the run
    naming the task, or drop the sample from the batch and count it (critic/score/nonfinite_dropped)"""

    def __post_init__(self):
        for name, value in LOSS_DEFAULTS[self.policy_loss].items():  # unset: the policy loss's own default
            if getattr(self, name) is None:
                setattr(self, name, value)


@dataclass
class Run:
    """Everything a step touches, built once by `setup()`."""

    args: Args
    rank: int
    world: int
    model: torch.nn.Module
    ref_model: torch.nn.Module | None
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
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
    best: dict = field(default_factory=dict)  # {"step", "metric", "value"} of the policy kept in best/
    evals: list[dict] = field(default_factory=list)  # every eval's eval_report.report summary and step, for the report
    judge: judge_lib.Judge | None = None  # the LLM judge of vl_agent rows (--judge-url)
    in_flight: rollout.InFlight | None = None  # trajectories carried between steps (--partial-rollouts)


def main(args: Args, score_fn: rewards.ScoreFn = rewards.score_batch) -> Run | None:
    if args.dry_run:
        print(json.dumps(dataclasses.asdict(args), indent=2))
        return None
    run = setup(args, score_fn)
    if run.step == 0 and run.eval_rows:
        run.log.metrics(runlog.announced_eval(evaluate, run) | {"step": 0})
    bar = tqdm(total=args.total_steps, initial=run.step, desc="grpo", disable=run.rank != 0)
    try:
        while run.step < args.total_steps:
            metrics = train_step(run)
            run.step += 1
            if args.eval_every and run.step % args.eval_every == 0 and run.step < args.total_steps and run.eval_rows:
                metrics |= runlog.announced_eval(evaluate, run)
            run.log.metrics(metrics | {"step": run.step})
            bar.update(1)
            bar.set_postfix(score=f"{metrics['critic/score/mean']:.3f}")
            if run.step % (args.save_every or args.total_steps) == 0 or run.step == args.total_steps:
                save(run)
    finally:  # the paused trajectories' tools (sessions, containers) end with training, however it ends
        if run.in_flight is not None:
            run.in_flight.close()
    bar.close()
    if run.eval_rows and run.step > 0:  # step 0 was evaluated above
        run.log.metrics(runlog.announced_eval(evaluate, run) | {"step": run.step})
    if run.rank == 0:
        print(f"done: metrics in {run.log.output_dir / 'metrics.jsonl'}"
              + (f", checkpoints in {run.log.output_dir / 'checkpoints'}" if run.step > 0 else ""))
    run.log.finish()
    return run


def check_variants(args: Args) -> None:
    """ValueError for a combination the GRPO variants do not define."""
    if args.policy_loss == "gspo" and args.dual_clip is not None:
        raise ValueError("--dual-clip bounds a token-level ratio; GSPO clips the sequence-level one (drop --dual-clip)")
    if args.dynamic_sampling and args.advantage == "reinforce++":
        raise ValueError("--dynamic-sampling drops groups whose rewards are equal, which carry no signal only for "
                         "group-relative advantages; REINFORCE++ whitens over the batch, where they do (use "
                         "--advantage reinforce++-baseline)")
    if args.max_sampling_tries < 1:
        raise ValueError(f"--max-sampling-tries must be >= 1, got {args.max_sampling_tries}")
    if args.tis_cap is not None and (args.rollout_is or args.rollout_rs or args.rollout_veto_threshold):
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


def prompt_limit(args: Args) -> int:
    """Longest prompt kept at load: --max-prompt-tokens, and with tools also one short of --max-total-tokens (a longer
    prompt leaves an agent no room to answer)."""
    return args.max_prompt_tokens if args.tools == "none" else min(args.max_prompt_tokens, args.max_total_tokens - 1)


def check_args(args: Args, world: int) -> None:
    """Refuse settings that would fail or train nothing, before anything loads (vLLM start-up and model loads take
    minutes on GPUs)."""
    for name in ("prompts_per_step", "group_size", "max_new_tokens", "minibatches", "epochs_per_step"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.total_steps < 0:
        raise ValueError(f"--total-steps must be >= 0, got {args.total_steps}")
    if args.temperature <= 0:
        raise ValueError(f"--temperature must be > 0 (the trainer scores tokens under it), got {args.temperature}")
    if args.group_size < 2 and args.advantage != "reinforce++":  # a group of one is its own baseline: advantage 0
        raise ValueError(f"--advantage {args.advantage} compares samples of a group: --group-size must be >= 2, got "
                         f"{args.group_size} (or use --advantage reinforce++)")
    if args.prompts_per_step % world:
        raise ValueError(f"--prompts-per-step {args.prompts_per_step} must divide by the world size {world}")
    if args.prompts_per_step // world < args.minibatches:  # a minibatch takes whole groups
        raise ValueError(f"--minibatches {args.minibatches} needs as many prompts per rank; --prompts-per-step "
                         f"{args.prompts_per_step} over {world} ranks gives {args.prompts_per_step // world}")
    check_best_metric(args.best_metric)
    if args.agent_cmd is not None:
        agent_server.check_agent_cmd(args.agent_cmd)
    runlog.check_output_dir(args.output_dir, args.resume, args.overwrite, dataclasses.asdict(args))
    policy.check_model_path(args.model)
    policy.check_attention(args.model, args.attn_implementation)
    engines.check_engine(args.engine)


def setup(args: Args, score_fn: rewards.ScoreFn) -> Run:
    check_variants(args)
    rank, world, device = policy.init_distributed()
    check_args(args, world)
    # Decided once, before any model loads (IsolationError names what the machine lacks); every sample is graded at
    # this level.
    isolation = sandbox.require(args.sandbox_isolation, sessions=args.tools in ("python", "codev"))
    if rank == 0:
        print(sandbox.describe(isolation))
    torch.manual_seed(args.seed + rank)
    random.seed(args.seed + rank)
    tokenizer = policy.load_tokenizer(args.model)
    counting = image_counting(args.model)
    rows = rollout.load_rows_within(args.data, tokenizer, prompt_limit(args), verbose=rank == 0, tools=args.tools,
                                    **counting)
    eval_rows = (rollout.load_rows_within(args.eval_data, tokenizer, prompt_limit(args), verbose=rank == 0,
                                          tools=args.tools, **counting) if args.eval_data else [])
    if 0 < len(eval_rows) < world:  # a rank without eval rows would leave the others' collectives hanging
        raise ValueError(f"{args.eval_data}: {len(eval_rows)} eval rows for {world} ranks; need at least one each")
    if score_fn is rewards.score_batch:  # a caller's own score function decides which sources it knows
        rewards.check_sources(rows, args.data)
        rewards.check_sources(eval_rows, args.eval_data)
    # A judge the rows need must answer now, before any model is loaded.
    judge = rewards.make_judge(args.judge_url, args.judge_model, rows + eval_rows, where=args.data,
                               max_concurrency=args.judge_max_concurrency, timeout_s=args.judge_timeout_s)
    if judge is not None:
        score_fn = functools.partial(score_fn, judge=judge)
    # vLLM takes its memory before the FSDP model does (its allocator must see a clean device).
    engine = None
    if args.engine == "vllm":
        images = None  # a vision model's budget: the most a row has, and what every tool call may add
        if counting:
            images = max(len(task_rows.row_images(r)) for r in rows + eval_rows) + (
                args.max_turns * tools.ImageLimits.max_images if args.tools != "none" else 0)
        engine = engines.VLLMEngine(
            args.model, seed=args.seed, gpu_memory_utilization=args.vllm_gpu_memory_utilization,
            max_model_len=args.vllm_max_model_len, tensor_parallel_size=args.vllm_tensor_parallel_size,
            max_images_per_prompt=images)
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
        engine = engines.HFEngine(model, pad_token_id=tokenizer.pad_token_id)
    optimizer = policy.adamw(model, args.lr, args.weight_decay)
    scheduler = policy.lr_schedule(optimizer, args.warmup_steps, args.total_steps, args.lr_schedule)
    sampling = engines.Sampling(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                                stop_token_ids=policy.stop_token_ids(tokenizer, args.model,
                                                                     chat.end_of_turn(tokenizer, args.end_of_turn)))
    limits = rollout.AgentLimits(args.max_turns, args.max_total_tokens, args.max_tool_response_tokens,
                                 args.max_agent_seconds)
    if args.tools == "swe":  # containers of dead kiln processes go; this one's go when it ends, however it ends
        containers.sweep(containers.shared_client())
        containers.remove_owned_at_exit(containers.shared_client())
    checkpoint, state = (load_newest_checkpoint(args.output_dir, lambda path: load_checkpoint(
        path, model, optimizer)) if args.resume else (None, None))
    step = data_pos = 0
    state = state or {}  # a fresh run: no best policy or evaluations yet
    if checkpoint is not None:
        scheduler.load_state_dict(state["scheduler"])
        step, data_pos = state["step"], state["data_pos"]
        if rank == 0:
            print(f"resumed from {checkpoint} at step {step}")
    in_flight = None
    if args.partial_rollouts:
        in_flight = rollout.InFlight(groups=args.prompts_per_step // world, max_staleness=args.max_staleness)
        regenerated = state.get("in_flight_groups", [])
        in_flight.regenerate = [(group, task_rows.in_epoch_order(rows, group, 1, args.seed)[0])
                                for group in regenerated[rank::world]]
        if regenerated and rank == 0:
            print(f"--partial-rollouts: the {len(regenerated)} groups in flight at the checkpoint start again from "
                  "their prompts (paused trajectories and their tools are not checkpointed: dropped)")
    log = runlog.start(args.output_dir, rank, dataclasses.asdict(args), args.wandb_project,
                       resume_step=step if args.resume else None, samples_max_mb=args.samples_max_mb)
    return Run(args=args, rank=rank, world=world, model=model, ref_model=ref_model, optimizer=optimizer,
               scheduler=scheduler, engine=engine, tokenizer=tokenizer, sampling=sampling, limits=limits, rows=rows,
               eval_rows=eval_rows, score_fn=score_fn, log=log, step=step, data_pos=data_pos,
               best=state.get("best", {}), evals=state.get("evals", []), judge=judge, in_flight=in_flight)


def train_step(run: Run) -> dict:
    """One GRPO step, phase by phase; each phase is the function of that name right below, in this order."""
    seconds = {}
    # 1-5. Prompts -> rollouts -> rewards, then the non-finite and dynamic-sampling filters.
    samples, batch, metrics = collect_batch(run, seconds)
    # 6. Advantages over the global batch (DAPO's truncation mask takes samples out of the loss after them).
    batch, advantage_metrics = assign_advantages(run, samples, batch)
    # 7. Old and reference logprobs (no grad) where the loss needs them.
    with runlog.timed(seconds, "old_ref_logprobs"):
        old_logprobs, ref_logprobs = old_and_ref_logprobs(run, batch)
        recorded_logprobs = logprobs_to_record(run, samples)
    # 8. Minibatch updates: per micro-batch packed forward -> policy loss (+ KL) -> backward; then clip -> step.
    with runlog.timed(seconds, "update"):
        update_metrics = update_epochs(run, batch, old_logprobs, ref_logprobs)
    # 9. Throughput, timings, staleness of the trained tokens and sample records.
    return (metrics | advantage_metrics | update_metrics | staleness_metrics(run, batch)
            | step_metrics(run, samples, seconds, recorded_logprobs))


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
            score(run, new)
        nonfinite_dropped += refuse_or_count_nonfinite(run, new)
        samples += new
        if run.judge is not None:  # stops the run past --judge-max-failure-rate, before any update
            metrics |= judge_metrics(run, samples)
        new = [s for s in new if math.isfinite(s.reward)]  # no reward (judge failures, dropped): not trained on
        if args.dynamic_sampling:
            keep = losses.nonconstant_groups(torch.tensor([s.shaped_reward for s in new]),
                                             torch.tensor([s.group for s in new]))
            new = [s for s, k in zip(new, keep) if k]
        batch += new
    metrics |= reward_metrics(run, samples, rollout_metrics)  # the last round's rollout metrics, every round's rewards
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
    starting = run.in_flight is not None and not collectives.any_rank(bool(run.in_flight.group_ids()))
    count = per_rank * (2 if starting else 1)
    rows = task_rows.in_epoch_order(run.rows, run.data_pos + run.rank * count, count, args.seed)
    # Group ids are unique over ranks and rounds; groups carried across steps take their row's data position, unique
    # over steps too and where a resumed run finds the row again.
    first_group = (run.data_pos if run.in_flight is not None else tries * args.prompts_per_step) + run.rank * count
    run.data_pos += count * run.world
    # Each sample's tokens come from its own seed (step, round, group, index, turn): a resumed run repeats them.
    sampling = dataclasses.replace(run.sampling, seed=engines.derive_seed(args.seed, run.step, tries))
    with runlog.timed(seconds, "wake_and_sync"):
        wake_with_current_weights(run)
    with runlog.timed(seconds, "rollout"):
        samples, metrics = run_rollouts(run, rows, args.group_size, sampling, first_group, in_flight=run.in_flight)
        run.engine.sleep()
    return samples, metrics


def score(run: Run, samples: list[rollout.Sample]) -> None:
    """Phase 5: each sample's reward, in parallel in the sandbox or from the LLM judge (which sees the rollout's tool
    images and messages), and its shaped reward (DAPO's overlong punishment with --overlong-buffer). A sample the
    judge could not grade gets NaN: it leaves the batch, and its group's advantages come from the others."""
    judged = {"sample_infos": [s.info for s in samples]} if run.judge is not None else {}
    for s, r in zip(samples, run.score_fn([s.row for s in samples], [s.text for s in samples], **judged)):
        s.reward, s.info = r.score, s.info | r.info  # the rollout's info (multi-turn messages) stays
    penalty = [0.0] * len(samples)
    if run.args.overlong_buffer:
        penalty = losses.overlong_penalty(torch.tensor([len(s.completion_ids) for s in samples]),
                                          run.args.max_new_tokens, run.args.overlong_buffer,
                                          run.args.overlong_penalty).tolist()
    for s, p in zip(samples, penalty):
        s.shaped_reward = s.reward + p


def refuse_or_count_nonfinite(run: Run, samples: list[rollout.Sample]) -> int:
    """A NaN or infinite reward the judge does not account for is a reward-function bug: with --nonfinite-rewards
    stop, every rank stops naming every offender; with drop, their number over all ranks."""
    offenders = [(task_rows.row_id(s.row), s.reward) for s in samples
                 if not math.isfinite(s.reward) and not rewards.judge_failed(s.info)]
    if run.args.nonfinite_rewards == "stop":
        rewards.refuse_nonfinite(collectives.gather_objects(offenders), run.step + 1)
        return 0
    return int(collectives.sum_over_ranks(len(offenders)))


def reward_metrics(run: Run, samples: list[rollout.Sample], rollout_metrics: dict) -> dict:
    """Rollout metrics (tool, SWE and agent families averaged over ranks); rewards by data source, error kinds and
    lengths of the samples that have a reward; with --tools swe the verdict counts."""
    tool_metrics = {k: v for k, v in rollout_metrics.items() if k.startswith(("tools/", "swe/", "agents/"))}
    counts = {k: v for k, v in rollout_metrics.items() if k.startswith("partial/")}  # trajectories, over all ranks
    metrics = (rollout_metrics | collectives.mean_dicts_over_ranks(tool_metrics)
               | collectives.sum_dicts_over_ranks(counts) | getattr(run.engine, "last_metrics", {}))
    sources, scores, errors, lengths, isolations = zip(*collectives.gather_objects(
        [(s.row["data_source"], s.reward, s.info.get("error"), len(s.completion_ids), s.info.get("sandbox_isolation"))
         for s in samples if math.isfinite(s.reward)]))
    metrics |= rewards.batch_metrics(sources, scores, errors, lengths, isolations)
    if run.args.tools == "swe":
        metrics |= swe_grading.swe_metrics(collectives.gather_objects([s.info for s in samples]))
    return metrics


def judge_metrics(run: Run, samples: list[rollout.Sample]) -> dict:
    """The step's judge/* metrics so far over all ranks (judge.metrics, plus the samples left out because the judge
    failed) and the vl_agent reward components by data source. Collective. Past --judge-max-failure-rate of failed
    questions the run stops, naming the judge and its errors: a dead judge must not train the policy."""
    stats = collectives.gather_objects([run.judge.stats()])
    graded = collectives.gather_objects([(s.row["data_source"], {k: s.info.get(k) for k in ("acc_by", "acc", "format",
                                                                                        "tool", "judge_error")})
                                    for s in samples])
    failed = [info["judge_error"] for _, info in graded if info["judge_error"]]
    metrics = judge_lib.metrics(stats) | rewards.component_metrics([s for s, _ in graded], [i for _, i in graded])
    metrics |= {"judge/excluded_samples": float(len(failed)), "judge/excluded_frac": len(failed) / len(graded)}
    if metrics["judge/failure_rate"] > run.args.judge_max_failure_rate:
        kinds = sum((Counter(s["error_kinds"]) for s in stats), Counter())
        raise RuntimeError(
            f"judge {run.judge.base_url}: {metrics['judge/failure_rate']:.0%} of this step's "
            f"{metrics['judge/calls']:.0f} judge questions failed (> --judge-max-failure-rate "
            f"{run.args.judge_max_failure_rate:.0%}): {metrics['judge/errors']:.0f} errors {dict(kinds)}, "
            f"{metrics['judge/parse_failures']:.0f} unparsable replies; {len(failed)} samples without a reward, e.g. "
            f"{failed[0] if failed else '-'}. Stopped before training on them (step {run.step + 1}).")
    return metrics


def assign_advantages(run: Run, samples: list[rollout.Sample],
                      batch: list[rollout.Sample]) -> tuple[list[rollout.Sample], dict]:
    """Phase 6: each sample's advantage from the shaped rewards of the global batch (groups never straddle ranks;
    REINFORCE++ normalises over every rank). With --mask-truncated (DAPO overlong filtering) samples cut by a token
    limit count in their group's advantages but leave the batch the loss sees. The segments of an external agent's
    session share its one result: the session counts once, with its first segment's reward."""
    args, metrics = run.args, {}
    units = [s.info.get("session") or f"{run.rank}:{k}" for k, s in enumerate(batch)]
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
    a batch gets more than one update) and under the reference model (with --kl-coef)."""
    args, old_logprobs, ref_logprobs = run.args, None, None
    if args.minibatches * args.epochs_per_step > 1:
        old_logprobs = policy.completion_logprobs_no_grad(run.model, batch, args.micro_batch_tokens,
                                                          args.temperature, args.logprob_chunk_size)
    if run.ref_model is not None:
        ref_logprobs = policy.completion_logprobs_no_grad(run.ref_model, batch, args.micro_batch_tokens,
                                                          args.temperature, args.logprob_chunk_size)
    return old_logprobs, ref_logprobs


def sample_step(run: Run) -> bool:
    """Whether this step's samples go to samples.jsonl (every --sample-every steps, and the last step)."""
    return runlog.writes_samples(run.step + 1, run.args.sample_every, run.args.total_steps)


def logprobs_to_record(run: Run, samples: list[rollout.Sample]) -> torch.Tensor | None:
    """With --rich-samples on a sample step: [B, T] logprobs of all the step's samples under the policy before this
    step's update (one more forward without grad), which the sample records set beside the engine's. Collective."""
    if not (run.args.rich_samples and sample_step(run)):
        return None
    return policy.completion_logprobs_no_grad(run.model, samples, run.args.micro_batch_tokens, run.args.temperature,
                                              run.args.logprob_chunk_size)


def update_epochs(run: Run, batch: list[rollout.Sample], old_logprobs: torch.Tensor | None,
                  ref_logprobs: torch.Tensor | None) -> dict:
    """Phase 8: --epochs-per-step passes of --minibatches optimizer steps (`update_policy`, right below), then the
    learning-rate schedule's step; metrics averaged over the updates."""
    update_metrics = defaultdict(list)
    for _ in range(run.args.epochs_per_step):
        for minibatch in range(run.args.minibatches):
            for k, v in update_policy(run, batch, minibatch, old_logprobs, ref_logprobs).items():
                update_metrics[k].append(v)
    run.scheduler.step()
    return {k: sum(v) / len(v) for k, v in update_metrics.items()}


def update_policy(run: Run, batch: list[rollout.Sample], minibatch: int, old_logprobs: torch.Tensor | None,
                  ref_logprobs: torch.Tensor | None) -> dict:
    """One optimizer step on this rank's share of one minibatch (whole groups): for each micro-batch of bounded
    tokens, packed forward -> policy loss (+ KL to the reference) -> backward; then clip and step. Without
    `old_logprobs` the update is on-policy (the ratio's denominator is the forward's own, detached)."""
    args = run.args
    index = policy.minibatch([s.group for s in batch], args.minibatches, minibatch)
    # Global normalisers make the sum of micro-batch losses on every rank equal the global-batch loss; FSDP
    # averages gradients over ranks, hence the factor `world`.
    global_tokens = collectives.sum_over_ranks(sum(sum(batch[i].loss_mask) for i in index))
    global_seqs = collectives.sum_over_ranks(len(index))
    if global_seqs == 0:  # no rank has a sample in this minibatch (dynamic sampling dropped them): no step
        return {}
    mask = policy.padded([s.loss_mask for s in batch])
    engine_logprobs = policy.padded([s.engine_logprobs for s in batch])
    advantages = policy.padded([[s.advantage] * len(s.loss_mask) for s in batch])
    stats = defaultdict(float)
    run.optimizer.zero_grad(set_to_none=True)
    for micro in policy.completion_micro_batches(run.model, batch, index, args.micro_batch_tokens):
        # An idle micro-batch (this rank has fewer than another) is all zeros below: it only keeps FSDP in step.
        logprobs, entropy = policy.completion_logprobs(run.model, [batch[i] for i in micro], args.temperature,
                                                       args.logprob_chunk_size, with_entropy=True)
        micro_mask, micro_engine, micro_advantages = (policy.rows_of(x, micro, logprobs)
                                                      for x in (mask, engine_logprobs, advantages))
        old = logprobs.detach() if old_logprobs is None else policy.rows_of(old_logprobs, micro, logprobs)
        weights = None
        if args.rollout_is or args.rollout_rs or args.rollout_veto_threshold:
            weights, micro_mask, correction = losses.rollout_correction(
                old, micro_engine, micro_mask, args.rollout_is, args.rollout_is_threshold, args.rollout_rs,
                args.rollout_rs_threshold, args.rollout_rs_threshold_lower, args.rollout_veto_threshold)
            for k, v in correction.items():  # token means: weighted by this micro-batch's share of the tokens
                stats[f"rollout_corr/{k}"] += v * policy.rows_of(mask, micro, logprobs).sum().item() / global_tokens
        if args.policy_loss == "gspo":
            token_loss, loss_stats = losses.gspo_loss(
                logprobs, old, micro_advantages, micro_mask, clip_low=args.clip_low, clip_high=args.clip_high,
                engine_logprobs=micro_engine if args.tis_cap else None, tis_cap=args.tis_cap)
        else:
            token_loss, loss_stats = losses.clipped_policy_loss(
                logprobs, old, micro_advantages, micro_mask, clip_low=args.clip_low, clip_high=args.clip_high,
                dual_clip=args.dual_clip, engine_logprobs=micro_engine if args.tis_cap else None, tis_cap=args.tis_cap)
        if weights is not None:  # elementwise, as --tis-cap's weight: after the clip, 0 off the mask
            token_loss = token_loss * weights
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


def staleness_metrics(run: Run, batch: list[rollout.Sample]) -> dict:
    """With --partial-rollouts: how many steps before this one each trained token was sampled (run.step minus its
    version), mean and max over the loss-mask tokens of every rank's batch. Collective."""
    if run.in_flight is None:
        return {}
    ages = [run.step - v for s in batch for v, m in zip(s.versions, s.loss_mask) if m]
    tokens = collectives.sum_over_ranks(len(ages))
    return {"partial/staleness_mean": collectives.sum_over_ranks(sum(ages)) / max(tokens, 1),
            "partial/staleness_max": float(max(collectives.gather_objects([max(ages, default=0)])))}


def step_metrics(run: Run, samples: list[rollout.Sample], seconds: dict,
                 recorded_logprobs: torch.Tensor | None = None) -> dict:
    """Phase 9: seconds per phase, sample tokens per second over all ranks, the learning rate; every --sample-every
    steps (and at the last) every sample of the step (trained on or not) goes to samples.jsonl (with --rich-samples, with
    `recorded_logprobs`)."""
    metrics = {f"timing_s/{k}": v for k, v in seconds.items()}
    metrics["perf/tokens_per_s"] = (collectives.sum_over_ranks(sum(len(s.ids) for s in samples))
                                    / sum(seconds.values()))
    metrics["actor/lr"] = run.scheduler.get_last_lr()[0]
    if sample_step(run):
        rich = dict(tokenizer=run.tokenizer, trainer_logprobs=recorded_logprobs) if run.args.rich_samples else {}
        run.log.samples(collectives.gather_objects(runlog.sample_records(run.step + 1, samples, **rich)))
    return metrics


def wake_with_current_weights(run: Run) -> None:
    """A level-2 sleep drops the engine's weights: each wake loads the policy's current ones."""
    run.engine.wake_up()
    run.engine.load_weights(policy.iter_full_weights(run.model))


def run_rollouts(run: Run, rows: list[dict], group_size: int, sampling: engines.Sampling, first_group: int,
                 evaluation: bool = False,
                 in_flight: rollout.InFlight | None = None) -> tuple[list[rollout.Sample], dict]:
    """kiln's own rollout loops (rollout.collect; images counted as the model expands them; tokens of version
    run.step; in_flight: partial rollouts), or with --agent-cmd one external agent per trajectory
    (rollout.external_agents). An evaluation keeps failed agents' sessions: their result is graded like any other."""
    args = run.args
    common = dict(first_group=first_group, check=args.check_tito, eot=args.end_of_turn)
    if args.agent_cmd is None:
        return rollout.collect(run.engine, run.tokenizer, rows, group_size, sampling, args.tools, run.limits,
                               **common, **image_counting(args.model), in_flight=in_flight, version=run.step)
    return rollout.external_agents(args.agent_cmd, run.engine, run.tokenizer, rows, group_size, sampling, args.tools,
                                   run.limits, keep_failed=args.agent_keep_failed or evaluation, **common)


def image_counting(model: str) -> dict:
    """The rollout's count_image for a vision-language model: the tokens an image expands to by the model's own
    image processor, as the engines and the trainer expand it; {} for a text model (the rollout's default)."""
    count = vision.image_counter(model)
    return {"count_image": count} if count else {}


def evaluate(run: Run) -> dict:
    """Greedy pass@1, mean test pass rate and its bands, and mean reward on the held-out rows, overall, by data source
    and by difficulty; the report in <output_dir>/eval_report.json/.md/.png, and the policy kept in <output_dir>/best
    when it is the best so far by --best-metric. Collective."""
    rows = run.eval_rows[run.rank :: run.world]
    greedy = dataclasses.replace(run.sampling, temperature=0.0)
    wake_with_current_weights(run)
    samples, _ = run_rollouts(run, rows, 1, greedy, first_group=run.rank * len(rows), evaluation=True)
    run.engine.sleep()
    # An external agent's session can hold several segments, all with its one result: graded once.
    samples = [s for s in samples if s.info.get("segment", 0) == s.info.get("segments", 1) - 1]
    judged = {"sample_infos": [s.info for s in samples]} if run.judge is not None else {}
    results = run.score_fn([s.row for s in samples], [s.text for s in samples], **judged)
    graded = collectives.gather_objects([(task_rows.row_id(s.row), rewards.for_report(r)) for s, r in zip(samples, results)
                                    if not rewards.judge_failed(r.info)])
    # Samples the judge could not grade are left out of the report and counted, never counted as fails.
    ungraded = {"val-aux/judge_ungraded": len(run.eval_rows) - len(graded)} if run.judge is not None else {}
    if not graded:
        return ungraded
    summary = eval_report.report({task_rows.row_id(row): row for row in run.eval_rows}, [task for task, _ in graded],
                             [reward for _, reward in graded])
    metrics = eval_report.report_metrics(summary) | ungraded
    run.evals.append({"step": run.step} | summary)
    run.best = keep_best(run.best, run.args.best_metric, metrics, run.step, run.model, run.args.model,
                         run.args.output_dir)
    if run.rank == 0:
        eval_report.write_eval_report(run.args.output_dir, run.evals, run.best, run.args.eval_data)
    return metrics


def save(run: Run) -> None:
    state = {"step": run.step, "data_pos": run.data_pos, "scheduler": run.scheduler.state_dict(), "best": run.best,
             "evals": run.evals}
    if run.in_flight is not None:  # their rows, to start again at a resume (their trajectories and tools are not kept)
        state["in_flight_groups"] = sorted(collectives.gather_objects(run.in_flight.group_ids()))
    path = save_checkpoint(run.args.output_dir, run.step, run.model, run.optimizer, state,
                           hf_source_dir=run.args.model, keep_last=run.args.keep_checkpoints)
    if run.rank == 0:
        tqdm.write(f"step {run.step}: checkpoint {path}")


if __name__ == "__main__":
    with cli.one_line_errors():
        main(cli.parse_args(Args))
    policy.exit_distributed()
