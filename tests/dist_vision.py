"""A Qwen2.5-VL policy under 2-rank FSDP2 on gloo, every check in one launch:

    torchrun --nproc-per-node 2 tests/dist_vision.py MODEL_DIR

Rank 0's micro-batches hold images, rank 1's none (and rank 1 also runs an idle one): without the blank image sequence
rank 1 would skip the vision tower's FSDP units and the collectives would mismatch. Rank 0 prints `ok <check>` for
each check that passed on every rank; any failure raises (non-zero exit).
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

import engines
import policy


def report(name: str) -> None:
    dist.barrier()  # a rank that failed never gets here, so rank 0's line means every rank passed
    if dist.get_rank() == 0:
        print(f"ok {name}", flush=True)


def png(height: int, width: int, seed: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


def scrambled(model):
    torch.manual_seed(0)  # the same weights on every rank and in the reference
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0, 0.3)
    return model


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def main(model_dir: str) -> None:
    rank, world, device = policy.init_distributed()
    assert (world, device.type) == (2, "cpu"), (world, device)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    reference = scrambled(policy.load_model(model_dir))
    model = policy.shard_model(scrambled(policy.load_model(model_dir, attn_implementation="packed_sdpa")))

    def turn(*parts):
        content = [{"type": "image"} if p == "I" else {"type": "text", "text": p} for p in parts]
        return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                              add_generation_prompt=True))

    if rank == 0:
        question, images = turn("I", "How many dots?", "I"), [png(37, 91, 0), png(64, 64, 1)]
        samples = [SimpleNamespace(prompt_ids=question, completion_ids=tokenizer.encode(answer),
                                   images=images) for answer in ("3", "<answer>4</answer>")]
    else:
        samples = [SimpleNamespace(prompt_ids=turn("Just text."), completion_ids=tokenizer.encode("def f(x): 1"),
                                   images=[])]

    text_only = policy._packed_row(model, [turn("No image.")], [3], False)
    assert len(text_only.vision_inputs["image_grid_thw"]) == 1 and text_only.targets.numel() == len(turn("No image."))-3
    report("blank_image_when_none")

    before = {name: full(p) for name, p in model.named_parameters() if ".visual." in name}
    logprobs, entropy = policy.completion_logprobs(model, samples, with_entropy=True)
    with torch.no_grad():
        want, _ = policy.completion_logprobs(reference, samples)
    torch.testing.assert_close(logprobs.detach(), want, atol=1e-5, rtol=1e-5)
    (logprobs.sum() + entropy.sum()).backward()
    # a second micro-batch: rank 0 another image sample, rank 1 an idle one (the text-only idle sequence)
    more, _ = policy.completion_logprobs(model, samples[:1] if rank == 0 else [])
    more.sum().backward()
    report("logprobs_sharded")

    grads = {name: full(p.grad) for name, p in model.named_parameters() if ".visual." in name}
    assert all(g.abs().sum() > 0 for name, g in grads.items() if "patch_embed" in name or "merger" in name), \
        {name: float(g.abs().sum()) for name, g in grads.items()}
    report("vision_gradients")

    optimizer = policy.adamw(model, lr=1e-2, weight_decay=0.0)
    policy.step_if_finite(optimizer, policy.clip_grad_norm(model, 1.0), "actor")
    changed = [name for name, p in model.named_parameters() if ".visual." in name and
               not torch.equal(full(p), before[name])]
    assert len(changed) == len(before), sorted(set(before) - set(changed))[:5]
    report("vision_weights_change")

    engine = engines.HFEngine(model, tokenizer.pad_token_id)
    engine.load_weights(policy.iter_full_weights(model))
    reference.load_state_dict({name: full(p) for name, p in model.named_parameters()}, strict=False)
    prompts, images = [s.prompt_ids for s in samples], [s.images for s in samples]
    sampling = engines.Sampling(max_new_tokens=8, temperature=0)
    got = engine.generate(prompts, sampling, images=images)
    want = engines.HFEngine(reference, tokenizer.pad_token_id).generate(prompts, sampling, images=images)
    assert [c.token_ids for c in got] == [c.token_ids for c in want], ([c.token_ids for c in got],
                                                                        [c.token_ids for c in want])
    report("hf_engine_sharded")
    policy.exit_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
