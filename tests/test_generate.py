"""`python generate.py` on the tiny model and toy rows: single process and 2 ranks under torchrun give a file
`rewards.py score` accepts, with n samples per row in row order; greedy samples are the engine's own greedy decoding,
from a Hugging Face folder and from a kiln checkpoint alike; multi-turn rows go through the training agent loop; a
failed run never leaves a half-written output."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import chat  # noqa: E402
import data_prep  # noqa: E402
import engines  # noqa: E402
import generate  # noqa: E402
import policy  # noqa: E402
import ranks  # noqa: E402
import rewards  # noqa: E402
import task_rows  # noqa: E402
import tiny  # noqa: E402
import script_runner  # noqa: E402
from checkpoint import save_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """5 toy rows (an odd count: the last round leaves a rank without rows) and a tiny model trained on nothing."""
    root = tmp_path_factory.mktemp("generate")
    train, test = data_prep.toy_rows(40, 5, seed=0, max_ops=2)
    task_rows.write_rows(test, root / "rows.parquet")
    corpus = [r["prompt"][-1]["content"] + "\n" + r["extra_info"]["solution"] for r in train]
    return root, tiny.make_tiny_model(root / "model", corpus, seed=0), test


@pytest.fixture()
def one_rank():
    created = not dist.is_initialized()
    policy.init_distributed()
    yield
    if created:
        dist.destroy_process_group()


def args_for(root: Path, model, out: Path, **overrides) -> generate.GenerateArgs:
    settings = dict(model=str(model), data=str(root / "rows.parquet"), out=str(out), max_new_tokens=12, batch_size=2)
    return generate.GenerateArgs(**settings | overrides)


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def greedy_texts(model, tokenizer, rows) -> list[str]:
    sampling = engines.Sampling(max_new_tokens=12, temperature=0.0, stop_token_ids=policy.stop_token_ids(
        tokenizer, model.name_or_path))
    prompts = [chat.encode_prompt(tokenizer, row["prompt"]) for row in rows]
    completions = engines.HFEngine(model.eval(), pad_token_id=tokenizer.pad_token_id).generate(prompts, sampling)
    return [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in completions]


def test_samples_in_row_order_that_score_accepts(toy, tmp_path, one_rank):
    root, model, rows = toy
    out = generate.generate(args_for(root, model, tmp_path / "samples.jsonl", n_samples=3, temperature=1.0))
    lines = read_lines(out)
    ids = [task_rows.row_id(r) for r in rows]
    assert [(line["task_id"], line["sample"]) for line in lines] == [(i, k) for i in ids for k in range(3)]
    assert all(line["finish_reason"] in ("stop", "length") and 0 < line["completion_tokens"] <= 12 for line in lines)
    assert len({line["completion"] for line in lines}) > 5  # sampled, not the same text repeated

    summary = rewards.main(rewards.ScoreArgs(str(out), data=str(root / "rows.parquet"), workers=2))
    assert summary["samples"] == 15 and summary["pass"]["all"]["tasks"] == 5 and "pass@3" in summary["pass"]["all"]
    assert summary["tests"]["all"]["rated"] == 15  # every sample graded by the toy tests (or scored "no code")

    # Greedy: exactly what the engine decodes greedily from the same prompts.
    greedy = generate.generate(args_for(root, model, tmp_path / "greedy.jsonl"))
    tokenizer = policy.load_tokenizer(model)
    assert [line["completion"] for line in read_lines(greedy)] == greedy_texts(policy.load_model(model), tokenizer,
                                                                               rows)
    with pytest.raises(ValueError, match="greedy samples of a row are all the same"):
        generate.generate(args_for(root, model, tmp_path / "x.jsonl", n_samples=2))
    # --out in folders that do not exist yet (the docs' runs/eval/samples.jsonl on a fresh clone): made
    nested = generate.generate(args_for(root, model, tmp_path / "runs" / "eval" / "x.jsonl"))
    assert [line["completion"] for line in read_lines(nested)] == [line["completion"] for line in read_lines(greedy)]
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="a folder on its path is a file"):
        generate.generate(args_for(root, model, tmp_path / "file" / "x.jsonl"))


def test_a_kiln_checkpoint_generates_its_own_weights(toy, tmp_path, one_rank):
    """A checkpoint saved by the trainers' code (weights moved off the Hugging Face folder's): greedy samples are the
    moved model's, so the checkpoint's weights (not the folder's, nor a fresh init) were loaded."""
    root, model_dir, rows = toy
    model = policy.load_model(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    optimizer = torch.optim.AdamW(model.parameters())
    checkpoint = save_checkpoint(tmp_path / "run", 7, model, optimizer, {"step": 7}, hf_source_dir=model_dir)
    out = generate.generate(args_for(root, checkpoint, tmp_path / "samples.jsonl"))
    tokenizer = policy.load_tokenizer(model_dir)
    moved = greedy_texts(model, tokenizer, rows)
    assert [line["completion"] for line in read_lines(out)] == moved
    assert moved != greedy_texts(policy.load_model(model_dir), tokenizer, rows)


class ToolThenAnswer:
    """An engines.Engine whose first turn calls the python tool and whose second answers with a code block."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def generate(self, prompts, sampling, seeds=None):
        call = '<tool_call>\n{"name": "python", "arguments": {"code": "print(6 * 7)"}}\n</tool_call>'
        out = []
        for prompt in prompts:
            text = call if "<tool_response>" not in self.tokenizer.decode(prompt) else "```python\nprint(42)\n```"
            ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
            out.append(engines.Completion(ids, [0.0] * len(ids), "stop"))
        return out


def test_multi_turn_rows_use_the_agent_loop(toy, tmp_path, one_rank):
    root, model, rows = toy
    tokenizer = policy.load_tokenizer(model)
    args = args_for(root, model, tmp_path / "samples.jsonl", tools="python", n_samples=2, temperature=1.0)
    lines = generate.generate_lines(ToolThenAnswer(tokenizer), tokenizer, rows[:3], args,
                                   engines.Sampling(max_new_tokens=64, stop_token_ids=[tokenizer.eos_token_id]))
    assert len(lines) == 6 and all(line["turns"] == 2 and line["tool_calls"] == 1 for line in lines)
    assert all(line["tool_errors"] == 0 for line in lines)
    # The completion is what training scores: the assistant turns, joined; the final block is the program.
    assert lines[0]["completion"].startswith("<tool_call>") and lines[0]["completion"].endswith("print(42)\n```")
    assert rewards.extract_code(lines[0]["completion"]) == "print(42)\n"


def test_a_failed_run_leaves_the_previous_output_whole(toy, tmp_path, one_rank, monkeypatch):
    root, model, _ = toy
    out = tmp_path / "samples.jsonl"
    out.write_text('{"task_id": "toy/0", "completion": "old"}\n')
    calls = []
    real = engines.HFEngine.generate

    def fail_on_second_round(self, prompts, sampling, seeds=None):
        calls.append(len(prompts))
        if len(calls) == 2:
            raise RuntimeError("engine died")
        return real(self, prompts, sampling, seeds=seeds)

    monkeypatch.setattr(engines.HFEngine, "generate", fail_on_second_round)
    with pytest.raises(RuntimeError, match="engine died"):
        generate.generate(args_for(root, model, out))
    assert out.read_text() == '{"task_id": "toy/0", "completion": "old"}\n'

    def lines_then_crash():
        yield {"task_id": "toy/1", "completion": "new"}
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        task_rows.write_atomically(out, lines_then_crash())
    assert out.read_text() == '{"task_id": "toy/0", "completion": "old"}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["samples.jsonl"]  # no temp file left behind
    task_rows.write_atomically(out, [{"task_id": "toy/1", "completion": "new"}])
    assert read_lines(out) == [{"task_id": "toy/1", "completion": "new"}]


@pytest.mark.slow
def test_two_ranks_from_a_checkpoint_with_tools(toy, tmp_path):
    """One torchrun launch, 2 ranks: a kiln checkpoint, multi-turn rollouts (every agent turn is a collective, and
    the last round gives rank 1 no row), n = 2: one file in row order that `rewards.py score` grades."""
    root, model_dir, rows = toy
    created = not dist.is_initialized()
    policy.init_distributed()
    try:
        model = policy.load_model(model_dir)
        checkpoint = save_checkpoint(tmp_path / "run", 3, model, torch.optim.AdamW(model.parameters()),
                                     {"step": 3}, hf_source_dir=model_dir)
    finally:
        if created:
            dist.destroy_process_group()
    out = tmp_path / "samples.jsonl"
    run = subprocess.run([*ranks.torchrun(2, ROOT / "generate.py"), "--model", str(checkpoint), "--data",
                          str(root / "rows.parquet"), "--out", str(out), "--n-samples", "2", "--temperature", "1.0",
                          "--max-new-tokens", "12", "--batch-size", "2", "--tools", "python"],
                         capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false"))
    assert run.returncode == 0, run.stderr[-3000:]
    lines = read_lines(out)
    assert [(line["task_id"], line["sample"]) for line in lines] == [
        (task_rows.row_id(r), k) for r in rows for k in range(2)]
    assert all(line["turns"] >= 1 for line in lines)
    assert "10 samples (2 per row, 5 rows, 2 ranks)" in run.stdout
    score = script_runner.run([sys.executable, str(ROOT / "rewards.py"), "score", str(out), "--data",
                            str(root / "rows.parquet")], capture_output=True, text=True, timeout=300)
    assert score.returncode == 0, score.stderr
    assert "10 samples in" in score.stdout
