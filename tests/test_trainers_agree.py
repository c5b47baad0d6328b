"""train_grpo.py and train_ppo.py cannot drift: what they share is written once (rl_run.py: SharedArgs, Run, set-up,
evaluation, rewards and metrics, the outer loop), and this file checks that it stays so. Their Args redeclare a field
only where the algorithms differ (listed below with the reason), their code shares no run of 6 or more identical lines
but a few import lines, train_grpo imports at most 12 of kiln's modules, and both refuse the same bad runs at the
same point, before any model loads."""

import ast
import dataclasses
import difflib
import importlib.util
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import policy
import rewards
import rl_run
import task_rows
import train_grpo
import train_ppo
from test_runs import process_group, toy  # noqa: F401 -- fixtures

ROOT = Path(__file__).resolve().parent.parent
# field -> why each trainer declares it itself (its default or meaning differs between the algorithms)
ALGORITHMIC = {
    "output_dir": "each trainer writes to its own folder by default",
    "group_size": "GRPO's baseline is the group (needs >= 2); PPO's is the critic (1 = classic PPO)",
    "clip_low": "GRPO's default follows --policy-loss (GSPO clips a sequence ratio); PPO has one loss",
    "clip_high": "as clip_low",
    "kl_coef": "GRPO adds the KL to the loss; PPO subtracts it from the token rewards",
    "kl_estimator": "the reward penalty uses k1 (verl's PPO); the loss term k3 (GRPO)",
    "minibatches": "PPO updates two models per batch in several minibatches; GRPO defaults to on-policy",
    "total_steps": "PPO can count epochs over its rows (--epochs) instead of steps",
    "lr": "PPO's is the actor's (the critic has --critic-lr); GRPO's has warm-up and a schedule",
    "weight_decay": "PPO's applies to both models",
    "max_grad_norm": "PPO's applies to both models",
    "keep_checkpoints": "PPO keeps as many critic checkpoints too",
    "tools": "PPO's critic has no vision model: no codev toolbox",
}
MAX_SHARED_LINES = 20  # lines in runs of >= 6 identical lines between the two trainers (imports, today)
MAX_KILN_IMPORTS = 12  # kiln modules train_grpo.py imports


def own_fields(cls) -> dict[str, tuple[object, object, str]]:
    """name -> (type, default, docstring) of the fields `cls` itself declares, each with its docstring line."""
    body = ast.parse(inspect.getsource(cls)).body[0].body
    docs = {node.target.id: after.value.value for node, after in zip(body, body[1:])
            if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr)}
    return {f.name: (f.type, f.default, docs.get(f.name, "")) for f in dataclasses.fields(cls) if f.name in docs}


def shared_runs(a: Path, b: Path, min_run: int = 6) -> list[tuple[int, int, list[str]]]:
    """(line in a, line in b, lines) of every run of at least `min_run` identical non-blank lines the files share."""
    left, right = a.read_text().splitlines(), b.read_text().splitlines()
    matcher = difflib.SequenceMatcher(None, left, right, autojunk=False)
    runs = []
    for block in matcher.get_matching_blocks():
        lines = [line for line in left[block.a : block.a + block.size] if line.strip()]
        if len(lines) >= min_run:
            runs.append((block.a + 1, block.b + 1, lines))
    return runs


def test_each_trainer_declares_only_what_differs_and_the_rest_once():
    shared = own_fields(rl_run.SharedArgs)
    grpo, ppo = own_fields(train_grpo.Args), own_fields(train_ppo.Args)
    assert len(shared) >= 40 and issubclass(train_grpo.Args, rl_run.SharedArgs) and issubclass(train_ppo.Args,
                                                                                                  rl_run.SharedArgs)
    assert not set(shared) & (set(grpo) | set(ppo)), "a trainer redeclares a shared setting: move the change to both"
    both = set(grpo) & set(ppo)
    assert both == set(ALGORITHMIC), {"declared twice, not listed": both - set(ALGORITHMIC),
                                      "listed, not declared twice": set(ALGORITHMIC) - both}
    same = [name for name in both if grpo[name] == ppo[name]]
    assert not same, f"identical in both trainers: move to rl_run.SharedArgs: {same}"


def test_every_field_has_a_docstring_line():
    for cls in (rl_run.SharedArgs, train_grpo.Args, train_ppo.Args):
        body = ast.parse(inspect.getsource(cls)).body[0].body
        declared = [node.target.id for node in body if isinstance(node, ast.AnnAssign)]
        assert set(declared) == set(own_fields(cls)), (cls.__qualname__, set(declared) - set(own_fields(cls)))


def test_the_trainers_share_code_by_construction_not_by_copy():
    runs = shared_runs(ROOT / "train_grpo.py", ROOT / "train_ppo.py")
    assert sum(len(lines) for _, _, lines in runs) <= MAX_SHARED_LINES, runs
    assert all(line.startswith(("import ", "from ", '"""')) for _, _, lines in runs for line in lines), runs
    kiln = {p.stem for p in ROOT.glob("*.py")}
    imported = {node.names[0].name.split(".")[0] if isinstance(node, ast.Import) else node.module
                for node in ast.parse((ROOT / "train_grpo.py").read_text()).body
                if isinstance(node, (ast.Import, ast.ImportFrom))}
    assert len(imported & kiln) <= MAX_KILN_IMPORTS, sorted(imported & kiln)


def test_the_copy_check_sees_a_copied_function(tmp_path):
    """What the check above counts: a function pasted into both files is one run of its length."""
    body = "def evaluate(run):\n" + "".join(f"    x{i} = run.step + {i}\n" for i in range(8))
    (tmp_path / "a.py").write_text("import a\n\n" + body)
    (tmp_path / "b.py").write_text("import b\n\nX = 1\n" + body)
    assert [len(lines) for _, _, lines in shared_runs(tmp_path / "a.py", tmp_path / "b.py")] == [9]


def bad_runs(tmp_path: Path, root: Path) -> list[tuple[dict, str, int]]:
    """(settings, message, world size) of runs both trainers must refuse before any model loads, each for the same reason."""
    (tmp_path / "file").write_text("x")
    rows = task_rows.load_rows(root / "train.parquet")
    task_rows.write_rows([r | {"data_source": "my_task"} for r in rows[:4]], tmp_path / "mine.parquet")
    judged = [r | {"data_source": "vstar", "reward_model": {"style": "judge", "ground_truth": "4"}} for r in rows[:4]]
    task_rows.write_rows(judged, tmp_path / "judged.parquet")
    cases = [
        (dict(prompts_per_step=0), r"--prompts-per-step must be > 0", 1),
        (dict(max_new_tokens=0), r"--max-new-tokens must be > 0", 1),
        (dict(epochs_per_step=0), r"--epochs-per-step must be > 0", 1),
        (dict(total_steps=-5), r"--total-steps must be >= 0", 1),
        (dict(temperature=0.0), r"--temperature must be > 0", 1),
        (dict(minibatches=3, prompts_per_step=2), r"--minibatches 3 needs as many prompts per rank", 1),
        (dict(best_metric="critic/score/mean"), r"--best-metric critic/score/mean: must be an evaluation metric", 1),
        (dict(judge_timeout_s=0.0), r"--judge-timeout-s > 0", 1),
        (dict(output_dir=str(tmp_path / "file")), r"--output-dir .*file is a file", 1),
        (dict(model=str(tmp_path / "no-such-model")), r"--model .*no-such-model: model folder does not exist", 1),
        (dict(attn_implementation="no_such_attention"), r"--attn-implementation no_such_attention: unknown", 1),
        (dict(data=str(tmp_path / "mine.parquet")), r"mine.parquet: no reward function for data_source 'my_task'", 1),
        (dict(data=str(tmp_path / "judged.parquet")), r"judged.parquet: 4 rows .* scored with an LLM judge: pass "
                                                      r"--judge-url", 1),
        (dict(eval_data=str(root / "one.parquet"), prompts_per_step=2, minibatches=1),
         r"one.parquet: 1 eval rows for 2 ranks", 2),
    ]
    if importlib.util.find_spec("vllm") is None:
        cases.append((dict(engine="vllm"), r"vllm is not installed .* on CPU pass --engine hf", 1))
    return cases


def test_both_trainers_refuse_the_same_bad_runs_before_any_model_loads(toy, tmp_path, process_group, monkeypatch):
    root, model = toy
    monkeypatch.setattr(policy, "load_model", lambda *a, **k: pytest.fail("a model loaded before the check"))
    monkeypatch.setattr(policy, "load_value_model", lambda *a, **k: pytest.fail("a critic loaded before the check"))
    base = dict(model=str(model), data=str(root / "train.parquet"), output_dir=str(tmp_path / "out"), group_size=2,
                minibatches=1, total_steps=1)
    for overrides, message, world in bad_runs(tmp_path, root):
        monkeypatch.setattr(policy, "init_distributed", lambda world=world: (0, world, torch.device("cpu")))
        for trainer in (train_grpo, train_ppo):
            with pytest.raises(ValueError, match=message):
                trainer.setup(trainer.Args(**base | overrides), rewards.score_batch)
    # The trainers' own refusals come at the same point: after the shared ones, before anything loads.
    with pytest.raises(ValueError, match=r"--advantage grpo compares samples of a group: --group-size must be >= 2"):
        train_grpo.setup(train_grpo.Args(**base | dict(group_size=1)), rewards.score_batch)
    with pytest.raises(ValueError, match=r"--critic-model .*nope: model folder"):
        train_ppo.setup(train_ppo.Args(**base | dict(critic_model=str(tmp_path / "nope"))), rewards.score_batch)


def test_dry_run_prints_the_resolved_args_of_either_trainer_and_loads_nothing(tmp_path):
    for script in ("train_grpo.py", "train_ppo.py"):
        out = rl_run_cli(script, "--dry-run", "--lr", "3e-6", "--model", str(tmp_path / "not-loaded"))
        resolved = json.loads(out)
        assert resolved["lr"] == 3e-6 and resolved["model"] == str(tmp_path / "not-loaded") and resolved["dry_run"]


def rl_run_cli(script: str, *args: str) -> str:
    result = subprocess.run([sys.executable, str(ROOT / script), *args], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout
