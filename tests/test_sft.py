"""train_sft.py: the loss falls on a fixed small set, only assistant tokens contribute to it (with a Qwen-style and a
Llama-3-style chat template), the mask follows the model's device, and data it cannot train on is refused; a tiny
Qwen2.5-VL trains on CodeV-style conversations with their images (row and tool images), masks off image and
observation tokens."""
import io
import json
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import chat  # noqa: E402
import data_prep  # noqa: E402
import policy  # noqa: E402
import tiny  # noqa: E402
import train_sft  # noqa: E402
import vision  # noqa: E402

CONVERSATIONS = [
    [{"role": "user", "content": "Double 21 with the tool."},
     {"role": "assistant", "content": "", "tool_calls": [
         {"type": "function", "function": {"name": "python", "arguments": {"code": "print(21 * 2)"}}}]},
     {"role": "tool", "content": "42"},
     {"role": "assistant", "content": "The answer is 42."}],
    [{"role": "user", "content": "Write f(x) that adds 3."},
     {"role": "assistant", "content": "```python\ndef f(x):\n    return x + 3\n```"}],
    [{"role": "user", "content": "Square 7."},
     {"role": "assistant", "content": "", "tool_calls": [
         {"type": "function", "function": {"name": "python", "arguments": {"code": "print(7 ** 2)"}}}]},
     {"role": "tool", "content": "49"}],
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    corpus = [json.dumps(c) for c in CONVERSATIONS] * 4
    return tiny.make_tiny_model(tmp_path_factory.mktemp("sft") / "model", corpus, seed=0)


def test_loss_falls_on_a_fixed_set(model_dir, tmp_path):
    data = tmp_path / "conversations.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    train_sft.main(train_sft.Args(model=str(model_dir), data=str(data), output_dir=str(tmp_path / "out"), steps=30,
                                  batch_size=3, lr=3e-3))
    losses = [json.loads(line)["train/loss"] for line in open(tmp_path / "out" / "metrics.jsonl")]
    assert len(losses) == 30 and losses[-1] < 0.5 * losses[0], losses
    assert (tmp_path / "out" / "hf" / "model.safetensors").is_file()


def test_only_assistant_tokens_contribute(model_dir):
    tokenizer = policy.load_tokenizer(model_dir)
    model = policy.load_model(model_dir)
    ids, mask = chat.encode_conversation(tokenizer, CONVERSATIONS[2])  # ends with a tool turn (mask 0)
    assert mask[-1] == 0 and sum(mask) > 0
    last_trained = max(i for i, m in enumerate(mask) if m)
    with torch.no_grad():
        base = train_sft.sft_loss(model, [(ids, mask, [])], sum(mask)).item()
        # A tool token after the last trained token: nothing trained depends on it, so the loss is unchanged.
        tool_position = next(i for i in range(last_trained + 1, len(ids)) if mask[i] == 0)
        changed = list(ids)
        changed[-2] = (changed[-2] + 1) % len(tokenizer)
        assert -2 % len(ids) >= tool_position
        assert train_sft.sft_loss(model, [(changed, mask, [])], sum(mask)).item() == base
        # An assistant token is trained: changing it changes the loss.
        changed = list(ids)
        changed[last_trained - 1] = (changed[last_trained - 1] + 1) % len(tokenizer)
        assert train_sft.sft_loss(model, [(changed, mask, [])], sum(mask)).item() != base


def test_a_shared_system_prompt_runs_once_with_the_same_loss_and_gradients(model_dir):
    """Agent SFT data repeats one system prompt (tool signatures) in every conversation: its tokens are untrained and
    equal, so they run once per micro-batch, and the loss and every gradient are those of the whole sequences."""
    tokenizer = policy.load_tokenizer(model_dir)
    system = [{"role": "system", "content": "You have a python tool. Call it for arithmetic."}]
    encoded = [(*chat.encode_conversation(tokenizer, system + c), []) for c in CONVERSATIONS]
    shared = train_sft.shared_prefix_length(encoded)
    system_ids = tokenizer(chat.render(tokenizer, system, None, False), add_special_tokens=False)["input_ids"]
    assert len(system_ids) <= shared < min(mask.index(1) for _, mask, _ in encoded)
    assert all(ids[:shared] == encoded[0][0][:shared] for ids, _, _ in encoded)
    assert train_sft.shared_prefix_length([(*chat.encode_conversation(tokenizer, c), []) for c in CONVERSATIONS]) < 8
    tokens = sum(sum(mask) for _, mask, _ in encoded)
    results, tokens_run = [], []
    for attention, prefix in (("sdpa", 1), ("packed_sdpa", shared)):  # sdpa shares nothing: the whole sequences
        model = policy.load_model(model_dir, attn_implementation=attention)
        model.get_input_embeddings().register_forward_hook(lambda _, args, out: tokens_run.append(out.shape[1]))
        loss = train_sft.sft_loss(model, encoded, tokens, prefix)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (whole, whole_grads), (once, once_grads) = results
    torch.testing.assert_close(once, whole, rtol=1e-5, atol=1e-6)
    for a, b in zip(once_grads, whole_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    packed = policy.pack(list(range(3)), [ids for ids, _, _ in encoded], 10**6, [shared] * 3, model)
    assert packed == [[0, 1, 2]]
    whole_tokens = sum(len(ids) for ids, _, _ in encoded)
    assert tokens_run == [whole_tokens, whole_tokens - 2 * shared]  # the prompt ran once, not thrice


@pytest.mark.parametrize("chat_format", ["qwen", "llama3"])
def test_mask_is_exactly_the_assistant_turns_of_either_template(tmp_path, chat_format):
    tokenizer = policy.load_tokenizer(tiny.make_tiny_model(tmp_path, [json.dumps(c) for c in CONVERSATIONS] * 4,
                                                           chat_format=chat_format))
    eot = {"qwen": "<|im_end|>", "llama3": "<|eot_id|>"}[chat_format]
    messages = CONVERSATIONS[0]
    ids, mask = chat.encode_conversation(tokenizer, messages)
    trained = [[]]  # runs of masked-in tokens, one per assistant turn
    for i, m in zip(ids, mask):
        if m:
            trained[-1].append(i)
        elif trained[-1]:
            trained.append([])
    turns = [tokenizer.decode(t) for t in trained if t]
    assert turns == [chat.render(tokenizer, messages[:i + 1], None, False)[
        len(chat.render(tokenizer, messages[:i], None, True)):].split(eot)[0] + eot
        for i, m in enumerate(messages) if m["role"] == "assistant"]
    assert turns[1] == "The answer is 42." + eot


def test_sft_loss_keeps_the_mask_on_the_models_device(model_dir, monkeypatch):
    """The logprobs land where the model is (here: `meta`, standing in for a GPU); the mask must follow them."""
    real = policy.packed_logprobs
    monkeypatch.setattr(policy, "packed_logprobs",
                        lambda model, seqs, **kw: (real(model, seqs, **kw)[0].to("meta"), None))
    loss = train_sft.sft_loss(policy.load_model(model_dir), [([5, 6, 7, 8], [0, 0, 1, 1], [])], 2.0)
    assert loss.device.type == "meta" and loss.shape == ()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sft_trains_on_a_gpu(model_dir, tmp_path):
    data = tmp_path / "conversations.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    train_sft.main(train_sft.Args(model=str(model_dir), data=str(data), output_dir=str(tmp_path / "out"), steps=3,
                                  batch_size=3, lr=3e-3))
    metrics = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    assert len(metrics) == 3 and all(m["train/tokens"] > 0 and m["train/loss"] > 0 and m["train/grad_norm"] > 0
                                     for m in metrics)


@pytest.mark.parametrize("rows, message", [
    ([{"messages": [{"role": "human", "content": "hi"}, {"role": "gpt", "content": "hello"}]}],
     r"row 0: messages\[0\]\.role: expected one of .*, got 'human' \(ShareGPT's 'human' is 'user'\)"),
    ([{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}],
     r"row 0: `conversations` looks like ShareGPT; write it as `messages` .*\(human -> user, gpt -> assistant"),
    ([{"messages": CONVERSATIONS[1]}, {"messages": [{"role": "user", "content": "hi"}]}],
     r"row 1: no assistant message to train on"),
])
def test_conversations_it_cannot_train_on_are_refused(model_dir, tmp_path, rows, message):
    data = tmp_path / "conversations.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=message):
        train_sft.main(train_sft.Args(model=str(model_dir), data=str(data), output_dir=str(tmp_path / "out")))
    assert not (tmp_path / "out").exists()


def test_zero_trainable_tokens_is_refused(model_dir, tmp_path):
    """An end-of-turn token the template never writes after an assistant turn leaves nothing to train on: refused
    before the model loads, instead of a NaN loss and an unchanged model."""
    data = tmp_path / "conversations.jsonl"
    data.write_text(json.dumps({"messages": CONVERSATIONS[1]}) + "\n")
    with pytest.raises(ValueError, match=r"1 conversations have no token to train on \(first: row 0\)"):
        train_sft.main(train_sft.Args(model=str(model_dir), data=str(data), output_dir=str(tmp_path / "out"),
                                      end_of_turn="<|endoftext|>"))


# ------------------------------------------------------------------------------------------------ vision (CodeV)


def vision_conversations(folder: Path) -> list[dict]:
    """Two vision_toy rows as SFT rows (jsonl, images as paths relative to the data file): a direct answer, and a
    code action whose observation returns a crop, then the answer."""
    first, second = data_prep.vision_toy_rows(2, 0, seed=0, size=128, families=("dots",))[0]
    for k, row in enumerate((first, second)):
        (folder / f"image{k}.png").write_bytes(row["images"][0])
    crop = io.BytesIO()
    Image.open(io.BytesIO(second["images"][0])).crop((0, 0, 64, 64)).save(crop, format="PNG")
    (folder / "crop.png").write_bytes(crop.getvalue())
    answer = [{"role": "assistant", "content": f"<answer>{first['reward_model']['ground_truth']}</answer>"}]
    action = [{"role": "assistant", "content": "<code>```python\nimage.crop((0, 0, 64, 64)).show()\n```</code>"},
              chat.observation_message("", 1),
              {"role": "assistant", "content": f"<answer>{second['reward_model']['ground_truth']}</answer>"}]
    return [{"messages": list(first["prompt"]) + answer, "images": ["image0.png"]},
            {"messages": list(second["prompt"]) + action, "images": ["image1.png", "crop.png"]}]


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return tiny.make_tiny_vlm(tmp_path_factory.mktemp("sft_vl") / "model",
                              ["<answer>3</answer>", "<code>```python\nimage.crop((0, 0, 64, 64)).show()\n```</code>",
                               "How many red dots are there?"] * 50, seed=0)


def test_vision_conversations_mask_off_images_and_observations_and_see_the_images(vlm_dir, tmp_path):
    rows = vision_conversations(tmp_path)
    data = tmp_path / "conversations.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = policy.load_tokenizer(vlm_dir)
    encoded = train_sft.encode(tokenizer, train_sft.load_conversations(str(data)), "<|im_end|>")
    ids, mask, images = encoded[1]
    assert images == [(tmp_path / "image1.png").read_bytes(), (tmp_path / "crop.png").read_bytes()]
    placeholders = {tokenizer.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")}
    assert sum(t in placeholders for t in ids) == 6 and not any(m for t, m in zip(ids, mask) if t in placeholders)
    trained = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert trained == (rows[1]["messages"][2]["content"] + rows[1]["messages"][4]["content"] + "<|im_end|>")
    assert "sandbox_output" not in trained  # the observation turn is not the policy's
    # The images reach the forward: another crop changes the loss of the answer that follows it.
    model = policy.load_model(vlm_dir)
    with torch.no_grad():
        loss = train_sft.sft_loss(model, [encoded[1]], sum(mask)).item()
        other = io.BytesIO()
        Image.new("RGB", (64, 64), "blue").save(other, format="PNG")
        assert train_sft.sft_loss(model, [(ids, mask, [images[0], other.getvalue()])], sum(mask)).item() != loss


def test_vision_sft_trains_the_vision_tower(vlm_dir, tmp_path):
    data = tmp_path / "conversations.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in vision_conversations(tmp_path)))
    train_sft.main(train_sft.Args(model=str(vlm_dir), data=str(data), output_dir=str(tmp_path / "out"), steps=8,
                                  batch_size=2, lr=3e-3))
    losses = [json.loads(line)["train/loss"] for line in open(tmp_path / "out" / "metrics.jsonl")]
    assert len(losses) == 8 and losses[-1] < 0.8 * losses[0], losses
    before, after = policy.load_model(vlm_dir), policy.load_model(tmp_path / "out" / "hf")
    assert vision.is_vision_model(after.config)
    tower = [(name, p) for name, p in after.named_parameters() if ".visual." in f".{name}"]
    assert tower and all(not torch.equal(p, before.get_parameter(name)) for name, p in tower if name.endswith("weight"))


def test_images_and_image_parts_must_agree(vlm_dir, tmp_path):
    rows = vision_conversations(tmp_path)
    rows[1]["images"] = rows[1]["images"][:1]
    data = tmp_path / "conversations.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"conversations.jsonl row 1: images: 1 images but the messages have 2 image"):
        train_sft.main(train_sft.Args(model=str(vlm_dir), data=str(data), output_dir=str(tmp_path / "out")))
