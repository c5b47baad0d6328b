"""LoRA (--lora-rank, PEFT): the adapted model computes exactly a hand-built low-rank update, loss and gradients;
SFT's checkpoints hold the adapters alone, resume exactly and merge.py merges them (as save_hf's hf/ does); a GRPO
run syncs its HF engine with the adapters alone after the first load, and its replica then generates as the policy;
a 2-rank torchrun GRPO run with LoRA trains under FSDP2 and checkpoints its adapters. That LoRA GRPO learns make demo's
task is `python demo.py --lora-rank 16 ...` (bench/RESULTS.md), minutes rather than seconds."""
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.nn.utils import parametrize

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import data_prep  # noqa: E402
import merge  # noqa: E402
import policy  # noqa: E402
import ranks  # noqa: E402
import task_rows  # noqa: E402
import tiny  # noqa: E402
import train_grpo  # noqa: E402
import train_sft  # noqa: E402
import vision  # noqa: E402
from test_grpo import Score, metrics_by_step  # noqa: E402
from test_sft import vision_conversations  # noqa: E402

CORPUS = ["def f(x):\n    return x + 1\n", "Write f that adds one.\n", "print(f(2))\n"] * 20
SEQUENCES = [[7, 20, 31, 44, 52, 60, 75], [9, 21, 32, 40, 18, 90]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny.make_tiny_model(tmp_path_factory.mktemp("lora") / "model", CORPUS, seed=0)


class LowRank(torch.nn.Module):
    """weight -> weight + scale * B @ A, A and B leaves of their own: the update LoRA claims to be."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, scale: float):
        super().__init__()
        self.a, self.b, self.scale = torch.nn.Parameter(a.clone()), torch.nn.Parameter(b.clone()), scale

    def forward(self, weight):
        return weight + self.scale * self.b @ self.a


def test_lora_equals_a_hand_built_low_rank_update(model_dir):
    """Rank 4, alpha 8, on q_proj and down_proj, B made non-zero: the LoRA model's logprob loss and its adapters'
    gradients are those of the plain model whose weights are W + 2 B A with A and B as leaves; the base gets none."""
    rank, alpha = 4, 8.0
    model = policy.add_lora(policy.load_model(model_dir), rank, alpha, "q_proj,down_proj", seed=3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(std=0.05)
    adapted = {name.removesuffix(".base_layer.weight") for name, _ in model.named_parameters()
               if name.endswith(".base_layer.weight")}
    assert len(adapted) == 2 * model.config.num_hidden_layers
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        f"{layer}.lora_{ab}.default.weight" for layer in adapted for ab in "AB"}
    hand = policy.load_model(model_dir)
    for p in hand.parameters():
        p.requires_grad_(False)
    params = dict(model.named_parameters())
    for layer in adapted:
        parametrize.register_parametrization(hand.get_submodule(layer), "weight", LowRank(
            params[f"{layer}.lora_A.default.weight"].detach(), params[f"{layer}.lora_B.default.weight"].detach(),
            alpha / rank))

    def loss(m):
        logprobs, _ = policy.packed_logprobs(m, SEQUENCES, score_from=[2, 3])
        return -logprobs.sum()

    lora_loss, hand_loss = loss(model), loss(hand)
    lora_loss.backward()
    hand_loss.backward()
    assert lora_loss.item() == pytest.approx(hand_loss.item(), rel=1e-6) and lora_loss.item() > 0
    for layer in adapted:
        low_rank = hand.get_submodule(layer).parametrizations.weight[0]
        for ab, mine in (("A", low_rank.a), ("B", low_rank.b)):
            grad = params[f"{layer}.lora_{ab}.default.weight"].grad
            assert grad.abs().sum() > 0
            torch.testing.assert_close(grad, mine.grad, rtol=1e-4, atol=1e-6)
    assert all(p.grad is None for n, p in model.named_parameters() if not p.requires_grad)
    optimizer = policy.adamw(model, 1e-3, 0.0)
    assert sum(len(g["params"]) for g in optimizer.param_groups) == 4 * model.config.num_hidden_layers


def test_sft_checkpoints_hold_the_adapters_resume_exactly_and_merge(model_dir, tmp_path):
    """4 LoRA SFT steps, checkpoints at 2 and 4: their DCP model entries are the adapters alone (PEFT's
    adapter_config.json names the base); resuming at 2 replays steps 3-4 exactly; merge.py's PEFT merge passes its
    logit check and equals the hf/ folder save_hf merged; the merged model is not the base."""
    rows = data_prep.toy_rows(40, 2, seed=0, max_ops=2)[0]
    task_rows.write_rows(rows, tmp_path / "train.parquet")
    args = train_sft.Args(model=str(model_dir), data=str(tmp_path / "train.parquet"), output_dir=str(tmp_path / "a"),
                          steps=4, save_every=2, lr=1e-2, batch_size=8, lora_rank=8, lora_alpha=16)
    train_sft.main(args)
    checkpoints = tmp_path / "a" / "checkpoints"
    metadata = dcp.FileSystemReader(str(checkpoints / "step_00000004")).read_metadata().state_dict_metadata
    model_keys = {k for k in metadata if k.startswith("model.")}
    assert model_keys and all(".lora_A.default." in k or ".lora_B.default." in k for k in model_keys)
    config = json.loads((checkpoints / "step_00000004" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (8, 16, str(model_dir.resolve()))

    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "step_00000004")
    train_sft.main(train_sft.Args(**{**vars(args), "output_dir": str(tmp_path / "b"), "resume": True}))
    straight, resumed = ([json.loads(line) for line in open(tmp_path / run / "metrics.jsonl")] for run in "ab")
    assert [m["train/loss"] for m in resumed[-2:]] == [m["train/loss"] for m in straight[-2:]]
    assert [m["step"] for m in resumed[-2:]] == [3, 4]

    diff = merge.merge(merge.Args(checkpoints / "step_00000004", tmp_path / "merged", device="cpu"))
    assert diff < 1e-4
    merged, saved, base = (policy.load_model(path) for path in (tmp_path / "merged", tmp_path / "a" / "hf", model_dir))
    changed = 0
    for (name, m), s, b in zip(merged.state_dict().items(), saved.state_dict().values(), base.state_dict().values()):
        torch.testing.assert_close(m, s, rtol=1e-5, atol=1e-6, msg=name)
        changed += not torch.equal(m, b)
    assert changed == 7 * merged.config.num_hidden_layers  # all-linear: q, k, v, o, gate, up, down
    # generate.py samples a LoRA checkpoint as this merged model
    for (name, m), c in zip(merged.state_dict().items(), merge.checkpoint_model(checkpoints / "step_00000004")
                            .state_dict().values()):
        torch.testing.assert_close(m, c, rtol=1e-5, atol=1e-6, msg=name)
    with pytest.raises(ValueError, match="not a model folder here"):
        broken = tmp_path / "broken"
        shutil.copytree(checkpoints / "step_00000004", broken)
        (broken / "adapter_config.json").write_text(json.dumps(config | {"base_model_name_or_path": "/nowhere"}))
        merge.merge(merge.Args(broken, tmp_path / "never", device="cpu"))


def toy_task(root: Path) -> Path:
    train, _ = data_prep.toy_rows(60, 2, seed=0, max_ops=2)
    task_rows.write_rows(train, root / "train.parquet")
    return root / "train.parquet"


def test_grpo_syncs_adapters_alone_and_the_replica_generates_as_the_policy(model_dir, tmp_path):
    """Three GRPO steps with --lora-rank 4 in one process (FSDP2, the HF engine's replica): the first sync sends the
    whole model (the replica is built), the next ones exactly the adapters' bytes; after the last sync the replica's
    logits are the (gathered) policy's."""
    data = toy_task(tmp_path)

    def x_fraction(rows, texts, sample_infos=None):
        return [Score(t.count("x") / max(1, len(t)), {}) for t in texts]

    args = train_grpo.Args(model=str(model_dir), data=str(data), output_dir=str(tmp_path / "out"), total_steps=3,
                           max_new_tokens=8, lr=1e-2, prompts_per_step=2, group_size=4, save_every=1000,
                           sample_every=0, lora_rank=4, lora_alpha=8)
    run = train_grpo.main(args, score_fn=x_fraction)
    steps = metrics_by_step(tmp_path / "out")
    adapters = dict(policy.iter_adapter_weights(run.model))
    adapter_bytes = sum(t.nbytes for t in adapters.values())
    full_bytes = sum(t.nbytes for _, t in policy.iter_full_weights(run.model))
    assert [steps[s]["weight_sync/bytes"] for s in (1, 2, 3)] == [full_bytes, adapter_bytes, adapter_bytes]
    assert adapter_bytes < full_bytes / 5 and all(steps[s]["timing_s/weight_sync"] > 0 for s in (1, 2, 3))
    assert any(t.abs().sum() > 0 for n, t in adapters.items() if ".lora_B." in n)  # the adapters were trained
    # the replica holds the adapters of the last sync (before step 3's update): sync once more, as a step would
    run.engine.load_adapter(policy.iter_adapter_weights(run.model), policy.lora_config(run.model))
    ids = torch.tensor([SEQUENCES[0]])
    plain = policy.load_model(model_dir)
    plain.load_state_dict(policy.merge_adapters(dict(policy.iter_full_weights(run.model)),
                                                policy.lora_config(run.model)), strict=False)
    with torch.no_grad():
        torch.testing.assert_close(run.engine.model(input_ids=ids).logits, plain(input_ids=ids).logits,
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_two_ranks_train_adapters_under_fsdp2(model_dir, tmp_path):
    """torchrun, 2 ranks, GRPO with --lora-rank 8 on toy tasks with the sandboxed code reward: every step has a
    gradient, the syncs after the first send the adapters alone, the checkpoint holds the adapters (the same ones
    on every rank: one DCP entry each) and merges. ~60 s on 2 cores."""
    data = toy_task(tmp_path)
    out = tmp_path / "run"
    subprocess.run([*ranks.torchrun(2, ROOT / "train_grpo.py"), "--model", str(model_dir), "--data", str(data),
                    "--output-dir", str(out), "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "32",
                    "--lr", "1e-2", "--total-steps", "3", "--save-every", "3", "--lora-rank", "8", "--seed", "1"],
                   check=True, env=dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1"), timeout=600)
    steps = metrics_by_step(out)
    assert sorted(steps) == [1, 2, 3] and all(math.isfinite(m["actor/pg_loss"]) for m in steps.values())
    assert steps[2]["weight_sync/bytes"] == steps[3]["weight_sync/bytes"] < steps[1]["weight_sync/bytes"] / 5
    checkpoint = out / "checkpoints" / "step_00000003"
    assert (checkpoint / "adapter_config.json").is_file()
    assert merge.merge(merge.Args(checkpoint, tmp_path / "merged", device="cpu")) < 1e-4


def test_vision_model_trains_adapters_and_merges(tmp_path):
    """A tiny Qwen2.5-VL through LoRA SFT (all-linear: the vision tower's linear layers get adapters too) on CodeV-style
    conversations with images: the loss falls, hf/ is the merged vision model, and merge.py's PEFT merge of the
    checkpoint passes its logit check (an image prompt among them) and equals hf/."""
    vlm_dir = tiny.make_tiny_vlm(tmp_path / "model", ["<answer>3</answer>", "How many red dots are there?"] * 50,
                                 seed=0)
    data = tmp_path / "conversations.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in vision_conversations(tmp_path)))
    train_sft.main(train_sft.Args(model=str(vlm_dir), data=str(data), output_dir=str(tmp_path / "out"), steps=6,
                                  batch_size=2, lr=1e-2, lora_rank=8))
    losses = [json.loads(line)["train/loss"] for line in open(tmp_path / "out" / "metrics.jsonl")]
    assert losses == sorted(losses, reverse=True) and losses[-1] < losses[0] - 0.2, losses  # B starts at 0: slowly
    assert merge.merge(merge.Args(tmp_path / "out" / "checkpoints" / "step_00000006", tmp_path / "merged",
                                  device="cpu")) < 1e-4
    merged, saved = policy.load_model(tmp_path / "merged"), policy.load_model(tmp_path / "out" / "hf")
    assert vision.is_vision_model(saved.config)
    for (name, m), s in zip(merged.state_dict().items(), saved.state_dict().values()):
        torch.testing.assert_close(m, s, rtol=1e-5, atol=1e-6, msg=name)
