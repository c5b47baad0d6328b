"""The vision-language model side: the tiny Qwen2.5-VL, placeholder expansion against transformers' processor, packed
multimodal logprobs against per-sequence forwards, the placeholder ban in the trainer and HFEngine, HFEngine with
images against the model's own generate; the FSDP2 checks run in one torchrun launch (tests/dist_vision.py)."""

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from PIL import Image
from transformers import AutoImageProcessor, AutoTokenizer, Qwen2_5_VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.processing_utils import ProcessorMixin

import chat
import data_prep
import engines
import generate
import policy
import ranks
import task_rows
import tiny
import vision

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ["def f(x):\n    return x + 1\n", "<answer>red</answer>", "The answer is 3 dots.",
          "How many dots are there in the picture?", "<code>print(image.size)</code>"] * 100


def png(height: int, width: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return tiny.make_tiny_vlm(tmp_path_factory.mktemp("tiny_vl"), CORPUS, seed=1)


@pytest.fixture(scope="module")
def tokenizer(vlm_dir):
    return AutoTokenizer.from_pretrained(vlm_dir)


def prompt(tokenizer, *parts) -> list[int]:
    """A user turn of text and images ("I") as the chat template renders it: one placeholder per image."""
    content = [{"type": "image"} if p == "I" else {"type": "text", "text": p} for p in parts]
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text)


def scrambled(model, seed: int = 0, std: float = 0.3):
    """The model with larger random weights: greedy choices then depend on every position and image (the tiny
    model's init answers one token whatever it sees)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0, std)
    return model


def test_tiny_vlm_is_a_qwen25_vl(vlm_dir, tokenizer):
    """Qwen2.5-VL's classes, weight names (what vLLM 0.32 maps), placeholder ids, chat template and image processor."""
    model = policy.load_model(vlm_dir, attn_implementation="packed_sdpa")
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    names = {name.split(".")[1] for name, _ in model.named_parameters() if name.startswith("model.")}
    assert names == {"visual", "language_model"}
    assert model.config.tie_word_embeddings and vision.banned_token_ids(model.config) == [
        tokenizer.convert_tokens_to_ids("<|image_pad|>"), tokenizer.convert_tokens_to_ids("<|video_pad|>")]
    assert vision.text_attention(model.config) == "packed_sdpa" and policy.shares_prefixes(model)
    assert model.config.vision_config._attn_implementation == "sdpa"
    text = tokenizer.decode(prompt(tokenizer, "I", "How many?"))
    assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                    "<|vision_start|><|image_pad|><|vision_end|>How many?<|im_end|>\n<|im_start|>assistant\n")
    assert type(vision.processor_for(model.config)).__name__ == "Qwen2VLImageProcessorPil"  # no torchvision here
    with pytest.raises(ValueError, match="cannot train with flex_attention"):
        policy.check_attention(str(vlm_dir), "flex_attention")
    policy.check_attention(str(vlm_dir), "packed_sdpa")


@pytest.mark.parametrize("sizes", [[], [(37, 91)], [(300, 201), (10, 40), (64, 57)]])
def test_expansion_equals_the_processor(vlm_dir, tokenizer, monkeypatch, sizes):
    """kiln's expansion of one placeholder per image gives Qwen2_5_VLProcessor's ids, image-token types and pixels
    (bit-equal) for 0, 1 and 3 images of odd sizes (a 10x40 one scaled up to the 28-pixel minimum by load_image, as
    the rollout and model do); image_tokens counts each image's share."""
    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: type(arg))
    processor = AutoImageProcessor.from_pretrained(vlm_dir)
    reference = Qwen2_5_VLProcessor(image_processor=processor, tokenizer=tokenizer, video_processor=object())
    images = [vision.load_image(png(h, w, i)) for i, (h, w) in enumerate(sizes)]
    text = tokenizer.decode(prompt(tokenizer, *(["I", "Count them"] * len(sizes) or ["no image"])))
    want = reference(text=[text], images=images or None, return_tensors="pt")
    ids = tokenizer.encode(text)
    if images:
        pixel_values, grid = vision.pixels(vision.image_processor(str(vlm_dir)), images)
        assert torch.equal(pixel_values, want["pixel_values"]) and torch.equal(grid, want["image_grid_thw"])
        expanded, where = vision.expand(ids, grid, tokenizer.convert_tokens_to_ids("<|image_pad|>"), 2)
        assert [vision.image_tokens(processor, image) for image in images] == [int(g.prod()) // 4 for g in grid]
    else:
        expanded, where = ids, list(range(len(ids)))
    assert expanded == want["input_ids"][0].tolist()
    assert [expanded[w] for w in where] == ids  # each original token keeps its id
    image_pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert [int(t == image_pad) for t in expanded] == want["mm_token_type_ids"][0].tolist()


def test_image_limits():
    """A side under 28 pixels is scaled up (aspect kept), an aspect ratio over 100 refused, 100 accepted, transparency
    flattened onto white."""
    assert vision.load_image(png(10, 40, 0)).size == (112, 28)
    clear = io.BytesIO()
    Image.new("RGBA", (30, 30), (255, 0, 0, 0)).save(clear, format="PNG")
    assert vision.load_image(clear.getvalue()).getpixel((3, 3)) == (255, 255, 255)
    assert vision.load_image(png(28, 2800, 0)).size == (2800, 28)
    with pytest.raises(ValueError, match="aspect ratio over 100"):
        vision.load_image(png(28, 2829, 0))
    with pytest.raises(ValueError, match="2 image placeholders but 1 images"):
        vision.expand([5, 1, 5], torch.tensor([[1, 2, 2]]), 5, 2)


def rows(tokenizer):
    """Sequences (prompt + completion) of 2, 0 and 1 prompt images, a branch sharing the 2-image prompt, and a branch
    of the 1-image prompt whose completion holds a tool's image; their images and prompt lengths."""
    two, none, one = prompt(tokenizer, "I", "How many dots?", "I"), prompt(tokenizer, "Just text."), \
        prompt(tokenizer, "I", "What colour?")
    image_pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    tool_turn = tokenizer.encode("<code>print(1)</code><|im_end|>\n<|im_start|>user\n<sandbox_output>") + [
        tokenizer.convert_tokens_to_ids("<|vision_start|>"), image_pad,
        tokenizer.convert_tokens_to_ids("<|vision_end|>")] + tokenizer.encode("</sandbox_output><|im_end|>\n"
                                                                              "<|im_start|>assistant\nred")
    a, b, c = [png(37, 91, 0), png(300, 201, 1)], [png(64, 64, 2)], [png(90, 45, 3)]
    sequences = [two + tokenizer.encode("The answer is 3"), none + tokenizer.encode("def f(x): return 1"),
                 one + tokenizer.encode("<answer>red</answer>"), two + tokenizer.encode("<answer>7</answer>"),
                 one + tool_turn]
    images = [a, [], b, a, b + c]
    return sequences, images, [len(two), len(none), len(one), len(two), len(one)]


def test_packed_multimodal_equals_per_sequence(vlm_dir, tokenizer):
    """One packed forward of rows mixing 0, 1 and 2 images with shared-prompt branches (one holding a tool image in
    its completion): the logprobs, entropies and vision-tower gradients of separate per-sequence forwards; the row
    carries each distinct image once (branches do not repeat their prompt's)."""
    model = scrambled(policy.load_model(vlm_dir, attn_implementation="packed_sdpa"))
    sequences, images, prompts = rows(tokenizer)
    row = policy._packed_row(model, sequences, prompts, True, images)
    assert len(row.vision_inputs["image_grid_thw"]) == 4  # a's 2, b, c: the branches' shared prompts run once
    assert row.positions.shape[:2] == (4, 1) and row.ids.shape[1] < sum(
        len(vision.expand(s, vision.pixels(vision.processor_for(model.config), i)[1], 5, 2)[0]) if i else len(s)
        for s, i in zip(sequences, images))
    packed, entropy = policy.packed_logprobs(model, sequences, score_from=prompts, share_prefixes=True,
                                             images=images, with_entropy=True)
    (packed.sum() + entropy.sum()).backward()
    packed_grad = model.model.visual.patch_embed.proj.weight.grad.clone()
    model.zero_grad()
    singles = [policy.packed_logprobs(model, [s], score_from=[p], images=[i], with_entropy=True)
               for s, i, p in zip(sequences, images, prompts)]
    sum(lp.sum() + ent.sum() for lp, ent in singles).backward()
    torch.testing.assert_close(packed, torch.cat([lp for lp, _ in singles]), atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, torch.cat([ent for _, ent in singles]), atol=1e-5, rtol=0)
    torch.testing.assert_close(packed_grad, model.model.visual.patch_embed.proj.weight.grad, atol=1e-5, rtol=1e-4)
    assert packed_grad.abs().sum() > 0
    offsets = np.cumsum([0] + [len(s) for s in sequences])
    tool_pad = offsets[4] + sequences[4].index(5, prompts[4])
    assert packed[tool_pad] == 0 and (packed[offsets[4] + prompts[4] : tool_pad] != 0).all()


def test_text_positions_in_every_row_do_not_match(vlm_dir, tokenizer, monkeypatch):
    """The classic packing bug, text positions given to mrope's rows too: the packed logprobs then differ from the
    per-sequence forwards, so the equality above is a test that can fail."""
    model = scrambled(policy.load_model(vlm_dir, attn_implementation="packed_sdpa"))
    sequences, images, prompts = rows(tokenizer)
    with torch.no_grad():
        want = torch.cat([policy.packed_logprobs(model, [s], score_from=[p], images=[i])[0]
                          for s, i, p in zip(sequences, images, prompts)])
        monkeypatch.setattr(vision, "rope_positions", lambda model, ids, grids: torch.arange(len(ids)).expand(3, -1))
        wrong, _ = policy.packed_logprobs(model, sequences, score_from=prompts, share_prefixes=True, images=images)
    assert (wrong - want).abs().max() > 1e-3


def pad_loving(model, tokenizer, sequence: list[int], images: list):
    """The model with the <|image_pad|> output row pointed along the last hidden state of `sequence`: unbanned, it is
    by far the most likely next token."""
    image_pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    with torch.no_grad():
        processor = vision.processor_for(model.config)
        pixel_values, grid = vision.pixels(processor, images)
        ids = torch.tensor([vision.expand(sequence, grid, image_pad, 2)[0]])
        hidden = model.model(input_ids=ids, pixel_values=pixel_values, image_grid_thw=grid,
                             mm_token_type_ids=(ids == image_pad).int()).last_hidden_state[0, -1]
        model.lm_head.weight[image_pad] = 50 * hidden / hidden.norm()  # tied: also the placeholder's embedding,
        logits = model(input_ids=ids, pixel_values=pixel_values, image_grid_thw=grid,  # which image features replace
                       mm_token_type_ids=(ids == image_pad).int()).logits[0, -1]
    assert logits.argmax() == image_pad
    return model


def test_trainer_logprobs_ban_the_placeholders(vlm_dir, tokenizer):
    """packed_logprobs and its entropy are those of the softmax with the image and video placeholders at -inf (the
    engines' distribution); a placeholder in a completion (a tool's image) is not scored; gradients stay finite."""
    model = scrambled(policy.load_model(vlm_dir))
    sequences, images, prompts = rows(tokenizer)
    model = pad_loving(model, tokenizer, sequences[2][: prompts[2]], images[2])
    sequence, image = sequences[4], images[4]
    logprobs, entropy = policy.packed_logprobs(model, [sequence], score_from=[prompts[4]], images=[image],
                                               with_entropy=True, temperature=0.7)
    (logprobs.sum() + entropy.sum()).backward()
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
    with torch.no_grad():
        pixel_values, grid = vision.pixels(vision.processor_for(model.config), image)
        expanded, where = vision.expand(sequence, grid, 5, 2)
        ids = torch.tensor([expanded])
        logits = model(input_ids=ids, pixel_values=pixel_values, image_grid_thw=grid,
                       mm_token_type_ids=(ids == 5).int()).logits[0] / 0.7
    logits[:, vision.banned_token_ids(model.config)] = -torch.inf
    full = logits.log_softmax(-1)
    for j in range(prompts[4], len(sequence)):
        if sequence[j] == 5:
            assert logprobs[j] == 0 and entropy[j] == 0
            continue
        at = where[j] - 1
        assert abs(logprobs[j] - full[at, sequence[j]]) < 1e-5
        p = full[at].exp()
        assert abs(entropy[j] - -(p[p > 0] * full[at][p > 0]).sum()) < 1e-5


def test_hf_engine_with_images_equals_generate(vlm_dir, tokenizer):
    """HFEngine greedily (one left-padded batch: 2, 0 and 1 images, a repeated prompt) gives the tokens of the model's
    own generate on each prompt alone."""
    model = scrambled(policy.load_model(vlm_dir))
    sequences, images, prompts = rows(tokenizer)
    batch = [sequences[0][: prompts[0]], sequences[1][: prompts[1]], sequences[2][: prompts[2]],
             sequences[0][: prompts[0]]]
    batch_images = [images[0], None, images[2], images[0]]
    out = engines.HFEngine(model, tokenizer.pad_token_id).generate(
        batch, engines.Sampling(max_new_tokens=10, temperature=0), images=batch_images)
    processor = vision.processor_for(model.config)
    for ids, image, completion in zip(batch, batch_images, out):
        extra = {}
        if image:
            pixel_values, grid = vision.pixels(processor, image)
            ids = vision.expand(ids, grid, 5, 2)[0]
            extra = {"pixel_values": pixel_values, "image_grid_thw": grid}
        ids = torch.tensor([ids])
        want = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=(ids == 5).int(),
                              max_new_tokens=10, do_sample=False, **extra)[0, ids.shape[1]:]
        assert completion.token_ids == want.tolist()[: len(completion.token_ids)] and len(completion.token_ids) > 3
    assert len({tuple(c.token_ids) for c in out[:3]}) == 3 and out[0].token_ids == out[3].token_ids


def test_hf_engine_bans_placeholders_and_matches_the_trainer(vlm_dir, tokenizer):
    """A model whose favourite next token is <|image_pad|>: HFEngine, sampling, never emits a placeholder, and the
    trainer's completion_logprobs of its samples (images from Sample.images) equal the engine's."""
    model = scrambled(policy.load_model(vlm_dir))
    sequences, images, prompts = rows(tokenizer)
    question = sequences[2][: prompts[2]]
    model = pad_loving(model, tokenizer, question, images[2])
    torch.manual_seed(0)
    batch = [question] * 3 + [sequences[1][: prompts[1]]]
    batch_images = [images[2]] * 3 + [None]
    out = engines.HFEngine(model, tokenizer.pad_token_id).generate(
        batch, engines.Sampling(max_new_tokens=12, temperature=1.0), images=batch_images)
    assert not {t for c in out for t in c.token_ids} & set(vision.banned_token_ids(model.config))
    samples = [SimpleNamespace(prompt_ids=p, completion_ids=c.token_ids, images=i or [])
               for p, c, i in zip(batch, out, batch_images)]
    with torch.no_grad():
        logprobs, _ = policy.completion_logprobs(model, samples)
    for row, completion in zip(logprobs, out):
        torch.testing.assert_close(row[: len(completion.logprobs)], torch.tensor(completion.logprobs),
                                   atol=1e-5, rtol=1e-5)  # the engine takes log(p), the trainer z - lse


def test_micro_batches_count_expanded_tokens(vlm_dir, tokenizer):
    """completion_micro_batches budgets a vision sample by its expanded length: two samples whose ids fit the budget
    but whose images do not go to separate micro-batches."""
    model = policy.load_model(vlm_dir)
    sequences, images, prompts = rows(tokenizer)
    samples = [SimpleNamespace(prompt_ids=sequences[k][: prompts[k]], completion_ids=sequences[k][prompts[k]:],
                               images=images[k]) for k in (1, 2)]
    ids_only = sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    added = vision.image_tokens(vision.processor_for(model.config), images[2][0]) - 1
    assert policy.completion_micro_batches(model, samples, [0, 1], ids_only + added) == [[0, 1]]
    assert policy.completion_micro_batches(model, samples, [0, 1], ids_only + added - 1) == [[0], [1]]


def test_generate_counts_images_with_the_model_processor(vlm_dir, tokenizer, tmp_path):
    """`generate.py` on vision_toy rows keeps the rows whose prompt fits --max-prompt-tokens with each image
    counted as the model's own image processor expands it (at most 64 tokens for the tiny model), not as Qwen2.5-VL's
    defaults would (81 for a 256-pixel square) nor as one placeholder token, and answers them with their images."""
    rows, _ = data_prep.vision_toy_rows(6, 0, seed=0, size=256)
    task_rows.write_rows(rows, tmp_path / "rows.parquet")
    qwen = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=12_845_056, patch_size=14, merge_size=2)
    text = [len(chat.encode_prompt(tokenizer, row["prompt"])) for row in rows]
    model_length = [n + vision.image_counter(str(vlm_dir))(row["images"][0]) - 1 for n, row in zip(text, rows)]
    qwen_length = [n + vision.image_tokens(qwen, row["images"][0]) - 1 for n, row in zip(text, rows)]
    limit = min(qwen_length)
    kept = [task_rows.row_id(row) for row, n in zip(rows, model_length) if n <= limit]
    assert len(kept) != sum(n <= limit for n in qwen_length) and 0 < len(kept) < len(rows)
    created = not dist.is_initialized()
    policy.init_distributed()
    try:
        out = generate.generate(generate.GenerateArgs(model=str(vlm_dir), data=str(tmp_path / "rows.parquet"),
                                                    out=str(tmp_path / "samples.jsonl"), max_new_tokens=4,
                                                    max_prompt_tokens=limit))
    finally:
        if created:
            dist.destroy_process_group()
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["task_id"] for line in lines] == kept and all(line["completion_tokens"] > 0 for line in lines)


@pytest.mark.slow
def test_fsdp2_two_ranks_with_and_without_images(vlm_dir, tmp_path):
    """2 gloo ranks under FSDP2 (tests/dist_vision.py): micro-batches with images on one rank and none (and an idle
    one) on the other run forward and backward in step; logprobs equal the unsharded model's, the vision tower gets
    gradients and changes, and HFEngine's replica of the sharded VL decodes with images like the plain model."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    result = subprocess.run(
        ranks.torchrun(2, ROOT / "tests" / "dist_vision.py", vlm_dir), capture_output=True, text=True, env=env, timeout=600)
    passed = {line[3:] for line in result.stdout.splitlines() if line.startswith("ok ")}
    expected = {"blank_image_when_none", "logprobs_sharded", "vision_gradients", "vision_weights_change",
                "hf_engine_sharded"}
    assert result.returncode == 0 and passed == expected, result.stdout[-3000:] + result.stderr[-6000:]
