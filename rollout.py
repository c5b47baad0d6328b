"""Producing samples: the engine protocol, the HF engine, and the rollout loop.

Token-in-token-out: prompts go to the engine as token ids and completions come back as token ids plus the
per-token logprobs of the distribution that was actually sampled (after temperature). Nothing is decoded
and re-encoded on the way to the trainer; text is decoded only for the reward.
"""
from __future__ import annotations

import copy
import sys
import time
from dataclasses import dataclass, field
from typing import Iterable, Protocol

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from transformers import DynamicCache
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper


@dataclass
class Sampling:
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    stop_token_ids: list[int] = field(default_factory=list)


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # log p(token) under the sampled distribution (logits / temperature)
    finish_reason: str  # "stop" (hit a stop token, which is kept) or "length"


class Engine(Protocol):
    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Completion]: ...
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...
    def sleep(self) -> None: ...
    def wake_up(self) -> None: ...


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
    info: dict = field(default_factory=dict)

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids


def truncate_at_stop(token_ids: list[int], logprobs: list[float], stop_ids: set[int]) -> Completion:
    """Cut a generation right after its first stop token (kept: the policy must learn to end its turn)."""
    for i, tok in enumerate(token_ids):
        if tok in stop_ids:
            return Completion(token_ids[: i + 1], logprobs[: i + 1], "stop")
    return Completion(token_ids, logprobs, "length")


class HFEngine:
    """Generation with the policy's own Hugging Face model (a KV-cached decoding loop): CPU tests, debugging,
    machines without vLLM.

    On a plain model it generates with that very model, always in sync (load_weights has nothing to do). On an
    FSDP2-sharded policy it generates with an unsharded replica that load_weights fills, as the trainer does before
    every rollout (`policy.iter_full_weights`, the stream vLLM gets): decoding then needs no collectives, so each rank
    decodes on its own instead of all-gathering every layer for every token.
    """

    def __init__(self, model, pad_token_id: int, batch_size: int = 64):
        self.policy = model
        self.sharded = any(isinstance(m, FSDPModule) for m in model.modules())
        self.model = None if self.sharded else model
        self.pad_token_id = pad_token_id
        self.batch_size = batch_size

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if not self.sharded:
            return None
        weights = dict(weights)
        if self.model is None:  # the policy's own class, built from its config, then filled below
            model_class = next(c for c in type(self.policy).__mro__ if not issubclass(c, FSDPModule))
            first = next(iter(weights.values()))
            # Packed-training attentions do not decode: packed_sdpa has no KV cache, flex_attention compiles a kernel
            # per decoding shape.
            config = copy.deepcopy(self.policy.config)  # _from_config sets the attention on the config it gets
            attn = config._attn_implementation
            attn = "sdpa" if attn in ("packed_sdpa", "flex_attention") else attn
            # The replica's init draws must not shift the sampling stream (resume, seeds).
            with torch.random.fork_rng(devices=[first.device] if first.is_cuda else []):
                self.model = model_class._from_config(config, attn_implementation=attn)
            self.model.to(device=first.device, dtype=first.dtype).eval()
            self.model.generation_config = self.policy.generation_config
        missing, unexpected = self.model.load_state_dict(weights, strict=False)
        tied = {"lm_head.weight"} if getattr(self.policy.config, "tie_word_embeddings", False) else set()
        if unexpected or set(missing) - tied:
            raise ValueError(f"HFEngine.load_weights: unexpected {unexpected}, missing {sorted(set(missing) - tied)}")

    def sleep(self) -> None:
        return None

    def wake_up(self) -> None:
        return None

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Completion]:
        if self.model is None:
            raise RuntimeError("HFEngine on an FSDP-sharded policy: call load_weights(policy.iter_full_weights(model)) "
                               "before generate")
        if sampling.max_new_tokens < 1:
            raise ValueError(f"Sampling.max_new_tokens must be >= 1, got {sampling.max_new_tokens}")
        out = []
        for start in range(0, len(prompts), self.batch_size):
            out += self._generate_batch(prompts[start : start + self.batch_size], sampling)
        return out

    def _generate_batch(self, prompts: list[list[int]], sampling: Sampling) -> list[Completion]:
        """A prefill of the left-padded batch, then one token per step from a KV cache. Written out rather than
        `generate()`, for two reasons: only `sampling` shapes the distribution (generate would also apply what the
        model's generation_config holds, e.g. Qwen2.5's repetition_penalty, which the trainer's logprobs know nothing
        of), and only the chosen tokens' logprobs are kept (generate's scores hold [rows, vocab] floats per step: 40 GB
        for 64 rows of 1024 tokens at vocab 152k). Scores go through transformers' own warpers (temperature, top-k,
        top-p); Llama-layout models decode with `decode_step`, the others with their own forward."""
        device = next(self.model.parameters()).device
        rows, width, new = len(prompts), max(len(p) for p in prompts), sampling.max_new_tokens
        input_ids = torch.full((rows, width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.ones((rows, width + new), dtype=torch.long)  # generated tokens are always attended
        for i, p in enumerate(prompts):  # left padding, so every row continues at the same position
            input_ids[i, width - len(p) :] = torch.tensor(p)
            attention_mask[i, : width - len(p)] = 0
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        positions = (attention_mask[:, :width].cumsum(-1) - 1).clamp_(min=0)
        greedy = sampling.temperature <= 0
        warpers = [] if greedy else (  # called directly: LogitsProcessorList inspects signatures at every call
            [TemperatureLogitsWarper(sampling.temperature)]
            + ([TopKLogitsWarper(sampling.top_k)] if sampling.top_k > 0 else [])
            + ([TopPLogitsWarper(sampling.top_p)] if sampling.top_p < 1 else []))
        stop_tokens = torch.tensor(sampling.stop_token_ids, dtype=torch.long, device=device)
        tokens = torch.full((rows, new), self.pad_token_id, dtype=torch.long, device=device)
        logprobs = torch.zeros((rows, new), device=device)
        stopped = torch.zeros(rows, dtype=torch.bool, device=device)
        was_training = self.model.training
        self.model.eval()
        # A group's samples share their prompt: each distinct prompt is prefilled once, then its cache row is copied.
        distinct: dict[tuple, tuple[int, int]] = {}  # prompt -> (its number, its first row)
        for i, p in enumerate(prompts):
            distinct.setdefault(tuple(p), (len(distinct), i))
        first = torch.tensor([row for _, row in distinct.values()], device=device)
        which = torch.tensor([distinct[tuple(p)][0] for p in prompts], device=device)
        cache = DynamicCache(config=self.model.config)
        logits = self.model(input_ids=input_ids[first], attention_mask=attention_mask[first, :width],
                            position_ids=positions[first], past_key_values=cache, use_cache=True,
                            logits_to_keep=1).logits[:, -1]
        cache.reorder_cache(which)
        logits = logits[which]
        lean = lean_decoding_supported(self.model)
        if lean:
            cache = KVBuffer.from_prefill(cache, width + new - 1)
            attend = attention_mask.bool()[:, None, None, :]  # [rows, 1, 1, keys]: what sdpa broadcasts over heads
            # the rotary angles of every position the loop will decode, once (logits lend only dtype and device)
            ahead = positions[:, -1:] + torch.arange(1, new, device=device)
            cos, sin = self.model.model.rotary_emb(logits[:, None], ahead)
        for step in range(new):
            scores = logits.float()
            for warp in warpers:
                scores = warp(None, scores)  # these warpers never look at the ids
            probs = scores.softmax(-1)
            token = scores.argmax(-1) if greedy else sample_from(probs)
            tokens[:, step] = token.masked_fill(stopped, self.pad_token_id)
            logprobs[:, step] = probs.gather(1, token[:, None]).squeeze(1).log()  # no [rows, vocab] log_softmax
            stopped |= torch.isin(token, stop_tokens)
            if step == new - 1 or stopped.all():
                break
            if lean:
                logits = decode_step(self.model, cache, token, (cos[:, step : step + 1], sin[:, step : step + 1]),
                                     attend[..., : width + step + 1])
            else:
                positions = positions[:, -1:] + 1
                logits = self.model(input_ids=token[:, None], attention_mask=attention_mask[:, : width + step + 1],
                                    position_ids=positions, past_key_values=cache, use_cache=True).logits[:, -1]
        self.model.train(was_training)
        tokens, logprobs = tokens[:, : step + 1].cpu(), logprobs[:, : step + 1].cpu()
        stop_ids = set(sampling.stop_token_ids)
        return [truncate_at_stop(tokens[i].tolist(), logprobs[i].tolist(), stop_ids) for i in range(rows)]


def sample_from(probs: torch.Tensor) -> torch.Tensor:
    """One token per row of `probs` [rows, vocab] by inverting its CDF at a uniform draw: one random number per row.
    (torch.multinomial draws an exponential per vocabulary entry: 0.3 ms for 32 x 371 on a CPU, most of a tiny
    model's decoding step.) The CDF is summed in fp64 so that at vocab 152k rounding cannot shift tail tokens' mass;
    `right=True` never lands on a zero-probability token (its CDF step is empty)."""
    cdf = probs.double().cumsum(-1)
    u = torch.rand(probs.shape[0], 1, dtype=torch.float64, device=probs.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


LEAN_DECODING_TYPES = ("llama", "qwen2", "qwen3")  # Mistral: its window is in the config, not the layers
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")


def lean_decoding_supported(model) -> bool:
    """Whether `decode_step` computes what the model's own forward computes: a Llama-layout decoder (pre-norm
    attention and gated-MLP blocks, rotary positions) of a type listed in LEAN_DECODING_TYPES, with no sliding window,
    rotary frequencies that do not depend on the length reached (the loop computes every step's angles up front;
    dynamic NTK and longrope rescale them as a sequence grows), plain `nn.Linear` projections and no hooks
    (decode_step uses the weights directly and skips `Module.__call__`: an adapter or a hook would be left out)."""
    if getattr(model.config, "model_type", None) not in LEAN_DECODING_TYPES:
        return False
    rope_type = model.model.rotary_emb.rope_type
    layers = model.model.layers
    return ("dynamic" not in rope_type and rope_type != "longrope"
            and all(getattr(layer.self_attn, "sliding_window", None) is None for layer in layers)
            and all(type(layer.get_submodule(p)) is torch.nn.Linear for layer in layers for p in PROJECTIONS)
            and not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()))


@dataclass
class KVBuffer:
    """Keys and values of every layer in preallocated [rows, kv_heads, capacity, head_dim] buffers: a decoding step
    writes one position instead of concatenating a longer cache."""
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int

    @classmethod
    def from_prefill(cls, cache: DynamicCache, capacity: int) -> KVBuffer:
        def grown(t):
            buffer = t.new_empty(*t.shape[:2], capacity, t.shape[3])
            buffer[:, :, : t.shape[2]] = t
            return buffer
        return cls([grown(layer.keys) for layer in cache.layers], [grown(layer.values) for layer in cache.layers],
                   cache.get_seq_length())


def decode_step(model, cache: KVBuffer, token: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                attend: torch.Tensor) -> torch.Tensor:
    """Next-token logits [rows, vocab] after `token` [rows] whose rotary angles are `rotary` (cos, sin of
    `model.model.rotary_emb` at its positions), attending to the cached keys where `attend` [rows, 1, 1, keys] is True.
    A Llama-layout decoder's computation in its order, with the model's own weights, norms, activation and rotation,
    without the generic forward's per-step mask building, cache bookkeeping and output objects (1.2 -> 0.75 ms per
    step for the tiny 2-layer model on a CPU, same values). Modules are entered through `forward` and projections
    through `F.linear` (`lean_decoding_supported` checks that nothing hooks them): `Module.__call__`'s dispatch was
    another 5% of a tiny model's decoding."""
    inner = model.model
    rope = sys.modules[type(inner.layers[0].self_attn).__module__].apply_rotary_pos_emb  # the model's own
    cos, sin = rotary
    hidden = inner.embed_tokens.forward(token[:, None])
    at = cache.length
    for keys, values, layer in zip(cache.keys, cache.values, inner.layers):
        attn, mlp = layer.self_attn, layer.mlp
        x = layer.input_layernorm.forward(hidden)
        shape = (x.shape[0], 1, -1, attn.head_dim)
        q, k, v = (linear(proj, x).view(shape) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head before the rotation
            q, k = attn.q_norm.forward(q), attn.k_norm.forward(k)
        q, k = rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        keys[:, :, at] = k[:, :, 0]
        values[:, :, at] = v[:, 0]
        out = torch.nn.functional.scaled_dot_product_attention(
            q, keys[:, :, : at + 1], values[:, :, : at + 1], attn_mask=attend, scale=attn.scaling, enable_gqa=True)
        hidden = hidden + linear(attn.o_proj, out.transpose(1, 2).reshape(x.shape[0], 1, -1))
        x = layer.post_attention_layernorm.forward(hidden)
        hidden = hidden + linear(mlp.down_proj, mlp.act_fn(linear(mlp.gate_proj, x)) * linear(mlp.up_proj, x))
    cache.length += 1
    return linear(model.lm_head, inner.norm.forward(hidden))[:, -1]


def linear(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, layer.weight, layer.bias)


def encode_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """Chat messages -> prompt token ids, ending with the assistant header (tokenized once, never again)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_conversation(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Chat messages -> (ids, loss mask), 1 exactly on assistant tokens (content and its end-of-turn token).

    Each message is tokenized alone as the text the template appends for it, so a conversation's ids are the
    concatenation a multi-turn rollout builds turn by turn: the same ids for training and for generation.
    """
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
            while end > 0 and piece[end - 1] != tokenizer.convert_tokens_to_ids("<|im_end|>"):
                end -= 1
            mask += [1] * end + [0] * (len(piece) - end)
        else:
            mask += [0] * len(piece)
        ids += piece
        rendered = text
    return ids, mask


def run(engine: Engine, tokenizer, rows: list[dict], group_size: int, sampling: Sampling,
        first_group: int = 0) -> tuple[list[Sample], dict]:
    """Single-turn rollout: each row's prompt is sampled `group_size` times. Returns samples and metrics."""
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


# ======================================================================================================================
# VLLMEngine: a colocated vLLM engine (vllm==0.32.0) per rank that sleeps while the policy trains.
# Per step: wake_up() (weights) -> load_weights(policy.iter_full_weights(model)) (bucketed; then KV cache, fresh prefix
# cache) -> generate() -> sleep() (level 2: weights and KV cache are discarded, so every wake needs a load).
# The kwargs builders below are plain functions so `make test-vllm` can check them against the real vllm signatures.
# ======================================================================================================================
import os  # noqa: E402  (this section's own imports, kept with the section)
from typing import Iterator  # noqa: E402


def vllm_llm_kwargs(model: str, *, rank: int, seed: int, tensor_parallel_size: int, gpu_memory_utilization: float,
                    max_model_len: int, max_num_seqs: int, enforce_eager: bool, dtype: str, **extra) -> dict:
    """Keyword arguments of `vllm.LLM` for one in-process engine per rank (or per tensor-parallel group)."""
    return dict(
        model=model,
        distributed_executor_backend="external_launcher",  # join torchrun's process group, no worker processes
        tensor_parallel_size=tensor_parallel_size,  # consecutive ranks form one engine
        enable_sleep_mode=True,
        seed=seed + rank // tensor_parallel_size,  # one seed per data-parallel engine; TP peers must share it
        logprobs_mode="processed_logprobs",  # after temperature/top-k/top-p: the distribution actually sampled
        gpu_memory_utilization=gpu_memory_utilization,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        enforce_eager=enforce_eager,
        dtype=dtype,
        **extra,
    )


def vllm_sampling_kwargs(sampling: Sampling) -> dict:
    """Keyword arguments of `vllm.SamplingParams`: token ids out, plus the logprob of each sampled token."""
    return dict(
        n=1,
        max_tokens=sampling.max_new_tokens,
        temperature=sampling.temperature,  # 0 = greedy in vLLM too
        top_p=sampling.top_p,
        top_k=sampling.top_k,  # 0 = off in vLLM too
        stop_token_ids=list(sampling.stop_token_ids),  # the stop token stays in the output, as in HFEngine
        logprobs=0,  # only the sampled token's logprob
        flat_logprobs=True,  # flat lists instead of one dict per token: far less garbage to collect
        detokenize=False,  # text is decoded once, later, for the reward
    )


def vllm_prompt(token_ids: list[int], images: list | None = None) -> dict:
    """A `vllm.inputs.TokensPrompt` (a TypedDict, so a plain dict). With images, the ids hold one unexpanded image
    placeholder per image (as `apply_chat_template` writes it): vLLM's processor expands them itself."""
    prompt = {"prompt_token_ids": list(token_ids)}
    if images:
        prompt["multi_modal_data"] = {"image": list(images)}
    return prompt


def bucket_weights(weights: Iterable[tuple[str, torch.Tensor]], cap_bytes: int,
                   dtype: torch.dtype | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group (name, tensor) pairs, in order, into lists of at most `cap_bytes` (a bigger tensor travels alone),
    cast to `dtype`. Tensors are held until their bucket is loaded, so the producer must not reuse their memory
    meanwhile (`policy.iter_full_weights` yields fresh copies)."""
    bucket, size = [], 0
    for name, tensor in weights:
        nbytes = tensor.numel() * (dtype or tensor.dtype).itemsize
        if bucket and size + nbytes > cap_bytes:  # hand the full bucket over before taking (and casting) more
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor.detach().to(dtype or tensor.dtype)))
        size += nbytes
    if bucket:
        yield bucket


def completion_from_vllm(output) -> Completion:
    """A vLLM `RequestOutput` (n=1, logprobs=0) -> Completion holding each sampled token's logprob."""
    out = output.outputs[0]
    token_ids, logprobs = list(out.token_ids), out.logprobs
    if logprobs is None or len(logprobs) != len(token_ids):
        raise RuntimeError(f"vLLM request {output.request_id}: {len(token_ids)} tokens but "
                           f"{'no' if logprobs is None else len(logprobs)} logprob positions")
    if hasattr(logprobs, "start_indices"):  # FlatLogprobs: position i's entries are [start_indices[i], end_indices[i])
        values = [logprobs.logprobs[logprobs.token_ids.index(tok, start, end)]
                  for tok, start, end in zip(token_ids, logprobs.start_indices, logprobs.end_indices)]
    else:  # one {token_id: Logprob} dict per position
        values = [position[tok].logprob for tok, position in zip(token_ids, logprobs)]
    if out.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM request {output.request_id} ended with {out.finish_reason!r}, not stop/length")
    return Completion(token_ids, values, out.finish_reason)


class VLLMEngine:
    """Colocated vLLM: one `vllm.LLM` per rank (or per `tensor_parallel_size` consecutive ranks) inside torchrun.

    Build it on every rank at the same point (it is a collective) before the FSDP model takes GPU memory, then
    sleep() it. Weights come only from the trainer (never reloaded from disk after a sync). `last_metrics` holds the
    latest sync seconds/bytes/buckets and generation seconds and tokens/s, for the trainer to log.
    """

    def __init__(self, model: str, *, seed: int = 0, tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float = 0.5, max_model_len: int = 4096, max_num_seqs: int = 256,
                 enforce_eager: bool = False, dtype: str = "bfloat16", sync_bucket_bytes: int = 1 << 30,
                 **llm_kwargs):
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
        world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
        if world % tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size} must divide the world size {world}")
        # external_launcher reads these (torchrun sets them; a plain `python` run gets a world of one).
        for key, value in {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world, "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": 29500}.items():
            os.environ.setdefault(key, str(value))
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine must live in this process (vLLM sets it too)
        self.tp, self.tp_group, self.tp_rank = tensor_parallel_size, None, 0
        if tensor_parallel_size > 1:  # new_subgroups is collective: every rank builds all groups in the same order
            self.tp_group, _ = dist.new_subgroups_by_enumeration(
                [list(range(start, start + tensor_parallel_size)) for start in range(0, world, tensor_parallel_size)])
            self.tp_rank = dist.get_rank(self.tp_group)
        from vllm import LLM

        self.llm = LLM(**vllm_llm_kwargs(
            model, rank=rank, seed=seed, tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            enforce_eager=enforce_eager, dtype=dtype, **llm_kwargs))
        self.dtype = getattr(torch, dtype)
        self.sync_bucket_bytes = sync_bucket_bytes
        # vLLM's loader rejects a tied lm_head arriving in a call without the embedding it aliases; it is the
        # same tensor anyway, so it is never sent.
        text_config = self.llm.llm_engine.model_config.hf_text_config
        self.tied_lm_head = bool(getattr(text_config, "tie_word_embeddings", False))
        self.param_names = self.llm.apply_model(lambda m: {name for name, _ in m.named_parameters()})[0]
        self.state = "awake"  # "asleep" -> wake_up() -> "weights" -> load_weights() -> "awake" -> sleep()
        self.last_metrics: dict[str, float] = {}

    def wake_up(self) -> None:
        if self.state != "asleep":
            return
        start = time.perf_counter()
        torch.cuda.empty_cache()  # hand the trainer's cached free blocks back before vLLM maps its weights
        self.llm.wake_up(["weights"])  # KV cache only after the load: weights and gathered buckets need room first
        self.state = "weights"
        self.last_metrics["vllm/wake_seconds"] = time.perf_counter() - start

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.state == "asleep":
            raise RuntimeError("VLLMEngine.load_weights before wake_up(): the engine's weight memory is unmapped")
        start, loaded, nbytes, buckets = time.perf_counter(), set(), 0, 0
        wanted = ((n, t) for n, t in weights if not (self.tied_lm_head and n.endswith("lm_head.weight")))
        for bucket in bucket_weights(wanted, self.sync_bucket_bytes, self.dtype):
            # The model runner's model.load_weights (vLLM's own name mapping and TP sharding), in this process.
            loaded |= self.llm.apply_model(lambda m, bucket=bucket: m.load_weights(bucket))[0]
            nbytes += sum(t.nbytes for _, t in bucket)
            buckets += 1
            del bucket  # freed before the next one is gathered
        missing = self.param_names - loaded
        if missing:  # after a level-2 sleep an unloaded parameter is garbage
            raise RuntimeError(f"VLLMEngine.load_weights: {len(missing)} vLLM parameters got no weights, e.g. "
                               f"{sorted(missing)[:5]}; the policy's names must match the Hugging Face checkpoint")
        torch.cuda.empty_cache()
        if self.state == "weights":
            self.llm.wake_up(["kv_cache"])
        self.llm.reset_prefix_cache()  # cached prefixes were computed by the old weights
        self.llm.llm_engine.reset_encoder_cache()  # so were cached image embeddings
        self.state = "awake"
        self.last_metrics |= {"vllm/sync_seconds": time.perf_counter() - start, "vllm/sync_bytes": nbytes,
                              "vllm/sync_buckets": buckets}

    def generate(self, prompts: list[list[int]], sampling: Sampling,
                 images: list[list | None] | None = None) -> list[Completion]:
        """Completions for `prompts` (token ids); `images[i]` are prompt i's images (Qwen2.5-VL style), or None."""
        if self.state != "awake":
            raise RuntimeError("VLLMEngine.generate needs wake_up() then load_weights(): "
                               "a level-2 sleep discards the weights")
        from vllm import SamplingParams

        images = images if images is not None else [None] * len(prompts)
        first, count = 0, len(prompts)
        if self.tp_group is not None:  # TP peers drive one engine together, so they must submit the same requests
            parts = [None] * self.tp
            dist.all_gather_object(parts, (prompts, images), group=self.tp_group)
            first = sum(len(p) for p, _ in parts[: self.tp_rank])
            prompts, images = [p for ps, _ in parts for p in ps], [i for _, imgs in parts for i in imgs]
        start = time.perf_counter()
        outputs = self.llm.generate([vllm_prompt(p, i) for p, i in zip(prompts, images)],
                                    SamplingParams(**vllm_sampling_kwargs(sampling)), use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        self.last_metrics |= {"vllm/generate_seconds": seconds,
                              "vllm/generate_tokens_per_s": tokens / max(seconds, 1e-9)}
        return [completion_from_vllm(o) for o in outputs[first : first + count]]

    def sleep(self) -> None:
        if self.state == "asleep":
            return
        start = time.perf_counter()
        if self.state == "weights":  # a load failed half way: wake fully first, vLLM sleeps only from awake
            self.llm.wake_up(["kv_cache"])
        self.llm.sleep(level=2)
        self.state = "asleep"
        self.last_metrics["vllm/sleep_seconds"] = time.perf_counter() - start
# =========================================== end of the VLLMEngine section ============================================


# ======================================================================================================================
# Multi-turn agent loop: generate a turn, parse its Qwen2.5 tool calls, run them concurrently, append the tool messages
# as the chat template formats them, continue. Token-in-token-out: a trajectory is the prompt ids, then generated ids
# and template ids in turn; the template ids of new messages are the suffix the template renders for them (only that
# suffix is tokenized, never the trajectory). Loss mask 1 exactly on generated tokens. `check_tito` reports drift.
# ======================================================================================================================
import dataclasses  # noqa: E402  (this section's own imports, kept with the section)
import inspect  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from typing import Callable  # noqa: E402

END_OF_TURN = "<|im_end|>"
TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


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


def template_suffix_ids(tokenizer, messages: list[dict], new_messages: list[dict], schemas: list[dict] | None) -> list[int]:
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
    return {"role": "tool", "content": [{"type": "text", "text": result.text}] + [{"type": "image"}] * len(result.images)}


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


def run_agent(engine: Engine, tokenizer, rows: list[dict], group_size: int, sampling: Sampling,
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
            while _any_live_anywhere(live := [t for t in trajectories if not t.finish_reason]):
                _agent_turn(engine, tokenizer, live, sampling, limits, eot, pool)
    finally:
        for t in trajectories:
            t.box.close()
    samples = [Sample(
        prompt_ids=t.prompt_ids, completion_ids=t.completion_ids, loss_mask=t.loss_mask, engine_logprobs=t.logprobs,
        row=t.row, group=t.group, finish_reason=t.finish_reason,
        text="\n".join(m["content"] for m in t.messages[len(t.row["prompt"]):] if m["role"] == "assistant"),
        info={"messages": t.messages, "images": t.images, "tools": t.box.schemas, "turns": t.turns,
              "tool_calls": t.tool_calls, "tool_errors": t.tool_errors})
        for t in trajectories]
    seconds = time.perf_counter() - start
    n = len(trajectories)
    generated = sum(sum(t.loss_mask) for t in trajectories)
    metrics = {
        "rollout/seconds": seconds,
        "rollout/tokens_per_s": generated / max(seconds, 1e-9),
        "rollout/truncated_frac": sum(t.finish_reason != "stop" for t in trajectories) / n,
        "tools/turns_mean": sum(t.turns for t in trajectories) / n,
        "tools/calls_mean": sum(t.tool_calls for t in trajectories) / n,
        "tools/errors_mean": sum(t.tool_errors for t in trajectories) / n,
        "tools/seconds": sum(t.tool_seconds for t in trajectories),
        "tools/truncated_responses": sum(t.truncated_responses for t in trajectories),
    }
    for reason in ("length", "max_turns", "max_total_tokens"):
        metrics[f"rollout/finish_{reason}_frac"] = sum(t.finish_reason == reason for t in trajectories) / n
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
    budget = min(max(limits.max_total_tokens - t.length for t in live), sampling.max_new_tokens)
    turn_sampling = dataclasses.replace(sampling, max_new_tokens=max(budget, 1))
    completions = _generate(engine, [t.prompt_ids + t.completion_ids for t in live], turn_sampling,
                            [t.images for t in live])
    pending = []
    for t, c in zip(live, completions):
        room = limits.max_total_tokens - t.length
        ids, logprobs = c.token_ids[:room], c.logprobs[:room]  # the batch budget follows the longest trajectory
        t.completion_ids += ids
        t.loss_mask += [1] * len(ids)
        t.logprobs += logprobs
        t.turns += 1
        ended = bool(ids) and ids[-1] == eot  # only a turn closed by the template's token can take tool results
        stopped = ended or (c.finish_reason == "stop" and len(ids) == len(c.token_ids))
        content = tokenizer.decode(ids[:-1] if stopped else ids, skip_special_tokens=False)
        t.messages.append({"role": "assistant", "content": content})
        calls = parse_tool_calls(content, set(t.box.tools)) if ended else []
        if not calls:
            t.finish_reason = "stop" if stopped else ("max_total_tokens" if len(ids) < len(c.token_ids) else "length")
        elif t.turns >= limits.max_turns:
            t.finish_reason = "max_turns"
        else:
            pending.append((t, [pool.submit(call_tool, t.box, call) for call in calls]))
    for t, futures in pending:
        new_messages = []
        for future in futures:
            result, seconds = future.result()
            text, cut = truncate_tool_text(tokenizer, result.text, limits.max_tool_response_tokens)
            result.text = text
            new_messages.append(tool_message(result))
            t.images += result.images
            t.tool_calls += 1
            t.tool_errors += result.error
            t.tool_seconds += seconds
            t.truncated_responses += cut
        ids = template_suffix_ids(tokenizer, t.messages, new_messages, t.box.schemas)
        if t.length + len(ids) >= limits.max_total_tokens:  # no room left to answer: end on the policy's own turn
            t.finish_reason = "max_total_tokens"
            continue
        t.messages += new_messages
        t.completion_ids += ids
        t.loss_mask += [0] * len(ids)
        t.logprobs += [0.0] * len(ids)


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
    if messages[-1]["role"] == "assistant" and sample.ids and sample.ids[-1] == tokenizer.convert_tokens_to_ids(END_OF_TURN):
        text = text[: text.rindex(END_OF_TURN) + len(END_OF_TURN)]  # the trajectory ends on the policy's token
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    want, offsets = encoded["input_ids"], encoded["offset_mapping"]
    findings = []
    got = sample.ids
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    if first < max(len(got), len(want)):
        findings.append(f"ids drift at token {first} of {len(got)} (template: {len(want)} tokens): trajectory "
                        f"{tokenizer.decode(got[first:first + 8])!r} vs template {tokenizer.decode(want[first:first + 8])!r}")
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
                        f"({tokenizer.decode(got[wrong[0]:wrong[0] + 1])!r}: mask {mask[wrong[0]]}, want {want_mask[wrong[0]]})")
    return findings
PYTHON_TOOL = {"type": "function", "function": {
    "name": "python", "description": "Run Python code in a persistent session (variables, imports and files are kept). "
    "The task's image is `image` (PIL) and input_image.png; images you show or save and matplotlib figures are returned.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}


def python_toolbox(row: dict) -> ToolBox:
    """The `python` tool: one sandbox.PythonSession per trajectory, given the row's first image."""
    import sandbox

    session = sandbox.PythonSession(input_image=(row.get("images") or [None])[0])

    def python(arguments: dict) -> ToolResult:
        if not isinstance(arguments.get("code"), str):
            return ToolResult('Error: python needs {"code": <string>}', error=True)
        out = session.run(arguments["code"])
        text = out.stdout + out.stderr + (out.error or "")
        return ToolResult(text or "(no output)", images=out.images, error=out.error is not None)

    return ToolBox({"python": python}, [PYTHON_TOOL], close=session.close)


# ======================================== end of the multi-turn agent loop section =====================================
