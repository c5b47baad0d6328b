"""Harbor-style task directories (task_dirs.py): the shipped tasks/ read into rows (what the agent sees, task.toml's
settings, refusals naming the directory and field), their images built offline from kiln's base image, and, against
the real Docker daemon, the reward: solve.sh scores 1 and doing nothing 0, partial credit, a planted reward file or
test (and a daemon rewriting the reward) does not count, no reward file is an infrastructure failure (no score, left
out), tests past their time limit score 0, the agent's time and user come from task.toml; kiln's own agent loop in
the task's container; a 2-rank GRPO step on the task rows.
"""
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
import chat  # noqa: E402
import containers  # noqa: E402
import data_prep  # noqa: E402
import engines  # noqa: E402
import policy  # noqa: E402
import ranks  # noqa: E402
import rewards  # noqa: E402
import rollout  # noqa: E402
import swe_instances  # noqa: E402
import task_dirs  # noqa: E402
import task_rows  # noqa: E402
import tiny  # noqa: E402
import tools  # noqa: E402
from test_multiturn import CORPUS, ScriptedEngine  # noqa: E402
from test_swe_agent import orphans, own_containers  # noqa: E402
from test_swebench import docker_client, swe_rows  # noqa: E402,F401 -- fixtures

TASKS = ROOT / "tasks"
LIMITS = rollout.AgentLimits(max_turns=6, max_total_tokens=200_000, max_tool_response_tokens=2000)
MEDIAN_BUG = "    middle = len(values) // 2\n    return values[middle]\n"
MEDIAN_FIX = ("    if not values:\n        raise ValueError('empty')\n    ordered = sorted(values)\n"
              "    middle = len(ordered) // 2\n    if len(ordered) % 2:\n        return ordered[middle]\n"
              "    return (ordered[middle - 1] + ordered[middle]) / 2\n")


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def variant(tmp_path: Path, task: str, toml: str | None = None, test_sh: str | None = None) -> Path:
    """A copy of a shipped task with its task.toml and/or tests/test.sh replaced."""
    copy = tmp_path / task
    shutil.copytree(TASKS / task, copy)
    if toml is not None:
        (copy / "task.toml").write_text(toml)
    if test_sh is not None:
        (copy / "tests" / "test.sh").write_text(test_sh)
    return copy


@pytest.fixture(scope="module")
def rows():
    return {row["extra_info"]["index"]: row for row in task_dirs.task_rows_of(TASKS)}


# ---------------------------------------------------------------------------------------------- reading, no Docker

def test_the_shipped_tasks_become_rows_the_agent_sees_only_the_instruction_of(rows):
    assert sorted(rows) == ["count-errors", "fix-median", "text-kit"]
    for name, row in rows.items():
        assert task_rows.validate_row(row, name) == row and row["data_source"] == "task"
        prompt = json.dumps(row["prompt"])
        assert prompt == json.dumps([{"role": "user", "content": task_dirs.instruction(TASKS / name)}])
        for hidden in [*(TASKS / name / "tests").iterdir(), *(TASKS / name / "solution").iterdir()]:
            for line in hidden.read_text().splitlines():  # no line of the tests or the solution reaches the prompt
                assert len(line.strip()) < 12 or line.strip() not in prompt, (name, line)
    median = rows["fix-median"]["prompt"][0]["content"]
    assert median.startswith("`/app/stats.py` has a function") and "canary" not in median  # its canary line went
    truth = task_dirs.truth_of(rows["fix-median"])
    assert truth["name"] == "kiln/fix-median" and truth["agent_timeout"] == 300.0 and truth["memory_mb"] == 1024
    assert truth["image"].startswith("kiln-task/kiln-fix-median:") and set(truth) >= {"environment", "tests",
                                                                                      "solution"}
    errors = task_dirs.truth_of(rows["count-errors"])  # legacy `version`, memory string, allow_internet, verifier env
    assert errors["memory_mb"] == 1024 and errors["verifier_env"] == {"EXPECTED_FILE": "/app/error_count.txt"}
    assert errors["name"] == "count-errors" and errors["verifier_timeout"] == 60.0
    assert task_dirs.truth_of(task_dirs.task_rows_of(TASKS)[1])["image"] == truth["image"]  # the same content, tag


def test_the_image_tag_follows_the_environment_and_nothing_else(tmp_path):
    copy = variant(tmp_path, "fix-median")
    tag = lambda: task_dirs.truth_of(task_dirs.read_task(copy))["image"]  # noqa: E731
    first = tag()
    (copy / "tests" / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    (copy / "instruction.md").write_text("Another instruction.\n")
    assert tag() == first
    (copy / "environment" / "stats.py").write_text("def median(values):\n    return 0\n")
    assert tag() != first


@pytest.mark.parametrize("change, message", [
    (lambda d: (d / "tests" / "test.sh").unlink(), "missing tests/test.sh"),
    (lambda d: (d / "task.toml").write_text("[agent]\ntimeout_sec = 'soon'\n"), "[agent].timeout_sec: expected a number"),
    (lambda d: (d / "task.toml").write_text("[agent\n"), "task.toml: not valid TOML"),
    (lambda d: (d / "task.toml").write_text("[[steps]]\nname = 'a'\n"), "multi-step tasks are not supported"),
    (lambda d: (d / "task.toml").write_text("[environment]\nos = 'windows'\n"), "[environment].os"),
    (lambda d: (d / "task.toml").write_text("[environment]\nmemory = 'lots'\n"), "[environment].memory"),
    (lambda d: (d / "task.toml").write_text("[verifier]\nenvironment_mode = 'separate'\n"), "environment_mode"),
    (lambda d: (d / "task.toml").write_text("[environment]\nenv = { K = '${KILN_TEST_UNSET_VAR}' }\n"),
     "${KILN_TEST_UNSET_VAR}, which is not set"),
    (lambda d: (d / "task.toml").write_text("[agent]\nuser = true\n"), "[agent].user: expected a user name"),
    (lambda d: (d / "environment" / "docker-compose.yaml").write_text("services: {}\n"), "compose sidecars"),
    (lambda d: (d / "instruction.md").write_text("<!-- a canary line -->\n\n"), "instruction.md: empty"),
    (lambda d: (d / "tests" / "test.sh").write_bytes(b"#!/bin/bash\r\necho 1\r\n"), "test.sh: has CRLF line endings"),
    (lambda d: (d / "solution" / "solve.sh").rename(d / "solution" / "fix.sh"), "solution/ has no solve.sh"),
])
def test_a_bad_task_is_refused_naming_its_directory_and_field(tmp_path, change, message):
    copy = variant(tmp_path, "fix-median")
    change(copy)
    with pytest.raises(task_dirs.TaskError) as error:
        task_dirs.task_rows_of(tmp_path)
    assert message in str(error.value) and str(copy) in str(error.value)


def test_a_folder_without_tasks_or_with_a_task_lacking_task_toml_is_refused(tmp_path):
    with pytest.raises(task_dirs.TaskError, match="no task directories"):
        task_dirs.task_rows_of(tmp_path)
    copy = variant(tmp_path, "fix-median")
    (copy / "task.toml").unlink()
    with pytest.raises(task_dirs.TaskError, match="looks like a task .* but has no task.toml"):
        task_dirs.task_rows_of(tmp_path)


def test_data_prep_writes_rows_that_load_and_need_the_swe_toolbox(tmp_path):
    out = tmp_path / "tasks.parquet"
    data_prep.tasks(TASKS, out, build=False)
    loaded = task_rows.load_rows(str(out))
    assert [row["extra_info"]["index"] for row in loaded] == ["count-errors", "fix-median", "text-kit"]
    assert dict(loaded[1]) == task_dirs.task_rows_of(TASKS)[1]
    rewards.check_sources(loaded, str(out))  # "task" has a reward function
    with pytest.raises(ValueError, match="task rows run with --tools swe"):
        tools.check_swe_rows(loaded, "python", str(out))


def test_the_command_line_reports_a_bad_folder_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "data_prep.py"), "tasks", "--source", str(tmp_path), "--out",
                           str(tmp_path / "rows.parquet")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and not (tmp_path / "rows.parquet").exists()
    assert done.stderr.strip().splitlines() == [f"error: {tmp_path}: no task directories (folders with a task.toml)"]


# ----------------------------------------------------------------------------------------- the reward, real Docker

@pytest.fixture(scope="module")
def base_image(docker_client, request):  # noqa: F811
    """kiln's base image, which the tasks' Dockerfiles start FROM (built with the SWE instances when it is missing)."""
    if not task_dirs.image_present(docker_client, swe_instances.BASE_IMAGE):
        request.getfixturevalue("swe_rows")
    return swe_instances.BASE_IMAGE


@pytest.fixture(scope="module")
def built(docker_client, base_image, rows):  # noqa: F811
    task_dirs.ensure_images([task_dirs.truth_of(row) for row in rows.values()], docker_client)
    return {name: task_dirs.truth_of(row) for name, row in rows.items()}


def grade(truth: dict, script: str, **kwargs) -> task_dirs.Verdict:
    return task_dirs.grade_script(truth, script, **kwargs)


@pytest.mark.docker
def test_solve_sh_scores_one_and_doing_nothing_zero_on_every_shipped_task(built, docker_client, rows):
    results = task_dirs.check_tasks(list(rows.values()), docker_client)
    assert [(r["task"], r["oracle"], r["noop"], r["ok"]) for r in results] == [
        ("count-errors", 1.0, 0.0, True), ("kiln/fix-median", 1.0, 0.0, True), ("kiln/text-kit", 1.0, 0.0, True)]
    assert own_containers(docker_client) == []


@pytest.mark.docker
def test_partial_credit_comes_from_reward_json(built):
    two_of_four = ("cat >> /app/textkit.py <<'EOF'\n\ndef reverse_words(text):\n    return ' '.join(reversed("
                   "text.split()))\n\n\ndef count_vowels(text):\n    return sum(c in 'aeiouAEIOU' for c in text)\nEOF\n")
    verdict = grade(built["text-kit"], two_of_four)
    assert verdict.score == 0.5 and verdict.rewards == {"reward": 0.5, "passed": 2.0, "total": 4.0}
    assert verdict.error is None and verdict.infra_error is None


@pytest.mark.docker
def test_a_planted_reward_planted_tests_and_a_daemon_rewriting_the_reward_do_not_count(built, docker_client):
    """The agent writes reward.txt and reward.json, its own /tests/test.sh, and leaves a setsid daemon (out of its
    command's process group) writing reward 1 every 20 ms: the tests still see the unfixed median and score 0."""
    plant = ("mkdir -p /logs/verifier /tests && echo 1 > /logs/verifier/reward.txt && "
             "echo '{\"reward\": 1}' > /logs/verifier/reward.json && "
             "printf '#!/bin/bash\\necho 1 > /logs/verifier/reward.txt\\n' > /tests/test.sh && chmod +x /tests/test.sh\n"
             "setsid nohup bash -c 'while true; do echo 1 > /logs/verifier/reward.txt; "
             "echo \"{\\\"reward\\\": 1}\" > /logs/verifier/reward.json; sleep 0.02; done' >/dev/null 2>&1 &\n"
             "sleep 0.3\n")
    verdict = grade(built["fix-median"], plant)
    assert verdict.score == 0.0 and verdict.rewards == {"reward": 0.0}, verdict.output
    assert "FAILED" in verdict.output and verdict.strays_after_tests == 0  # the task's own tests ran; the daemon
    # was gone before them. Code under test that leaves a daemon of its own is reported (strays_after_tests).
    daemon = "echo 'import subprocess; subprocess.Popen([\"setsid\", \"sleep\", \"300\"])' >> /app/stats.py"
    verdict = grade(built["fix-median"], daemon)
    assert verdict.score == 0.0 and verdict.strays_after_tests >= 1
    assert own_containers(docker_client) == []


@pytest.mark.docker
def test_no_reward_file_is_an_infrastructure_failure_left_out_never_a_zero(tmp_path, docker_client, base_image):
    row = task_dirs.read_task(variant(tmp_path, "fix-median", test_sh="#!/bin/bash\necho 'forgot the reward'\n"))
    truth = task_dirs.truth_of(row)
    task_dirs.ensure_image(docker_client, truth)
    verdict = grade(truth, "", oracle=True)
    assert verdict.score is None and verdict.error == "infra" and "wrote no /logs/verifier/reward.txt" in \
        verdict.infra_error and "forgot the reward" in verdict.output
    reward = rewards.score(row, "true")
    assert math.isnan(reward.score) and rewards.ungraded(reward.info) and "reward.txt" in reward.info["infra_failed"]
    garbled = task_dirs.read_task(variant(tmp_path / "b", "fix-median",
                                          test_sh="#!/bin/bash\necho 'all good' > /logs/verifier/reward.txt\n"))
    verdict = grade(task_dirs.truth_of(garbled), "true")
    assert verdict.score is None and "not a reward" in verdict.infra_error


@pytest.mark.docker
def test_tests_past_their_time_limit_score_zero_and_task_toml_sets_the_users(tmp_path, docker_client, base_image):
    """[verifier].timeout_sec kills a hanging test.sh: 0, error verifier_timeout. [agent].user runs the agent's
    script (nobody: it cannot write /app), [verifier].user the tests."""
    toml = "[agent]\nuser = 'nobody'\n[verifier]\ntimeout_sec = 2\n"
    hanging = task_dirs.truth_of(task_dirs.read_task(variant(tmp_path, "fix-median", toml=toml,
                                                             test_sh="#!/bin/bash\nsleep 60\n")))
    task_dirs.ensure_image(docker_client, hanging)
    verdict = grade(hanging, "touch /app/x")
    assert verdict.score == 0.0 and verdict.error == "verifier_timeout"
    assert verdict.output.startswith("[agent exit 1]")  # nobody may not write /app
    toml = "[agent]\nuser = 'nobody'\n[verifier]\nuser = 'root'\n"
    users = task_dirs.truth_of(task_dirs.read_task(variant(tmp_path / "b", "fix-median", toml=toml, test_sh=(
        "#!/bin/bash\nif [ \"$(id -un)\" = root ] && [ \"$(cat /tmp/who)\" = nobody ]; then echo 1; else echo 0; fi "
        "> /logs/verifier/reward.txt\n"))))
    assert grade(users, "id -un > /tmp/who").score == 1.0


# ------------------------------------------------------------------------------------------ kiln's own agent loop

@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return policy.load_tokenizer(tiny.make_tiny_model(tmp_path_factory.mktemp("tiny"), CORPUS))


def tagged(row: dict, marker: str) -> dict:
    (user,) = row["prompt"]
    return row | {"prompt": [user | {"content": user["content"] + f"\n[{marker}]"}]}


@pytest.mark.docker
def test_the_agent_loop_in_the_task_container_scores_by_the_tests_and_its_script_replays(built, docker_client, rows,
                                                                                         tokenizer):
    scripts = {
        "fix-editor": [call("bash", command="ls /tests /solution; cat stats.py"),
                       call("str_replace_editor", command="str_replace", path="/app/stats.py", old_str=MEDIAN_BUG,
                            new_str=MEDIAN_FIX),
                       call("submit")],
        "noop": [call("bash", command="echo 1 > /logs/verifier/reward.txt && pwd"), "I am done."],
        "count": [call("bash", command="grep -h ERROR logs/*.log | wc -l > error_count.txt"), call("submit")],
    }
    task_of = {"fix-editor": "fix-median", "noop": "fix-median", "count": "count-errors"}
    engine = ScriptedEngine(tokenizer, scripts)
    batch = [tagged(rows[task_of[marker]], marker) for marker in scripts]
    samples, metrics = rollout.multi_turn(engine, tokenizer, batch, 1, engines.Sampling(max_new_tokens=600),
                                          tools.container_toolbox, LIMITS)
    assert own_containers(docker_client) == []  # each container went once its tests ran
    by = dict(zip(scripts, samples))
    for marker, s in by.items():
        assert chat.check_tito(tokenizer, s, s.info["messages"], s.info["tools"]) == {}, marker
        assert s.info["tools"] == tools.TASK_TOOLS and s.text.startswith("#!/bin/bash\n")
    seen = next(m["content"] for m in by["fix-editor"].info["messages"] if m["role"] == "tool")
    assert "ls: cannot access '/tests'" in seen and "ls: cannot access '/solution'" in seen  # hidden from the agent
    assert "<output>\n/app\n" in next(m["content"] for m in by["noop"].info["messages"] if m["role"] == "tool")
    scored = rewards.score_batch([s.row for s in samples], [s.text for s in samples],
                                 sample_infos=[s.info for s in samples])
    assert [r.score for r in scored] == [1.0, 0.0, 1.0]  # the planted reward.txt of "noop" is gone before the tests
    replayed = [rewards.score(s.row, s.text) for s in samples]  # no verdict: the script runs in a fresh container
    assert [r.score for r in replayed] == [1.0, 0.0, 1.0]
    assert "swe/container_seconds" in metrics  # the task containers' time is accounted like a SWE instance's


@pytest.mark.docker
def test_the_agents_time_is_the_tasks_then_the_tests_run(tmp_path, docker_client, base_image, tokenizer):
    row = task_dirs.read_task(variant(tmp_path, "count-errors", toml="[agent]\ntimeout_sec = 2\n"))
    task_dirs.ensure_image(docker_client, task_dirs.truth_of(row))
    scripts = {"slow": [call("bash", command="sleep 30; echo never", timeout=60),
                        call("bash", command="grep -h ERROR logs/*.log | wc -l > error_count.txt"), "done"]}
    samples, _ = rollout.multi_turn(ScriptedEngine(tokenizer, scripts), tokenizer, [tagged(row, "slow")], 1,
                                    engines.Sampling(max_new_tokens=600), tools.container_toolbox, LIMITS)
    (s,) = samples
    results = [m["content"] for m in s.info["messages"] if m["role"] == "tool"]
    assert "killed after" in results[0]  # cut at the task's 2 s, not the 60 s asked for
    assert s.info["agent_timeout"] and s.finish_reason == "submit" and len(results) == 1  # the next call ended it
    assert s.info["task_verdict"]["score"] == 0.0 and own_containers(docker_client) == []


@pytest.mark.after_suite  # a 2-rank torchrun, a container per trajectory and its tests: 1-2 minutes (make test-long)
@pytest.mark.docker
def test_two_rank_grpo_on_task_rows_scores_by_their_tests_leaves_out_infra_failures_and_no_container(
        built, docker_client, tmp_path):
    """fix-median and a copy whose tests write no reward, one per rank, two trajectories each: the step completes on
    the two scored samples, the other two are left out and counted, no container is left."""
    variant(tmp_path / "tasks", "fix-median")
    variant(tmp_path / "tasks", "text-kit", test_sh="#!/bin/bash\necho 'no reward file'\n").rename(
        tmp_path / "tasks" / "no-reward")
    data_prep.tasks(tmp_path / "tasks", tmp_path / "tasks.parquet", build=False)
    model = tiny.make_tiny_model(tmp_path / "model", CORPUS, max_position_embeddings=8192)
    subprocess.run([*ranks.torchrun(2, ROOT / "train_grpo.py"), "--model", str(model), "--data",
                    str(tmp_path / "tasks.parquet"), "--output-dir", str(tmp_path / "out"), "--prompts-per-step", "2",
                    "--group-size", "2", "--max-new-tokens", "16", "--total-steps", "1", "--save-every", "0",
                    "--tools", "swe", "--max-turns", "2", "--max-prompt-tokens", "4000", "--max-total-tokens",
                    "4100", "--check-tito"], check=True, timeout=900, cwd=tmp_path)
    step = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[-1])
    assert step["step"] == 1 and "swe/container_seconds" in step and step["critic/score/infra_dropped"] == 2
    assert step["critic/score/task/mean"] == 0.0  # an untrained model fixes nothing; the tests scored its samples
    assert orphans(docker_client) == []
