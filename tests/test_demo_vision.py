"""`make demo-vision`: its parts (the counting tasks need code on the image and hold out unseen colour sequences, the
teacher's programs print and show exactly what the real sandboxed tool returns, its conversations train only the
policy's tokens, never an image or an observation) and its whole loop shortened. The full demo is the benchmark
(bench/RESULTS.md)."""
import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import board  # noqa: E402
import chat  # noqa: E402
import data_prep  # noqa: E402
import demo_agent  # noqa: E402
import demo_vision  # noqa: E402
import policy  # noqa: E402
import ranks  # noqa: E402
import rewards  # noqa: E402
import tiny  # noqa: E402
import tools  # noqa: E402
import vision_tasks  # noqa: E402


def test_count_tasks_hold_out_unseen_colour_sequences_and_need_the_pixels():
    train, test = data_prep.vision_count_rows(600, 40, seed=1)
    train_seqs = {tuple(r["extra_info"]["colours"]) for r in train}
    test_seqs = {tuple(r["extra_info"]["colours"]) for r in test}
    assert not test_seqs & train_seqs and {len(s) for s in test_seqs} == {3}
    assert {(c,) for c in vision_tasks.COUNT_COLOURS} <= train_seqs  # every colour is asked alone
    assert {pair for a, b, c in test_seqs for pair in ((a, b), (b, c))} <= train_seqs  # and each held-out pair
    with pytest.raises(ValueError, match="1 must be >= 2"):
        data_prep.vision_count_rows(100, 10, max_colours=1)
    for row in train[:100] + test:
        pixels = np.array(Image.open(io.BytesIO(row["images"][0])))
        truth = sum(int((pixels == vision_tasks.COUNT_COLOURS[c]).all(2).sum()) for c in row["extra_info"]["colours"])
        assert str(truth // vision_tasks.COUNT_SIDE ** 2) == row["reward_model"]["ground_truth"]
        assert truth % vision_tasks.COUNT_SIDE ** 2 == 0  # whole squares: none touches another or the border
    assert data_prep.vision_count_rows(50, 5, seed=3) == data_prep.vision_count_rows(50, 5, seed=3)  # bit for bit


def test_teacher_programs_print_and_show_what_the_real_tool_returns():
    """count_output (how the teacher's conversations are written) against the sandboxed codev tool itself, for the
    right program and for each colour's slip: the same printed line and the same mask image; the right program
    computes the answer and every slip does not."""
    train, _ = data_prep.vision_count_rows(8, 0, seed=2)
    for row in train[:4]:
        colours = row["extra_info"]["colours"]
        variants = [[vision_tasks.colour_test(c) for c in colours],
                    *[[vision_tasks.COUNT_SLIPS[c] if i == k else vision_tasks.colour_test(c)
                       for i, c in enumerate(colours)] for k in range(len(colours))]]
        box = tools.TOOLBOXES["codev"](row)
        try:
            for k, tests in enumerate(variants):
                result = box.tools["python"]({"code": vision_tasks.count_code(colours, tests)})
                printed, mask = data_prep.count_output(row["images"][0], tests)
                assert not result.error and result.text == printed and result.images == [mask], result.text
                assert (printed.strip() == row["reward_model"]["ground_truth"]) == (k == 0), (k, printed)
        finally:
            box.close()


def test_careless_teacher_writes_codev_conversations_that_train_only_its_own_tokens(tmp_path):
    train, _ = data_prep.vision_count_rows(300, 0, seed=0)
    conversations = data_prep.vision_count_teacher_conversations(train, slip_rate=0.6, skip_rate=0.3,
                                                                 misread_rate=0.25, seed=0)
    demo_vision.write_conversations(conversations, tmp_path / "sft.jsonl")
    model = tiny.make_tiny_vlm(tmp_path / "m", tiny.corpus_of(tmp_path / "sft.jsonl"))
    tokenizer = policy.load_tokenizer(str(model))
    graded = [rewards.score(row, c["messages"][-1]["content"]) for row, c in zip(train, conversations)]
    coded = [c for c in conversations if len(c["messages"]) == 5]
    assert 0.55 < len(coded) / len(conversations) < 0.85  # the teacher answers at a glance ~30% of the time
    assert 0.03 < sum(g.score for g in graded) / len(graded) < 0.4  # and slips: far from all right
    assert all(g.score == 0 for g, c in zip(graded, conversations) if len(c["messages"]) == 3)
    written = [json.loads(line) for line in open(tmp_path / "sft.jsonl")]
    for conversation, line in zip(conversations[:40], written):
        assert [(tmp_path / name).read_bytes() for name in line["images"]] == conversation["images"]
        ids, mask = chat.encode_conversation(tokenizer, conversation["messages"])
        assert ids.count(chat.image_pad_id(tokenizer)) == len(conversation["images"])  # the row's, then the mask
        trained = tokenizer.decode([t for t, m in zip(ids, mask) if m])
        assert "<|image_pad|>" not in trained and "<sandbox_output>" not in trained and "<|im_start|>" not in trained
        assert trained.startswith("<code>" if len(conversation["messages"]) == 5 else "<answer>")


@pytest.mark.slow
@pytest.mark.after_suite  # about 6 minutes alone: .ci/run runs it after make test (make test-long)
def test_a_shortened_demo_vision_learns_to_count_with_code_with_every_mask_right(tmp_path, monkeypatch):
    """The demo's loop on seed 0, shortened: 1,000 tasks naming 1-2 colours (held out: 2-colour sequences never
    trained), 600 SFT steps, 15 GRPO steps, 50 held-out tasks. The warm start slips on most colours, so greedy
    decoding passes few tasks; GRPO must teach the exact colour tests through the tool's outputs."""
    monkeypatch.setattr(demo_agent, "torchrun", ranks.torchrun)  # the same launches, ranks forked with imports done
    args = demo_vision.Args(output_dir=str(tmp_path), seed=0, n_train=1000, n_test=50, max_colours=2,
                            sft_steps=600, grpo_steps=15)
    result = demo_vision.main(args)

    trajectories = args.grpo_steps * args.prompts_per_step * args.group_size + 2 * args.n_test
    assert result["checked"] == trajectories and result["mask_drifted"] == 0, result  # every sample, none mistrained
    assert demo_agent.sign_test_p(result["wins"], result["losses"]) < 1e-3, result  # no chance lift
    assert result["calls_right"][1] > result["calls_right"][0], result  # its programs compute the answer more often
    records = [json.loads(line) for line in open(tmp_path / "grpo" / "metrics.jsonl")]
    train = [m for m in records if "critic/score/mean" in m]
    assert [m["step"] for m in train] == list(range(1, args.grpo_steps + 1))
    assert all(m["tools/tito_mask_drift_frac"] == 0 for m in train)
    recorded = [json.loads(line) for line in open(tmp_path / "grpo" / "samples.jsonl")]  # --rich-samples: tokens
    run_board = board.Board.open([str(tmp_path / "grpo")])
    for sample in recorded:
        trained = "".join(t for t, m in zip(sample["token_text"], sample["loss_mask"]) if m)
        assert "<|image_pad|>" not in trained and "<sandbox_output>" not in trained, sample["task_id"]
        assert "<|im_start|>" not in trained, sample["task_id"]
        shown = [image for call in sample["tool_calls"] for image in call["images"]]
        assert sample["images"][1:] == shown  # the row's image, then each one the tool returned, in order
        for name in sample["images"]:  # each on the board as the file the record names
            status, kind, body = run_board.answer("/file", {"path": name})
            assert status == 200 and kind == "image/png" and body == (tmp_path / "grpo" / name).read_bytes()
    assert any(sample["tool_calls"] for sample in recorded)
    evals = json.loads(run_board.answer("/api/evals", {})[2])
    assert {step: e["all"]["pass@1"] for step, e in evals.items()} == {
        "0": result["before"], str(args.grpo_steps): result["after"]}
