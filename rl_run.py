"""What both RL trainers (train_grpo.py, train_ppo.py) do alike, written once so that a fix lands in both: the checks
before anything loads, the set-up of rows, judge, sandbox, engine, policy and tools, the rollout and reward phases and
their metrics, evaluation, and the outer loop. What differs (the algorithm, its extra models, its step) stays in each
trainer, next to its `train_step`.

`run` below is either trainer's Run, which extends `Run` here: these functions read only its fields.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import random
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Callable, Literal

import torch
from tqdm import tqdm

import agent_server
import chat
import collectives
import containers
import engines
import eval_report
import hub
import judge as judge_lib
import losses
import policy
import rewards
import rollout
import runlog
import sandbox
import sequence_parallel
import swe_grading
import task_rows
import tools
import vision
from checkpoint import check_best_metric, keep_best

@dataclass
class SharedArgs:
    """Settings both RL trainers have, meaning and defaulting the same (each trainer's Args extends them with its
    algorithm's own; tests/test_trainers_agree.py lists where their defaults differ and why)."""

    model: str = "runs/demo/sft/hf"
    """policy to train: a Hugging Face folder or hub name (default: the SFT'd tiny model `make demo` builds)"""
    data: str = "runs/demo/train.parquet"
    """training rows (parquet / jsonl / HF dataset name) in kiln's row schema"""
    eval_data: str | None = None
    """held-out rows, evaluated greedily every `eval_every` steps"""

    engine: Literal["hf", "vllm"] = "hf"
    """rollout engine: colocated vLLM on GPUs, or generation with the policy itself (CPU, debugging)"""
    seed: int = 0
    """seed for data order, sampling and initialisation"""

    prompts_per_step: int = 8
    """prompts per step across all ranks (must divide by the world size)"""

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

    epochs_per_step: int = 1
    """passes over each batch of rollouts"""
    micro_batch_tokens: int = 8192
    """tokens packed into one forward/backward (gradient accumulation beyond that)"""
    logprob_chunk_size: int = 512
    """rows of the output layer computed at once for logprobs (each holds rows x vocab fp32 values)"""

    mixed_precision: bool = False
    """bf16 parameters with fp32 reductions (use on GPUs; with --lora-rank the frozen base is stored in bf16 too)"""
    lora_rank: int = 0
    """train LoRA adapters of this rank (PEFT) instead of the full weights, the base frozen; the engine gets the
    adapters alone at every sync; 0 = full fine-tuning (PPO: the actor's; its critic trains its full weights)"""
    lora_alpha: float = 16.0
    """LoRA scale alpha: an adapted layer adds (alpha / rank) B A x"""
    lora_targets: str = "all-linear"
    """the linear layers that get adapters: all-linear (all but the output layer) or module names, comma-separated
    (e.g. q_proj,k_proj,v_proj,o_proj)"""
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    """recompute in backward to save memory: full (decoder layers from their inputs) or selective (keeps matmul and
    attention outputs, recomputes only elementwise work)"""
    attn_implementation: str = "packed_sdpa"
    """attention of the trained models: packed_sdpa (policy.py: sdpa per packed sequence), flex_attention (faster on
    GPUs), flash_attention_2 when installed; plain sdpa masks the whole micro-batch, quadratic in its tokens"""
    compile_layers: bool = False
    """torch.compile each decoder layer of the trained models (GPUs: fuses norms, rotary and activations)"""
    sequence_parallel: int = 1
    """spread each packed row of the trained and scoring models over N consecutive ranks (Ulysses: each holds 1/N of
    its tokens, attention all-to-all over heads; N must divide the ranks and the heads, docs/long_horizon.md); the N
    ranks train on their samples together, so --micro-batch-tokens can grow N times"""
    vllm_gpu_memory_utilization: float = 0.5
    """fraction of GPU memory vLLM may take while awake"""
    vllm_max_model_len: int = 4096
    """vLLM context length"""
    vllm_tensor_parallel_size: int = 1
    """ranks per vLLM engine (consecutive ranks form a group)"""

    save_every: int = 50
    """checkpoint every N steps (0 = only at the end)"""

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
    """log to wandb too (WANDB_MODE=offline works without network); also the project of the other sinks (default
    kiln)"""
    log_to: str = ""
    """mirror metrics.jsonl to these sinks, comma-separated: wandb, tensorboard (<output_dir>/tensorboard), trackio
    ($TRACKIO_DIR), mlflow ($MLFLOW_TRACKING_URI, else <output_dir>/mlruns); docs/metrics.md"""
    dry_run: bool = False
    """print the resolved Args and exit (on the command line: cli.parse_args)"""

    sandbox_isolation: Literal["full", "userns", "plain"] = "full"
    """the weakest isolation allowed for reward programs and the python tool (full: namespaces, filesystem view, no
    network, a uid per run; see docs/sandbox.md); the run stops at start if the machine allows less"""

    max_turns: int = 4
    """assistant turns per trajectory (tools on)"""
    max_total_tokens: int = 2048
    """prompt + all turns and tool outputs per trajectory (tools on)"""
    max_tool_response_tokens: int = 512
    """longer tool outputs are cut and marked (tools on)"""
    max_agent_seconds: float = 1800.0
    """wall clock per trajectory; checked before each turn's tools run (tools on; docs/swebench.md's budget table)"""
    swe_suspicious_fails: bool = False
    """a swebench patch whose non-test code reaches into the test runner (swe_grading.screen_patch) scores -1 on that
    flag alone; off, the flag is only reported (the sample's info, swe/suspicious): some real fixes touch test tools"""
    check_tito: bool = False
    """compare every trajectory with the chat template's rendering of its messages; log the drifting fraction
    (tools/tito_drift_frac) and the first drift of each step (tools on)"""

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
    rollout_is: Literal["token", "sequence", None] = None
    """rollout correction (losses.rollout_correction, verl's): importance weights exp(old - engine logprob) per token,
    or per sequence from the sum of its tokens' log-ratios; None = off. Needs the policy's logprobs before the update:
    one more forward without grad where the step had none"""
    rollout_is_threshold: str = "2.0"
    """rollout correction's weights: "C" truncates them at C (TIS), "lo_hi" zeroes those outside [lo, hi] (IcePop,
    e.g. 0.5_5.0)"""
    rollout_is_batch_normalize: bool = False
    """divide the rollout-correction weights by their mean over the global batch (tokens, or sequences)"""
    rollout_rs: str | None = None
    """rollout correction's rejection, verl's options, comma-separated (all must keep a token): token_k1/k2/k3,
    seq_sum_k1/k2/k3, seq_mean_k1/k2/k3 (seq_mean_k1: geometric mean), seq_max_k2/k3; rejected tokens leave the loss
    (they still count in its normaliser); None = off"""
    rollout_rs_threshold: str | None = None
    """thresholds of --rollout-rs, one for all or one per option: k1 "lo_hi" bounds of log(engine / trainer) as ratios
    (a single u = [1/u, u]), k2 and k3 an upper bound (e.g. seq_max_k2 with 0.5)"""
    teacher: str | None = None
    """on-policy distillation: a teacher model (Hugging Face folder, the policy's tokenizer) scores the policy's sampled
    tokens, and each policy token's advantage gains --distill-coef times log p_teacher - log p_policy (the sampled
    reverse KL, as verl's and slime's OPD); the teacher is forward-only, sharded like the reference model"""
    distill_coef: float = 1.0
    """weight of the distillation advantage (with --teacher)"""
    distill_task_reward: bool = True
    """with --teacher: train on the task reward's advantages too; --no-distill-task-reward distils alone (rewards are
    still computed and logged, and move nothing)"""
    nonfinite_rewards: Literal["stop", "drop"] = "stop"
    """a NaN or infinite reward from the reward function (a bug: one would make every parameter NaN): stop the run
    naming the task, or drop the sample from the batch and count it (critic/score/nonfinite_dropped)"""
    swe_prestart: bool = True
    """with --tools swe: start the containers of the next step's trajectories while this step trains (containers.
    ContainerPool), so that an agent's first command finds its container running"""
    swe_max_live: int = 0
    """with --tools swe: most agent containers alive at once per rank (0: from the host's memory and cores, shared
    among the local ranks; containers.host_live_cap)"""
    swe_max_starting: int = 8
    """with --tools swe: container starts in flight at once per rank"""
    swe_start_budget: float = 600.0
    """with --tools swe: seconds a trajectory waits for its container before it is left out (swe/start_failures)"""


@dataclass(kw_only=True)
class Run:
    """What a step of either trainer touches and rl_run's functions read, built once by the trainer's `setup()`; each
    trainer's Run adds its optimizers and algorithm state."""

    args: SharedArgs
    rank: int
    world: int
    model: torch.nn.Module  # the policy, FSDP2-sharded
    ref_model: torch.nn.Module | None  # the frozen reference of the KL term (--kl-coef > 0)
    teacher: torch.nn.Module | None  # the forward-only teacher of on-policy distillation (--teacher)
    engine: engines.Engine
    tokenizer: object
    sampling: engines.Sampling
    limits: rollout.AgentLimits  # of multi-turn rollouts (--tools)
    rows: list[dict]
    eval_rows: list[dict]
    score_fn: rewards.ScoreFn
    judge: judge_lib.Judge | None  # the LLM judge of vl_agent rows (--judge-url)
    log: runlog.RunLog
    step: int = 0
    data_pos: int = 0  # rows consumed, over all ranks: where the seeded epoch order goes on
    best: dict = field(default_factory=dict)  # {"step", "metric", "value"} of the policy kept in best/
    evals: list[dict] = field(default_factory=list)  # every eval's eval_report.report summary and step, for the report
    sync_metrics: dict = field(default_factory=dict)  # the latest weight sync's seconds and bytes


# Settings that count something and must be at least 1, in either trainer.
COUNTS = ("prompts_per_step", "group_size", "max_new_tokens", "minibatches", "epochs_per_step")


def check_args(args, world: int) -> None:
    """Refuse the settings either trainer cannot run, before anything loads (vLLM start-up and model loads take
    minutes on GPUs): counts below 1, a temperature the trainer cannot score under, prompts that do not split over
    the ranks or the minibatches, judge limits out of range, an unknown --best-metric, a log sink that is unknown or
    not installed, a bad --agent-cmd."""
    for name in COUNTS:
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
    if args.judge_max_failure_rate < 0 or args.judge_timeout_s <= 0 or args.judge_max_concurrency < 1:
        raise ValueError("--judge-max-failure-rate must be >= 0, --judge-timeout-s > 0 and --judge-max-concurrency "
                         ">= 1")
    check_best_metric(args.best_metric)
    runlog.sink_names(args.log_to, args.wandb_project)
    if args.teacher is None and not args.distill_task_reward:
        raise ValueError("--no-distill-task-reward drops the task reward for distillation alone: it needs --teacher")
    if args.teacher is not None and args.distill_coef <= 0:
        raise ValueError(f"--distill-coef must be > 0 with --teacher, got {args.distill_coef}")
    losses.is_threshold_bounds(args.rollout_is_threshold)
    if args.rollout_rs is not None:
        if args.rollout_rs_threshold is None:
            raise ValueError(f"--rollout-rs {args.rollout_rs} needs --rollout-rs-threshold")
        losses.rs_bounds(args.rollout_rs, args.rollout_rs_threshold)
    if getattr(args, "agent_cmd", None) is not None:
        agent_server.check_agent_cmd(args.agent_cmd, args.agent_harnesses)
    sequence_parallel.check_world(args.sequence_parallel, world)


def check_paths(args) -> None:
    """Refuse, before anything loads, an output dir in use, a model that is neither a folder nor a hub name (nor cached,
    offline), a hub dataset not cached offline, an engine that is not installed."""
    runlog.check_output_dir(args.output_dir, args.resume, args.overwrite, dataclasses.asdict(args))
    policy.check_model_path(args.model)
    if args.teacher is not None:
        policy.check_model_path(args.teacher, "--teacher")
    for flag, source in (("--data", args.data), ("--eval-data", args.eval_data)):
        if source:
            task_rows.check_source(source, flag)
    engines.check_engine(args.engine)


# The settings that name a model: a local folder or a hub name, which fetch_models downloads.
MODEL_FIELDS = ("model", "critic_model", "teacher")


def fetch_models(args) -> dict[str, str]:
    """Replace each hub name among args' models by its local folder, downloaded once per node (hub.fetch);
    returns the names replaced ({field: hub name}), which run_config.json records instead of the folders."""
    names = {}
    for name in MODEL_FIELDS:
        value = getattr(args, name, None)
        if value:
            local = hub.fetch(value, "--" + name.replace("_", "-"))
            if local != value:
                names[name] = value
                setattr(args, name, local)
    return names


@dataclass
class Prepared:
    """What `prepare` builds before any model loads: the ranks, the rows, the judge, the score function and the
    sampling and agent settings."""

    rank: int
    world: int
    device: torch.device
    tokenizer: object
    rows: list[dict]
    eval_rows: list[dict]
    judge: judge_lib.Judge | None
    score_fn: rewards.ScoreFn
    sampling: engines.Sampling
    limits: rollout.AgentLimits
    model_names: dict[str, str]  # the hub names fetch_models replaced by folders in args: what run_config.json records


def prepare(args, score_fn: rewards.ScoreFn, check: Callable[[object, int], None]) -> Prepared:
    """Everything a run can check or build before its models load, in the order that fails fastest: the process
    group, the settings (the shared checks, then the trainer's own `check(args, world)`, then the paths), the sandbox
    level every sample is graded at, the models named by hub name (downloaded once per node; args then names their
    folders), the seeds, the tokenizer, the training and held-out rows (too-long prompts
    skipped, sources checked), and the judge the rows need, asked to answer now."""
    rank, world, device = policy.init_distributed()
    check_args(args, world)
    check(args, world)
    check_paths(args)
    isolation = sandbox.require(args.sandbox_isolation, sessions=args.tools in ("python", "codev"))
    if rank == 0:
        print(sandbox.describe(isolation))
    model_names = fetch_models(args)
    policy.check_attention(args.model, args.attn_implementation)
    for path in (args.model, getattr(args, "critic_model", None), args.teacher):
        sequence_parallel.check_model(path, args.sequence_parallel, args.attn_implementation)
    torch.manual_seed(args.seed + rank)
    random.seed(args.seed + rank)
    tokenizer = policy.load_tokenizer(args.model)
    if args.teacher is not None:
        check_teacher(tokenizer, args.teacher)
    rows, eval_rows = load_rows(args, tokenizer, rank, world)
    if score_fn is rewards.score_batch:  # a caller's own score function decides which sources it knows
        rewards.check_sources(rows, args.data)
        rewards.check_sources(eval_rows, args.eval_data)
    judge = rewards.make_judge(args.judge_url, args.judge_model,
                               task_rows.summaries(rows) + task_rows.summaries(eval_rows), where=args.data,
                               max_concurrency=args.judge_max_concurrency, timeout_s=args.judge_timeout_s)
    if score_fn is rewards.score_batch:  # a caller's own score function brings its own judge and SWE settings
        score_fn = functools.partial(rewards.score_batch, judge=judge,
                                     swe=swe_grading.SweConfig(suspicious_fails=args.swe_suspicious_fails))
    sampling = engines.Sampling(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                                stop_token_ids=policy.stop_token_ids(tokenizer, args.model,
                                                                     chat.end_of_turn(tokenizer, args.end_of_turn)))
    limits = rollout.AgentLimits(args.max_turns, args.max_total_tokens, args.max_tool_response_tokens,
                                 args.max_agent_seconds)
    return Prepared(rank, world, device, tokenizer, rows, eval_rows, judge, score_fn, sampling, limits, model_names)


def prompt_limit(args) -> int:
    """Longest prompt kept at load: --max-prompt-tokens, and with tools also one short of --max-total-tokens (a longer
    prompt leaves an agent no room to answer)."""
    return args.max_prompt_tokens if args.tools == "none" else min(args.max_prompt_tokens, args.max_total_tokens - 1)


def load_rows(args, tokenizer, rank: int, world: int) -> tuple[list[dict], list[dict]]:
    """The training and held-out rows whose prompts fit `prompt_limit` (images counted as the model expands them);
    held-out rows must give every rank at least one."""
    within = functools.partial(rollout.load_rows_within, tokenizer=tokenizer, max_prompt_tokens=prompt_limit(args),
                               verbose=rank == 0, tools=args.tools, **image_counting(args.model))
    rows = within(args.data)
    eval_rows = within(args.eval_data) if args.eval_data else []
    if 0 < len(eval_rows) < world:  # a rank without eval rows would leave the others' collectives hanging
        raise ValueError(f"{args.eval_data}: {len(eval_rows)} eval rows for {world} ranks; need at least one each")
    return rows, eval_rows


def image_counting(model: str) -> dict:
    """The rollout's count_image for a vision-language model: the tokens an image expands to by the model's own
    image processor, as the engines and the trainer expand it; {} for a text model (the rollout's default)."""
    count = vision.image_counter(model)
    return {"count_image": count} if count else {}


def start_vllm(args, prepared: Prepared) -> engines.Engine | None:
    """With --engine vllm, the colocated engine, started and put to sleep before the FSDP models load (its allocator
    must see a clean device); None for the HF engine, which `rollout_engine` builds on the policy."""
    if args.engine != "vllm":
        return None
    engine = engines.VLLMEngine(
        args.model, seed=args.seed, gpu_memory_utilization=args.vllm_gpu_memory_utilization, lora_rank=args.lora_rank,
        max_model_len=args.vllm_max_model_len, tensor_parallel_size=args.vllm_tensor_parallel_size,
        max_images_per_prompt=vision.images_per_prompt(
            args.model, [prepared.rows, prepared.eval_rows],
            args.max_turns * tools.ImageLimits.max_images if args.tools != "none" else 0))
    engine.sleep()
    return engine


def load_policy(args, device: torch.device) -> torch.nn.Module:
    """The policy to train (with --lora-rank: its LoRA adapters, the base frozen, in bf16 with --mixed-precision),
    sharded with FSDP2 under the run's precision, checkpointing and compile settings."""
    lora = args.lora_rank > 0
    model = policy.load_model(args.model, dtype=torch.bfloat16 if lora and args.mixed_precision else torch.float32,
                              attn_implementation=args.attn_implementation)
    if lora:
        policy.add_lora(model, args.lora_rank, args.lora_alpha, args.lora_targets, seed=args.seed)
    return spread(args, policy.shard_model(model.to(device), mixed_precision=args.mixed_precision,
                                           activation_checkpointing=args.activation_checkpointing,
                                           compile_layers=args.compile_layers))


def spread(args, model: torch.nn.Module) -> torch.nn.Module:
    """`model` run sequence-parallel over this rank's group of --sequence-parallel ranks (as it is for 1). Collective:
    every rank loads the same models in the same order."""
    return sequence_parallel.attach(model, sequence_parallel.make_group(args.sequence_parallel))


def sequence_group_batch(run, samples: list[rollout.Sample]) -> tuple[list[rollout.Sample], slice]:
    """The samples of every rank of this rank's sequence-parallel group, in rank order (what its ranks train on
    together: every packed row is spread over them), and where this rank's own are among them; the samples alone
    without --sequence-parallel. Every sum over ranks then counts each sample N times, numerators and normalisers
    alike, so token means and the loss stay what they are. Collective."""
    return sequence_parallel.group_samples(samples, sequence_parallel.of(run.model))


def load_reference(args, device: torch.device) -> torch.nn.Module | None:
    """The frozen reference policy of the KL term (--kl-coef > 0), sharded; None without one."""
    if args.kl_coef <= 0:
        return None
    ref_model = policy.shard_model(policy.load_model(args.model, attn_implementation=args.attn_implementation)
                                   .to(device), mixed_precision=args.mixed_precision)
    return spread(args, ref_model.requires_grad_(False))


def check_teacher(tokenizer, teacher: str) -> None:
    """Refuse a teacher whose tokenizer is not the policy's: it scores the policy's token ids, which must mean the same
    text to both."""
    theirs, ours = policy.load_tokenizer(teacher).get_vocab(), tokenizer.get_vocab()
    if theirs != ours:
        differ = sorted(set(theirs.items()) ^ set(ours.items()))
        raise ValueError(f"--teacher {teacher}: its tokenizer is not the policy's ({len(theirs)} and {len(ours)} "
                         f"tokens, {len(differ)} (token, id) pairs differ, e.g. {differ[:3]}); on-policy distillation "
                         "scores the policy's own token ids with the teacher, so both need one tokenizer")


def load_teacher(args, device: torch.device) -> torch.nn.Module | None:
    """The forward-only teacher of on-policy distillation (--teacher), sharded as the reference; None without."""
    if args.teacher is None:
        return None
    teacher = policy.shard_model(policy.load_model(args.teacher, attn_implementation=args.attn_implementation)
                                 .to(device), mixed_precision=args.mixed_precision)
    return spread(args, teacher.requires_grad_(False))


def rollout_engine(vllm_engine: engines.Engine | None, model: torch.nn.Module, tokenizer) -> engines.Engine:
    """The engine rollouts run on: the vLLM one started before the models, or generation with the policy itself."""
    return vllm_engine or engines.HFEngine(model, pad_token_id=tokenizer.pad_token_id)


def start_tools(args) -> None:
    """With --tools swe: containers of dead kiln processes go now; this process's go when it ends, however it ends;
    the container pool gets the run's caps."""
    if args.tools == "swe":
        containers.sweep(containers.shared_client())
        containers.remove_owned_at_exit(containers.shared_client())
        containers.configure_pool(containers.PoolLimits(args.swe_max_live, args.swe_max_starting,
                                                        args.swe_start_budget))


def prestart_next_step(run) -> None:
    """With --tools swe and --swe-prestart: the containers of the next step's trajectories (its rows are known: the
    seeded epoch order at run.data_pos) start now in the background, while this step scores and trains."""
    args = run.args
    if args.tools == "swe" and args.swe_prestart and getattr(args, "agent_cmd", None) is None:
        per_rank = args.prompts_per_step // run.world
        rows = task_rows.in_epoch_order(run.rows, run.data_pos + run.rank * per_rank, per_rank, args.seed)
        tools.prestart_swe(rows, args.group_size)


def train(run, train_step: Callable, save: Callable, total_steps: int, desc: str) -> None:
    """The outer loop: a held-out evaluation before the first step, then `train_step` until `total_steps`, with an
    evaluation every --eval-every steps and after the last, metrics logged every step, and `save` every --save-every
    steps and after the last."""
    args = run.args
    if run.step == 0 and run.eval_rows:
        run.log.metrics(runlog.announced_eval(evaluate, run) | {"step": 0})
    bar = tqdm(total=total_steps, initial=run.step, desc=desc, disable=run.rank != 0)
    prestart_next_step(run)
    while run.step < total_steps:
        metrics = train_step(run)
        run.step += 1
        last = run.step == total_steps
        if run.eval_rows and (last or (args.eval_every and run.step % args.eval_every == 0)):
            metrics |= runlog.announced_eval(evaluate, run)
        run.log.metrics(metrics | {"step": run.step})
        bar.update(1)
        bar.set_postfix(score=f"{metrics['critic/score/mean']:.3f}")
        if last or (args.save_every and run.step % args.save_every == 0):
            save(run)
    bar.close()
    if run.rank == 0:
        print(f"done: metrics in {run.log.output_dir / 'metrics.jsonl'}"
              + (f", checkpoints in {run.log.output_dir / 'checkpoints'}" if run.step > 0 else "")
              + (f", eval report and best/ in {args.output_dir}" if run.eval_rows else ""))
    run.log.finish()


# ------------------------------------------------------------------------------------- rollouts, rewards, metrics
def wake_with_current_weights(run) -> None:
    """A level-2 sleep drops the engine's weights: each wake loads the policy's current ones. An engine that holds the
    base of a LoRA policy (vLLM's level-1 sleep keeps it; HFEngine's replica after its first load) gets the adapters
    alone. The sync's seconds and bytes (this rank's engine) go to run.sync_metrics: timing_s/weight_sync,
    weight_sync/bytes."""
    sent = [0]

    def counted(weights):
        for name, tensor in weights:
            sent[0] += tensor.nbytes
            yield name, tensor

    run.engine.wake_up()
    start = time.perf_counter()
    if policy.lora_config(run.model) is not None and getattr(run.engine, "holds_base", False):
        run.engine.load_adapter(counted(policy.iter_adapter_weights(run.model)), policy.lora_config(run.model))
    else:
        run.engine.load_weights(counted(policy.iter_full_weights(run.model)))
    run.sync_metrics = {"timing_s/weight_sync": time.perf_counter() - start, "weight_sync/bytes": float(sent[0])}


def run_rollouts(run, rows: list[dict], group_size: int, sampling: engines.Sampling, first_group: int,
                 evaluation: bool = False, in_flight=None) -> tuple[list[rollout.Sample], dict]:
    """kiln's own rollout loops (rollout.collect; images counted as the model expands them; tokens of version
    run.step; in_flight: partial rollouts), or with --agent-cmd one external agent per trajectory
    (rollout.external_agents). An evaluation keeps failed agents' sessions: their result is graded like any other."""
    args = run.args
    common = dict(first_group=first_group, check=args.check_tito, eot=args.end_of_turn)
    agent_cmd = getattr(args, "agent_cmd", None)  # PPO trains kiln's own loops only
    if agent_cmd is None:
        samples, metrics = rollout.collect(run.engine, run.tokenizer, rows, group_size, sampling, args.tools,
                                           run.limits, **common, **image_counting(args.model), in_flight=in_flight,
                                           version=run.step)
        if args.tools == "swe" and not evaluation:  # the pool's caps and queue over the step; the next step's start
            metrics |= containers.shared_pool().metrics()
            if run.step + 1 < getattr(run, "total_steps", args.total_steps):  # PPO's Run holds its own
                prestart_next_step(run)
        return samples, metrics
    return rollout.external_agents(agent_cmd, run.engine, run.tokenizer, rows, group_size, sampling, args.tools,
                                   run.limits, keep_failed=args.agent_keep_failed or evaluation,
                                   harnesses=args.agent_harnesses, mix_groups=args.agent_mix_groups, **common)


def corrects_rollouts(args) -> bool:
    """Whether the run corrects for the engine's sampling distribution (--rollout-is, --rollout-rs)."""
    return args.rollout_is is not None or args.rollout_rs is not None


@dataclass
class Correction:
    """Rollout correction over one rank's batch: [B, T] weights (None without --rollout-is), the loss mask less the
    rejected tokens, and the rollout_corr/* metrics of the global batch."""

    weights: torch.Tensor | None
    mask: torch.Tensor
    metrics: dict


def rollout_correction(run, old_logprobs: torch.Tensor | None, samples: list[rollout.Sample]) -> Correction:
    """losses.rollout_correction of the samples' engine logprobs against `old_logprobs` (the policy's before the
    update) under the run's flags; the mask as it is without them. Metrics: the mean over ranks, the max of maxima and
    the min of minima. Collective."""
    args, mask = run.args, policy.padded([s.loss_mask for s in samples])
    if not corrects_rollouts(args):
        return Correction(None, mask, {})
    engine = policy.padded([s.engine_logprobs for s in samples])
    weights, kept, stats = losses.rollout_correction(
        old_logprobs, engine, mask, args.rollout_is, args.rollout_is_threshold, args.rollout_is_batch_normalize,
        args.rollout_rs, args.rollout_rs_threshold, sum_over_ranks=collectives.sum_tensor_over_ranks)
    every = collectives.gather_objects([stats])
    pick = {"_max": max, "_min": min}
    metrics = {f"rollout_corr/{k}": pick.get(k[-4:], lambda xs: sum(xs) / len(xs))([s[k] for s in every])
               for k in stats}
    return Correction(weights, kept, metrics)


def distill(run, old_logprobs: torch.Tensor | None, samples: list[rollout.Sample],
            advantages: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """On-policy distillation (--teacher): the teacher's logprobs of the samples' completion tokens (the policy's own
    tokens, under the same temperature) and the token advantages [B, T]: `advantages` (the algorithm's, from the task
    reward; zeros with --no-distill-task-reward) plus losses.distill_advantages against `old_logprobs` (the policy's
    before the update), on the loss mask only (no prompt, tool or observation token). Metrics distill/* over every
    rank's policy tokens. Without --teacher, `advantages` as they are. Collective."""
    args = run.args
    if run.teacher is None:
        return advantages, {}
    mask = policy.padded([s.loss_mask for s in samples])
    teacher = policy.completion_logprobs_no_grad(run.teacher, samples, args.micro_batch_tokens, args.temperature,
                                                 args.logprob_chunk_size)
    signal = losses.distill_advantages(old_logprobs, teacher, mask, args.distill_coef)
    log_ratio = torch.where(mask.bool(), old_logprobs - teacher, 0)
    metrics = {"distill/reverse_kl": collectives.global_mean_var(log_ratio, mask)[0],
               "distill/reverse_kl_k3": collectives.global_mean_var((-log_ratio).exp() - 1 + log_ratio, mask)[0],
               "distill/teacher_logprob": collectives.global_mean_var(teacher, mask)[0],
               "distill/student_logprob": collectives.global_mean_var(old_logprobs, mask)[0],
               "distill/advantage_mean": collectives.global_mean_var(signal, mask)[0]}
    return (advantages if args.distill_task_reward else torch.zeros_like(advantages)) + signal, metrics


def score(run, samples: list[rollout.Sample]) -> None:
    """Each sample's reward, in parallel in the sandbox or from the LLM judge (which sees the rollout's tool images and
    messages through its info). A sample the judge could not grade gets NaN: it leaves the batch, never scored 0. So
    does one whose container or daemon failed (info["infra_failed"]), without being graded: its group trains on the
    samples it has left, their advantages computed over them."""
    for s in samples:  # the infrastructure failed under these: never scored, never trained on
        if "infra_failed" in s.info:
            s.reward, s.reward_info = math.nan, {"error": "infra", "infra_failed": s.info["infra_failed"]}
    scored = [s for s in samples if "infra_failed" not in s.info]
    results = run.score_fn([s.row for s in scored], [s.text for s in scored], sample_infos=[s.info for s in scored])
    for s, r in zip(scored, results):
        s.reward, s.reward_info = r.score, r.info


def refuse_or_count_nonfinite(run, samples: list[rollout.Sample]) -> int:
    """A NaN or infinite reward the judge does not account for is a reward-function bug: with --nonfinite-rewards
    stop, every rank stops naming every offender; with drop, their number over all ranks."""
    offenders = [(task_rows.row_id(s.row), s.reward) for s in samples
                 if not math.isfinite(s.reward) and not rewards.ungraded(s.reward_info)]
    if run.args.nonfinite_rewards == "stop":
        rewards.refuse_nonfinite(collectives.gather_objects(offenders), run.step + 1)
        return 0
    return int(collectives.sum_over_ranks(len(offenders)))


def reward_metrics(run, samples: list[rollout.Sample], rollout_metrics: dict) -> dict:
    """Rollout metrics (tool, SWE and agent families averaged over ranks, partial-rollout counts summed); rewards by
    data source, error kinds and lengths of the samples that have a reward; with --tools swe the verdict counts."""
    tool_metrics = {k: v for k, v in rollout_metrics.items() if k.startswith(("tools/", "swe/", "agents/"))}
    counts = {k: v for k, v in rollout_metrics.items() if k.startswith("partial/")}  # trajectories, over all ranks
    metrics = (rollout_metrics | collectives.mean_dicts_over_ranks(tool_metrics)
               | collectives.sum_dicts_over_ranks(counts) | getattr(run.engine, "last_metrics", {})
               | run.sync_metrics)
    sources, scores, errors, lengths, isolations = zip(*collectives.gather_objects(
        [(s.row["data_source"], s.reward, s.reward_info.get("error"), len(s.completion_ids),
          s.reward_info.get("sandbox_isolation")) for s in samples if math.isfinite(s.reward)]))
    metrics |= rewards.batch_metrics(sources, scores, errors, lengths, isolations)
    # samples the infrastructure failed under (a container or daemon in the rollout, a task's tests that left no
    # reward file): no score, left out of the batch; a count that should stay 0
    metrics["critic/score/infra_dropped"] = float(collectives.sum_over_ranks(
        sum("infra_failed" in s.reward_info for s in samples)))
    metrics |= harness_scores(collectives.gather_objects([(s.info["harness"], s.reward) for s in samples if (
        s.info.get("harness") and s.segment == 0 and math.isfinite(s.reward))]))  # a session once
    if run.args.tools == "swe":  # the graded swebench samples' verdicts (task rows have their scores above)
        swe = collectives.gather_objects([s.reward_info for s in samples if s.row["data_source"] == "swebench"
                                          and "infra_failed" not in s.reward_info])
        metrics |= swe_grading.swe_metrics(swe) if swe else {}
    return metrics


def harness_scores(scored: list[tuple[str, float]]) -> dict:
    """agents/harness/<name>/score_mean: the mean reward of each harness's sessions (mixed harnesses in one run)."""
    by_harness = defaultdict(list)
    for harness, score in scored:
        by_harness[harness].append(score)
    return {f"agents/harness/{h}/score_mean": sum(v) / len(v) for h, v in sorted(by_harness.items())}


def judge_metrics(run, samples: list[rollout.Sample]) -> dict:
    """The step's judge/* metrics so far over all ranks (judge.metrics, plus the samples left out because the judge
    failed) and the vl_agent reward components by data source. Collective. Past --judge-max-failure-rate of failed
    questions the run stops, naming the judge and its errors: a dead judge must not train the policy."""
    stats = collectives.gather_objects([run.judge.stats()])
    graded = collectives.gather_objects([(s.row["data_source"], {k: s.reward_info.get(k) for k in (
        "acc_by", "acc", "format", "tool", "judge_error")}) for s in samples])
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


def step_metrics(run, samples: list[rollout.Sample], seconds: dict, total_steps: int, **rich) -> dict:
    """Seconds per phase and sample tokens per second over all ranks; every --sample-every steps (and at the last)
    every sample of the step (trained on or not) goes to samples.jsonl, with --rich-samples also what `rich` holds
    (runlog.sample_records' trainer_logprobs, token_advantages)."""
    metrics = {f"timing_s/{k}": v for k, v in seconds.items()}
    metrics["perf/tokens_per_s"] = (collectives.sum_over_ranks(sum(len(s.ids) for s in samples))
                                    / sum(seconds.values()))
    if runlog.writes_samples(run.step + 1, run.args.sample_every, total_steps):
        extra = dict(tokenizer=run.tokenizer, **rich) if run.args.rich_samples else {}
        run.log.samples(collectives.gather_objects(runlog.sample_records(run.step + 1, samples, **extra)))
    return metrics


def evaluate(run) -> dict:
    """pass@1 (greedy, or the mean over --eval-samples draws at --eval-temperature where the trainer has them), mean
    test pass rate and its bands, and mean reward on the held-out rows, overall, by data source and by difficulty; the
    report in <output_dir>/eval_report.json/.md/.png, and the policy kept in <output_dir>/best when it is the best so
    far by --best-metric. Samples the judge could not grade are left out and counted, never counted as fails.
    Collective."""
    args = run.args
    rows = run.eval_rows[run.rank :: run.world]
    draws, temperature = getattr(args, "eval_samples", 1), getattr(args, "eval_temperature", 0.0)
    sampling = dataclasses.replace(run.sampling, temperature=temperature,
                                   seed=engines.derive_seed(args.seed, "eval", run.step))
    wake_with_current_weights(run)
    samples, _ = run_rollouts(run, rows, draws, sampling, first_group=run.rank * len(rows), evaluation=True)
    run.engine.sleep()
    # An external agent's session can hold several segments, all with its one result: graded once.
    samples = [s for s in samples if s.segment == s.segments - 1]
    score(run, samples)
    graded = collectives.gather_objects([(task_rows.row_id(s.row), rewards.for_report(rewards.Reward(s.reward,
                                                                                                      s.reward_info)))
                                         for s in samples if not rewards.ungraded(s.reward_info)])
    ungraded = {"val-aux/judge_ungraded": len(run.eval_rows) * draws - len(graded)} if run.judge is not None else {}
    if not graded:
        return ungraded
    summary = eval_report.report({task_rows.row_id(row): row for row in run.eval_rows}, [task for task, _ in graded],
                                 [reward for _, reward in graded])
    metrics = eval_report.report_metrics(summary) | ungraded
    run.evals.append({"step": run.step} | summary)
    run.best = keep_best(run.best, args.best_metric, metrics, run.step, run.model, args.model, args.output_dir)
    if run.rank == 0:
        eval_report.write_eval_report(args.output_dir, run.evals, run.best, args.eval_data)
    return metrics
