"""merge.py on a real 2-rank FSDP2 checkpoint (torchrun, gloo): the Hugging Face folder it writes reloads with
`from_pretrained` and generates exactly what the checkpointed model generates; a Qwen2.5-VL checkpoint merges with its
vision tower."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

import merge as merge_lib
import policy
import ranks
import script_runner
import tiny
from checkpoint import save_checkpoint

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i * i)\n",
          "import sys\nprint(sys.stdin.read().upper())\n", "class Stack:\n    def push(self, x):\n        pass\n"] * 20
PROMPTS = ["def add(a, b):", "for i in range(", "import sys\n"]

# Every rank: shard the tiny model, take one optimizer step (so the checkpoint differs from the model on disk),
# checkpoint it, and let rank 0 keep the full weights that were checkpointed, as the reference.
TRAIN_AND_SAVE = textwrap.dedent("""
    import sys, torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    import policy
    from checkpoint import save_checkpoint
    model_dir, out = sys.argv[1], sys.argv[2]
    rank, world, device = policy.init_distributed()
    model = policy.shard_model(policy.load_model(model_dir))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    save_checkpoint(out, 1, model, optimizer, {"step": 1}, hf_source_dir=model_dir)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(full, out + "/checkpointed_weights.pt")
    policy.exit_distributed()
""")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("merge")
    model_dir = tiny.make_tiny_model(tmp / "tiny", CORPUS)
    (tmp / "train_and_save.py").write_text(TRAIN_AND_SAVE)
    run = subprocess.run(ranks.torchrun(2, tmp / "train_and_save.py", model_dir, tmp / "run", standalone=False),
                         capture_output=True, text=True, timeout=600, cwd=ROOT,
                         env=os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    reference.load_state_dict(torch.load(tmp / "run" / "checkpointed_weights.pt"))
    return tmp / "run" / "checkpoints" / "step_00000001", model_dir, reference.eval()


def merge(*args: str) -> subprocess.CompletedProcess:
    return script_runner.run([sys.executable, str(ROOT / "merge.py"), *args, "--device", "cpu"], capture_output=True,
                          text=True, timeout=300)


def greedy(model, tokenizer) -> list[list[int]]:
    out = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out.append(model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist())
    return out


@pytest.mark.slow
def test_fp32_merge_generates_exactly_like_the_checkpoint(checkpoint, tmp_path):
    ckpt, model_dir, reference = checkpoint
    result = merge(str(ckpt), str(tmp_path / "hf"), "--max-shard-size", "40KB")  # the tiny model's float32: default
    assert result.returncode == 0, result.stderr[-3000:]
    assert "max abs logit difference vs the checkpoint: 0 (tolerance" in result.stdout and "for float32)" in result.stdout
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "float32"
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded, with an index
    assert "lm_head.weight" not in index["weight_map"]  # tied to the embedding, as in Qwen2.5 checkpoints
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    for name, tensor in reference.state_dict().items():
        assert torch.equal(merged.state_dict()[name], tensor), name
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert greedy(merged, tokenizer) == greedy(reference, AutoTokenizer.from_pretrained(model_dir))
    messages = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == AutoTokenizer.from_pretrained(
        model_dir).apply_chat_template(messages, tokenize=False)
    assert merged.generation_config.eos_token_id == reference.generation_config.eos_token_id


@pytest.mark.slow
def test_bf16_merge_within_tolerance_and_refused_past_it(checkpoint, tmp_path):
    ckpt, _, reference = checkpoint
    result = merge(str(ckpt), str(tmp_path / "hf"), "--dtype", "bfloat16")
    assert result.returncode == 0, result.stderr[-3000:]
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    embed = reference.model.embed_tokens.weight
    assert torch.equal(merged.model.embed_tokens.weight, embed.to(torch.bfloat16).float())
    # bf16 rounding moves the logits a little: a zero tolerance must fail, loudly
    strict = merge(str(ckpt), str(tmp_path / "strict"), "--dtype", "bfloat16", "--tolerance", "0")
    assert strict.returncode == 1 and "logits differ from the checkpoint by" in strict.stderr


@pytest.mark.parametrize("config, dtype", [({"dtype": "bfloat16"}, "bfloat16"), ({"torch_dtype": "float16"}, "float16"),
                                           ({"dtype": "float32"}, "float32"), ({}, "float32")])
def test_the_runs_dtype_is_the_default(tmp_path, config, dtype):
    """An fp32 run merges to fp32 and a bf16 hub model's run to bf16, unless --dtype says otherwise."""
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    assert merge_lib.run_dtype(tmp_path) == dtype


def test_not_a_checkpoint(tmp_path):
    result = merge(str(tmp_path), str(tmp_path / "out"))
    assert result.returncode == 1 and ".metadata missing" in result.stderr


def test_vision_language_checkpoint_merges_with_its_vision_tower(tmp_path):
    """A Qwen2.5-VL checkpoint saved the way the trainers save one (weights moved off the folder's, vision tower
    included) merges into a folder that reloads as a vision-language model with the checkpoint's logits on an image
    prompt, not the original folder's."""
    model_dir = tiny.make_tiny_vlm(tmp_path / "tiny_vl", ["<answer>red</answer> It is 3."] * 50)
    created = not dist.is_initialized()
    policy.init_distributed()
    try:
        model = policy.load_model(model_dir)
        torch.manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        saved = save_checkpoint(tmp_path / "run", 3, model, torch.optim.AdamW(model.parameters()), {"step": 3},
                                hf_source_dir=model_dir)
    finally:
        if created:
            dist.destroy_process_group()
    assert merge_lib.merge(merge_lib.Args(saved, tmp_path / "hf", dtype="float32", device="cpu")) == 0
    merged = AutoModelForImageTextToText.from_pretrained(tmp_path / "hf").eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    image_prompt = merge_lib.verification_inputs(merged, tokenizer)[-1]
    assert image_prompt["pixel_values"].shape[0] > 0
    with torch.no_grad():
        got, want, original = (m.eval()(**image_prompt).logits for m in (merged, model, policy.load_model(model_dir)))
    assert torch.equal(got, want) and not torch.allclose(got, original, atol=1e-3)
