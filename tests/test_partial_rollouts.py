"""Partial rollouts across steps (partial_rollouts.py, train_grpo --partial-rollouts): a phase returns whole groups
only, the oldest first; unfinished trajectories pause with their tokens, engine logprobs, versions and live tool
state and go on in the next phase; every token records the version that sampled it; a phase waits for a trajectory
the staleness bound would pass, and a complete group left waiting past it restarts from its prompts; nothing leaks on
an error or Ctrl-C; the loss corrects carried tokens with the engine logprobs recorded when they were sampled; a
checkpoint keeps the groups in flight, which a resumed run regenerates; the default multi-turn loop knows nothing of
them but one hook. The engine is scripted (test_async_rollout's TokenEngine: replies depend only on a trajectory's
tokens)."""
import ast
import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import chat  # noqa: E402
import engines  # noqa: E402
import losses  # noqa: E402
import partial_rollouts  # noqa: E402
import rewards  # noqa: E402
import rollout  # noqa: E402
import task_rows  # noqa: E402
import tiny  # noqa: E402
import tools  # noqa: E402
import train_grpo  # noqa: E402
from test_async_rollout import CORPUS, TokenEngine, call, latency_toolbox  # noqa: E402
from test_async_rollout import tokenizer  # noqa: E402,F401,F811 -- a fixture

SAMPLING = engines.Sampling(max_new_tokens=200)
LIMITS = rollout.AgentLimits(max_turns=8, max_total_tokens=900, max_tool_response_tokens=16)
SCRIPTS = {"task-S": ["The answer is 3."], "task-T": ["It is 3."], "task-U": ["3"],
           "task-L": [call("x = 41"), call("print(x + 1)"), "The answer is 42."],
           "task-Z": [call("print(1)")] * 5 + ["done"]}


def rows(*markers: str) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": f"{m}: solve it"}]} for m in markers]


def recording(new_toolbox, opened: list):
    """`new_toolbox` that keeps every toolbox it makes in `opened`."""
    def make(row):
        opened.append(new_toolbox(row))
        return opened[-1]
    return make


def counting_closes(new_toolbox, closed: list):
    """`new_toolbox` whose toolboxes append their row's marker to `closed` when closed."""
    def make(row):
        box = new_toolbox(row)
        box.close = lambda: closed.append(row["prompt"][0]["content"].split(":")[0])
        return box
    return make


def session_open(box: tools.ToolBox) -> bool:
    return box.close.__self__._job is not None  # python_toolbox's close is its PythonSession's


def by_group(samples: list[rollout.Sample]) -> dict[int, list[rollout.Sample]]:
    groups = {}
    for s in samples:
        groups.setdefault(s.group, []).append(s)
    return groups


def test_a_paused_trajectory_resumes_with_its_python_session_and_versions(tokenizer):
    """Phase 0 (version 0) needs one group: task-S's completes on the first engine call; task-L's two trajectories
    have set x = 41 in their sessions and pause. Phase 1 (version 1) resumes them in the same sessions: print(x + 1)
    says 42. Tokens up to the pause are version 0, the rest version 1."""
    opened = []
    in_flight = partial_rollouts.InFlight(groups=1, max_staleness=1)
    engine = TokenEngine(tokenizer, SCRIPTS)
    first, metrics = rollout.multi_turn(engine, tokenizer, rows("task-S", "task-L"), 2, SAMPLING,
                                        recording(tools.python_toolbox, opened), LIMITS, in_flight=in_flight)
    assert [s.group for s in first] == [0, 0] and engine.sizes == [4]
    assert metrics["partial/paused"] == 2 and metrics["partial/groups_in_flight"] == 1
    paused = in_flight.trajectories
    assert [(t.group, t.turns, t.finish_reason) for t in paused] == [(1, 1, ""), (1, 1, "")]
    assert all(session_open(t.box) for t in paused)  # alive between phases, with x set
    assert not any(session_open(b) for b in opened if b not in [t.box for t in paused])
    before = [len(t.completion_ids) for t in paused]
    assert all(t.versions == [0] * n for t, n in zip(paused, before))

    second, metrics = rollout.multi_turn(engine, tokenizer, [], 2, SAMPLING, recording(tools.python_toolbox, opened),
                                         LIMITS, in_flight=in_flight, version=1)
    assert metrics["partial/resumed"] == 2 and metrics["partial/restarted_stale"] == 0
    assert metrics["partial/paused"] == 0 and in_flight.trajectories == [] and sum(engine.sizes[1:]) == 4  # 2 turns
    for s, n in zip(second, before):
        assert s.group == 1 and s.finish_reason == "stop"
        assert [m["content"] for m in s.info["messages"] if m["role"] == "tool"] == ["(no output)", "42\n"]
        assert s.versions == [0] * n + [1] * (len(s.completion_ids) - n)
        assert chat.check_tito(tokenizer, s, s.info["messages"], s.info["tools"]) == {}
    assert not any(session_open(b) for b in opened)


def test_a_trajectory_the_bound_would_pass_finishes_in_its_phase(tokenizer):
    """task-Z needs 6 turns; each phase needs one group. Phase 0: task-S's group completes on the first engine call
    and task-Z pauses after one turn. Phase 1: a fresh one-turn group completes at once, but task-Z's version-0 tokens
    would be 2 versions old in phase 2, past the bound (1): the phase waits for it, and returns it (the stalest),
    with no work thrown away. The fresh group waits, complete, and goes in phase 2 with no engine call."""
    closed = []
    in_flight = partial_rollouts.InFlight(groups=1, max_staleness=1)
    engine = TokenEngine(tokenizer, SCRIPTS)
    toolbox = counting_closes(latency_toolbox(0, 0.0), closed)
    returned, turns = [], []  # trajectory turns the engine ran, per phase
    for version, new in enumerate([("task-Z", "task-S"), ("task-T",), ()]):
        samples, metrics = rollout.multi_turn(engine, tokenizer, rows(*new), 2, SAMPLING, toolbox, LIMITS,
                                              first_group=10 * version, in_flight=in_flight, version=version)
        returned.append(sorted(by_group(samples)))
        turns.append(sum(engine.sizes) - sum(turns))
        assert all(len(members) == 2 for members in by_group(samples).values())  # whole groups
        assert metrics.get("partial/restarted_stale", 0) == 0
        if version == 1:
            assert metrics["partial/paused"] == 0
            for s in samples:
                assert s.finish_reason == "stop" and s.info["turns"] == 6
                first = s.versions.index(1)
                assert 0 < first and s.versions == [0] * first + [1] * (len(s.versions) - first)
    assert returned == [[1], [0], [10]] and turns == [4, 2 + 2 * 5, 0]
    assert closed.count("task-Z") == 2 and len(closed) == 6  # each toolbox once, when its group was returned


def test_a_complete_group_left_past_the_bound_restarts_from_its_prompts(tokenizer):
    """Three one-turn groups complete in phase 0's one engine call; each phase takes one. The third waits two phases:
    in phase 2 its version-0 tokens would train 2 versions late, so it starts again from its prompts on fresh
    toolboxes, and is returned with version-2 tokens only."""
    closed = []
    in_flight = partial_rollouts.InFlight(groups=1, max_staleness=1)
    engine = TokenEngine(tokenizer, SCRIPTS)
    toolbox = counting_closes(latency_toolbox(0, 0.0), closed)
    returned = []
    for version, new in enumerate([("task-S", "task-T", "task-U"), (), ()]):
        samples, metrics = rollout.multi_turn(engine, tokenizer, rows(*new), 2, SAMPLING, toolbox, LIMITS,
                                              in_flight=in_flight, version=version)
        returned.append([(s.group, set(s.versions)) for s in samples])
    assert returned == [[(0, {0})] * 2, [(1, {0})] * 2, [(2, {2})] * 2] and metrics["partial/restarted_stale"] == 2
    assert closed.count("task-U") == 4 and engine.sizes == [6, 2]  # the stale toolboxes, then the restarted ones


def test_complete_groups_beyond_the_need_wait_stalest_first(tokenizer):
    """Two groups a phase. Phase 0 completes groups 10-12 in one call and returns 10 and 11; 12 waits. Phase 1
    completes new groups 0 and 1 in one call: of 0, 1 and 12 it returns 12 (its tokens are a version older) and 0.
    Phase 2 has only group 1 left: it returns it alone, with no engine call (it was complete already)."""
    in_flight = partial_rollouts.InFlight(groups=2, max_staleness=1)
    engine = TokenEngine(tokenizer, SCRIPTS)
    toolbox = latency_toolbox(0, 0.0)
    first, metrics = rollout.multi_turn(engine, tokenizer, rows("task-S", "task-T", "task-U"), 2, SAMPLING, toolbox,
                                        LIMITS, first_group=10, in_flight=in_flight)
    assert [s.group for s in first] == [10, 10, 11, 11] and metrics["partial/paused"] == 0
    assert metrics["partial/groups_in_flight"] == 1 and in_flight.group_ids() == [12]
    second, _ = rollout.multi_turn(engine, tokenizer, rows("task-S", "task-T"), 2, SAMPLING, toolbox, LIMITS,
                                   in_flight=in_flight, version=1)
    assert [(s.group, set(s.versions)) for s in second] == [(0, {1})] * 2 + [(12, {0})] * 2
    third, _ = rollout.multi_turn(engine, tokenizer, [], 2, SAMPLING, toolbox, LIMITS, in_flight=in_flight, version=2)
    assert [s.group for s in third] == [1, 1] and engine.sizes == [6, 4] and in_flight.group_ids() == []


class FailingEngine(TokenEngine):
    """TokenEngine that raises `error` at its call number `at` (0-based)."""

    def __init__(self, tokenizer, scripts, error: BaseException, at: int):
        super().__init__(tokenizer, scripts)
        self.error, self.at = error, at

    def generate(self, prompts, sampling):
        if len(self.sizes) == self.at:
            raise self.error
        return super().generate(prompts, sampling)


@pytest.mark.parametrize("error", [RuntimeError("engine died"), KeyboardInterrupt()])
def test_an_error_mid_phase_closes_every_session_carried_and_new(tokenizer, error):
    """task-L pauses in phase 0 with its sessions open; in phase 1 the engine's second call fails after the first one
    sent task-L and a new task-Z to their tools (their sessions running): no session is left open, nothing stays in
    flight."""
    opened = []
    in_flight = partial_rollouts.InFlight(groups=1, max_staleness=1)
    toolbox = recording(tools.python_toolbox, opened)
    engine = FailingEngine(tokenizer, SCRIPTS, error, at=2)
    rollout.multi_turn(engine, tokenizer, rows("task-S", "task-L"), 2, SAMPLING, toolbox, LIMITS, in_flight=in_flight)
    assert sum(map(session_open, opened)) == 2
    with pytest.raises(type(error)):
        rollout.multi_turn(engine, tokenizer, rows("task-Z"), 2, SAMPLING, toolbox, LIMITS, first_group=2,
                           in_flight=in_flight, version=1)
    assert len(opened) == 6 and engine.sizes == [4, 4]  # task-Z's two sessions ran a call
    assert not any(map(session_open, opened)) and in_flight.trajectories == []


def test_loss_weights_of_tokens_from_two_versions_by_hand():
    """Step 1 trains a carried trajectory: tokens 0-1 sampled by version 0 (the engine's logprobs then: .25 and .4
    where the current policy gives .5 and .2), tokens 2-3 by version 1 (the same numbers on both sides: no mismatch),
    then padding. rho = 2, .5, 1, 1."""
    old = torch.log(torch.tensor([[0.5, 0.2, 0.4, 0.3, 1.0]]))
    engine = torch.log(torch.tensor([[0.25, 0.4, 0.4, 0.3, 1.0]]))
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    weights, kept, _ = losses.rollout_correction(old, engine, mask, "token", 1.5)
    assert weights[0].tolist() == pytest.approx([1.5, 0.5, 1.0, 1.0, 0.0])  # min(rho, 1.5), 0 off the mask
    assert kept.tolist() == mask.tolist()
    weights, _, _ = losses.rollout_correction(old, engine, mask, "sequence", 1.5)
    assert weights[0].tolist() == pytest.approx([1.0] * 4 + [0.0])  # min(2 * .5 * 1 * 1, 1.5) on every token
    _, kept, stats = losses.rollout_correction(old, engine, mask, "token", 1.5, rs="token_k1", rs_threshold=1.5)
    assert kept.tolist() == [[0, 0, 1, 1, 0]]  # 2 and .5 leave [1/1.5, 1.5]: the stale tokens are rejected
    assert stats["rollout_rs_masked_fraction"] == pytest.approx(0.5)


# train_grpo with --partial-rollouts, in one process: positions 0-3 of the data order are task-L, task-S, task-S,
# task-L; positions 4-5 task-L, 6-7 task-S. Step 0 takes positions 0-3 (two rounds: nothing is in flight) and returns
# groups 1 and 2; the task-L groups 0 and 3 pause after x = 41. Step 1 (positions 4-5) resumes them: they finish on
# the second engine call (print(x + 1) -> 42), while groups 4-5 pause.
KINDS = ["task-L", "task-S", "task-S", "task-L", "task-L", "task-L", "task-S", "task-S"]


class TrainerEngine(TokenEngine):
    def generate(self, prompts, sampling, seeds=None):
        return super().generate(prompts, sampling)

    def load_weights(self, weights):
        list(weights)  # consumed as an engine does: the stream gathers each weight as it is read

    def sleep(self):
        return None

    def wake_up(self):
        return None


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("partial")
    order = task_rows.in_epoch_order(list(range(len(KINDS))), 0, len(KINDS), 0)
    kinds = [None] * len(KINDS)
    for position, item in enumerate(order):
        kinds[item] = KINDS[position]
    tests = {"test_list": ["assert True"], "test_setup_code": ""}
    task_rows.write_rows([task_rows.make_row("toy", f"{kind}: solve it", tests, {"index": k, "split": "train"})
                          for k, kind in enumerate(kinds)], root / "train.parquet")
    return root, tiny.make_tiny_model(root / "model", CORPUS, seed=0)


def make_run(task, output_dir, **kwargs) -> train_grpo.Run:
    root, model = task
    args = train_grpo.Args(model=str(model), data=str(root / "train.parquet"), output_dir=str(output_dir),
                           total_steps=3, save_every=0, sample_every=0, lr=1e-3, tools="python", max_turns=4,
                           max_total_tokens=900, max_tool_response_tokens=16, prompts_per_step=2, group_size=2,
                           partial_rollouts=True, max_staleness=1, rollout_is="token", check_tito=True, **kwargs)
    run = train_grpo.setup(args, lambda rows, texts, sample_infos=None: [rewards.Reward(float("42" in t))
                                                                      for t in texts])
    run.engine = TrainerEngine(run.tokenizer, SCRIPTS)
    return run


def test_grpo_trains_carried_groups_whole_with_versions_and_corrected_weights(task, tmp_path, monkeypatch, capsys):
    """Two steps of train_step with --partial-rollouts, the loss's correction weights caught on their way; a
    checkpoint after them keeps the groups in flight, a resumed run regenerates them from their prompts and says so;
    main() releases the paused sessions when training is interrupted. 3 s (the module: 15-30 s with its imports)."""
    opened, batches, corrections = [], [], []
    monkeypatch.setitem(rollout.TOOLBOXES, "python", recording(tools.python_toolbox, opened))
    real_update, real_correction = train_grpo.update_policy, losses.rollout_correction
    monkeypatch.setattr(train_grpo, "update_policy", lambda run, batch, *rest: (
        batches.append(list(batch)), real_update(run, batch, *rest))[1])
    monkeypatch.setattr(losses, "rollout_correction", lambda *a, **k: (
        corrections.append((a, real_correction(*a, **k))), corrections[-1][1])[1])
    run = make_run(task, tmp_path / "out")

    metrics = train_grpo.train_step(run)
    run.step += 1
    assert [(s.group, s.row["prompt"][0]["content"][:6]) for s in batches[0]] == [(1, "task-S")] * 2 + [
        (2, "task-S")] * 2
    assert metrics["partial/paused"] == 4 and metrics["partial/staleness_max"] == 0 and run.data_pos == 4
    assert run.in_flight.group_ids() == [0, 3] and all(session_open(t.box) for t in run.in_flight.trajectories)

    corrections.clear()
    metrics = train_grpo.train_step(run)
    run.step += 1
    batch = batches[1]
    assert [s.group for s in batch] == [0, 0, 3, 3] and run.in_flight.group_ids() == [4, 5] and run.data_pos == 6
    # How many of groups 4 and 5 finish before the phase ends is timing (tool calls run in the sandbox): 3 or 4 paused.
    unfinished = sum(not traj.finish_reason for traj in run.in_flight.trajectories)
    assert metrics["partial/resumed"] == 4 and metrics["partial/paused"] == unfinished and len(
        run.in_flight.trajectories) == 4
    for s in batch:  # x = 41 was set in step 0, before the pause
        assert [m["content"] for m in s.info["messages"] if m["role"] == "tool"] == ["(no output)", "42\n"]
    ages = [1 - v for s in batch for v, m in zip(s.versions, s.loss_mask) if m]
    assert metrics["partial/staleness_max"] == 1 and metrics["partial/staleness_mean"] == pytest.approx(
        sum(ages) / len(ages)) and 0 < metrics["partial/staleness_mean"] < 1
    rows = [(old[r], engine[r], mask[r], weights[r]) for (old, engine, mask, *_), (weights, _, _) in corrections
            for r in range(len(old))]
    assert len(rows) == len(batch)
    for old, engine, mask, weights in rows:  # against the engine logprobs recorded at sampling, version 0's included
        assert any(engine[: len(s.engine_logprobs)].tolist() == pytest.approx(s.engine_logprobs)
                   and mask.sum() == sum(s.loss_mask) for s in batch)
        expected = torch.where(mask.bool(), (old - engine).exp().clamp(max=2.0), 0)
        assert weights.tolist() == pytest.approx(expected.tolist())
        assert (weights[mask.bool()] != 1).any()  # the tiny model is not the script: a real correction

    train_grpo.save(run)
    state = json.loads(next((tmp_path / "out" / "checkpoints").glob("step_*/trainer_state.json")).read_text())
    assert state["in_flight_groups"] == [4, 5]
    run.in_flight.close()
    run.log.finish()
    capsys.readouterr()
    resumed = make_run(task, tmp_path / "out", resume=True)
    assert "the 2 groups in flight at the checkpoint start again from their prompts" in capsys.readouterr().out
    assert [(g, r["extra_info"]["index"]) for g, r in resumed.in_flight.regenerate] == [
        (g, task_rows.in_epoch_order(resumed.rows, g, 1, 0)[0]["extra_info"]["index"]) for g in (4, 5)]
    metrics = train_grpo.train_step(resumed)
    assert metrics["partial/regenerated"] == 4 and resumed.data_pos == 8  # one round: groups 4-5 are in flight again

    def interrupted(run):
        raise KeyboardInterrupt
    monkeypatch.setattr(train_grpo, "setup", lambda args, score_fn: resumed)
    monkeypatch.setattr(train_grpo, "train_step", interrupted)
    assert any(session_open(t.box) for t in resumed.in_flight.trajectories)
    with pytest.raises(KeyboardInterrupt):
        train_grpo.main(resumed.args)
    assert resumed.in_flight.trajectories == [] and not any(map(session_open, opened))
    resumed.log.finish()
    assert math.isfinite(metrics["actor/pg_loss"])


def test_the_default_loop_names_partial_rollouts_at_one_hook():
    """rollout.py never imports partial_rollouts (it imports rollout) and holds none of its names. Its hook, in_flight
    for multi_turn and stop_when for run_trajectories, is branched on in one statement each and otherwise only passed
    on: collect hands in_flight to multi_turn, multi_turn's loop (_start_and_run) hands stop_when on."""
    source = Path(rollout.__file__).read_text()
    tree = ast.parse(source)
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "partial_rollouts" not in imported
    assert not {"InFlight", "staleness", "due", "complete_groups", "resume"} & set(vars(rollout))
    hooks = {}  # (function, hook) -> the source of each statement naming it (the innermost one)
    for function in (node for node in tree.body if isinstance(node, ast.FunctionDef)):
        parents = {child: node for node in ast.walk(function) for child in ast.iter_child_nodes(node)}
        for name in (node for node in ast.walk(function) if isinstance(node, ast.Name)):
            if name.id in ("in_flight", "stop_when"):
                statement = parents[name]
                while not isinstance(statement, ast.stmt):
                    statement = parents[statement]
                text = ast.get_source_segment(source, statement)
                hooks.setdefault((function.name, name.id), {})[statement.lineno] = text
    hooks = {key: list(statements.values()) for key, statements in hooks.items()}
    assert {key: len(statements) for key, statements in hooks.items()} == {
        ("collect", "in_flight"): 1, ("multi_turn", "in_flight"): 1, ("_start_and_run", "stop_when"): 1,
        ("run_trajectories", "stop_when"): 1}, hooks
    assert "in_flight is None" in hooks["multi_turn", "in_flight"][0]  # the one branch of multi_turn
    assert "stop_when is not None" in hooks["run_trajectories", "stop_when"][0]  # and of run_trajectories
