"""The SWE agent loop against the real Docker daemon and the offline SWE-bench instances (swe_instances.py):
scripted assistant turns call bash, str_replace_editor and submit in the instance's container through kiln's
token-in-token-out multi-turn loop; the container's diff is graded by SWE-bench's own grading; no container outlives
its trajectory, whatever ends it.
"""
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
import chat  # noqa: E402
import containers  # noqa: E402
import engines  # noqa: E402
import policy  # noqa: E402
import rewards  # noqa: E402
import swe_grading  # noqa: E402
import rollout  # noqa: E402
import ranks  # noqa: E402
import task_rows  # noqa: E402
import tiny  # noqa: E402
import tools  # noqa: E402
from test_multiturn import CORPUS, ScriptedEngine  # noqa: E402
from test_swebench import DJANGO, M1359, docker_client, swe_rows  # noqa: E402,F401 -- fixtures

pytestmark = pytest.mark.docker
LIMITS = rollout.AgentLimits(max_turns=6, max_total_tokens=200_000, max_tool_response_tokens=2000)
FIELDS = "/testbed/src/marshmallow/fields.py"
BUG, FIX = "getattr(schema.opts, self.SCHEMA_OPTS_VAR_NAME)", "getattr(self.root.opts, self.SCHEMA_OPTS_VAR_NAME)"


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return policy.load_tokenizer(tiny.make_tiny_model(tmp_path_factory.mktemp("tiny"), CORPUS))


def tagged(row: dict, marker: str) -> dict:
    """The row with `marker` in its user message, so the scripted engine knows which script a trajectory follows."""
    system, user = row["prompt"]
    return row | {"prompt": [system, user | {"content": user["content"] + f"\n[{marker}]"}]}


def own_containers(client) -> list:
    return client.containers.list(all=True, filters={"label": f"{containers.OWNER}={containers.owner_label()}"})


def orphans(client) -> list[str]:
    """Kiln containers on this host whose owner process is gone: after a subprocess's run, what it left behind (it
    swept earlier orphans at its start; other live processes' containers are none of the test's business)."""
    host = containers.owner_label().rpartition(":")[0]
    owners = [c.labels[containers.OWNER] for c in client.containers.list(all=True, filters={"label": containers.OWNER})]
    return [o for o in owners if o.rpartition(":")[0] == host and not Path(f"/proc/{o.rpartition(':')[2]}").exists()]


def test_scripted_agent_fix_resolves_noop_does_not_and_nothing_is_left(docker_client, swe_rows, tokenizer):
    row = swe_rows[M1359]
    scripts = {
        "task-sed": [call("bash", command="grep -n 'schema.opts' src/marshmallow/fields.py"),
                     call("bash", command=f"sed -i 's/{BUG}/{FIX}/' src/marshmallow/fields.py && git diff --stat"),
                     "I fixed the lookup of the schema options.\n" + call("submit")],
        "task-editor": [call("str_replace_editor", command="view", path=FIELDS, view_range=[1110, 1120]),
                        call("str_replace_editor", command="str_replace", path=FIELDS, old_str=BUG, new_str=FIX),
                        call("submit")],
        "task-noop": [call("bash", command="ls src/marshmallow && cat nothing.txt"),
                      call("str_replace_editor", command="create", path="/testbed/NOTES.txt", file_text="a note\n"),
                      "Nothing to fix, I think."],
    }
    engine = ScriptedEngine(tokenizer, scripts)
    rows = [tagged(row, marker) for marker in scripts]
    samples, metrics = rollout.multi_turn(engine, tokenizer, rows, 1, engines.Sampling(max_new_tokens=400),
                                         tools.swe_toolbox, LIMITS)
    assert own_containers(docker_client) == []  # every trajectory's container is gone once its diff is taken
    by_marker = {marker: s for marker, s in zip(scripts, samples)}
    for marker, s in by_marker.items():
        assert chat.check_tito(tokenizer, s, s.info["messages"], s.info["tools"]) == {}, marker
        assert s.info["turns"] == 3 and s.info["container_seconds"] > 0 and s.info["agent_seconds"] > 0
    sed, editor, noop = by_marker["task-sed"], by_marker["task-editor"], by_marker["task-noop"]
    tool_texts = [m["content"] for m in sed.info["messages"] if m["role"] == "tool"]
    assert tool_texts[0].startswith("<returncode>0</returncode>") and BUG in tool_texts[0]
    assert "1 file changed" in tool_texts[1]
    assert sed.finish_reason == editor.finish_reason == "submit" and noop.finish_reason == "stop"
    assert sed.info["messages"][-1]["role"] == "assistant"  # the submit's result is not part of the trajectory
    assert FIX in sed.text and sed.text.startswith("diff --git a/src/marshmallow/fields.py")  # the completion: a diff
    assert editor.text == sed.text
    noop_tools = [m["content"] for m in noop.info["messages"] if m["role"] == "tool"]
    assert noop_tools[0].startswith("<returncode>1</returncode>") and "No such file" in noop_tools[0]
    assert noop_tools[1] == "Created /testbed/NOTES.txt." and "b/NOTES.txt\nnew file mode" in noop.text
    assert noop.info["tool_errors"] == 0  # a failing command is the model's information, not a tool error
    graded = [rewards.score(s.row, s.text) for s in samples]
    assert [g.score for g in graded] == [1.0, 1.0, -1.0]
    assert graded[0].info["f2p"] == [1, 1] and graded[2].info["f2p"] == [0, 1]
    assert metrics["rollout/finish_submit_frac"] == pytest.approx(2 / 3) and metrics["rollout/truncated_frac"] == 0
    assert metrics["swe/container_seconds"] > 0 and metrics["swe/diff_errors"] == 0
    assert swe_grading.swe_metrics([g.info for g in graded]) == {
        "swe/resolve_rate": pytest.approx(2 / 3), "swe/f2p_pass_frac": pytest.approx(2 / 3),
        "swe/p2p_pass_frac": 1.0, "swe/patch_apply_failures": 0, "swe/dropped_files": 0, "swe/tampered": 0,
        "swe/suspicious": 0, "swe/docker_retries": 0}


def test_scripted_agent_fixes_the_django_instance_through_bash_and_the_editor(docker_client, swe_rows, tokenizer):
    """django-11099: the username validators' `$` also matches before a trailing newline; the agent finds them with
    grep, fixes one with str_replace_editor and the other with sed, and the container's diff resolves the instance
    under swebench's Django log parser."""
    validators = "/testbed/django/contrib/auth/validators.py"
    old = "class ASCIIUsernameValidator(validators.RegexValidator):\n    regex = r'^[\\w.@+-]+$'"
    script = [call("bash", command="grep -rn \"regex = r'\" django/contrib/auth/"),
              call("str_replace_editor", command="str_replace", path=validators, old_str=old,
                   new_str=old.replace("+$'", "+\\Z'")),
              call("bash", command="sed -i \"/class UnicodeUsernameValidator/,/regex/s/+\\$'$/+\\\\\\\\Z'/\" "
                                   "django/contrib/auth/validators.py && grep -c '+.Z.$' "
                                   "django/contrib/auth/validators.py"),
              call("submit")]
    engine = ScriptedEngine(tokenizer, {"task-django": script})
    samples, _ = rollout.multi_turn(engine, tokenizer, [tagged(swe_rows[DJANGO], "task-django")], 1,
                                   engines.Sampling(max_new_tokens=400), tools.swe_toolbox, LIMITS)
    sample = samples[0]
    tool_texts = [m["content"] for m in sample.info["messages"] if m["role"] == "tool"]
    assert tool_texts[0].count("regex = r'^[\\w.@+-]+$'") == 2 and tool_texts[1] == f"Edited {validators}."
    assert tool_texts[2] == "<returncode>0</returncode>\n<output>\n2\n</output>"
    assert sample.finish_reason == "submit" and sample.text.count("+    regex = r'^[\\w.@+-]+\\Z'") == 2
    assert chat.check_tito(tokenizer, sample, sample.info["messages"], sample.info["tools"]) == {}
    assert set(sample.info) <= set(rollout.INFO_KEYS) and "container_seconds" in sample.info  # the swe toolbox's too
    graded = rewards.score(sample.row, sample.text)
    assert graded.score == 1.0 and graded.info["f2p"] == [2, 2] and graded.info["p2p"] == [20, 20]
    assert own_containers(docker_client) == []


def test_editor_refuses_what_it_cannot_do_as_tool_errors(docker_client, swe_rows):
    box = tools.swe_toolbox(swe_rows[M1359])
    try:
        edit = box.tools["str_replace_editor"]
        cases = [({"command": "view", "path": "relative.py"}, "absolute path"),
                 ({"command": "str_replace", "path": FIELDS, "old_str": "self", "new_str": "x"}, "times in"),
                 ({"command": "create", "path": FIELDS, "file_text": "x"}, "exists already"),
                 ({"command": "insert", "path": FIELDS, "new_str": "x", "insert_line": 10**6}, "insert_line"),
                 ({"command": "undo_edit", "path": FIELDS}, "must be one of")]
        for arguments, message in cases:
            result = edit(arguments)
            assert result.error and message in result.text, (arguments, result.text)
        assert box.tools["bash"]({"command": "ls", "timeout": 10**6}).error
        slow = box.tools["bash"]({"command": "sleep 30", "timeout": 1})
        assert slow.error and "killed after 1 s" in slow.text
        assert not edit({"command": "insert", "path": FIELDS, "new_str": "# top", "insert_line": 0}).error
        assert edit({"command": "view", "path": FIELDS, "view_range": [1, 1]}).text == "     1\t# top\n"
    finally:
        box.close()
    assert own_containers(docker_client) == [] and box.info["completion"].startswith("diff --git")


def test_wall_limit_ends_a_trajectory_and_a_crash_leaves_no_container(docker_client, swe_rows, tokenizer):
    row = tagged(swe_rows[M1359], "task-slow")
    engine = ScriptedEngine(tokenizer, {"task-slow": [call("bash", command="sleep 2")] * 6})
    limits = rollout.AgentLimits(max_turns=6, max_total_tokens=200_000, max_seconds=1.0)
    samples, metrics = rollout.multi_turn(engine, tokenizer, [row], 1, engines.Sampling(max_new_tokens=400),
                                         tools.swe_toolbox, limits)
    # checked before each turn's tools: the first `sleep 2` (or, on a slow machine, the container's start) passes the
    # 1 s limit, so the trajectory ends after one or two turns of the six scripted, whatever the load
    assert samples[0].finish_reason == "max_seconds" and samples[0].info["turns"] in (1, 2)
    assert metrics["rollout/finish_max_seconds_frac"] == 1.0 and own_containers(docker_client) == []

    class Crash(RuntimeError):
        pass

    def crash_on_second_turn(prompts, sampling, real=engine.generate):
        if engine.calls == 1:
            raise Crash("the engine died")
        return real(prompts, sampling)
    engine.calls = 0
    engine.generate = crash_on_second_turn
    with pytest.raises(Crash):
        rollout.multi_turn(engine, tokenizer, [row, row], 1, engines.Sampling(max_new_tokens=400),
                           tools.swe_toolbox, limits)
    assert own_containers(docker_client) == []


@pytest.mark.slow
def test_two_rank_grpo_on_swebench_rows_leaves_no_container(docker_client, swe_rows, tmp_path):
    rows = [swe_rows[i] for i in sorted(swe_rows) if i.startswith("marshmallow")]
    task_rows.write_rows(rows, tmp_path / "swe.parquet")
    model = tiny.make_tiny_model(tmp_path / "model", CORPUS, max_position_embeddings=8192)
    subprocess.run([*ranks.torchrun(2, ROOT / "train_grpo.py"), "--model", str(model), "--data", str(tmp_path / "swe.parquet"),
                    "--output-dir", str(tmp_path / "out"), "--prompts-per-step", "2", "--group-size", "2",
                    "--max-new-tokens", "16", "--total-steps", "1", "--save-every", "0", "--tools", "swe",
                    "--max-turns", "2", "--max-prompt-tokens", "4000", "--max-total-tokens", "4100",
                    "--check-tito"], check=True, timeout=900, cwd=tmp_path)
    step = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[-1])
    assert step["step"] == 1 and step["swe/container_seconds"] > 0 and step["tools/agent_seconds_mean"] > 0
    assert step["swe/resolve_rate"] == 0.0 and step["critic/score/mean"] == -1.0  # an untrained model changes nothing
    assert "tools/tito_drift_frac" in step and step["swe/patch_apply_failures"] == step["swe/dropped_files"] == 0
    assert orphans(docker_client) == []  # the trainer's agent and grading containers are all gone


@pytest.mark.slow
def test_a_ppo_step_on_swebench_rows_leaves_no_container(docker_client, swe_rows, tmp_path):
    rows = [swe_rows[i] for i in sorted(swe_rows) if i.startswith("marshmallow")]
    task_rows.write_rows(rows, tmp_path / "swe.parquet")
    model = tiny.make_tiny_model(tmp_path / "model", CORPUS, max_position_embeddings=8192)
    subprocess.run([*ranks.torchrun(1, ROOT / "train_ppo.py"), "--model", str(model), "--data", str(tmp_path / "swe.parquet"),
                    "--eval-data", "None", "--output-dir", str(tmp_path / "out"), "--engine", "hf",
                    "--prompts-per-step", "2", "--minibatches", "1", "--max-new-tokens", "16", "--total-steps", "1",
                    "--save-every", "0", "--tools", "swe", "--max-turns", "2", "--max-prompt-tokens", "4000",
                    "--max-total-tokens", "4100"], check=True, timeout=900, cwd=tmp_path)
    step = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[-1])
    assert step["step"] == 1 and step["swe/container_seconds"] > 0 and step["tools/agent_seconds_mean"] > 0
    assert step["swe/resolve_rate"] == 0.0 and step["critic/score/mean"] == -1.0  # an untrained model changes nothing
    assert "critic/vf_loss" in step and step["swe/patch_apply_failures"] == 0
    assert orphans(docker_client) == []  # the trainer's agent and grading containers are all gone


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_trainer_interrupted_mid_rollout_removes_its_containers(docker_client, swe_rows, tmp_path, signum):
    """What train_grpo --tools swe installs at setup: Ctrl-C (SIGINT) and torchrun's SIGTERM remove this process's
    containers on the way out."""
    task_rows.write_rows([swe_rows[M1359]], tmp_path / "row.parquet")
    script = (f"import sys, time; sys.path.insert(0, {str(ROOT)!r}); import containers, task_rows, tools\n"
              "containers.remove_owned_at_exit(containers.shared_client())\n"
              f"boxes = [tools.swe_toolbox(task_rows.load_rows({str(tmp_path / 'row.parquet')!r})[0]) "
              "for _ in range(2)]\n"
              "print('ready', flush=True)\ntime.sleep(600)\n")
    # A suite started in the background (`make test &`) ignores SIGINT, and a child inherits that: give the trainer
    # the default disposition a terminal's Ctrl-C meets.
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert trainer.stdout.readline() == "ready\n"
        owner = f"{containers.owner_label().rpartition(':')[0]}:{trainer.pid}"
        assert len(docker_client.containers.list(filters={"label": f"{containers.OWNER}={owner}"})) == 2
        trainer.send_signal(signum)
        assert trainer.wait(timeout=60) != 0
    finally:
        trainer.kill()
    assert docker_client.containers.list(all=True, filters={"label": f"{containers.OWNER}={owner}"}) == []


@pytest.mark.slow
def test_generate_with_swe_tools_writes_the_containers_diffs(docker_client, swe_rows, tmp_path):
    """`generate.py --tools swe`: a line per sample whose completion is its container's diff (an untrained
    model changes nothing: ""); no container is left."""
    task_rows.write_rows([swe_rows[M1359]], tmp_path / "swe.parquet")
    model = tiny.make_tiny_model(tmp_path / "model", CORPUS, max_position_embeddings=8192)
    generated = subprocess.run(
        [sys.executable, str(ROOT / "generate.py"), "--model", str(model), "--data",
         str(tmp_path / "swe.parquet"), "--out", str(tmp_path / "samples.jsonl"), "--tools", "swe", "--n-samples", "2",
         "--temperature", "1.0", "--max-new-tokens", "8", "--max-turns", "2", "--max-prompt-tokens", "4000",
         "--max-total-tokens", "4100", "--dtype", "float32"], capture_output=True, text=True, timeout=600)
    assert generated.returncode == 0, generated.stderr[-3000:]
    lines = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [(line["task_id"], line["completion"]) for line in lines] == [(f"swebench/{M1359}", "")] * 2
    assert orphans(docker_client) == []
