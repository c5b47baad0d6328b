"""train_sft.py: the loss falls on a fixed small set, and only assistant tokens contribute to it."""
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import policy  # noqa: E402
import rollout  # noqa: E402
import tiny  # noqa: E402
import train_sft  # noqa: E402

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
    losses = [json.loads(line)["loss"] for line in open(tmp_path / "out" / "metrics.jsonl")]
    assert len(losses) == 30 and losses[-1] < 0.5 * losses[0], losses
    assert (tmp_path / "out" / "hf" / "model.safetensors").is_file()


def test_only_assistant_tokens_contribute(model_dir):
    tokenizer = policy.load_tokenizer(model_dir)
    model = policy.load_model(model_dir)
    ids, mask = rollout.encode_conversation(tokenizer, CONVERSATIONS[2])  # ends with a tool turn (mask 0)
    assert mask[-1] == 0 and sum(mask) > 0
    last_trained = max(i for i, m in enumerate(mask) if m)
    with torch.no_grad():
        base = train_sft.sft_loss(model, [(ids, mask)], sum(mask)).item()
        # A tool token after the last trained token: nothing trained depends on it, so the loss is unchanged.
        tool_position = next(i for i in range(last_trained + 1, len(ids)) if mask[i] == 0)
        changed = list(ids)
        changed[-2] = (changed[-2] + 1) % len(tokenizer)
        assert -2 % len(ids) >= tool_position
        assert train_sft.sft_loss(model, [(changed, mask)], sum(mask)).item() == base
        # An assistant token is trained: changing it changes the loss.
        changed = list(ids)
        changed[last_trained - 1] = (changed[last_trained - 1] + 1) % len(tokenizer)
        assert train_sft.sft_loss(model, [(changed, mask)], sum(mask)).item() != base
