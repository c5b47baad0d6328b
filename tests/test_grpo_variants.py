"""GRPO variants in train_step as their papers define them: DAPO's refilled dynamic sampling, soft overlong punishment
and overlong filtering; GSPO's defaults and the combinations it refuses; the chat template's end of turn as a stop
token. Generation is scripted (a fake engine with chosen lengths and finish reasons) and rewards come from a score_fn
the test controls, so every advantage and count is known in advance; the model, the update and the trainer are real."""
import math

import pytest
import tyro

import data_prep
import engines
import policy
import rewards
import rl_run
import task_rows
import tiny
import train_grpo


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("variants")
    train, _ = data_prep.toy_rows(60, 4, seed=0)
    task_rows.write_rows(train, root / "train.parquet")
    corpus = [r["prompt"][-1]["content"] + "\n" + r["extra_info"]["solution"] for r in train]
    return root, tiny.make_tiny_model(root / "model", corpus, seed=0)


class LengthsEngine:
    """Sample j of every group (prompts arrive group by group) is `lengths[j]` tokens, cut by the limit ("length") or
    ended by a stop token ("stop") as an engine would; logprobs are -1 per token."""

    def __init__(self, lengths: list[int], stop_id: int):
        self.lengths, self.stop_id = lengths, stop_id

    def generate(self, prompts, sampling, seeds=None):
        out = []
        for i, _ in enumerate(prompts):
            n = self.lengths[i % len(self.lengths)]
            if n < sampling.max_new_tokens:
                out.append(engines.Completion([40] * (n - 1) + [self.stop_id], [-1.0] * n, "stop"))
            else:
                out.append(engines.Completion([40] * sampling.max_new_tokens, [-1.0] * sampling.max_new_tokens,
                                              "length"))
        return out

    def load_weights(self, weights):
        return None

    def sleep(self):
        return None

    def wake_up(self):
        return None


def informative(row: dict) -> bool:
    return row["extra_info"]["index"] % 3 == 0


def position_rewards(group_size: int):
    """A score_fn: rows with an index divisible by 3 get rewards 0, 1, 0, 1... over their group (they teach
    something), the others 0.5 for every sample (nothing to learn)."""
    def score(rows, texts, sample_infos=None):
        return [rewards.Reward(float(i % group_size % 2) if informative(row) else 0.5, {})
                for i, row in enumerate(rows)]
    return score


def make_run(task, tmp_path, engine, score_fn, **kwargs) -> train_grpo.Run:
    root, model = task
    args = train_grpo.Args(model=str(model), data=str(root / "train.parquet"), output_dir=str(tmp_path),
                           total_steps=1, save_every=0, sample_every=0, lr=1e-3, **kwargs)
    run = train_grpo.setup(args, score_fn)
    run.engine = engine
    return run


def spy_update(monkeypatch) -> list[list]:
    """The batches update_policy is called with (it still runs)."""
    seen = []
    real = train_grpo.update_policy

    def update(run, batch, *rest):
        seen.append(list(batch))
        return real(run, batch, *rest)
    monkeypatch.setattr(train_grpo, "update_policy", update)
    return seen


def test_dynamic_sampling_refills_the_batch_with_groups_that_differ(task, tmp_path, monkeypatch):
    seen = spy_update(monkeypatch)
    run = make_run(task, tmp_path, LengthsEngine([3], stop_id=2), position_rewards(2), prompts_per_step=4,
                   group_size=2, max_new_tokens=8, dynamic_sampling=True)
    # Replay the data order: rounds of 4 prompts until 4 informative ones have come up.
    tries, found = 0, 0
    while found < 4:
        found += sum(map(informative, task_rows.in_epoch_order(run.rows, tries * 4, 4, 0)))
        tries += 1
    assert tries > 1  # the first round alone would leave the batch short
    metrics = train_grpo.train_step(run)
    assert metrics["batch/sampling_tries"] == tries and run.data_pos == 4 * tries
    assert metrics["batch/kept_frac"] == pytest.approx(found / (4 * tries))
    batch = seen[0]
    assert len(batch) == 8 and len({s.group for s in batch}) == 4  # exactly the requested groups
    assert all(informative(s.row) for s in batch) and sorted(s.reward for s in batch) == [0.0] * 4 + [1.0] * 4
    assert all(abs(s.advantage) == pytest.approx(0.5 / (math.sqrt(0.5) + 1e-6)) for s in batch)  # GRPO of 0, 1
    assert math.isfinite(metrics["actor/pg_loss"]) and metrics["actor/grad_norm"] > 0


def test_dynamic_sampling_tries_are_bounded(task, tmp_path, monkeypatch):
    seen = spy_update(monkeypatch)
    run = make_run(task, tmp_path, LengthsEngine([3], stop_id=2),
                   lambda rows, texts, sample_infos=None: [rewards.Reward(0.5, {})] * len(rows),
                   prompts_per_step=4, group_size=2, max_new_tokens=8, dynamic_sampling=True, max_sampling_tries=3)
    metrics = train_grpo.train_step(run)
    assert metrics["batch/sampling_tries"] == 3 and metrics["batch/kept_frac"] == 0.0 and run.data_pos == 12
    assert seen == [[]] and "actor/pg_loss" not in metrics  # nothing to learn: no optimizer step


def test_overlong_punishment_and_filtering(task, tmp_path, monkeypatch):
    """Lengths 2, 4, 6, 8 with max_new_tokens 8 and a 4-token buffer: penalties 0, 0, -0.5, -1 on rewards of 1, so
    shaped rewards 1, 1, 0.5, 0: mean 0.625, deviations .375 .375 -.125 -.625, unbiased std sqrt(.6875 / 3) =
    0.4787136. The 8-token sample was cut by the limit: it counts in the advantages, not in the loss."""
    seen = spy_update(monkeypatch)
    run = make_run(task, tmp_path, LengthsEngine([2, 4, 6, 8], stop_id=2), lambda rows, texts, sample_infos=None: [
        rewards.Reward(1.0, {})] * len(rows), prompts_per_step=2, group_size=4, max_new_tokens=8, overlong_buffer=4,
        mask_truncated=True)
    metrics = train_grpo.train_step(run)
    std = math.sqrt(0.6875 / 3)
    batch = seen[0]
    assert [len(s.completion_ids) for s in batch] == [2, 4, 6] * 2 and all(s.finish_reason == "stop" for s in batch)
    assert [s.advantage for s in batch] == pytest.approx([d / (std + 1e-6) for d in (0.375, 0.375, -0.125)] * 2)
    assert metrics["overlong/penalty_mean"] == pytest.approx(-1.5 / 4)
    assert metrics["overlong/masked_frac"] == pytest.approx(1 / 4)
    assert metrics["critic/score/mean"] == 1.0  # the task's reward is logged as it was scored


def test_gspo_defaults_and_refusals(task, tmp_path):
    gspo = train_grpo.Args(policy_loss="gspo")
    assert (gspo.clip_low, gspo.clip_high, gspo.loss_agg) == (3e-4, 4e-4, "seq-mean-token-mean")
    clip = train_grpo.Args()
    assert (clip.clip_low, clip.clip_high, clip.loss_agg) == (0.2, 0.2, "token-mean")
    mine = train_grpo.Args(policy_loss="gspo", clip_high=1e-3, loss_agg="token-mean")
    assert (mine.clip_low, mine.clip_high, mine.loss_agg) == (3e-4, 1e-3, "token-mean")
    # Refused in setup, before anything loads (the model path does not exist).
    for kwargs, message in [({"policy_loss": "gspo", "dual_clip": 3.0}, "GSPO clips the sequence-level"),
                            ({"dynamic_sampling": True, "advantage": "reinforce++"}, "reinforce\\+\\+-baseline"),
                            ({"overlong_buffer": 300, "max_new_tokens": 256}, "--overlong-buffer 300 must be in"),
                            ({"dynamic_sampling": True, "max_sampling_tries": 0}, "--max-sampling-tries")]:
        with pytest.raises(ValueError, match=message):
            train_grpo.setup(train_grpo.Args(model=str(tmp_path / "missing"), **kwargs), None)


def test_gspo_trains_with_truncated_importance_sampling(task, tmp_path):
    run = make_run(task, tmp_path, LengthsEngine([3, 5], stop_id=2), position_rewards(2), prompts_per_step=3,
                   group_size=2, max_new_tokens=8, policy_loss="gspo", tis_cap=2.0)
    assert (run.args.clip_low, run.args.loss_agg) == (3e-4, "seq-mean-token-mean")
    metrics = train_grpo.train_step(run)
    # The engine claims logprob -1 for every token: TIS weights are min(exp(old + 1), 2), below the cap here.
    assert 0 < metrics["actor/tis_weight_mean"] < 2 and math.isfinite(metrics["actor/pg_loss"])


def test_stop_tokens_hold_the_templates_end_of_turn(tmp_path):
    model = tiny.make_tiny_model(tmp_path / "llama", ["def f(x):\n    return x + 1\n"] * 20, chat_format="llama3")
    train, _ = data_prep.toy_rows(8, 2, seed=0)
    task_rows.write_rows(train, tmp_path / "train.parquet")
    run = train_grpo.setup(train_grpo.Args(model=str(model), data=str(tmp_path / "train.parquet"),
                                           output_dir=str(tmp_path / "out"), max_prompt_tokens=4096), None)
    eot = run.tokenizer.convert_tokens_to_ids("<|eot_id|>")
    assert eot in run.sampling.stop_token_ids and run.tokenizer.eos_token_id in run.sampling.stop_token_ids
    assert eot not in policy.stop_token_ids(run.tokenizer, model)  # the generation config and eos alone


def test_variants_reach_the_command_line():
    args = tyro.cli(train_grpo.Args, args=["--policy-loss", "gspo", "--clip-high", "5e-4", "--advantage",
                                           "reinforce++-baseline", "--dynamic-sampling"])
    assert (args.clip_low, args.clip_high, args.loss_agg) == (3e-4, 5e-4, "seq-mean-token-mean")
    assert args.advantage == "reinforce++-baseline" and args.dynamic_sampling
    train_grpo.check_args(args, 1)  # a group baseline first: dynamic sampling is defined for it
