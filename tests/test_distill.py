"""On-policy distillation (--teacher): the per-token advantage by hand, the teacher's logprobs on exactly the policy's
tokens (none on a tool's output), a teacher equal to the student gives no signal, a teacher with another tokenizer is
refused before any model loads, a GRPO step of distillation alone moves the student's logprobs with the teacher's
signal, and PPO takes the same term. `make demo-distill` is the real run (demo_distill.py; tests/test_demo.py style is too
long for the suite: bench/RESULTS.md)."""
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import data_prep  # noqa: E402
import losses  # noqa: E402
import policy  # noqa: E402
import rl_run  # noqa: E402
import rollout  # noqa: E402
import task_rows  # noqa: E402
import tiny  # noqa: E402
import train_grpo  # noqa: E402
import train_ppo  # noqa: E402
from test_grpo import Score, metrics_by_step  # noqa: E402

CORPUS = ["def f(x):\n    return x + 1\n", "Write f that adds one.\n", "print(f(2))\n"] * 20


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """Toy rows, an untrained tiny student (close to uniform over its vocabulary) and a teacher of the same tokenizer
    that is the student with 4x its final norm: the same ranking of tokens, much more peaked."""
    root = tmp_path_factory.mktemp("distill")
    train, _ = data_prep.toy_rows(40, 2, seed=0, max_ops=2)
    task_rows.write_rows(train, root / "train.parquet")
    student = tiny.make_tiny_model(root / "student", CORPUS, seed=0)
    teacher = policy.load_model(student)
    with torch.no_grad():
        teacher.model.norm.weight.mul_(4)
    teacher.save_pretrained(root / "teacher")
    policy.load_tokenizer(student).save_pretrained(root / "teacher")
    return root / "train.parquet", student, root / "teacher"


def test_distill_advantage_by_hand():
    """A_t = -coef (student - teacher) on the mask, 0 elsewhere (the padding's -inf included), no gradient."""
    student = torch.tensor([[-1.0, -2.0, -0.5, -torch.inf]], requires_grad=True)
    teacher = torch.tensor([[-0.5, -3.0, -0.1, 0.0]])
    advantages = losses.distill_advantages(student, teacher, torch.tensor([[1, 1, 0, 0]]), coef=2.0)
    assert advantages.tolist() == [[1.0, -2.0, 0.0, 0.0]] and not advantages.requires_grad


def test_teacher_scores_the_policy_tokens_only(task):
    """A multi-turn sample (assistant, tool output, assistant): the teacher's logprobs of the completion given the
    prompt, the advantage on the policy's tokens only, added to the sample's own advantage (or alone with
    --no-distill-task-reward); the same model as teacher gives zero reverse KL."""
    _, student_dir, teacher_dir = task
    student, teacher = policy.load_model(student_dir), policy.load_model(teacher_dir)
    samples = [rollout.Sample(prompt_ids=[1, 20, 31], completion_ids=[44, 52, 60, 61, 75, 2],
                              loss_mask=[1, 1, 0, 0, 1, 1], engine_logprobs=[0.0] * 6, row={}, group=0),
               rollout.Sample(prompt_ids=[1, 20, 31], completion_ids=[40, 2], loss_mask=[1, 1],
                              engine_logprobs=[0.0] * 2, row={}, group=0)]
    old = policy.completion_logprobs_no_grad(student, samples, 4096)
    by_teacher = policy.completion_logprobs_no_grad(teacher, samples, 4096)
    mask = policy.padded([s.loss_mask for s in samples])
    scalar = torch.tensor([[0.5] * 6, [-0.5] * 2 + [0.0] * 4])
    args = SimpleNamespace(micro_batch_tokens=4096, temperature=1.0, logprob_chunk_size=512, distill_coef=0.5,
                           distill_task_reward=True)
    run = SimpleNamespace(args=args, teacher=teacher)
    advantages, metrics = rl_run.distill(run, old, samples, scalar)
    expected = scalar - 0.5 * (old - by_teacher) * mask
    torch.testing.assert_close(advantages, expected)
    assert advantages[0, 2] == advantages[0, 3] == 0.5  # the tool's tokens: the sample's advantage, nothing more
    assert metrics["distill/reverse_kl"] == pytest.approx(((old - by_teacher) * mask).sum().item() / mask.sum().item(),
                                                          rel=1e-5)
    args.distill_task_reward = False
    alone, _ = rl_run.distill(run, old, samples, scalar)
    torch.testing.assert_close(alone, -0.5 * (old - by_teacher) * mask)
    run.teacher = student
    same, metrics = rl_run.distill(run, old, samples, scalar)
    assert metrics["distill/reverse_kl"] == pytest.approx(0, abs=1e-5)
    torch.testing.assert_close(same, torch.zeros_like(same), atol=1e-5, rtol=0)


def test_a_teacher_with_another_tokenizer_is_refused_before_loading(task, tmp_path):
    data, student_dir, _ = task
    other = tiny.make_tiny_model(tmp_path / "other", ["SELECT * FROM t WHERE x > 1;\n"] * 30, seed=0)
    with pytest.raises(ValueError, match="its tokenizer is not the policy's"):
        train_grpo.setup(train_grpo.Args(model=str(student_dir), data=str(data), output_dir=str(tmp_path / "o"),
                                         teacher=str(other)), None)
    with pytest.raises(ValueError, match="needs --teacher"):
        rl_run.check_args(train_grpo.Args(model="m", data="d", distill_task_reward=False), 1)
    with pytest.raises(ValueError, match="--dynamic-sampling"):
        train_grpo.check_args(train_grpo.Args(model="m", data="d", teacher="t", distill_task_reward=False,
                                              dynamic_sampling=True), 1)


def nothing(rows, texts, sample_infos=None):
    return [Score(0.0, {}) for _ in texts]


def test_distillation_alone_moves_the_student_toward_the_teacher(task, tmp_path, monkeypatch):
    """One GRPO step with --teacher and --no-distill-task-reward (a reward of 0 everywhere: no task signal at all):
    on the tokens it trained on, the student's logprobs move with the distillation advantage (up where the teacher
    finds a token likelier than the student, down where less likely: sum_t A_t (new - old)_t > 0), and the logged
    distill/* metrics are the batch's. Moving the student toward a real teacher's pass rate is `make demo-distill`."""
    data, student_dir, teacher_dir = task
    args = train_grpo.Args(model=str(student_dir), data=str(data), output_dir=str(tmp_path / "out"), total_steps=1,
                           max_new_tokens=16, lr=1e-4, prompts_per_step=4, group_size=2, save_every=1000,
                           sample_every=0, teacher=str(teacher_dir), distill_task_reward=False, seed=0)
    run = train_grpo.setup(args, nothing)
    seen, real = [], train_grpo.update_policy

    def update(run, batch, minibatch, old_logprobs, ref_logprobs, correction, advantages):
        seen.append((list(batch), old_logprobs, advantages))
        return real(run, batch, minibatch, old_logprobs, ref_logprobs, correction, advantages)
    monkeypatch.setattr(train_grpo, "update_policy", update)
    metrics = train_grpo.train_step(run)
    run.log.finish()
    (batch, old, advantages), = seen
    mask = policy.padded([s.loss_mask for s in batch])
    teacher = policy.completion_logprobs_no_grad(run.teacher, batch, 4096)
    torch.testing.assert_close(advantages, (teacher - old) * mask)  # no task term, coef 1
    assert metrics["distill/reverse_kl"] == pytest.approx(((old - teacher) * mask).sum().item() / mask.sum().item(),
                                                          rel=1e-4) and metrics["distill/reverse_kl"] > 0.05
    new = policy.completion_logprobs_no_grad(run.model, batch, 4096)
    assert ((new - old) * advantages).sum() > 0 and metrics["actor/grad_norm"] > 0


def test_ppo_distils_too(task, tmp_path):
    """PPO's actor takes the distillation term into its advantages (before whitening): two steps with a teacher log
    distill/* and train; the actor trains LoRA adapters (--lora-rank), its critic its full weights."""
    data, student_dir, teacher_dir = task
    args = train_ppo.Args(model=str(student_dir), data=str(data), output_dir=str(tmp_path / "ppo"), total_steps=2,
                          max_new_tokens=8, prompts_per_step=2, minibatches=1, save_every=1000, sample_every=0,
                          teacher=str(teacher_dir), distill_task_reward=False, lr=1e-3, lora_rank=4)
    run = train_ppo.main(args, score_fn=nothing)
    steps = metrics_by_step(tmp_path / "ppo")
    assert steps[1]["distill/reverse_kl"] > 0.1 and steps[2]["actor/grad_norm"] > 0
    assert policy.lora_config(run.model).r == 4 and policy.lora_config(run.value_model) is None
    assert all(p.requires_grad for p in run.value_model.parameters())
