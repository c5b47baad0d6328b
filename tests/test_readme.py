"""The README's commands (and its CPU recipes, docs/recipes.md) as a new user types them: flags that exist and do
what the text says; the README within its size, its code map linked near the top."""
import importlib
import inspect
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import huggingface_hub.constants
import pytest
import tyro

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import demo  # noqa: E402
import hub  # noqa: E402
import policy  # noqa: E402
import rewards  # noqa: E402
import train_grpo  # noqa: E402
import train_sft  # noqa: E402

README = (ROOT / "README.md").read_text()
RECIPES = (ROOT / "docs" / "recipes.md").read_text()


def readme_commands(script: str) -> list[list[str]]:
    """Every inline `...` span and code-block line of the README that runs `script`, split as a shell would."""
    spans = re.findall(r"`([^`\n]*(?:\n[^`\n]*)*?)`", README.replace("```", ""))
    return [shlex.split(" ".join(span.split())) for span in spans if f" {script}" in " ".join(span.split())]


def test_readme_sft_command_redoes_the_demos_warm_start():
    """The README says its train_sft.py command redoes `make demo`'s warm start: the same resolved Args (output folder
    aside), with model and data from the defaults."""
    [command] = readme_commands("train_sft.py")
    flags = command[command.index("train_sft.py") + 1:]
    readme = tyro.cli(train_sft.Args, args=flags)
    out = Path(demo.Args().output_dir)
    demos = tyro.cli(train_sft.Args, args=demo.sft_flags(demo.Args(), out / "tiny-model", out))
    assert readme.output_dir != demos.output_dir  # a fresh folder: the demo's own SFT run stays
    readme.output_dir = demos.output_dir
    assert readme == demos



def expanded(name: str) -> list[str]:
    """`a/{x,y}` -> a/x, a/y."""
    match = re.search(r"\{([^}]*)\}", name)
    if not match:
        return [name]
    return [n for part in match.group(1).split(",") for n in expanded(name[:match.start()] + part + name[match.end():])]


def test_judge_component_metrics_are_named_as_logged():
    """docs/judge.md names the vl_agent reward components' metrics as rewards.component_metrics logs them."""
    logged = rewards.component_metrics(["vl_agent"], [{"acc_by": "judge", "acc": 1.0, "format": 1.0, "tool": 0.5}])
    named = re.search(r"in the metrics as `([^`]+)`", (ROOT / "docs" / "judge.md").read_text()).group(1)
    assert sorted(n.replace("<source>", "vl_agent") for n in expanded(named)) == sorted(logged)


def recipe(title: str) -> list[str]:
    """The shell commands of the CPU recipe titled `title` (its bash block, continuation lines joined)."""
    section = RECIPES.split(f"**{title}**", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def trainer_flags(command: str) -> list[str]:
    words = shlex.split(command)
    return words[words.index("train_grpo.py") + 1:]


@pytest.mark.parametrize("title", ["Vision", "SWE-bench", "External agents", "qwen-code"])
def test_readme_cpu_recipes_give_flags_the_trainer_takes(title, monkeypatch):
    """Every command of the CPU recipes is complete (no <placeholder>), and every train_grpo command resolves to Args
    as written (a renamed or mistyped flag fails), its --agent-cmd's script taking the flags it is given."""
    assert not re.search(r"<[a-z][^>]*>", "\n".join(recipe(title))), recipe(title)
    commands = [c for c in recipe(title) if "train_grpo.py" in c]
    assert commands
    for command in commands:
        args = tyro.cli(train_grpo.Args, args=trainer_flags(command))
        assert args.prompts_per_step % 2 == 0 and args.total_steps <= 2  # 2 ranks, minutes on a CPU
        if args.agent_cmd:
            agent = shlex.split(args.agent_cmd.format(base_url="http://x/v1", api_key="k", row_file="r.json",
                                                      result="out.txt"))
            script = next(word for word in agent if word.endswith(".py"))
            monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # as the recipe runs it: no network at import
            module = importlib.import_module(script.removesuffix(".py"))
            parsed = tyro.cli(module.Args, args=agent[agent.index(script) + 1:])  # a flag it lacks fails here
            assert (str(parsed.row), str(parsed.result)) == ("r.json", "out.txt")


@pytest.mark.slow
def test_readme_vision_recipe_runs_as_written(tmp_path):
    """The vision recipe, command by command as a user pastes it, in a folder holding the checkout's scripts
    (its runs/ would otherwise get the output). About 90 s on 2 loaded cores: data, a tiny VLM, 2 GRPO steps on 2 ranks."""
    for path in [*ROOT.glob("*.py"), *ROOT.glob("*.json")]:
        (tmp_path / path.name).symlink_to(path)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    for command in recipe("Vision"):
        result = subprocess.run(command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True,
                                timeout=600)
        assert result.returncode == 0, f"{command}\n{result.stderr[-3000:]}"
    run = tmp_path / "runs" / "vision" / "grpo"
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1, 2] and all("tools/tito_drift_frac" in m for m in steps)
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == {1, 2} and all(s["messages"][-1]["role"] == "assistant" for s in samples)
    assert json.loads((run / "run_config.json").read_text())["args"]["tools"] == "codev"
    assert all(s["token_ids"] and s["images"] for s in samples)  # rich records: the board shows tokens and images
    assert all((run / path).is_file() for s in samples for path in s["images"])
    assert "\ufffd" not in result.stdout + result.stderr  # check_tito's lines are escaped: no raw replacement char


def test_gpu_quick_start_names_hub_models_that_offline_runs_refuse_uncached(tmp_path, monkeypatch):
    """The GPU quick start trains a hub model by name (the trainers download it: tests/test_hub_models.py); with
    HF_HUB_OFFLINE=1 a model not in the cache is refused with the command that fetches it."""
    block = (ROOT / "docs" / "gpu.md").read_text().split("```bash\n", 1)[1].split("```", 1)[0]
    names = [name for name in re.findall(r"--model (\S+)", block) if not name.startswith(("runs/", "data/", ".", "/"))]
    assert names == ["Qwen/Qwen2.5-Coder-7B-Instruct"] and hub.hub_name(names[0]) == (names[0], None)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))  # an empty cache
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match=r"--model Qwen/Qwen2.5-Coder-7B-Instruct: .*`hf download "
                                         r"Qwen/Qwen2.5-Coder-7B-Instruct`"):
        policy.check_model_path("Qwen/Qwen2.5-Coder-7B-Instruct")


def test_readme_fits_and_points_to_the_code_map_first():
    assert len(README.encode()) <= 16 * 1024
    top = "\n".join(README.splitlines()[:40])
    assert "](docs/code.md)" in top and (ROOT / "docs" / "code.md").is_file()


def test_readme_phase_numbers_are_the_step_comments():
    """The README's walk through a GRPO step numbers its phases as train_step's comments do, and names the phase
    functions train_step calls."""
    source = inspect.getsource(train_grpo.train_step)
    in_code = re.findall(r"^\s*# (\d+(?:-\d+)?)\. ", source, re.M)
    walk = README.split("### One GRPO step", 1)[1].split("**The mask**", 1)[0]
    in_readme = re.findall(r"^(\d+(?:-\d+)?)\. \*\*", walk, re.M)
    assert in_readme == in_code == ["1-5", "6", "7", "8", "9"]
    called = set(re.findall(r"\b([a-z_][\w.]*)\(run\b", source))
    assert called and all(f"`{name}`" in walk for name in called), called
