"""A parquet file's rows read lazily (task_rows.Rows): the same rows as a whole-file read, in the same seeded epoch
order; the validated Arrow copy beside the parquet made once and again when the file changes, never when a row is
bad (which is named); single columns read without the rest of each row; images decoded per use. The prompt-length
filter's lengths computed once per tokenizer, template and tool signatures, and again when one of them changes."""
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import chat  # noqa: E402
import data_prep  # noqa: E402
import policy  # noqa: E402
import rollout  # noqa: E402
import task_rows  # noqa: E402
import tiny  # noqa: E402
from task_rows import RowError, Rows, load_rows, validate_row  # noqa: E402


def cache_of(path: Path) -> Path:
    return path.with_name(task_rows.ARROW_CACHE.format(name=path.name))


def test_rows_equal_the_whole_file_and_keep_the_seeded_epoch_order(tmp_path):
    train, _ = data_prep.toy_rows(37, 0, seed=0, max_ops=2)
    path = tmp_path / "train.parquet"
    task_rows.write_rows(train, path)
    rows = load_rows(path)
    assert isinstance(rows, Rows) and len(rows) == 37
    expected = [validate_row(r) for r in train]
    assert list(rows) == expected and rows == expected and rows[-1] == expected[-1]
    assert list(rows[3:30:4]) == expected[3:30:4]
    # The order the trainers visit rows in, across epochs and from any resume position, is the list's.
    for start, count in ((0, 8), (33, 10), (70, 5), (111, 40)):
        assert task_rows.in_epoch_order(rows, start, count, seed=3) == \
            task_rows.in_epoch_order(expected, start, count, seed=3)
    kept = task_rows.subset(rows, [5, 1, 36])
    assert list(kept) == [expected[5], expected[1], expected[36]]
    assert task_rows.in_epoch_order(kept, 2, 4, seed=0) == \
        task_rows.in_epoch_order([expected[5], expected[1], expected[36]], 2, 4, seed=0)
    assert list(task_rows.values(kept, "data_source")) == ["toy"] * 3
    assert list(task_rows.values(rows, "reward_model.style")) == ["rule"] * 37
    assert list(task_rows.values(rows, "prompt")) == [r["prompt"] for r in expected]
    assert task_rows.summaries(kept)[0] == {"data_source": "toy", "ability": "code", "reward_model": {"style": "rule"}}
    assert list(task_rows.values(rows, "images")) == [None] * 37

    # The Arrow copy is made once; a changed parquet gets a new one.
    cache = cache_of(path)
    made = cache.stat().st_mtime_ns
    assert load_rows(path) == expected and cache.stat().st_mtime_ns == made
    task_rows.write_rows(train[:5], path)
    os.utime(path, ns=(made + 10**9, made + 10**9))  # a rewrite within the clock's tick still differs in size
    assert list(load_rows(path)) == expected[:5]


def test_a_bad_or_repeated_row_is_named_and_no_copy_is_kept(tmp_path):
    good = [validate_row(data_prep.toy_rows(30, 0, seed=1, max_ops=1)[0][i]) for i in range(30)]
    bad = [dict(r) for r in good]
    bad[23] = bad[23] | {"reward_model": {"style": "rule", "ground_truth": "{'test_list': 1}"}}
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(bad), path, row_group_size=8)  # the bad row sits in a later batch
    with pytest.raises(RowError, match=rf"^{path} row 23: reward_model.ground_truth: not valid JSON"):
        load_rows(path)
    assert not cache_of(path).exists() and not list(tmp_path.glob("*.tmp"))
    repeated = good[:12] + [good[3]]
    pq.write_table(pa.Table.from_pylist(repeated), path)
    with pytest.raises(RowError, match=rf"row 12: extra_info.index: task id 'toy/3' repeats row 3"):
        load_rows(path)


def test_images_come_back_per_row(tmp_path):
    data_prep.vision_toy(tmp_path / "train.parquet", split="train", n_train=3, n_test=1, size=128)
    rows = load_rows(tmp_path / "train.parquet")
    expected = data_prep.vision_toy_rows(3, 1, size=128)[0]
    assert [task_rows.row_images(r) for r in rows] == [task_rows.row_images(r) for r in expected]
    assert [len(images) for images in task_rows.values(rows, "images")] == [1, 1, 1]


def test_prompt_lengths_are_kept_beside_the_rows_until_the_tokenizer_template_tools_or_file_change(
        tmp_path, monkeypatch, capsys):
    train, _ = data_prep.toy_rows(40, 0, seed=0, max_ops=3)
    path = tmp_path / "train.parquet"
    task_rows.write_rows(train, path)
    tokenizer = policy.load_tokenizer(tiny.make_tiny_model(tmp_path / "a", [r["prompt"][-1]["content"] for r in train]))
    truth = sorted(len(chat.encode_prompt(tokenizer, r["prompt"])) for r in train)
    limit = truth[24]
    kept = rollout.load_rows_within(str(path), tokenizer, limit)
    first = capsys.readouterr().out
    assert len(kept) == sum(n <= limit for n in truth) < 40 and f"skipped {40 - len(kept)} of 40 rows" in first
    assert len(list(tmp_path.glob(f"{cache_of(path).name}.prompt-tokens-*.npy"))) == 1

    # A later start (or another rank) reads the lengths: nothing is rendered, the same rows and message come back.
    renders = []
    monkeypatch.setattr(chat, "render", lambda *a, **k: renders.append(1) or real_render(*a, **k))
    assert rollout.load_rows_within(str(path), tokenizer, limit) == kept and renders == []
    assert capsys.readouterr().out == first
    with pytest.raises(ValueError, match="no row has a prompt within"):  # the tool signatures' own lengths
        rollout.load_rows_within(str(path), tokenizer, limit, tools="python")
    assert len(renders) == 40
    # Another chat template, another tokenizer: lengths computed again, and right.
    renders.clear()
    tokenizer.chat_template = "Hi " + tokenizer.chat_template
    longer = sorted(len(chat.encode_prompt(tokenizer, r["prompt"])) for r in train)
    assert all(a > b for a, b in zip(longer, truth)) and len(rollout.load_rows_within(str(path), tokenizer, longer[24])) == \
        sum(n <= longer[24] for n in longer)
    assert len(renders) == 40
    other = policy.load_tokenizer(tiny.make_tiny_model(tmp_path / "b", ["a few other words"] * 20, vocab_size=300))
    other_lengths = [len(chat.encode_prompt(other, r["prompt"])) for r in train]
    assert len(rollout.load_rows_within(str(path), other, sorted(other_lengths)[10])) == \
        sum(n <= sorted(other_lengths)[10] for n in other_lengths)
    assert len(list(tmp_path.glob(f"{cache_of(path).name}.prompt-tokens-*.npy"))) == 4
    # A changed file gets a new Arrow copy, and its lengths go with the old one.
    task_rows.write_rows(train[:30], path)
    os.utime(path, ns=(10**18, 10**18))
    assert len(rollout.load_rows_within(str(path), other, 10**6)) == 30
    assert len(list(tmp_path.glob(f"{cache_of(path).name}.prompt-tokens-*.npy"))) == 1


real_render = chat.render


def test_image_counts_are_kept_per_image_processor_and_a_counter_without_a_key_counts_every_time(tmp_path):
    data_prep.vision_toy(tmp_path / "train.parquet", split="train", n_train=3, n_test=1, size=128)
    rows = load_rows(tmp_path / "train.parquet")
    tokenizer = policy.load_tokenizer(tiny.make_tiny_model(tmp_path / "m", ["a few words"] * 20))
    text = rollout.prompt_lengths(rows, tokenizer, None)
    calls = []

    class Counter:  # what vision.ImageCounter is to the filter: a count per image, named by `key`
        def __init__(self, tokens: int, key: str | None):
            self.tokens, self.key = tokens, key

        def __call__(self, image: bytes) -> int:
            calls.append(image)
            return self.tokens

    assert rollout.prompt_lengths(rows, tokenizer, None, Counter(10, "processor A")) == [n + 9 for n in text]
    assert len(calls) == 3
    assert rollout.prompt_lengths(rows, tokenizer, None, Counter(10, "processor A")) == [n + 9 for n in text]
    assert len(calls) == 3  # read back, not counted
    assert rollout.prompt_lengths(rows, tokenizer, None, Counter(20, "processor B")) == [n + 19 for n in text]
    assert rollout.prompt_lengths(rows, tokenizer, None, Counter(30, None)) == [n + 29 for n in text]
    assert rollout.prompt_lengths(rows, tokenizer, None, Counter(30, None)) == [n + 29 for n in text]
    assert len(calls) == 3 + 3 + 3 + 3
