"""policy.py and checkpoint.py under 2-rank FSDP2 on gloo, every distributed check in one launch (imports dominate
the cost):

    torchrun --nproc-per-node 2 tests/dist_policy.py MODEL_DIR OUT_DIR

Rank 0 prints `ok <check>` for each check that passed on every rank; any failure raises (non-zero exit).
"""

import random
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

import collectives
import engines
import policy
from checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, save_hf


def local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def report(name: str) -> None:
    dist.barrier()  # a rank that failed never gets here, so rank 0's line means every rank passed
    if dist.get_rank() == 0:
        print(f"ok {name}", flush=True)


def draws() -> tuple:
    return torch.rand(4).tolist(), random.random(), float(np.random.rand())


def weighted_loss(logprobs, entropy, rank):
    # Fixed random weights so every token's gradient matters, different on each rank.
    gen = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(len(logprobs), generator=gen) * logprobs).sum() + (
        torch.randn(len(entropy), generator=gen) * entropy).sum()


def main(model_dir: str, out_dir: str) -> None:
    rank, world, device = policy.init_distributed()
    assert (world, device.type) == (2, "cpu"), (world, device)
    torch.manual_seed(rank)
    sequences = [torch.randint(6, 500, (n,)).tolist() for n in (7 + rank, 3, 12 - rank)]  # differ across ranks

    reference = policy.load_model(model_dir)
    model = policy.shard_model(policy.load_model(model_dir), activation_checkpointing="full")
    assert isinstance(model.model.layers[0].self_attn.q_proj.weight, DTensor)
    names = [n for n, _ in model.named_parameters()]
    assert names == [n for n, _ in reference.named_parameters()], "sharding must keep Hugging Face names"

    # iter_full_weights: HF names, full tensors on every rank, each equal to the unsharded model's parameter.
    weights = dict(policy.iter_full_weights(model))
    expected = dict(reference.named_parameters())
    assert sorted(weights) == sorted(expected), sorted(set(weights) ^ set(expected))
    assert "lm_head.weight" not in weights  # tied: HF checkpoints carry only the embeddings
    for name, tensor in weights.items():
        assert tensor.shape == expected[name].shape and torch.equal(tensor, expected[name]), name
    full_sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if rank == 0:
        assert all(torch.equal(weights[n], full_sd[n]) for n in weights)
        assert set(full_sd) - set(weights) == {"lm_head.weight"}
    report("iter_full_weights")

    # same_count_on_every_rank: a rank with fewer micro-batches gets empty ones, up to the busiest rank's count.
    mine = [[0], [1], [2]][: 3 - 2 * rank]  # rank 0: three, rank 1: one
    assert collectives.same_count_on_every_rank(mine) == mine + [[]] * (2 * rank)
    report("same_micro_batch_count")

    # packed_logprobs: the sharded model gives the unsharded model's numbers, with and without grad.
    with torch.no_grad():
        lp, ent = policy.packed_logprobs(model, sequences, temperature=0.8, chunk_size=5, with_entropy=True)
        ref_lp, ref_ent = policy.packed_logprobs(reference, sequences, temperature=0.8, with_entropy=True)
    assert not lp.requires_grad
    torch.testing.assert_close(lp, ref_lp, atol=1e-6, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-6, rtol=0)
    report("packed_logprobs_sharded")

    # HFEngine on the sharded model: an unsharded replica filled by load_weights, so ranks decode on their own (here
    # for different numbers of tokens, which per-token all-gathers could not survive); greedy tokens and logprobs
    # are the unsharded model's, and the policy stays sharded.
    sampling = engines.Sampling(max_new_tokens=4 + 5 * rank, temperature=0.0)
    engine = engines.HFEngine(model, pad_token_id=0)
    try:
        engine.generate(sequences, sampling)
        raise AssertionError("generate before load_weights must fail")
    except RuntimeError as e:
        assert "load_weights" in str(e)
    engine.load_weights(policy.iter_full_weights(model))
    got = engine.generate(sequences[: 3 - 2 * rank], sampling)
    want = engines.HFEngine(reference, pad_token_id=0).generate(sequences[: 3 - 2 * rank], sampling)
    assert [c.token_ids for c in got] == [c.token_ids for c in want] and len(got[0].token_ids) == 4 + 5 * rank
    for a, b in zip(got, want):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    report("hf_engine_sharded")

    # Gradients through the chunked head + FSDP2 + activation checkpointing equal the rank-averaged reference ones.
    lp, ent = policy.packed_logprobs(model, sequences, temperature=0.8, chunk_size=5, with_entropy=True)
    weighted_loss(lp, ent, rank).backward()
    ref_lp, ref_ent = policy.packed_logprobs(reference, sequences, temperature=0.8, with_entropy=True)
    weighted_loss(ref_lp, ref_ent, rank).backward()
    ref_grads = {}
    for name, p in reference.named_parameters():
        dist.all_reduce(p.grad)
        ref_grads[name] = p.grad / world
    for name, p in model.named_parameters():
        torch.testing.assert_close(full(p.grad), ref_grads[name], atol=1e-6, rtol=1e-5, msg=name)
    report("gradients_sharded")

    ref_norm = torch.stack([g.norm() for g in ref_grads.values()]).norm().item()
    norm = policy.clip_grad_norm(model, 1e9)
    assert isinstance(norm, float) and abs(norm - ref_norm) < 1e-5 * ref_norm, (norm, ref_norm)
    report("clip_grad_norm")

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    before = {n: full(p) for n, p in model.named_parameters()}
    optimizer.step()
    scheduler.step()
    assert all(not torch.equal(full(p), before[n]) for n, p in model.named_parameters())
    report("train_step_changes_params")

    # Checkpoint: save, perturb (another step, more draws), load -> bit-exact state and the same RNG streams.
    state = {"step": 1, "data_pos": 8, "scheduler": scheduler.state_dict()}
    path = save_checkpoint(out_dir, 1, model, optimizer, state, hf_source_dir=model_dir)
    after_save = draws()
    saved_params = {n: local(p) for n, p in model.named_parameters()}
    saved_optim = {(i, k): local(v) for i, s in optimizer.state.items() for k, v in s.items()}
    assert path == Path(out_dir) / "checkpoints" / "step_00000001" and latest_checkpoint(out_dir) == path
    for f in (".metadata", "trainer_state.json", f"rng/rank{rank}.pt", "hf/config.json", "hf/generation_config.json",
              "hf/tokenizer.json", "hf/tokenizer_config.json", "hf/chat_template.jinja"):
        assert (path / f).is_file(), f
    assert not (path / "hf" / "model.safetensors").exists()
    lp, ent = policy.packed_logprobs(model, sequences, with_entropy=True)
    weighted_loss(lp, ent, rank).backward()
    optimizer.step()
    scheduler.step()
    draws()
    assert any(not torch.equal(local(p), saved_params[n]) for n, p in model.named_parameters())
    restored = load_checkpoint(path, model, optimizer)
    assert restored == state, restored
    for n, p in model.named_parameters():
        assert torch.equal(local(p), saved_params[n]), n
    assert {(i, k): local(v) for i, s in optimizer.state.items() for k, v in s.items()}.keys() == saved_optim.keys()
    for (i, k), v in saved_optim.items():
        assert torch.equal(local(optimizer.state[i][k]), v), (i, k)
    assert draws() == after_save
    report("checkpoint_roundtrip")

    # Saving the same step again (a resumed run) replaces it; keep_last prunes older ones.
    save_checkpoint(out_dir, 2, model, optimizer, state | {"step": 2}, hf_source_dir=model_dir)
    save_checkpoint(out_dir, 2, model, optimizer, state | {"step": 2}, hf_source_dir=model_dir, keep_last=1)
    assert [p.name for p in (Path(out_dir) / "checkpoints").iterdir()] == ["step_00000002"]
    report("checkpoint_resave_and_prune")

    # save_hf: a Hugging Face folder that loads back into exactly the current weights.
    hf = save_hf(model, model_dir, Path(out_dir) / "hf_final")
    reloaded = policy.load_model(hf)
    for name, tensor in policy.iter_full_weights(model):
        assert torch.equal(dict(reloaded.named_parameters())[name], tensor), name
    report("save_hf")

    # bf16 mixed precision: bf16 weights streamed, logprobs close to fp32, gradients flow to the fp32 masters.
    mixed = policy.shard_model(policy.load_model(model_dir), mixed_precision=True)
    weights = dict(policy.iter_full_weights(mixed))
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    assert torch.equal(weights["model.norm.weight"], expected["model.norm.weight"].to(torch.bfloat16))
    lp, ent = policy.packed_logprobs(mixed, sequences, temperature=0.8, with_entropy=True)
    torch.testing.assert_close(lp.detach(), ref_lp.detach(), atol=0.05, rtol=0)
    weighted_loss(lp, ent, rank).backward()
    grad = mixed.model.embed_tokens.weight.grad
    assert grad.dtype == torch.float32 and full(grad).abs().sum() > 0
    report("mixed_precision")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    policy.exit_distributed()
