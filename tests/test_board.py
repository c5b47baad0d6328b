"""The run board end to end: a short real GRPO run (a tiny model warm-started to call the python tool on the row's
image, then answer) writes rich sample records; they hold what board.py shows, and board.py serves them to a real
headless chromium. Cost: one in-process GRPO run of 2 steps after a 60-step warm start (about 40 s on 2 idle cores);
the browser tests add a few seconds each."""
import hashlib
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
import runlog  # noqa: E402
import tiny  # noqa: E402
import tools  # noqa: E402
import train_grpo  # noqa: E402

pytestmark = pytest.mark.slow

CALL = '<tool_call>\n{"name": "python", "arguments": {"code": "image.show()"}}\n</tool_call>'
ANSWER = "```python\ndef f(x):\n    return x + 1\n```"


def png(colour: str) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), colour).save(buf, format="PNG")
    return buf.getvalue()


def conversation(row: dict) -> list[dict]:
    """The warm start's target: show the row's image with the tool, then answer."""
    return [*row["prompt"], {"role": "assistant", "content": CALL},
            {"role": "tool", "content": [{"type": "text", "text": "(no output)"}, {"type": "image"}]},
            {"role": "assistant", "content": ANSWER}]


def warm_start(model_dir: Path, rows: list[dict], steps: int = 60) -> None:
    tokenizer = policy.load_tokenizer(model_dir)
    model = policy.load_model(model_dir, attn_implementation="packed_sdpa")
    encoded = [chat.encode_conversation(tokenizer, conversation(r), tools=tools.TOOL_SCHEMAS["python"]) for r in rows]
    mask = torch.tensor([m for _, ms in encoded for m in ms], dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        logprobs, _ = policy.packed_logprobs(model, [ids for ids, _ in encoded])
        loss = -(logprobs * mask).sum() / mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(model_dir)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A finished 2-step GRPO run with --rich-samples: two rows (one whose tests the warm-started answer passes, one it
    fails, so REINFORCE++'s batch-whitened advantages differ), the python tool on the row's image, every step
    sampled."""
    root = tmp_path_factory.mktemp("board")
    rows = [data_prep.make_row("toy", "f", {"test_list": [test], "test_setup_code": ""}, {"index": i, "split": "train"})
            | {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Write f."}]}],
               "images": [png(colour)]}
            for i, (test, colour) in enumerate([("assert f(1) == 2", "red"), ("assert f(1) == 3", "blue")])]
    data_prep.write_rows(rows, root / "train.parquet")
    corpus = [json.dumps(conversation(r)) for r in rows] * 4 + [json.dumps(tools.TOOL_SCHEMAS["python"])] * 4
    model = tiny.make_tiny_model(root / "model", corpus, vocab_size=1024, seed=0)
    warm_start(model, rows)
    train_grpo.main(train_grpo.Args(
        model=str(model), data=str(root / "train.parquet"), output_dir=str(root / "grpo"), tools="python",
        max_turns=2, prompts_per_step=2, group_size=2, max_new_tokens=48, max_total_tokens=1024,
        max_prompt_tokens=1000, temperature=0.5, advantage="reinforce++", total_steps=2, lr=1e-4, sample_every=1,
        rich_samples=True, save_every=0, micro_batch_tokens=4096, seed=1, best_metric=""))
    return root / "grpo"


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in open(run / "samples.jsonl")]


def test_rich_records_hold_tokens_logprobs_advantages_and_tool_images(run_dir):
    tokenizer = policy.load_tokenizer(run_dir.parent / "model")
    lines = records(run_dir)
    assert [r["step"] for r in lines] == [1] * 4 + [2] * 4
    for r in lines:
        n = len(r["token_ids"])
        assert n > 0 and len(r["token_text"]) == len(r["loss_mask"]) == len(r["engine_logprobs"]) == n
        assert len(r["trainer_logprobs"]) == n
        assert "".join(r["token_text"]) == tokenizer.decode(r["token_ids"])
        policy_tokens = [k for k, m in enumerate(r["loss_mask"]) if m]
        # The HF engine is the policy itself: the trainer's logprobs match the engine's on every sampled token.
        assert max(abs(r["trainer_logprobs"][k] - r["engine_logprobs"][k]) for k in policy_tokens) <= 1e-3
        assert all(r["engine_logprobs"][k] == 0 for k in range(n) if not r["loss_mask"][k])
        assert r["finish_reason"] in ("stop", "length", "max_turns", "max_total_tokens")
        assert r["data_source"] == "toy" and r["group"] in (0, 1, 2, 3)
        assert "passed" in r["info"] and "format" in r["info"]  # the toy reward's components
        assert r["info"]["tool_calls"] == len(r["tool_calls"])
    for step in (1, 2):  # REINFORCE++ whitens over the batch: the advantages of a step sum to zero
        assert abs(sum(r["advantage"] for r in lines if r["step"] == step)) < 1e-4
    assert {r["reward"] for r in lines} == {0.0, 1.0}


def test_images_are_files_named_by_their_content_and_placed_in_the_messages(run_dir):
    shown = [r for r in records(run_dir) if any(c["images"] for c in r["tool_calls"])]
    assert shown, "no trajectory showed an image"
    for r in shown:
        call = next(c for c in r["tool_calls"] if c["images"])
        assert call["name"] == "python" and call["arguments"] == {"code": "image.show()"} and not call["error"]
        assert call["seconds"] > 0 and call["output"] == "(no output)"
        parts = [p["image"] for m in r["messages"] if isinstance(m["content"], list) for p in m["content"]
                 if p.get("type") == "image"]
        assert parts == r["images"] and r["prompt_images"] == 1 and parts[1:] == call["images"]
        for path in parts:
            data = (run_dir / path).read_bytes()
            assert path == f"{runlog.IMAGES_DIR}/{hashlib.sha256(data).hexdigest()[:16]}.png"
        # The tool image is the row's own, shown by PIL (and scaled up to the least size tools.fit_images allows).
        assert [colour for _, colour in Image.open(run_dir / parts[1]).convert("RGB").getcolors()] == [
            Image.open(run_dir / parts[0]).getpixel((0, 0))]


def test_samples_rotate_and_unnamed_images_go(tmp_path):
    log = runlog.RunLog(tmp_path, rank=0, samples_max_bytes=4000)
    for k in range(14):  # about 380 bytes a line: rotated after the 6th and the 12th
        name = f"{k:016x}.png"
        log.samples([{"step": k, "images": [f"{runlog.IMAGES_DIR}/{name}"], "pad": "x" * 300,
                      "_images": {name: png("red")}}])
    current, old = records(tmp_path), [json.loads(line) for line in open(tmp_path / "samples.old.jsonl")]
    assert [r["step"] for r in old + current] == list(range(6, 14))  # two generations, in order
    assert (tmp_path / "samples.jsonl").stat().st_size + (tmp_path / "samples.old.jsonl").stat().st_size <= 4000
    kept = sorted(p.name for p in (tmp_path / runlog.IMAGES_DIR).iterdir())
    assert kept == sorted(r["images"][0].split("/")[1] for r in old + current)
    assert all("_images" not in r for r in old + current)
