"""`make demo-agent`'s whole loop, shortened for CI: calc tasks -> tiny model -> SFT on the careless tool-using teacher
-> 2-rank GRPO with the sandboxed python tool, multi-turn, on the demo's default seed. Every trajectory (training and
held-out) must match the chat template's rendering, ids and loss mask (check_tito), and the held-out pass rate must
rise by more than chance allows; the full demo's numbers are the benchmark (bench/RESULTS.md).

Also, cheaply: the calc tasks need the tool and hold out unseen chains, the teacher's conversations go through the
real template and protocol, and the answer reward grades the answer alone."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import chat  # noqa: E402
import data_prep  # noqa: E402
import demo_agent  # noqa: E402
import policy  # noqa: E402
import rewards  # noqa: E402
import tiny  # noqa: E402
import tools  # noqa: E402

# The shortened demo: the demo's warm start (it must learn to copy the numbers), half its GRPO steps. On seed 0, 20
# steps gave 10 held-out tasks of 60 taught and none unlearnt (sign test p = 0.001, too close); 60 steps 25 of 100.
SFT_STEPS, GRPO_STEPS = 600, 30


def test_calc_tasks_hold_out_unseen_chains_and_defeat_shortcuts():
    train, test = data_prep.calc_rows(300, 40, seed=1)
    train_chains = {tuple(r["extra_info"]["ops"]) for r in train}
    assert not {tuple(r["extra_info"]["ops"]) for r in test} & train_chains
    assert {(op,) for op in data_prep.CALC_OPS} <= train_chains  # every operation is seen alone
    for row in train + test:
        info, answer = row["extra_info"], row["reward_model"]["ground_truth"]
        assert data_prep.calc_output(info["code"]).strip() == answer
        assert answer not in {str(info["start"]), *map(str, info["constants"])}  # not copied from the question


def test_careless_teacher_uses_the_tool_protocol_and_slips(tmp_path):
    train, _ = data_prep.calc_rows(200, 0, seed=0)
    schemas = tools.TOOL_SCHEMAS["python"]
    conversations = data_prep.calc_teacher_conversations(train, schemas, slip_rate=0.6, skip_rate=0.3,
                                                         misread_rate=0.25, seed=0)
    model = tiny.make_tiny_model(tmp_path / "m", demo_agent.tokenizer_corpus(conversations))
    tokenizer = policy.load_tokenizer(str(model))
    graded = [rewards.score(row, "\n".join(m["content"] for m in c["messages"] if m["role"] == "assistant"
                                           and not m.get("tool_calls")))
              for row, c in zip(train, conversations)]
    called = [c for c in conversations if len(c["messages"]) == 4]
    assert 0.5 < len(called) / len(conversations) < 0.9  # the teacher answers without its tool ~30% of the time
    assert 0.05 < sum(g.score for g in graded) / len(graded) < 0.6  # and slips: far from all right
    assert all(g.score == 0 for g, c in zip(graded, conversations) if len(c["messages"]) == 2)
    for conversation in called[:20]:
        ids, mask = chat.encode_conversation(tokenizer, conversation["messages"], tools=conversation["tools"])
        prompt = chat.render(tokenizer, conversation["messages"][:1], schemas, add_generation_prompt=True)
        assert tokenizer.decode(ids).startswith(prompt)  # the prompt the agent will see, tool signatures included
        trained = tokenizer.decode([t for t, m in zip(ids, mask) if m])
        assert trained.startswith("<tool_call>") and "<tool_response>" not in trained
        code = chat.parse_tool_calls(trained.split("<|im_end|>")[0], {"python"})[0]["arguments"]["code"]
        assert data_prep.calc_output(code) == conversation["messages"][2]["content"]  # the real tool's output


def test_answer_reward_grades_the_last_answer_only():
    row = {"data_source": "calc", "reward_model": {"style": "rule", "ground_truth": "56621"},
           "extra_info": {"index": 0}}
    assert rewards.score(row, "<tool_call>...</tool_call>\n<answer>56621</answer>").score == 1.0
    assert rewards.score(row, "<answer>56621</answer> no, <answer>5662</answer>").info["error"] == "wrong_answer"
    assert rewards.score(row, "x = 56621").info["error"] == "no_answer"
    assert rewards.score(row, "<answer>56621.0</answer>").score == 0.0  # the teacher's `/` slip prints a float


def test_sign_test_p():
    assert demo_agent.sign_test_p(0, 0) == 1.0
    assert demo_agent.sign_test_p(3, 0) == 1 / 8
    assert demo_agent.sign_test_p(10, 10) > 0.5


@pytest.mark.slow
def test_demo_agent_learns_to_use_its_tool(tmp_path):
    args = demo_agent.Args(output_dir=str(tmp_path), seed=0, sft_steps=SFT_STEPS, grpo_steps=GRPO_STEPS)
    result = demo_agent.main(args)

    # check_tito ran on every trajectory. Its drifts seen so far are all sampled ids that are not the tokenizer's
    # canonical split of their text (a tiny model at T=1 samples such splits; the trainer trains on the sampled ids,
    # token in, token out); check_tito checks the loss mask of every trajectory whose ids are canonical.
    trajectories = GRPO_STEPS * args.prompts_per_step * args.group_size + 2 * args.n_test
    assert result["checked"] == trajectories, result
    assert result["train_drifted"] <= 0.1 * (trajectories - 2 * args.n_test), result
    assert result["after"] > result["before"] and demo_agent.sign_test_p(result["wins"], result["losses"]) < 1e-3, \
        result
    records = [json.loads(line) for line in open(tmp_path / "grpo" / "metrics.jsonl")]
    assert [m["step"] for m in records if "tools/calls_mean" in m] == list(range(1, GRPO_STEPS + 1))
    samples = [json.loads(line) for line in open(tmp_path / "grpo" / "samples.jsonl")]
    assert samples and all(s["messages"][-1]["role"] == "assistant" for s in samples)
    held_out = [json.loads(line) for line in open(tmp_path / "held_out_after.jsonl")]
    findings = [f for h in held_out for f in h["tito"]]
    assert len(held_out) == args.n_test and not [f for f in findings if f.startswith("loss mask drift")], findings
    assert sum(bool(h["tito"]) for h in held_out) <= 0.05 * args.n_test, findings
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| 0 |" in (tmp_path / "grpo" / "eval_report.md").read_text()

