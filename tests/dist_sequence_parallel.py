"""Ulysses sequence parallelism against one rank, on gloo, every check in one launch:

    torchrun --nproc-per-node WORLD tests/dist_sequence_parallel.py MODEL_DIR [VLM_DIR]

For each group size N dividing WORLD (N > 1), the data ranks (WORLD / N) each take their own samples, the ranks of a
group the same ones; a model sharded over every rank (FSDP2, full activation checkpointing) runs them with N ranks per
packed row. Per-token logprobs, entropies, the loss and every parameter's gradient must equal those of a plain model
on one rank (the gradient: the mean over data ranks, what data parallelism averages). Rank 0 prints `ok <check>` for
each check that passed on every rank, then `max_rel_err X`, the largest error relative to each tensor's largest
entry; any failure raises (non-zero exit).
"""

import io
import sys
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image
from torch.distributed.tensor import DTensor
from transformers import AutoTokenizer

import losses
import policy
import sequence_parallel

TOLERANCE = 1e-5
errors = []


def report(name: str) -> None:
    dist.barrier()  # a rank that failed never gets here, so rank 0's line means every rank passed
    if dist.get_rank() == 0:
        print(f"ok {name}", flush=True)


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    error = ((got.detach().double() - want.detach().double()).abs().max() / want.detach().double().abs().max()).item()
    errors.append(error)
    assert error <= TOLERANCE, f"{what}: relative error {error:.2e}"


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def batch(data_rank: int, vocab: int) -> list[SimpleNamespace]:
    """A data rank's samples: a group of three sharing a prompt (run once: a branch per sample), a session's two
    segments sharing a longer prefix (a prefix tree), and a sample of its own; ~700 tokens, so that every rank of a
    group holds parts of several sequences."""
    g = torch.Generator().manual_seed(10 + data_rank)

    def ids(n):
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    prompt, history = ids(70), ids(90)
    return ([SimpleNamespace(prompt_ids=prompt, completion_ids=ids(60 + 17 * k), images=[]) for k in range(3)]
            + [SimpleNamespace(prompt_ids=history[:40], completion_ids=history[40:] + ids(30), images=[]),
               SimpleNamespace(prompt_ids=history + ids(20), completion_ids=ids(50), images=[]),
               SimpleNamespace(prompt_ids=ids(33), completion_ids=ids(101 + data_rank), images=[])])


def loss_of(logprobs, entropy, data_rank: int):
    """A PPO-clipped loss with a random advantage per token and an entropy bonus: every token's gradient matters."""
    g = torch.Generator().manual_seed(100 + data_rank)
    mask = (logprobs != 0).float()
    old = logprobs.detach() + 0.1 * torch.randn(logprobs.shape, generator=g)
    token_loss, _ = losses.clipped_policy_loss(logprobs, old, torch.randn(logprobs.shape, generator=g), mask)
    return losses.aggregate(token_loss, mask) - 0.01 * losses.aggregate(entropy, mask)


def check_policy(model_dir: str, size: int, rank: int, world: int) -> None:
    group = sequence_parallel.make_group(size)
    data_rank, data_ranks = rank // size, world // size
    plain = policy.load_model(model_dir, attn_implementation="packed_sdpa")
    vocab = plain.config.vocab_size
    mine = None
    for d in range(data_ranks):  # the reference: each data rank's samples on one rank, the gradient averaged
        logprobs, entropy = policy.completion_logprobs(plain, batch(d, vocab), with_entropy=True)
        loss = loss_of(logprobs, entropy, d)
        (loss / data_ranks).backward()
        mine = (logprobs, entropy, loss) if d == data_rank else mine
    model = sequence_parallel.attach(policy.shard_model(policy.load_model(model_dir, attn_implementation="packed_sdpa"),
                                                        activation_checkpointing="full"), group)
    logprobs, entropy = policy.completion_logprobs(model, batch(data_rank, vocab), with_entropy=True)
    loss = loss_of(logprobs, entropy, data_rank)
    loss.backward()
    close(logprobs, mine[0], "logprobs")
    close(entropy, mine[1], "entropy")
    close(loss, mine[2], "loss")
    report(f"logprobs_entropy_loss_{size}")
    want = dict(plain.named_parameters())
    for name, param in model.named_parameters():
        close(full(param.grad), want[name].grad, f"gradient of {name}")
    report(f"gradients_{size}")
    if data_ranks == 1:
        check_values(model_dir, group, vocab)


def check_values(model_dir: str, group: sequence_parallel.Group, vocab: int) -> None:
    """A critic (packed_values): values and gradients, one data rank."""
    critic_plain = policy.load_value_model(model_dir, attn_implementation="packed_sdpa")
    with torch.no_grad():  # the fresh head is zero: give it weights so values and gradients are not all 0
        critic_plain.score.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(0))
    critic = policy.load_value_model(model_dir, attn_implementation="packed_sdpa")
    critic.load_state_dict(critic_plain.state_dict())
    critic = sequence_parallel.attach(policy.shard_model(critic), group)
    samples = batch(0, vocab)
    values = policy.completion_values(critic, samples)
    want_values = policy.completion_values(critic_plain, samples)
    close(values, want_values, "values")
    values.square().sum().backward()
    want_values.square().sum().backward()
    grads = {name: p.grad for name, p in critic_plain.named_parameters()}
    for name, param in critic.named_parameters():
        close(full(param.grad), grads[name], f"value gradient of {name}")
    report(f"values_{group.size}")


def png(height: int, width: int, seed: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


def check_vision(vlm_dir: str, size: int) -> None:
    """A Qwen2.5-VL policy: the vision tower runs whole on every rank, its output merged into the whole row, and the
    language model runs sequence-parallel."""
    group = sequence_parallel.make_group(size)
    tokenizer = AutoTokenizer.from_pretrained(vlm_dir)
    prompt = tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many dots? " * 8}]}],
        tokenize=False, add_generation_prompt=True))
    samples = [SimpleNamespace(prompt_ids=prompt, completion_ids=tokenizer.encode(answer * 5), images=[png(60, 90, 0)])
               for answer in ("3 dots, I think. ", "<answer>4</answer>")]
    plain = policy.load_model(vlm_dir, attn_implementation="packed_sdpa")
    want, want_entropy = policy.completion_logprobs(plain, samples, with_entropy=True)
    (want.sum() + want_entropy.sum()).backward()
    model = policy.shard_model(policy.load_model(vlm_dir, attn_implementation="packed_sdpa"))
    model = sequence_parallel.attach(model, group)
    got, entropy = policy.completion_logprobs(model, samples, with_entropy=True)
    (got.sum() + entropy.sum()).backward()
    close(got, want, "vision logprobs")
    close(entropy, want_entropy, "vision entropy")
    grads = {name: p.grad for name, p in plain.named_parameters()}
    for name, param in model.named_parameters():
        close(full(param.grad), grads[name], f"vision gradient of {name}")
    report(f"vision_{size}")


def main(model_dir: str, vlm_dir: str | None = None) -> None:
    rank, world, _ = policy.init_distributed()
    torch.manual_seed(0)
    for size in [n for n in (world, 2) if n > 1 and not world % n][: 2 if world > 2 else 1]:
        check_policy(model_dir, size, rank, world)
    if vlm_dir:
        check_vision(vlm_dir, world)
    if rank == 0:
        print(f"max_rel_err {max(errors):.3e}", flush=True)
    policy.exit_distributed(0)


if __name__ == "__main__":
    main(*sys.argv[1:])
