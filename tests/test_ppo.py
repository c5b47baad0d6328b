"""PPO on CPU: GAE and value clipping against hand-computed numbers; the trainer's experience on multi-turn samples
(values and advantages only on policy tokens); the critic fitting a fixed batch; a step and the evaluation by APPS
difficulty with real sandboxed rewards; a 2-rank torchrun run on the real APPS problems, killed and resumed."""
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import chat  # noqa: E402
import data_prep  # noqa: E402
import engines  # noqa: E402
import losses  # noqa: E402
import policy  # noqa: E402
import rewards  # noqa: E402
import rl_run  # noqa: E402
import ranks  # noqa: E402
import rollout  # noqa: E402
import task_rows  # noqa: E402
import tiny  # noqa: E402
import train_ppo  # noqa: E402
from data_files import APPS_DIR  # noqa: E402
from checkpoint import latest_checkpoint, load_checkpoint, save_hf  # noqa: E402
from test_runs import undocumented  # noqa: E402
from wandb_offline import logged, offline_run  # noqa: E402



def test_gae_by_hand_on_a_multi_turn_mask():
    # Row 0: policy turn (2 tokens), tool output (2 tokens, not a step), policy turn (1 token), padding.
    # Row 1: one policy turn of 3 tokens.
    mask = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 0]], dtype=torch.float32)
    values = torch.tensor([[0.5, 0.2, 9.0, 9.0, 0.4, 9.0], [0.1, -0.3, 0.2, 9.0, 9.0, 9.0]])
    token_rewards = losses.outcome_token_rewards(torch.tensor([1.0, -1.0]), mask)
    assert token_rewards.tolist() == [[0, 0, 0, 0, 1, 0], [0, 0, -1, 0, 0, 0]]
    advantages, returns = losses.gae(token_rewards, values, mask, gamma=0.9, lam=0.8)
    # Row 0, chain 0 -> 1 -> 4: d4 = 1 - 0.4 = 0.6; d1 = 0.9 * 0.4 - 0.2 = 0.16, A1 = 0.16 + 0.72 * 0.6 = 0.592;
    # d0 = 0.9 * 0.2 - 0.5 = -0.32, A0 = -0.32 + 0.72 * 0.592 = 0.10624.
    # Row 1: d2 = -1 - 0.2 = -1.2; d1 = 0.9 * 0.2 + 0.3 = 0.48, A1 = 0.48 - 0.72 * 1.2 = -0.384;
    # d0 = 0.9 * -0.3 - 0.1 = -0.37, A0 = -0.37 - 0.72 * 0.384 = -0.64648.
    expected = torch.tensor([[0.10624, 0.592, 0, 0, 0.6, 0], [-0.64648, -0.384, -1.2, 0, 0, 0]])
    torch.testing.assert_close(advantages, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(returns, torch.where(mask.bool(), expected + values, 0), atol=1e-6, rtol=0)


def test_value_clipping_engages_only_when_the_clipped_loss_is_larger():
    old = torch.tensor([[0.0, 0.0, 0.0, 9.0]])
    returns = torch.tensor([[1.0, 1.0, 1.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.1, -0.5, 3.0]])
    # 0.5 moved past old + 0.2 toward the return: clipped (0.2 - 1)^2 = 0.64 beats (0.5 - 1)^2 = 0.25 -> engaged.
    # 0.1 is inside the clip range; -0.5 moved away from the return, its own error (2.25) is the larger one.
    loss, clip_frac = losses.value_loss(values, old, returns, mask, clip=0.2)
    torch.testing.assert_close(loss, torch.tensor([[0.32, 0.405, 1.125, 0.0]]))
    assert clip_frac == pytest.approx(1 / 3)
    loss, clip_frac = losses.value_loss(values, old, returns, mask, clip=None)
    torch.testing.assert_close(loss, torch.tensor([[0.125, 0.405, 1.125, 0.0]]))
    assert clip_frac == 0.0


# ------------------------------------------------------------------------------------------- in-process trainer


@pytest.fixture(scope="module")
def apps(tmp_path_factory):
    """The real APPS problems as a parquet, and a tiny model whose tokenizer was trained on their text."""
    root = tmp_path_factory.mktemp("ppo")
    rows = data_prep.apps_rows(APPS_DIR)
    assert sorted(r["extra_info"]["difficulty"] for r in rows) == ["competition", "interview", "interview",
                                                                   "introductory", "introductory"]
    task_rows.write_rows(rows, root / "apps.parquet")
    corpus = [r["prompt"][-1]["content"] for r in rows] + [s for r in rows for s in r["extra_info"]["solutions"][:3]]
    return root, tiny.make_tiny_model(root / "model", corpus, seed=0), rows


class ScriptedEngine:
    """A engines.Engine answering each task with a fixed text, so real code meets the real sandbox."""

    def __init__(self, tokenizer, rows: list[dict], answers: dict[str, str]):
        self.tokenizer = tokenizer
        self.task_of = {tuple(chat.encode_prompt(tokenizer, r["prompt"])): task_rows.row_id(r) for r in rows}
        self.answers = answers

    def generate(self, prompts, sampling, seeds=None):
        out = []
        for prompt in prompts:
            ids = self.tokenizer.encode(self.answers[self.task_of[tuple(prompt)]], add_special_tokens=False)
            ids.append(self.tokenizer.eos_token_id)
            out.append(engines.Completion(ids, [0.0] * len(ids), "stop"))
        return out

    def load_weights(self, weights):
        for _ in weights:  # the policy's weight stream must be consumed in step (a collective under FSDP)
            pass

    def sleep(self):
        return None

    def wake_up(self):
        return None


def fenced(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}\n```"


def answers_with_known_scores(rows) -> tuple[dict[str, str], dict[str, float]]:
    """apps/1 right, apps/111 wrong, apps/2287 1 of 3 tests, apps/2404 no code, apps/4184 4 of 8 tests."""
    solution = {task_rows.row_id(r): r["extra_info"]["solutions"][0] for r in rows}
    answers = {"apps/1": fenced(solution["apps/1"]), "apps/111": fenced("print(0)"),
               "apps/2287": fenced('print("No")'), "apps/2404": "I do not know.",
               "apps/4184": fenced("def is_prime(num):\n    return False")}
    return answers, {"apps/1": 1.0, "apps/111": 0.0, "apps/2287": 1 / 3, "apps/2404": 0.0, "apps/4184": 0.5}


def make_trainer(apps, out: Path, **overrides):

    root, model, _ = apps
    settings = dict(model=str(model), data=str(root / "apps.parquet"), eval_data=str(root / "apps.parquet"),
                    output_dir=str(out), engine="hf", prompts_per_step=5, group_size=1, max_prompt_tokens=4096,
                    max_new_tokens=8, minibatches=1, micro_batch_tokens=4096, total_steps=10)
    args = train_ppo.Args(**settings | overrides)
    return train_ppo, train_ppo.setup(args, rewards.score_batch)


def multi_turn_samples(t, rows) -> list[rollout.Sample]:
    """Hand-built two-turn trajectories: answer, tool output (loss mask 0), answer again."""
    tok = t.tokenizer
    tool = tok.encode("<|im_start|>user\n<tool_response>\nok\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
                      add_special_tokens=False)
    samples = []
    for i, (row, score) in enumerate(zip(rows[:2], (0.75, 0.25))):
        first = tok.encode(f"```python\nprint({i})\n```", add_special_tokens=False) + [tok.eos_token_id]
        second = tok.encode("done", add_special_tokens=False) + [tok.eos_token_id] * (i + 1)
        completion = first + tool + second
        samples.append(rollout.Sample(
            prompt_ids=chat.encode_prompt(tok, row["prompt"]), completion_ids=completion,
            loss_mask=[1] * len(first) + [0] * len(tool) + [1] * len(second),
            engine_logprobs=[0.0] * len(completion), row=row, group=i, reward=score))
    return samples


@pytest.mark.slow
def test_experience_lives_on_policy_tokens_of_multi_turn_samples(apps, tmp_path):
    train_ppo, t = make_trainer(apps, tmp_path, whiten_advantages=False, gamma=1.0, lam=1.0)
    with torch.no_grad():  # a head that is not all zero, so values differ token by token
        t.value_model.score.weight.fill_(0.05)
        t.value_model.score.bias.fill_(0.3)
    critic = save_hf(t.value_model, apps[1], tmp_path / "critic_hf")  # a saved value model keeps its head
    assert (policy.load_value_model(critic).score.bias == 0.3).all()
    samples = multi_turn_samples(t, apps[2])
    exp, metrics = train_ppo.make_experience(t, samples)
    on = exp.mask.bool()
    assert exp.mask.shape == (2, max(len(s.completion_ids) for s in samples))
    for name in ("values", "advantages", "returns", "old_logprobs"):
        assert (getattr(exp, name)[~on] == 0).all(), name  # tool output and padding: nothing
    for i, s in enumerate(samples):
        with torch.no_grad():  # the value of completion token j is the head on the hidden state before it
            head = t.value_model(input_ids=torch.tensor([s.ids])).logits[0, :, 0]
        positions = [len(s.prompt_ids) + j - 1 for j, m in enumerate(s.loss_mask) if m]
        torch.testing.assert_close(exp.values[i][on[i]], head[positions], atol=1e-5, rtol=0)
        assert exp.values[i][on[i]].std() > 1e-4
        # gamma = lambda = 1 and one reward at the end: every policy token's return is the score, A = score - V.
        torch.testing.assert_close(exp.returns[i][on[i]], torch.full((len(positions),), s.reward), atol=1e-5, rtol=0)
        torch.testing.assert_close(exp.advantages[i][on[i]], s.reward - exp.values[i][on[i]], atol=1e-5, rtol=0)
    assert metrics["critic/returns/mean"] == pytest.approx(
        (0.75 * sum(samples[0].loss_mask) + 0.25 * sum(samples[1].loss_mask)) / exp.mask.sum().item())

    t.args.whiten_advantages = True
    exp, _ = train_ppo.make_experience(t, samples)
    assert (exp.advantages[~on] == 0).all()
    assert exp.advantages[on].mean().item() == pytest.approx(0, abs=1e-5)
    assert exp.advantages[on].std().item() == pytest.approx(1, abs=1e-3)


@pytest.mark.slow
def test_critic_fits_a_fixed_batch_and_value_clipping_engages(apps, tmp_path):
    train_ppo, t = make_trainer(apps, tmp_path, value_clip=None)
    for group in t.critic_optimizer.param_groups:
        group["lr"] = 1e-3
    samples = multi_turn_samples(t, apps[2])
    exp, _ = train_ppo.make_experience(t, samples)
    stats = [train_ppo.update_critic(t, exp, 0) for _ in range(40)]
    first, last = stats[0]["critic/vf_loss"], stats[-1]["critic/vf_loss"]
    assert first > 0.05 and last < first / 10, [s["critic/vf_loss"] for s in stats]
    assert all(s["critic/vf_clipfrac"] == 0 for s in stats)

    # Clipped: the first update starts at the rollout's values (nothing to clip); after one step the values have moved
    # further than 1e-3 toward the returns on most tokens, and the clipped term takes over there.
    t.args.value_clip = 1e-3
    exp, _ = train_ppo.make_experience(t, [dataclasses.replace(s, reward=1.0 - s.reward) for s in samples])
    clipped = [train_ppo.update_critic(t, exp, 0)["critic/vf_clipfrac"] for _ in range(3)]
    assert clipped[0] == 0 and clipped[1] > 0.5 and clipped[2] > 0.5, clipped


@pytest.mark.slow
def test_step_and_eval_by_difficulty_with_real_apps_rewards(apps, tmp_path):
    train_ppo, t = make_trainer(apps, tmp_path)
    rows = apps[2]
    answers, expected = answers_with_known_scores(rows)
    t.engine = ScriptedEngine(t.tokenizer, rows, answers)

    metrics = rl_run.evaluate(t)
    assert metrics["val-core/all/pass@1"] == pytest.approx(1 / 5)
    assert metrics["val-core/apps/interview/pass@1"] == pytest.approx(1 / 2)
    assert metrics["val-core/apps/introductory/pass@1"] == 0 and metrics["val-core/apps/competition/pass@1"] == 0
    assert [metrics[f"val-aux/apps/{d}/tasks"] for d in ("introductory", "interview", "competition")] == [2, 2, 1]
    assert metrics["val-core/all/reward/mean"] == pytest.approx(sum(expected.values()) / 5)
    assert metrics["val-aux/error/no_code"] == pytest.approx(1 / 5)
    best = json.loads((tmp_path / "best" / "best.json").read_text())
    assert best["step"] == 0 and best["metrics"]["val-core/all/pass@1"] == pytest.approx(0.2)

    # Better at step 3: the best moves; worse at step 4: it stays.
    t.engine.answers = {r: fenced(row["extra_info"]["solutions"][0]) for r, row in
                        ((task_rows.row_id(row), row) for row in rows)}
    t.step = 3
    assert rl_run.evaluate(t)["val-core/all/pass@1"] == 1.0
    t.engine.answers, t.step = answers, 4
    rl_run.evaluate(t)
    assert json.loads((tmp_path / "best" / "best.json").read_text())["step"] == 3
    assert policy.load_model(tmp_path / "best").config.num_hidden_layers == 2  # a loadable Hugging Face folder
    report = json.loads((tmp_path / "eval_report.json").read_text())
    assert report["best"]["step"] == 3 and [e["step"] for e in report["evals"]] == [0, 3, 4]
    assert report["evals"][0]["pass"]["apps/interview"] == {"tasks": 2, "pass@1": 0.5}
    table = (tmp_path / "eval_report.md").read_text().splitlines()
    assert table[2] == ("| step | all (5) | apps (5) | apps/introductory (2) | apps/interview (2) | "
                        "apps/competition (1) | reward |")
    assert table[5].startswith("| 3 (best) | 1.000 |") and table[4].startswith("| 0 | 0.200 |")
    # The last evaluation in full: test pass rates 1, 0, 1/3, 0 (no code), 4/8 -> mean 11/30, and their bands.
    assert metrics["val-core/all/test_pass_rate"] == pytest.approx(11 / 30)
    assert "| all | 5 | 0.200 | 5 | 0.367 | 2 (40%) | 1 (20%) | 1 (20%) | 0 (0%) | 1 (20%) |" in table
    assert (tmp_path / "eval_report.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")

    # One PPO step on the same answers: the partial APPS scores reach the critic and the actor.
    t.step = 0
    metrics = train_ppo.train_step(t)
    assert metrics["critic/score/mean"] == pytest.approx(sum(expected.values()) / 5)
    assert metrics["critic/score/pass_rate"] == pytest.approx(1 / 5)
    assert metrics["critic/vf_loss"] > 0 and metrics["critic/grad_norm"] > 0 and metrics["actor/grad_norm"] > 0
    assert metrics["critic/returns/mean"] > 0 and metrics["actor/frozen"] == 0
    evaluation = rl_run.evaluate(t)
    assert not undocumented(metrics | evaluation)  # docs/metrics.md lists every key


class ToolThenAnswerEngine:
    """A engines.Engine that calls the python tool once, then answers: two policy turns around a tool response."""

    CALL = '<tool_call>\n{"name": "python", "arguments": {"code": "print(6 * 7)"}}\n</tool_call>'

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def generate(self, prompts, sampling, seeds=None):
        out = []
        for prompt in prompts:
            seen_tool = "<tool_response>" in self.tokenizer.decode(prompt)
            text = fenced('print("No")') if seen_tool else self.CALL
            ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
            out.append(engines.Completion(ids, [0.0] * len(ids), "stop"))
        return out

    load_weights, sleep, wake_up = ScriptedEngine.load_weights, ScriptedEngine.sleep, ScriptedEngine.wake_up


@pytest.mark.slow
def test_multi_turn_tool_rollouts_train_on_policy_tokens_only(apps, tmp_path):
    train_ppo, t = make_trainer(apps, tmp_path, tools="python", max_new_tokens=64)
    t.engine = ToolThenAnswerEngine(t.tokenizer)
    samples, metrics = rollout.collect(t.engine, t.tokenizer, apps[2][:2], 1, t.sampling, t.args.tools, t.limits)
    assert metrics["tools/calls_mean"] == 1 and metrics["tools/errors_mean"] == 0
    for s in samples:  # policy turn, tool response (mask 0), policy turn
        assert [m["content"] for m in s.info["messages"] if m["role"] == "tool"] == ["42\n"]
        runs = [k for i, k in enumerate(s.loss_mask) if i == 0 or k != s.loss_mask[i - 1]]
        assert runs == [1, 0, 1]
        assert "42" in t.tokenizer.decode([i for i, m in zip(s.completion_ids, s.loss_mask) if not m])
        s.reward = rewards.score(s.row, s.text).score
    assert [s.reward for s in samples] == [0.0, 0.0]  # apps/1 and apps/111 do not answer "No"
    samples[0].reward = 1.0  # so the advantages differ across samples
    exp, _ = train_ppo.make_experience(t, samples)
    on = exp.mask.bool()
    assert (exp.advantages[~on] == 0).all() and (exp.returns[~on] == 0).all() and (exp.values[~on] == 0).all()
    assert (exp.advantages[on] != 0).all()

    metrics = train_ppo.train_step(t)  # a whole step through the agent loop, the sandboxed tool and the APPS reward
    assert metrics["tools/calls_mean"] == 1 and metrics["critic/score/apps/mean"] == pytest.approx(1 / 3 / 5)
    assert metrics["actor/grad_norm"] > 0 and metrics["critic/grad_norm"] > 0


# ------------------------------------------------------------------------------------------- 2-rank torchrun


def ppo_command(apps, out: Path, *extra: str) -> list[str]:
    root, model, _ = apps
    return [*ranks.torchrun(2, ROOT / "train_ppo.py"), "--model", str(model), "--data", str(root / "apps.parquet"),
            "--eval-data", str(root / "apps.parquet"), "--output-dir", str(out), "--engine", "hf",
            "--prompts-per-step", "4", "--group-size", "2", "--max-prompt-tokens", "4096", "--max-new-tokens", "12",
            "--minibatches", "2", "--micro-batch-tokens", "4096", "--lr", "1e-3", "--critic-lr", "1e-3",
            "--critic-warmup-steps", "1", "--entropy-coef", "0.05", "--kl-coef", "0.5", "--kl-estimator", "k3",
            "--kl-target", "0.001", "--kl-horizon", "8",
            "--total-steps", "4", "--eval-every", "2", "--save-every", "2", "--sample-every", "2", "--seed", "1",
            *extra]


def env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


def metrics_by_step(out: Path) -> dict[int, dict]:
    """The last record of each training step (a resumed run rewrites the steps after its checkpoint)."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {m["step"]: m for m in records if "critic/score/mean" in m}


def deterministic(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith(("timing_s/", "perf/", "rollout/seconds", "timestamp",
                                                                  "rollout/tokens_per_s"))}


CRITIC_KEYS = ["critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm", "critic/skipped_step", "critic/values/mean",
               "critic/returns/mean", "critic/vf_explained_var"]
ACTOR_KEYS = ["actor/pg_loss", "actor/entropy", "actor/ppo_kl", "actor/pg_clipfrac", "actor/pg_clipfrac_low",
              "actor/pg_clipfrac_high", "actor/ratio_mean", "actor/grad_norm", "actor/skipped_step"]
STEP_KEYS = ["critic/score/mean", "critic/score/std", "critic/score/pass_rate", "critic/score/apps/mean",
             "response_length/mean", "response_length/max", "critic/advantages/mean", "critic/advantages/std",
             "actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff", "mismatch/engine_abs", "actor/frozen",
             "timing_s/rollout", "timing_s/reward", "timing_s/experience", "timing_s/update", "perf/tokens_per_s",
             "rollout/truncated_frac", "timestamp", *CRITIC_KEYS]
EVAL_KEYS = ["val-core/all/pass@1", "val-core/apps/introductory/pass@1", "val-core/apps/interview/pass@1",
             "val-core/apps/competition/pass@1", "val-aux/apps/introductory/tasks", "val-core/all/reward/mean"]


@pytest.mark.slow
def test_two_ranks_on_apps_then_kill_and_resume(apps, tmp_path):
    straight = tmp_path / "straight"
    subprocess.run(ppo_command(apps, straight), check=True, env=env(), timeout=900)
    steps = metrics_by_step(straight)
    assert sorted(steps) == [1, 2, 3, 4]
    for step, m in steps.items():
        keys = STEP_KEYS + (ACTOR_KEYS if step > 1 else [])  # step 1 is the critic's warm-up: the actor is frozen
        assert all(k in m and math.isfinite(m[k]) for k in keys), (step, sorted(set(keys) - set(m)))
    assert steps[1]["actor/frozen"] == 1 and "actor/pg_loss" not in steps[1]
    assert all(steps[s]["actor/frozen"] == 0 and steps[s]["actor/grad_norm"] > 0 for s in (2, 3, 4))
    # The entropy bonus moves the actor away from the reference, the KL penalty turns that into token rewards, so the
    # critic has returns to fit. The adaptive coefficient (horizon = one batch: at most 20% a step) shrinks while the
    # KL is 0 (steps 1-2: the actor has not moved yet) and grows once it is far above its target.
    assert steps[2]["actor/reward_kl_penalty"] == 0 and steps[4]["actor/reward_kl_penalty"] > 0.0012
    assert steps[4]["critic/vf_loss"] > 0 and steps[4]["critic/grad_norm"] > 0
    assert [steps[s]["actor/reward_kl_penalty_coeff"] for s in (1, 2, 3)] == pytest.approx([0.5, 0.4, 0.32])
    coeff, penalty = "actor/reward_kl_penalty_coeff", "actor/reward_kl_penalty"
    assert steps[4][coeff] == pytest.approx(0.32 * (1.2 if steps[3][penalty] > 0.0012 else 0.8))
    records = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    evals = [m for m in records if "val-core/all/pass@1" in m]
    assert [m["step"] for m in evals] == [0, 2, 4]
    assert all(k in m for m in evals for k in EVAL_KEYS)
    report = json.loads((straight / "eval_report.json").read_text())
    assert [e["step"] for e in report["evals"]] == [0, 2, 4]
    assert {g: report["evals"][-1]["pass"][g]["tasks"] for g in report["evals"][-1]["pass"]} == {
        "all": 5, "apps": 5, "apps/introductory": 2, "apps/interview": 2, "apps/competition": 1}
    assert "apps/competition (1)" in (straight / "eval_report.md").read_text()
    best = json.loads((straight / "best" / "best.json").read_text())
    assert best["step"] == report["best"]["step"] and (straight / "best" / "model.safetensors").is_file()
    samples = [json.loads(line) for line in (straight / "samples.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == {2, 4} and all(s["task_id"].startswith("apps/") for s in samples)

    # Both models trained and checkpointed at the last step.
    checkpoint = latest_checkpoint(straight)
    assert checkpoint.name == "step_00000004"
    for load, path in ((policy.load_model, checkpoint), (policy.load_value_model,
                                                         straight / "critic" / "checkpoints" / checkpoint.name)):
        initial, trained = load(apps[1]), load(apps[1])
        load_checkpoint(path, trained)
        unchanged = [n for (n, a), (_, b) in zip(initial.named_parameters(), trained.named_parameters())
                     if torch.equal(a, b)]
        assert not unchanged, (path, unchanged)

    # Kill a second run once its step-2 checkpoint is complete, resume it: the remaining steps are identical.
    killed = tmp_path / "killed"
    proc = subprocess.Popen(ppo_command(apps, killed), env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while latest_checkpoint(killed) is None and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    ranks.kill(proc)  # torchrun and its ranks: each rank has a session of its own, out of torchrun's group
    resumed_from = latest_checkpoint(killed)
    assert resumed_from is not None
    start = json.loads((resumed_from / "trainer_state.json").read_text())["step"]
    assert start < 4
    subprocess.run(ppo_command(apps, killed, "--resume"), check=True, env=env(), timeout=900)
    again = metrics_by_step(killed)
    for step in range(start + 1, 5):
        assert deterministic(again[step]) == deterministic(steps[step]), step
    assert json.loads((killed / "eval_report.json").read_text()) == report


@pytest.mark.slow
def test_wandb_offline_logs_every_metric_of_every_step(apps, tmp_path, monkeypatch):
    """--wandb-project with WANDB_MODE=offline: one run under <output_dir>/wandb whose log holds every key and value
    of every metrics.jsonl record (the step as wandb's own), the step-0 evaluation included."""

    root, model, _ = apps
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    train_ppo.main(train_ppo.Args(
        model=str(model), data=str(root / "apps.parquet"), eval_data=str(root / "apps.parquet"), output_dir=str(tmp_path),
        engine="hf", prompts_per_step=5, group_size=1, max_prompt_tokens=4096, max_new_tokens=8, minibatches=1,
        total_steps=1, wandb_project="kiln-test"))
    run = offline_run(tmp_path)
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in records] == [0, 1] and "val-core/all/pass@1" in records[0]
    for record in records:
        missing = {k: v for k, v in record.items()
                   if k not in ("step", "timestamp") and not logged(run, k, v)}  # wandb stamps its own time
        assert not missing, missing
