"""Producing samples: the engine protocol, the HF engine, and the rollout loop.

Token-in-token-out: prompts go to the engine as token ids and completions come back as token ids plus the
per-token logprobs of the distribution that was actually sampled (after temperature). Nothing is decoded
and re-encoded on the way to the trainer; text is decoded only for the reward.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Protocol

import torch
import torch.distributed as dist


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
    """Generation with the policy model itself: CPU tests, debugging, machines without vLLM.

    Every rank calls generate() (under FSDP each forward is a collective; `synced_gpus` keeps ranks that
    finish early stepping until all are done). load_weights/sleep/wake_up have nothing to do: the engine
    runs on the very parameters being trained, so it is always in sync.
    """

    def __init__(self, model, pad_token_id: int, batch_size: int = 64):
        self.model = model
        self.pad_token_id = pad_token_id
        self.batch_size = batch_size

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        return None

    def sleep(self) -> None:
        return None

    def wake_up(self) -> None:
        return None

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Completion]:
        out = []
        for start in range(0, len(prompts), self.batch_size):
            out += self._generate_batch(prompts[start : start + self.batch_size], sampling)
        return out

    def _generate_batch(self, prompts: list[list[int]], sampling: Sampling) -> list[Completion]:
        device = next(self.model.parameters()).device
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding, so every row continues at the same position
            input_ids[i, width - len(p) :] = torch.tensor(p)
            attention_mask[i, width - len(p) :] = 1
        greedy = sampling.temperature <= 0
        was_training = self.model.training
        self.model.eval()
        out = self.model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            max_new_tokens=sampling.max_new_tokens,
            do_sample=not greedy,
            temperature=None if greedy else sampling.temperature,
            top_p=None if greedy else sampling.top_p,
            top_k=None if greedy else sampling.top_k,
            eos_token_id=sampling.stop_token_ids or None,
            pad_token_id=self.pad_token_id,
            return_dict_in_generate=True,
            output_scores=True,  # processed scores: after temperature / top-k / top-p, i.e. what was sampled from
            synced_gpus=dist.is_initialized() and dist.get_world_size() > 1,
        )
        self.model.train(was_training)
        new_tokens = out.sequences[:, width:].cpu()
        scores = torch.stack(out.scores, dim=1).float().cpu()  # [batch, new, vocab]
        logprobs = torch.log_softmax(scores, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        stop_ids = set(sampling.stop_token_ids)
        return [truncate_at_stop(new_tokens[i].tolist(), logprobs[i].tolist(), stop_ids) for i in range(len(prompts))]


def encode_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """Chat messages -> prompt token ids, ending with the assistant header (tokenized once, never again)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


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
