"""Generating tokens: the engine protocol and its two implementations.

`HFEngine` generates with the policy's own Hugging Face model (CPU tests, debugging, machines without vLLM);
`VLLMEngine` is a colocated vLLM engine per rank that sleeps while the policy trains. Both take prompts as token
ids and return completions as token ids plus the logprob of each sampled token under the distribution actually
sampled (after temperature, top-k, top-p). Nothing is decoded here but to match stop strings (`Sampling.stop`),
which end a completion at the token that completes one, that token kept whole. A vision-language policy (Qwen2.5-VL)
takes each prompt's images beside its ids (one unexpanded `<|image_pad|>` per image); both engines ban the image and
video placeholders from sampling, as the trainer's logprobs do. Both also batch continuously (`ContinuousEngine`:
requests submitted one at a time join the running batch at the next decoding step and leave it at their last), for
agent rollouts whose turns must not wait for each other; HFEngine for Llama-layout text models.
"""
from __future__ import annotations

import copy
import hashlib
import importlib.util
import itertools
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Protocol

import torch
import torch.distributed as dist
from peft import inject_adapter_in_model
from safetensors.torch import save_file
from torch.distributed.fsdp import FSDPModule
from transformers import AutoTokenizer, DynamicCache
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import vision


@dataclass
class Sampling:
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # strings that end a completion once its decoded text holds one
    seed: int | None = None  # the rollout's seed: rollout.py derives each sample's seed per turn from it (derive_seed)
    # and the engines draw that sample's tokens from it alone (generate's `seeds`); None: the engine's shared stream


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # log p(token) under the sampled distribution (logits / temperature)
    finish_reason: str  # "stop" (hit a stop token or completed a stop string; that token is kept) or "length"


class Engine(Protocol):
    def generate(self, prompts: list[list[int]], sampling: Sampling, seeds: list[int] | None = None
                 ) -> list[Completion]: ...
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...
    # An engine that `holds_base` of a LoRA policy takes its adapters alone: load_adapter(weights, peft LoraConfig).
    def sleep(self) -> None: ...
    def wake_up(self) -> None: ...


class ContinuousEngine(Engine, Protocol):
    """An engine that also batches continuously (`continuous` says whether it can now): `submit` a request, and each
    `step()` decodes one token of every running request and returns the finished ones."""
    continuous: bool

    def submit(self, key: object, prompt: list[int], sampling: Sampling, seed: int | None = None) -> None: ...
    def step(self) -> list[tuple[object, Completion]]: ...
    def abort(self) -> None: ...


def derive_seed(*parts: int | str) -> int:
    """A seed from `parts` (a run's seed, a step, a sample, a turn): the same parts give the same seed in any process on
    any machine (no Python hash), other parts an unrelated one. 63 bits, what torch.Generator and vLLM's seed take."""
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little") >> 1


def check_seeds(prompts: list, seeds: list[int] | None) -> None:
    if seeds is not None and len(seeds) != len(prompts):
        raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts: one seed per prompt")


def continuous(engine) -> bool:
    """Whether `engine` batches continuously: requests are `submit`ted one at a time and every `step()` decodes one
    token for each running request, admitting new ones and returning finished ones at any step, so a trajectory's turn
    neither waits for an engine call to end nor for the next one to start. A tensor-parallel engine's peers must
    submit together, so theirs are calls (`generate`)."""
    return bool(getattr(engine, "continuous", False)) and call_group(engine) is None


def call_group(engine) -> object | None:
    """The process group whose ranks must call `engine.generate` together, the same number of times (a
    tensor-parallel VLLMEngine's peers), or None: the engine's calls are this rank's alone."""
    return getattr(engine, "tp_group", None)


def truncate_at_stop(token_ids: list[int], logprobs: list[float], stop_ids: set[int]) -> Completion:
    """Cut a generation right after its first stop token (kept: the policy must learn to end its turn)."""
    for i, tok in enumerate(token_ids):
        if tok in stop_ids:
            return Completion(token_ids[: i + 1], logprobs[: i + 1], "stop")
    return Completion(token_ids, logprobs, "length")


@dataclass
class Request:
    """A request in an engine's continuous batch: what was submitted, and the tokens drawn so far."""
    key: object
    prompt: list[int]
    sampling: Sampling
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


@dataclass
class Running:
    """HFEngine's running batch: row i of `cache` and `logits` (its next token's) is `requests[i]`; `pick` draws from
    the distribution they share."""
    requests: list[Request]
    cache: KVBuffer
    logits: torch.Tensor
    pick: Picker


class HFEngine:
    """Generation with the policy's own Hugging Face model (a KV-cached decoding loop): CPU tests, debugging,
    machines without vLLM.

    On a plain model it generates with that very model, always in sync (load_weights has nothing to do). On an
    FSDP2-sharded policy it generates with an unsharded replica that load_weights fills, as the trainer does before
    every rollout (`policy.iter_full_weights`, the stream vLLM gets): decoding then needs no collectives, so each rank
    decodes on its own instead of all-gathering every layer for every token.

    A vision-language model prefills each prompt with its images (placeholders expanded, 3-D mrope positions) and
    decodes at its text position plus the prompt's rope delta, as its own `generate` does.

    Stop strings are matched in each row's decoded completion (special tokens written out, as chat.code_stop reads
    it) with `tokenizer`, by default the model folder's (loaded the first time a Sampling has stop strings).

    A text model that `decode_step` decodes also batches continuously (`continuous`, `submit`, `step`): each request
    joins the running batch at the next step and leaves it with its last token, rows of different lengths side by
    side in one KVBuffer. It draws the tokens generate() draws for the same prompt and seed.
    """

    def __init__(self, model, pad_token_id: int, batch_size: int = 64, tokenizer=None):
        self.policy = model
        self.sharded = any(isinstance(m, FSDPModule) for m in model.modules())
        self.model = None if self.sharded else model
        self.pad_token_id = pad_token_id
        self.batch_size = batch_size
        self.banned = vision.banned_token_ids(model.config)
        self.tokenizer = tokenizer
        self.queued: list[Request] = []  # submitted, prefilled at the next step
        self.running: Running | None = None

    @property
    def continuous(self) -> bool:
        return (self.model is not None and not vision.is_vision_model(self.model.config)
                and lean_decoding_supported(self.model))

    @property
    def holds_base(self) -> bool:
        """Whether a LoRA policy's base is here (the replica, once loaded; or the unsharded policy itself): from then
        on `load_adapter` takes its adapters alone."""
        return self.model is not None

    def load_adapter(self, weights: Iterable[tuple[str, torch.Tensor]], config) -> None:
        """A LoRA policy's adapters (policy.iter_adapter_weights) into the replica, whose base and adapter layers the
        first load_weights built; PEFT's layers apply them as the policy's do."""
        if self.queued or self.running:
            raise RuntimeError("HFEngine.load_adapter while submitted requests are unfinished: step() them to the end")
        weights = dict(weights)
        if not self.sharded:  # generating with the policy itself: its adapters are these very tensors
            return None
        wanted = {name for name, _ in self.model.named_parameters() if ".lora_" in name}
        if set(weights) != wanted:
            raise ValueError(f"HFEngine.load_adapter: the replica's {len(wanted)} adapter weights and the "
                             f"{len(weights)} given differ, e.g. {sorted(set(weights) ^ wanted)[:5]}")
        self.model.load_state_dict(weights, strict=False)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.queued or self.running:
            raise RuntimeError("HFEngine.load_weights while submitted requests are unfinished: step() them to the end")
        if not self.sharded:
            return None
        weights = dict(weights)
        if self.model is None:  # the policy's own class, built from its config, then filled below
            model_class = next(c for c in type(self.policy).__mro__ if not issubclass(c, FSDPModule))
            first = next(iter(weights.values()))
            # Packed-training attentions do not decode: packed_sdpa has no KV cache, flex_attention compiles a kernel
            # per decoding shape.
            config = copy.deepcopy(self.policy.config)  # _from_config sets the attention on the config it gets
            attn = vision.text_attention(config)
            attn = "sdpa" if attn in ("packed_sdpa", "flex_attention") else attn
            if vision.is_vision_model(config):
                attn = {"text_config": attn, "vision_config": "sdpa"}
            # The replica's init draws must not shift the sampling stream (resume, seeds).
            with torch.random.fork_rng(devices=[first.device] if first.is_cuda else []):
                self.model = model_class._from_config(config, attn_implementation=attn)
                if getattr(self.policy, "peft_config", None):  # a LoRA policy: the same adapter layers
                    inject_adapter_in_model(self.policy.peft_config["default"], self.model)
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
    def generate(self, prompts: list[list[int]], sampling: Sampling, images: list[list | None] | None = None,
                 seeds: list[int] | None = None) -> list[Completion]:
        """Completions for `prompts` (token ids); `images[i]` are prompt i's images (PNG bytes or PIL, one per
        `<|image_pad|>` in its ids, in order), or None. A text-only model sees only the placeholder tokens. `seeds[i]`
        seeds prompt i's own generator, so its draws do not depend on the prompts batched with it; without seeds
        every row draws from torch's global stream."""
        if self.model is None:
            raise RuntimeError("HFEngine on an FSDP-sharded policy: call load_weights(policy.iter_full_weights(model)) "
                               "before generate")
        self._check_sampling(sampling)
        if images is None or not vision.is_vision_model(self.model.config):  # a text model sees only placeholders
            images = [[] for _ in prompts]
        images = [list(i or []) for i in images]
        check_seeds(prompts, seeds)
        out = []
        for start in range(0, len(prompts), self.batch_size):
            end = start + self.batch_size
            out += self._generate_batch(prompts[start:end], sampling, images[start:end],
                                        None if seeds is None else seeds[start:end])
        return out

    def _check_sampling(self, sampling: Sampling) -> None:
        if sampling.max_new_tokens < 1:
            raise ValueError(f"Sampling.max_new_tokens must be >= 1, got {sampling.max_new_tokens}")
        if sampling.stop and self.tokenizer is None:
            try:
                self.tokenizer = AutoTokenizer.from_pretrained(self.policy.name_or_path, local_files_only=True)
            except (OSError, ValueError) as e:
                raise ValueError(f"HFEngine: stop strings {sampling.stop} need a tokenizer and the model's folder "
                                 f"{self.policy.name_or_path!r} has none: pass HFEngine(tokenizer=...)") from e

    def submit(self, key: object, prompt: list[int], sampling: Sampling, seed: int | None = None) -> None:
        """Queue a request named `key` (step() returns it with its completion); the next step() prefills it and decodes
        it with the running ones. Requests running together share temperature, top-k and top-p; their max_new_tokens,
        stop tokens and stop strings are their own. `seed` seeds its own generator, as generate()'s `seeds`."""
        if not self.continuous:
            raise RuntimeError("HFEngine.submit: continuous batching decodes text models that decode_step serves "
                               "(engines.continuous); call generate()")
        self._check_sampling(sampling)
        others = self.queued + (self.running.requests if self.running else [])
        shape = (sampling.temperature, sampling.top_k, sampling.top_p)
        if others and shape != (others[0].sampling.temperature, others[0].sampling.top_k, others[0].sampling.top_p):
            raise ValueError(f"HFEngine.submit: temperature, top_k, top_p {shape} differ from the running requests'; "
                             "finish those first")
        device = next(self.model.parameters()).device
        generator = None if seed is None else torch.Generator(device).manual_seed(seed)
        self.queued.append(Request(key, list(prompt), sampling, generator))

    @torch.no_grad()
    def step(self) -> list[tuple[object, Completion]]:
        """One step of continuous batching: the queued requests are prefilled and join the running batch, each running
        request draws its next token, and those that end with it (a stop token, a completed stop string, their
        max_new_tokens) leave it: returns their (key, completion), the completion as generate() would give it."""
        if self.queued:
            self._admit(self.queued)
            self.queued = []
        if self.running is None:
            return []
        run, device = self.running, self.running.logits.device
        requests = run.requests
        generators = [r.generator for r in requests]
        token, logprob = run.pick(run.logits, generators if all(generators) else None)
        finished, keep = [], []
        for i, (request, t, lp) in enumerate(zip(requests, token.tolist(), logprob.tolist())):
            request.tokens.append(t)
            request.logprobs.append(lp)
            stop = t in request.sampling.stop_token_ids or bool(request.sampling.stop) and completes_stop(
                self.tokenizer, request.tokens, request.sampling.stop)
            if stop or len(request.tokens) == request.sampling.max_new_tokens:
                reason = "stop" if stop else "length"
                finished.append((request.key, Completion(request.tokens, request.logprobs, reason)))
            else:
                keep.append(i)
        cache = run.cache
        if len(keep) < len(requests):  # the finished rows leave the buffer, which shrinks if the longest left
            index = torch.tensor(keep, dtype=torch.long, device=device)
            span = max((len(requests[i].prompt) + len(requests[i].tokens) - 1 for i in keep), default=0)
            capacity = min(cache.keys[0].shape[2], 2 * (span + 1))
            cache = KVBuffer([k[index, :, :capacity] for k in cache.keys],  # one copy of the rows and positions kept
                             [v[index, :, :capacity] for v in cache.values], cache.lengths[index], span)
            token, requests = token[index], [requests[i] for i in keep]
        if requests and cache.span + 1 > cache.keys[0].shape[2]:  # the buffer doubles when a row reaches its end
            capacity = 2 * (cache.span + 1)
            cache = KVBuffer([resized(k, capacity) for k in cache.keys], [resized(v, capacity) for v in cache.values],
                             cache.lengths, cache.span)
        if not requests:
            self.running = None
        else:
            attend = (torch.arange(cache.span + 1, device=device) <= cache.lengths[:, None])[:, None, None, :]
            rotary = self.model.model.rotary_emb(run.logits[:1, None], cache.lengths[:, None])
            # decode_step calls no module's __call__: the model's training mode plays no part
            self.running = Running(requests, cache, decode_step(self.model, cache, token, rotary, attend), run.pick)
        return finished

    def abort(self) -> None:
        """Drop every submitted request unfinished (the rollout that submitted them failed or was interrupted)."""
        self.queued, self.running = [], None

    def _admit(self, requests: list[Request]) -> None:
        """Prefill `requests` (each distinct prompt once) and add their rows to the running batch, every row's cache
        starting at position 0."""
        device = next(self.model.parameters()).device
        prompts = [r.prompt for r in requests]
        input_ids, attention_mask = left_padded(prompts, self.pad_token_id, device)
        first, which = distinct_rows([tuple(p) for p in prompts], device)
        prefill = DynamicCache(config=self.model.config)
        was_training = self.model.training
        self.model.eval()
        logits = self.model(input_ids=input_ids[first], attention_mask=attention_mask[first],
                            position_ids=(attention_mask[first].cumsum(-1) - 1).clamp_(min=0),
                            past_key_values=prefill, use_cache=True, logits_to_keep=1).logits[:, -1][which]
        self.model.train(was_training)
        running = self.running.requests if self.running else []
        capacity = max(self.running.cache.keys[0].shape[2] if self.running else 0, 2 * input_ids.shape[1])
        width, rows = input_ids.shape[1], which.tolist()
        keys, values = [], []
        for layer in prefill.layers:
            for tensors, cached in ((keys, layer.keys), (values, layer.values)):
                block = cached.new_zeros(len(requests), cached.shape[1], capacity, cached.shape[3])
                for i, (p, d) in enumerate(zip(prompts, rows)):  # left padding dropped: each row from position 0
                    block[i, :, : len(p)] = cached[d, :, width - len(p) :]
                tensors.append(block)
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        if self.running:
            old = self.running.cache
            keys = [torch.cat([resized(k, capacity), new]) for k, new in zip(old.keys, keys)]
            values = [torch.cat([resized(v, capacity), new]) for v, new in zip(old.values, values)]
            lengths, logits = torch.cat([old.lengths, lengths]), torch.cat([self.running.logits, logits])
        pick = self.running.pick if self.running else Picker(requests[0].sampling, self.banned, device)
        self.running = Running(running + requests, KVBuffer(keys, values, lengths, int(lengths.max())), logits, pick)

    def _generate_batch(self, prompts: list[list[int]], sampling: Sampling, images: list[list],
                        seeds: list[int] | None) -> list[Completion]:
        """A prefill of the left-padded batch, then one token per step from a KV cache. Written out rather than
        `generate()`, for two reasons: only `sampling` shapes the distribution (generate would also apply what the
        model's generation_config holds, e.g. Qwen2.5's repetition_penalty, which the trainer's logprobs know nothing
        of), and only the chosen tokens' logprobs are kept (generate's scores hold [rows, vocab] floats per step: 40 GB
        for 64 rows of 1024 tokens at vocab 152k). Scores go through transformers' own warpers (temperature, top-k,
        top-p); Llama-layout models decode with `decode_step`, the others with their own forward."""
        device = next(self.model.parameters()).device
        multimodal = vision.is_vision_model(self.model.config)
        if multimodal:  # each placeholder becomes its image's tokens; a prompt is distinct by its ids and images
            keys = [(tuple(p), tuple(map(vision.digest, i))) for p, i in zip(prompts, images)]
            processor = vision.processor_for(self.model.config)
            grids = [vision.pixels(processor, i)[1] if i else torch.zeros(0, 3, dtype=torch.long) for i in images]
            prompts = [vision.expand(p, g, self.model.config.image_token_id, processor.merge_size)[0]
                       for p, g in zip(prompts, grids)]
        else:
            keys = [tuple(p) for p in prompts]
        rows, new = len(prompts), sampling.max_new_tokens
        input_ids, attention_mask = left_padded(prompts, self.pad_token_id, device)
        width = input_ids.shape[1]
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(rows, new)], 1)  # generated: attended
        positions = (attention_mask[:, :width].cumsum(-1) - 1).clamp_(min=0)
        generators = None if seeds is None else [torch.Generator(device).manual_seed(s) for s in seeds]
        pick = Picker(sampling, self.banned, device)
        stop_tokens = torch.tensor(sampling.stop_token_ids, dtype=torch.long, device=device)
        tokens = torch.full((rows, new), self.pad_token_id, dtype=torch.long, device=device)
        logprobs = torch.zeros((rows, new), device=device)
        stopped = torch.zeros(rows, dtype=torch.bool, device=device)
        string_end = [new] * rows  # tokens up to and including the one that completed a stop string
        was_training = self.model.training
        self.model.eval()
        first, which = distinct_rows(keys, device)  # a group's samples share their prompt: prefilled once
        cache = DynamicCache(config=self.model.config)
        extra = {}
        if multimodal:  # 3-D positions over the images at prefill; text tokens after them run at position + delta
            row_images = [image for row in first.tolist() for image in images[row]]
            grid = None
            if row_images:
                pixel_values, grid = (t.to(device) for t in vision.pixels(processor, row_images))
                extra = {"pixel_values": pixel_values, "image_grid_thw": grid}
            ids = input_ids[first]
            prefill_positions, delta = self.model.model.get_rope_index(
                ids, mm_token_type_ids=(ids == self.model.config.image_token_id).int(), image_grid_thw=grid,
                attention_mask=attention_mask[first, :width])
            delta, text_position = delta[which], attention_mask[:, :width].sum(-1, keepdim=True) - 1
        else:
            prefill_positions = positions[first]
        logits = self.model(input_ids=input_ids[first], attention_mask=attention_mask[first, :width],
                            position_ids=prefill_positions, past_key_values=cache, use_cache=True, logits_to_keep=1,
                            **extra).logits[:, -1]
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
            token, logprobs[:, step] = pick(logits, generators)
            tokens[:, step] = token.masked_fill(stopped, self.pad_token_id)
            stopped |= torch.isin(token, stop_tokens)
            if sampling.stop:
                for row in self._completed_stop_strings(tokens[:, : step + 1], stopped, sampling.stop):
                    stopped[row], string_end[row] = True, step + 1
            if step == new - 1 or stopped.all():
                break
            if lean:
                logits = decode_step(self.model, cache, token, (cos[:, step : step + 1], sin[:, step : step + 1]),
                                     attend[..., : width + step + 1])
            elif multimodal:
                text_position = text_position + 1
                logits = self.model(input_ids=token[:, None], attention_mask=attention_mask[:, : width + step + 1],
                                    position_ids=(text_position + delta)[None].expand(3, -1, -1),
                                    past_key_values=cache, use_cache=True).logits[:, -1]
            else:
                positions = positions[:, -1:] + 1
                logits = self.model(input_ids=token[:, None], attention_mask=attention_mask[:, : width + step + 1],
                                    position_ids=positions, past_key_values=cache, use_cache=True).logits[:, -1]
        self.model.train(was_training)
        tokens, logprobs = tokens[:, : step + 1].cpu(), logprobs[:, : step + 1].cpu()
        stop_ids = set(sampling.stop_token_ids)
        out = [truncate_at_stop(tokens[i, : string_end[i]].tolist(), logprobs[i, : string_end[i]].tolist(), stop_ids)
               for i in range(rows)]
        return [Completion(c.token_ids, c.logprobs, "stop") if string_end[i] < new else c for i, c in enumerate(out)]

    def _completed_stop_strings(self, tokens: torch.Tensor, stopped: torch.Tensor, stop: list[str]) -> list[int]:
        """The rows still going whose decoded tokens [rows, generated] now hold a stop string: it was completed by the
        last token (an earlier one would have stopped them), so only the tail it can lie in is decoded."""
        live = (~stopped).nonzero().flatten().tolist()
        texts = self.tokenizer.batch_decode(tokens[live, -stop_reach(stop):].tolist(), skip_special_tokens=False)
        return [row for row, text in zip(live, texts) if any(s in text for s in stop)]


STOP_CONTEXT = 8  # tokens decoded before a stop string: a decoder treats a text's first token apart


def stop_reach(stop: list[str]) -> int:
    """How many of the last tokens a stop string completed by the last one lies in: each token writes at least a byte,
    so at most the longest stop string's bytes, and STOP_CONTEXT more for the decoder's start."""
    return max(len(s.encode()) for s in stop) + STOP_CONTEXT


def completes_stop(tokenizer, tokens: list[int], stop: list[str]) -> bool:
    """Whether the last of `tokens` completes one of the `stop` strings (checked at every step: an earlier one would
    have ended the request). Only the tail it can lie in is decoded: a step costs the same at any reply length, where
    decoding the whole reply each step is quadratic in it."""
    text = tokenizer.decode(tokens[-stop_reach(stop):], skip_special_tokens=False)
    return any(s in text for s in stop)


def sample_from(probs: torch.Tensor, generators: list[torch.Generator] | None = None) -> torch.Tensor:
    """One token per row of `probs` [rows, vocab] by inverting its CDF at a uniform draw: one random number per row,
    where torch.multinomial draws one per vocabulary entry; row i's from `generators[i]` when given, else all from
    torch's global stream. The CDF is summed in fp64 so that at vocab 152k rounding cannot shift tail tokens' mass;
    `right=True` never lands on a zero-probability token (its CDF step is empty)."""
    cdf = probs.double().cumsum(-1)
    if generators is None:
        u = torch.rand(probs.shape[0], 1, dtype=torch.float64, device=probs.device)
    else:
        u = torch.cat([torch.rand(1, 1, dtype=torch.float64, device=probs.device, generator=g) for g in generators])
    u = u * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


class Picker:
    """The next token of each row and its logprob under the distribution `sampling` describes: banned tokens
    removed, then transformers' own warpers (temperature, top-k, top-p), then greedy or a draw (`sample_from`)."""

    def __init__(self, sampling: Sampling, banned: list[int], device: torch.device):
        self.greedy = sampling.temperature <= 0
        self.banned = torch.tensor(banned, dtype=torch.long, device=device)
        self.warpers = [] if self.greedy else (  # called directly: LogitsProcessorList inspects signatures every call
            [TemperatureLogitsWarper(sampling.temperature)]
            + ([TopKLogitsWarper(sampling.top_k)] if sampling.top_k > 0 else [])
            + ([TopPLogitsWarper(sampling.top_p)] if sampling.top_p < 1 else []))

    def __call__(self, logits: torch.Tensor, generators: list[torch.Generator] | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        scores = logits.float()
        scores[:, self.banned] = -torch.inf
        for warp in self.warpers:
            scores = warp(None, scores)  # these warpers never look at the ids
        probs = scores.softmax(-1)
        token = scores.argmax(-1) if self.greedy else sample_from(probs, generators)
        return token, probs.gather(1, token[:, None]).squeeze(1).log()  # no [rows, vocab] log_softmax


def left_padded(prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) [rows, longest prompt], padded on the left so that every row ends at the same
    position."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.ones((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p) :] = torch.tensor(p)
        attention_mask[i, : width - len(p)] = 0
    return input_ids.to(device), attention_mask.to(device)


def distinct_rows(keys: list, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(first, which): the first row of each distinct key, and each row's distinct number; prefilling rows `first` and
    taking `which` of the result prefills every distinct prompt once (a group's samples share their prompt)."""
    distinct: dict = {}  # key -> (its number, its first row)
    for i, key in enumerate(keys):
        distinct.setdefault(key, (len(distinct), i))
    return (torch.tensor([row for _, row in distinct.values()], device=device),
            torch.tensor([distinct[key][0] for key in keys], device=device))


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
    writes one position per row instead of concatenating a longer cache. Row i holds `lengths[i]` cached positions
    (the next one is written there); `span` is the most any row holds, kept on the host so that a step needs no sync."""
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    lengths: torch.Tensor
    span: int

    @classmethod
    def from_prefill(cls, cache: DynamicCache, capacity: int) -> KVBuffer:
        """The buffer of a left-padded batch's prefill: every row at the batch's length."""
        rows, length = cache.layers[0].keys.shape[0], cache.get_seq_length()
        return cls([resized(layer.keys, capacity) for layer in cache.layers],
                   [resized(layer.values, capacity) for layer in cache.layers],
                   torch.full((rows,), length, device=cache.layers[0].keys.device), length)


def resized(t: torch.Tensor, capacity: int) -> torch.Tensor:
    """`t` [rows, heads, positions, dim] in a buffer of `capacity` positions: cut, or grown with zeros (a row shorter
    than the span attends past its end with weight 0, and 0 * uninitialised memory could be NaN); `t` itself if it
    has that many."""
    if t.shape[2] >= capacity:
        return t if t.shape[2] == capacity else t[:, :, :capacity].clone()
    buffer = t.new_zeros(*t.shape[:2], capacity, t.shape[3])
    buffer[:, :, : t.shape[2]] = t
    return buffer


def decode_step(model, cache: KVBuffer, token: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                attend: torch.Tensor) -> torch.Tensor:
    """Next-token logits [rows, vocab] after `token` [rows] whose rotary angles are `rotary` (cos, sin of
    `model.model.rotary_emb` at its positions): each row's key and value are written at its own length in `cache`, and
    it attends to the cached keys where `attend` [rows, 1, 1, cache.span + 1] is True.
    A Llama-layout decoder's computation in its order, with the model's own weights, norms, activation and rotation,
    without the generic forward's per-step mask building, cache bookkeeping and output objects, which dominate a small
    model's decoding step. Modules are entered through `forward` and projections through `F.linear`, skipping
    `Module.__call__`'s dispatch (`lean_decoding_supported` checks that nothing hooks them)."""
    inner = model.model
    rope = sys.modules[type(inner.layers[0].self_attn).__module__].apply_rotary_pos_emb  # the model's own
    cos, sin = rotary
    hidden = inner.embed_tokens.forward(token[:, None])
    rows, at, span = torch.arange(token.shape[0], device=token.device), cache.lengths, cache.span + 1
    for keys, values, layer in zip(cache.keys, cache.values, inner.layers):
        attn, mlp = layer.self_attn, layer.mlp
        x = layer.input_layernorm.forward(hidden)
        shape = (x.shape[0], 1, -1, attn.head_dim)
        q, k, v = (linear(proj, x).view(shape) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head before the rotation
            q, k = attn.q_norm.forward(q), attn.k_norm.forward(k)
        q, k = rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        keys[rows, :, at] = k[:, :, 0]
        values[rows, :, at] = v[:, 0]
        out = torch.nn.functional.scaled_dot_product_attention(
            q, keys[:, :, :span], values[:, :, :span], attn_mask=attend, scale=attn.scaling, enable_gqa=True)
        hidden = hidden + linear(attn.o_proj, out.transpose(1, 2).reshape(x.shape[0], 1, -1))
        x = layer.post_attention_layernorm.forward(hidden)
        hidden = hidden + linear(mlp.down_proj, mlp.act_fn(linear(mlp.gate_proj, x)) * linear(mlp.up_proj, x))
    cache.lengths += 1
    cache.span += 1
    return linear(model.lm_head, inner.norm.forward(hidden))[:, -1]


def linear(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, layer.weight, layer.bias)


# VLLMEngine (vllm==0.32.0), per step: wake_up() (weights) -> load_weights(policy.iter_full_weights(model)) (bucketed;
# then the KV cache and a fresh prefix cache) -> generate() -> sleep() (level 2: weights and KV cache are discarded, so
# every wake needs a load). The keyword builders are plain functions so `make test-vllm` can check them against the
# real vllm signatures.


# vLLM 0.32's allowed --max-lora-rank values (vllm/config/lora.py).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_llm_kwargs(model: str, *, rank: int, seed: int, tensor_parallel_size: int, gpu_memory_utilization: float,
                    max_model_len: int, max_num_seqs: int, enforce_eager: bool, dtype: str,
                    max_images_per_prompt: int | None = None, lora_rank: int = 0, **extra) -> dict:
    """Keyword arguments of `vllm.LLM` for one in-process engine per rank (or per tensor-parallel group).
    max_images_per_prompt: a vision-language model's image budget per prompt (no videos); None for a text model.
    lora_rank: a LoRA policy's rank (one adapter slot, the rank rounded up to one vLLM allows); 0 without."""
    if max_images_per_prompt is not None:  # vLLM's default of 999 per modality also inflates its profiling run
        extra["limit_mm_per_prompt"] = {"image": max_images_per_prompt, "video": 0}
    if lora_rank > 0:
        allowed = [r for r in VLLM_LORA_RANKS if r >= lora_rank]
        if not allowed:
            raise ValueError(f"--lora-rank {lora_rank}: vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}")
        extra |= {"enable_lora": True, "max_lora_rank": allowed[0], "max_loras": 1}
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


def vllm_sampling_kwargs(sampling: Sampling, banned_token_ids: Iterable[int] = (), seed: int | None = None) -> dict:
    """Keyword arguments of `vllm.SamplingParams`: token ids out, plus the logprob of each sampled token. Banned ids
    get vLLM's strongest logit bias, -100, before temperature and before the logprobs are taken: against the other
    logits that is a probability under e^-50, nothing in fp32, so the distribution is the trainer's, which drops them
    outright. `seed`: the request's own generator (None: the engine's stream, seeded by vllm_llm_kwargs)."""
    banned = {"logit_bias": {int(i): -100.0 for i in banned_token_ids}} if banned_token_ids else {}
    return dict(
        n=1,
        max_tokens=sampling.max_new_tokens,
        temperature=sampling.temperature,  # 0 = greedy in vLLM too
        top_p=sampling.top_p,
        top_k=sampling.top_k,  # 0 = off in vLLM too
        stop_token_ids=list(sampling.stop_token_ids),  # the stop token stays in the output, as in HFEngine
        stop=list(sampling.stop),
        # vLLM keeps the ids up to the token that completes a stop string, that token whole; the text is not used
        include_stop_str_in_output=True,
        skip_special_tokens=False,  # stop strings are matched in the text as HFEngine and chat.code_stop decode it
        logprobs=0,  # only the sampled token's logprob
        flat_logprobs=True,  # flat lists instead of one dict per token: far less garbage to collect
        detokenize=bool(sampling.stop),  # stop strings need it; kiln decodes text once, later, for the reward
        seed=seed,
        **banned,
    )


def vllm_prompt(token_ids: list[int], images: list | None = None) -> dict:
    """A `vllm.inputs.TokensPrompt` (a TypedDict, so a plain dict). With images (PNG bytes or PIL), the ids hold one
    unexpanded image placeholder per image (as `apply_chat_template` writes it): vLLM's processor expands them itself
    (expanded ids would be expanded again). Images go as RGB PIL images within kiln's limits (`vision.load_image`),
    each with its content hash as its uuid, so vLLM's processor and encoder caches know a repeated image."""
    prompt = {"prompt_token_ids": list(token_ids)}
    if images:
        prompt["multi_modal_data"] = {"image": [vision.load_image(image) for image in images]}
        prompt["multi_modal_uuids"] = {"image": [vision.digest(image) for image in images]}
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


def write_adapter(directory: Path | str, weights: Iterable[tuple[str, torch.Tensor]], config,
                  dtype: torch.dtype) -> int:
    """A LoRA policy's adapters (policy.iter_adapter_weights) as a PEFT adapter folder, what vLLM loads a LoRARequest
    from: adapter_model.safetensors (PEFT's names, base_model.model.<module>.lora_A.weight, in `dtype`) and
    adapter_config.json (its target modules as the layer names vLLM matches, e.g. q_proj). Returns the bytes written."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {"base_model.model." + name.replace(".default.", "."): tensor.detach().to(dtype).contiguous()
               for name, tensor in weights}
    save_file(tensors, directory / "adapter_model.safetensors")
    config = copy.copy(config)
    config.target_modules = sorted({name.split(".lora_")[0].rsplit(".", 1)[-1] for name in tensors})
    config.save_pretrained(directory)
    return sum(t.nbytes for t in tensors.values())


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


def check_engine(name: str) -> None:
    """Refuse, before anything loads, an engine that cannot start here."""
    if name == "vllm" and importlib.util.find_spec("vllm") is None:
        raise RuntimeError("--engine vllm: vllm is not installed (GPU machines: pip install -r requirements-vllm.txt); "
                         "on CPU pass --engine hf")


class VLLMEngine:
    """Colocated vLLM: one `vllm.LLM` per rank (or per `tensor_parallel_size` consecutive ranks) inside torchrun.

    Build it on every rank at the same point (it is a collective) before the FSDP model takes GPU memory, then
    sleep() it. Weights come only from the trainer (never reloaded from disk after a sync). `last_metrics` holds the
    latest sync seconds/bytes/buckets and generation seconds and tokens/s, for the trainer to log.
    """

    def __init__(self, model: str, *, seed: int = 0, tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float = 0.5, max_model_len: int = 4096, max_num_seqs: int = 256,
                 enforce_eager: bool = False, dtype: str = "bfloat16", sync_bucket_bytes: int = 1 << 30,
                 max_images_per_prompt: int | None = None, lora_rank: int = 0, **llm_kwargs):
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
        from vllm import LLM  # here, not at the top: vllm is installed on GPU machines only

        self.llm = LLM(**vllm_llm_kwargs(
            model, rank=rank, seed=seed, tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            enforce_eager=enforce_eager, dtype=dtype, max_images_per_prompt=max_images_per_prompt,
            lora_rank=lora_rank, **llm_kwargs))
        self.dtype = getattr(torch, dtype)
        self.sync_bucket_bytes = sync_bucket_bytes
        # A LoRA policy: the base stays loaded (level-1 sleeps), each sync writes the adapters to a new folder that
        # one adapter slot reloads in place; requests name it.
        self.holds_base = lora_rank > 0
        self.adapter_root = Path(tempfile.mkdtemp(prefix="kiln-lora-")) if self.holds_base else None
        self.adapter_versions = itertools.count(1)
        self.lora_request = None
        # vLLM's loader rejects a tied lm_head arriving in a call without the embedding it aliases; it is the
        # same tensor anyway, so it is never sent. A vision-language config holds the flag at its top level.
        model_config = self.llm.llm_engine.model_config
        tied = getattr(model_config.hf_config, "tie_word_embeddings", None)
        self.tied_lm_head = bool(tied if tied is not None else
                                 getattr(model_config.hf_text_config, "tie_word_embeddings", False))
        self.banned = vision.banned_token_ids(model_config.hf_config)
        self.image_token_id = getattr(model_config.hf_config, "image_token_id", None)
        self.image_processor = vision.image_processor(model) if vision.is_vision_model(model_config.hf_config) \
            else None
        self.param_names = self.llm.apply_model(lambda m: {name for name, _ in m.named_parameters()})[0]
        self.state = "awake"  # "asleep" -> wake_up() -> "weights" -> load_weights() -> "awake" -> sleep()
        self.last_metrics: dict[str, float] = {}
        self.submitted: dict[str, tuple[object, list[int], list]] = {}  # request id -> (key, prompt, images)
        self.request_numbers = itertools.count()

    @property
    def continuous(self) -> bool:
        return self.tp_group is None  # tensor-parallel peers drive one engine and must add the same requests

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
        self._synced(start, nbytes, buckets)

    def load_adapter(self, weights: Iterable[tuple[str, torch.Tensor]], config) -> None:
        """A LoRA policy's adapters: written to a new folder (`write_adapter`), which the engine's one adapter slot
        reloads in place (LoRARequest(load_inplace=True)); later requests name the new folder. A new path per version
        also keeps vLLM's prefix cache, whose keys hold the adapter's name and path, from serving old KV."""
        if self.state == "asleep":
            raise RuntimeError("VLLMEngine.load_adapter before wake_up()")
        from vllm.lora.request import LoRARequest

        start, folder = time.perf_counter(), self.adapter_root / f"v{next(self.adapter_versions)}"
        nbytes = write_adapter(folder, weights, config, self.dtype)
        self.llm.llm_engine.add_lora(LoRARequest("kiln", 1, str(folder), load_inplace=True))
        # Stored without load_inplace: with it, every request would reload the adapter from disk.
        previous, self.lora_request = self.lora_request, LoRARequest("kiln", 1, str(folder))
        if previous is not None:
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        self._synced(start, nbytes, 1)

    def _adapter(self) -> dict:
        """The keyword that names a LoRA policy's current adapter in a request; none for a full-weight policy."""
        return {"lora_request": self.lora_request} if self.lora_request is not None else {}

    def _synced(self, start: float, nbytes: int, buckets: int) -> None:
        """The end of a sync: the KV cache back, caches that the old weights computed dropped, the sync's metrics."""
        torch.cuda.empty_cache()
        if self.state == "weights":
            self.llm.wake_up(["kv_cache"])
        self.llm.reset_prefix_cache()  # cached prefixes were computed by the old weights
        self.llm.llm_engine.reset_encoder_cache()  # so were cached image embeddings
        self.state = "awake"
        self.last_metrics |= {"vllm/sync_seconds": time.perf_counter() - start, "vllm/sync_bytes": nbytes,
                              "vllm/sync_buckets": buckets}

    def generate(self, prompts: list[list[int]], sampling: Sampling, images: list[list | None] | None = None,
                 seeds: list[int] | None = None) -> list[Completion]:
        """Completions for `prompts` (token ids); `images[i]` are prompt i's images (Qwen2.5-VL style), or None;
        `seeds[i]` is request i's own seed (vLLM's per-request generator), so its draws do not depend on the requests
        batched with it."""
        if self.state != "awake":
            raise RuntimeError("VLLMEngine.generate needs wake_up() then load_weights(): "
                               "a level-2 sleep discards the weights")
        from vllm import SamplingParams

        check_seeds(prompts, seeds)
        if self.submitted:
            raise RuntimeError("VLLMEngine.generate while submitted requests are unfinished: step() them to the end")
        images = images if images is not None else [None] * len(prompts)
        first, count = 0, len(prompts)
        if self.tp_group is not None:  # TP peers drive one engine together, so they must submit the same requests
            parts = [None] * self.tp
            dist.all_gather_object(parts, (prompts, images, seeds), group=self.tp_group)
            first = sum(len(p) for p, _, _ in parts[: self.tp_rank])
            prompts, images = [p for ps, _, _ in parts for p in ps], [i for _, imgs, _ in parts for i in imgs]
            if any(s is not None for _, _, s in parts):  # peers' rollouts share their Sampling, so all or none
                seeds = [s for ps, _, ss in parts for s in (ss if ss is not None else [None] * len(ps))]
        for p, i in zip(prompts, images):
            self._check_images(p, i)
        start = time.perf_counter()
        params = SamplingParams(**vllm_sampling_kwargs(sampling, self.banned)) if seeds is None else \
            [SamplingParams(**vllm_sampling_kwargs(sampling, self.banned, seed)) for seed in seeds]
        outputs = self.llm.generate([vllm_prompt(p, i) for p, i in zip(prompts, images)], params, use_tqdm=False,
                                    **self._adapter())
        seconds = time.perf_counter() - start
        for p, i, output in zip(prompts, images, outputs):
            self._check_expansion(p, i, output)
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        self.last_metrics |= {"vllm/generate_seconds": seconds,
                              "vllm/generate_tokens_per_s": tokens / max(seconds, 1e-9)}
        return [completion_from_vllm(o) for o in outputs[first : first + count]]

    def submit(self, key: object, prompt: list[int], sampling: Sampling, seed: int | None = None,
               images: list | None = None) -> None:
        """Add a request named `key` to vLLM's scheduler (its continuous batch); step() returns it once finished."""
        if self.state != "awake":
            raise RuntimeError("VLLMEngine.submit needs wake_up() then load_weights()")
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self._check_images(prompt, images)
        request_id = str(next(self.request_numbers))
        params = SamplingParams(**vllm_sampling_kwargs(sampling, self.banned, seed),
                                output_kind=RequestOutputKind.FINAL_ONLY)  # nothing back until it is finished
        self.llm.llm_engine.add_request(request_id, vllm_prompt(prompt, images), params, **self._adapter())
        self.submitted[request_id] = (key, prompt, images)

    def step(self) -> list[tuple[object, Completion]]:
        """One step of vLLM's scheduler (a decoding step of the running requests, prefills of new ones as its token
        budget allows); returns the requests that finished in it as (key, completion)."""
        if not self.submitted:
            return []
        finished = []
        for output in self.llm.llm_engine.step():
            if output.finished:
                key, prompt, images = self.submitted.pop(output.request_id)
                self._check_expansion(prompt, images, output)
                finished.append((key, completion_from_vllm(output)))
        return finished

    def abort(self) -> None:
        """Drop every submitted request unfinished (the rollout that submitted them failed or was interrupted)."""
        if self.submitted:
            self.llm.llm_engine.abort_request(list(self.submitted))
            self.submitted = {}

    def _check_images(self, prompt: list[int], images: list | None) -> None:
        if images and (self.image_processor is None or prompt.count(self.image_token_id) != len(images)):
            raise ValueError(f"a prompt with {len(images)} images and {prompt.count(self.image_token_id)} image "
                             f"placeholders, for a {'vision' if self.image_processor else 'text-only'} model")

    def _check_expansion(self, prompt: list[int], images: list | None, output) -> None:
        """The engine's expansion of a prompt's images must be the trainer's, token for token."""
        if not images:
            return
        want = len(prompt) + sum(vision.image_tokens(self.image_processor, image) - 1 for image in images)
        if len(output.prompt_token_ids) != want:
            raise RuntimeError(f"vLLM expanded a prompt with {len(images)} images to {len(output.prompt_token_ids)} "
                               f"tokens where kiln's image processor gives {want}: the engine preprocesses images "
                               "differently (mm_processor_kwargs?) from the trainer")

    def sleep(self) -> None:
        if self.state == "asleep":
            return
        if self.submitted:
            raise RuntimeError("VLLMEngine.sleep while submitted requests are unfinished: step() them to the end")
        start = time.perf_counter()
        if self.state == "weights":  # a load failed half way: wake fully first, vLLM sleeps only from awake
            self.llm.wake_up(["kv_cache"])
        self.llm.sleep(level=1 if self.holds_base else 2)  # level 1 keeps a LoRA policy's base (in CPU memory)
        self.state = "asleep"
        self.last_metrics["vllm/sleep_seconds"] = time.perf_counter() - start
