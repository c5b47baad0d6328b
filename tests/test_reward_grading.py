"""rewards.py on real data: every HumanEval / MBPP / APPS reference scores 1, mutated ones 0; the eval CLI."""
import json
import os
import re
import signal
import sys
import threading
import time
from itertools import combinations
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import data_prep  # noqa: E402
import eval_report  # noqa: E402
import rewards  # noqa: E402
import sandbox  # noqa: E402
import script_runner  # noqa: E402
import task_rows  # noqa: E402
from data_files import APPS_DIR, MBPP_FILE  # noqa: E402

# A mutation wraps the function under test so that it returns a wrong value of a plausible type.
PERTURB = """
def _kiln_perturb(fn):
    def wrong(*args, **kwargs):
        out = fn(*args, **kwargs)
        if isinstance(out, bool):
            return not out
        if isinstance(out, (int, float)):
            return out + 1
        if isinstance(out, str):
            return out + "x"
        if isinstance(out, (list, tuple)):
            return type(out)(list(out) + [None])
        return None
    return wrong
"""

# References are held to the CPU limit the reward uses, but not to its wall clock: under `make test`'s load a
# CPU-bound reference (MBPP 123 runs 2.3 s of CPU) can get a small share of a core and overrun timeout x wall_factor.
UNHURRIED = sandbox.Limits(wall_factor=20.0, total_timeout=600.0)


def fenced(code: str) -> str:
    return f"Here is my solution:\n```python\n{code}\n```\n"


def perturbed(code: str, names: list[str]) -> str:
    return code + "\n" + PERTURB + "".join(f"\n{n} = _kiln_perturb({n})" for n in names)


@pytest.fixture(scope="module")
def humaneval():
    return data_prep.humaneval_rows()


@pytest.fixture(scope="module")
def mbpp():
    return data_prep.mbpp_rows(MBPP_FILE)


def test_every_humaneval_canonical_solution_scores_one(humaneval):
    bodies = [r["extra_info"]["canonical_solution"] for r in humaneval]  # HumanEval's native completion
    full = [fenced(json.loads(r["reward_model"]["ground_truth"])["prompt"] + b) for r, b in zip(humaneval, bodies)]
    for completions in (bodies, full):
        results = rewards.score_batch(humaneval, completions, limits=UNHURRIED)
        assert [r["extra_info"]["task_id"] for r, x in zip(humaneval, results) if x.score != 1.0] == []


def test_mutated_humaneval_solutions_score_zero(humaneval):
    none = ["    return None\n" for _ in humaneval]
    wrong = [fenced(perturbed(json.loads(r["reward_model"]["ground_truth"])["prompt"]
                              + r["extra_info"]["canonical_solution"], [r["extra_info"]["entry_point"]]))
             for r in humaneval]
    for completions in (none, wrong):
        results = rewards.score_batch(humaneval, completions)
        assert [r["extra_info"]["task_id"] for r, x in zip(humaneval, results) if x.score != 0.0] == []
        assert all(x.info["error"] in ("wrong_answer", "runtime_error") for x in results)


def test_every_mbpp_reference_scores_one_and_mutations_zero(mbpp):
    results = rewards.score_batch(mbpp, [fenced(r["extra_info"]["code"]) for r in mbpp], limits=UNHURRIED)
    assert [r["extra_info"]["index"] for r, x in zip(mbpp, results) if x.score != 1.0] == []
    def called(row):  # the functions the asserts call (wrapping helpers too could cancel out: not(not(x)))
        tests = " ".join(json.loads(row["reward_model"]["ground_truth"])["test_list"])
        return [n for n in re.findall(r"^def (\w+)", row["extra_info"]["code"], re.M) if re.search(rf"\b{n}\(", tests)]

    mutated = [fenced(perturbed(r["extra_info"]["code"], called(r))) for r in mbpp]
    results = rewards.score_batch(mbpp, mutated)
    assert [r["extra_info"]["index"] for r, x in zip(mbpp, results) if x.score != 0.0] == []


def test_apps_references_score_one_and_partial_credit():
    rows = data_prep.apps_rows(APPS_DIR)
    assert len(rows) == 5
    results = rewards.score_batch(rows, [fenced(r["extra_info"]["solutions"][0]) for r in rows], limits=UNHURRIED)
    assert [x.score for x in results] == [1.0] * 5
    # 4184 (is_prime, 8 call-based tests): a solution that always says False passes exactly the non-primes.
    row = next(r for r in rows if r["extra_info"]["index"] == 4184)
    truth = json.loads(row["reward_model"]["ground_truth"])
    expected_false = sum(1 for out in truth["outputs"] if out in (False, [False]))
    reward = rewards.score(row, fenced("def is_prime(n):\n    return False"))
    assert reward.score == pytest.approx(expected_false / len(truth["outputs"]))
    assert 0 < reward.score < 1 and reward.info["error"] == "wrong_answer"


def test_error_categories():
    row = data_prep.toy_rows(20, 4, seed=0)[0][0]
    assert rewards.score(row, "no code here at all!").info["error"] == "no_code"
    assert rewards.score(row, fenced("def f(x):\n    return (")).info["error"] == "syntax_error"
    assert rewards.score(row, fenced("def f(x):\n    raise ValueError")).info["error"] == "runtime_error"
    spin = rewards.score(row, fenced("def f(x):\n    while True: pass"), sandbox.Limits(timeout=0.5))  # not 6 s a test
    assert spin.info["error"] == "timeout" and spin.score == 0.0
    good = rewards.score(row, fenced(row["extra_info"]["solution"]))
    assert good.score == 1.0 and good.info["error"] is None and good.info["format"] == 1.0


def test_extract_code_takes_the_last_block():
    text = "first\n```python\na = 1\n```\nthen\n```py\nb = 2\n```"
    assert rewards.extract_code(text) == "b = 2\n"
    assert rewards.extract_code("x = 1\n") == "x = 1\n"  # unfenced but valid Python
    assert rewards.extract_code("I think the answer is 42.") is None
    assert rewards.format_reward(text) == 0.0 and rewards.format_reward("```python\nx\n```") == 1.0


def test_unknown_data_source_names_the_known_ones():
    row = data_prep.toy_rows(20, 4, seed=0)[0][0] | {"data_source": "nope"}
    with pytest.raises(KeyError, match="nope.*known"):
        rewards.score(row, fenced("x = 1"))


def test_pass_at_k_matches_the_definition():
    n, c = 5, 2
    for k in range(1, 6):
        draws = list(combinations([1] * c + [0] * (n - c), k))
        assert eval_report.pass_at_k(n, c, k) == pytest.approx(sum(any(d) for d in draws) / len(draws))


def run_cli(tmp_path, lines: list[str]):
    train, _ = data_prep.toy_rows(40, 4, seed=0)
    task_rows.write_rows(train, tmp_path / "rows.parquet")
    (tmp_path / "samples.jsonl").write_text("\n".join(lines) + "\n")
    return train, script_runner.run([sys.executable, str(ROOT / "rewards.py"), "score", str(tmp_path / "samples.jsonl"),
                                  "--data", str(tmp_path / "rows.parquet"), "--out", str(tmp_path / "out.jsonl")],
                                 capture_output=True, text=True, timeout=300)


def test_cli_reports_pass_at_k_by_source_and_difficulty(tmp_path):
    train, _ = data_prep.toy_rows(40, 4, seed=0)
    lines = []
    for row in train[:3]:  # 4 samples per task: 2 right, 2 wrong -> pass@1 = 0.5, pass@2 = 5/6, pass@4 = 1
        for code in [row["extra_info"]["solution"]] * 2 + ["def f(x):\n    return None"] * 2:
            lines.append(json.dumps({"task_id": task_rows.row_id(row), "completion": fenced(code)}))
    _, proc = run_cli(tmp_path, lines)
    assert proc.returncode == 0, proc.stderr
    all_line = next(line for line in proc.stdout.splitlines() if line.startswith("all "))
    assert all_line.split()[1:] == ["3", "0.500", "0.833", "1.000"]
    assert any(line.startswith("toy/") for line in proc.stdout.splitlines())
    results = [json.loads(line) for line in open(tmp_path / "out.jsonl")]
    assert [r["score"] for r in results] == [1.0, 1.0, 0.0, 0.0] * 3


def test_cli_rejects_malformed_samples_and_unknown_tasks(tmp_path):
    _, proc = run_cli(tmp_path, ['{"task_id": "toy/0", "completion": "x"}', "not json"])
    assert proc.returncode != 0 and "line 2" in proc.stderr
    _, proc = run_cli(tmp_path, ['{"task_id": "toy/999999", "completion": "x"}'])
    assert proc.returncode != 0 and "unknown task id 'toy/999999'" in proc.stderr


def test_programs_cannot_make_scoring_raise():
    """Outputs the numeric comparison treats specially, and an exception that cannot be rebuilt from its message:
    ordinary verdicts, never an exception out of score."""
    apps = task_rows.make_row("apps", "echo", {"inputs": ["sNaN\n", "1e999999999\n"], "outputs": ["1", "2"]},
                              {"index": 0, "split": "test"})
    reward = rewards.score(apps, fenced("print(input())"))
    assert reward.score == 0.0 and reward.info["error"] == "wrong_answer"
    mbpp = task_rows.make_row("mbpp", "f", {"test_list": ["assert f(1) == 1"]}, {"index": 1, "split": "test"})
    reward = rewards.score(mbpp, fenced("raise UnicodeDecodeError('utf-8', b'x', 0, 1, 'no')\ndef f(x): return x"))
    assert reward.score == 0.0 and reward.info["error"] == "runtime_error"


def test_a_grading_that_fails_is_a_counted_grader_error():
    """The supervisor grading a sample dies (killed here; a CPU limit in C code would do the same): that sample is a
    Reward of 0 with error grader_error and its reason, counted by batch_metrics; nothing raises."""
    box = sandbox.default_sandbox()
    sandbox.run("pass")  # the zygote is up, so its uid range is known
    mbpp = task_rows.make_row("mbpp", "f", {"test_list": ["assert f(1) == 1"]}, {"index": 9, "split": "test"})
    outcome = []
    thread = threading.Thread(target=lambda: outcome.append(rewards.score(
        mbpp, fenced("import time\ntime.sleep(5)\ndef f(x): return x"), sandbox.Limits(timeout=10))))
    thread.start()
    tests_side = []
    for _ in range(200):  # the supervisor runs the tests as the run's second uid (odd offsets of the range)
        tests_side = [pid for pid in filter(str.isdigit, os.listdir("/proc")) if is_tests_side(pid, box)]
        if tests_side:
            break
        time.sleep(0.02)
    assert len(tests_side) == 1
    os.kill(int(tests_side[0]), signal.SIGKILL)
    thread.join()
    (reward,) = outcome
    assert reward.score == 0.0 and reward.info["error"] == "grader_error" and "mbpp/9" in reward.info["reason"]
    metrics = rewards.batch_metrics(["mbpp", "mbpp"], [0.0, 1.0], ["grader_error", None], [5, 5])
    assert metrics["critic/score/grader_errors"] == 1.0 and metrics["critic/score/error/grader_error"] == 0.5
    assert rewards.batch_metrics(["mbpp"], [1.0], [None], [5])["critic/score/grader_errors"] == 0.0


def is_tests_side(pid: str, box) -> bool:
    try:
        uid = int(Path(f"/proc/{pid}/status").read_text().split("\nUid:")[1].split()[0])
    except OSError:
        return False
    return box.uid_base <= uid < box.uid_base + sandbox.UID_RANGE and (uid - box.uid_base) % 2 == 1
