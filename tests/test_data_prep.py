"""data_prep.py: schema validation messages, exact round trips, converters on the real data, the toy task."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import data_prep
import script_runner
import task_rows
from data_files import APPS_DIR, MBPP_FILE, SWE_LITE_DEV
from task_rows import RowError, load_rows, row_id, validate_row, write_rows

REPO = Path(__file__).resolve().parent.parent


def good_row(**overrides) -> dict:
    row = {
        "data_source": "apps",
        "prompt": [{"role": "user", "content": "Add two numbers."}],
        "ability": "code",
        "reward_model": {"style": "rule", "ground_truth": json.dumps({"inputs": ["1 2\n"], "outputs": ["3\n"]})},
        "extra_info": {"index": 7, "split": "train"},
    }
    row.update(overrides)
    return row


def truth(**fields) -> dict:
    return {"style": "rule", "ground_truth": json.dumps(fields)}


@pytest.fixture(scope="module")
def humaneval():
    return data_prep.humaneval_rows()


@pytest.fixture(scope="module")
def mbpp():
    return data_prep.mbpp_rows(MBPP_FILE)


@pytest.fixture(scope="module")
def apps():
    return data_prep.apps_rows(APPS_DIR, "train")


@pytest.fixture(scope="module")
def toy():
    return data_prep.toy_rows(600, 150, seed=3)


# ------------------------------------------------------------------------------------------------ validation


@pytest.mark.parametrize("change, message", [
    (lambda r: r.pop("data_source"), "data_source: missing"),
    (lambda r: r.update(data_source=3), "data_source: expected str, got int"),
    (lambda r: r.update(prompt="hi"), "prompt: expected list, got str"),
    (lambda r: r.update(prompt=[]), "prompt: empty"),
    (lambda r: r["prompt"][0].update(role="robot"), "prompt[0].role: expected one of"),
    (lambda r: r["prompt"].append({"role": "user", "content": 5}), "prompt[1].content: expected str or list"),
    (lambda r: r.pop("ability"), "ability: missing"),
    (lambda r: r.update(images=b"png"), "images: expected list, got bytes"),
    (lambda r: r.update(images=[3]), "images[0]: expected bytes or str or dict, got int"),
    (lambda r: r.update(reward_model="rule"), "reward_model: expected dict, got str"),
    (lambda r: r["reward_model"].update(style="model"), "reward_model.style: expected 'rule' or 'judge'"),
    (lambda r: r["reward_model"].update(ground_truth={"inputs": []}), "ground_truth: expected str, got dict"),
    (lambda r: r["reward_model"].update(ground_truth="{inputs: [1]}"), "reward_model.ground_truth: not valid JSON"),
    (lambda r: r["reward_model"].update(ground_truth="[1, 2]"), "reward_model.ground_truth: expected a JSON object"),
    (lambda r: r.update(reward_model=truth(inputs=[], outputs=[])), "ground_truth.inputs: expected a non-empty list"),
    (lambda r: r.update(reward_model=truth(inputs=["1\n"])), "ground_truth.outputs: expected a non-empty list"),
    (lambda r: r.update(reward_model=truth(inputs=["1\n", "2\n"], outputs=["1\n"])), "2 inputs but 1 outputs"),
    (lambda r: r.update(reward_model=truth(inputs=[[1]], outputs=[2], fn_name=3)), "fn_name: expected a string"),
    (lambda r: r.update(data_source="humaneval", reward_model=truth(test="def check(c): pass", prompt="def f():")),
     "reward_model.ground_truth.entry_point: expected a non-empty str"),
    (lambda r: r.update(data_source="mbpp", reward_model=truth(test_list="assert f() == 1")),
     "reward_model.ground_truth.test_list: expected a non-empty list"),
    (lambda r: r.update(data_source="mbpp", reward_model=truth(test_list=[["assert f() == 1"]])),
     "reward_model.ground_truth.test_list: expected assert statements as strings"),
    (lambda r: r.update(data_source="toy", reward_model=truth(test_list=["assert f(1) == 2"], test_setup_code=0)),
     "reward_model.ground_truth.test_setup_code: expected a string"),
    (lambda r: r.pop("extra_info"), "extra_info: missing"),
    (lambda r: r["extra_info"].pop("index"), "extra_info.index: expected int or str, got NoneType"),
    (lambda r: r["extra_info"].update(index=True), "extra_info.index: expected int or str, got bool"),
    (lambda r: r["extra_info"].update(split=["train"]), "extra_info.split: expected str, got list"),
    (lambda r: r["extra_info"].update(difficulty=2), "extra_info.difficulty: expected str, got int"),
])
def test_validate_row_names_the_bad_field(change, message):
    row = good_row()
    change(row)
    with pytest.raises(RowError) as e:
        validate_row(row, "rows.parquet row 17")
    assert str(e.value).startswith("rows.parquet row 17: ")
    assert message in str(e.value)


def test_validate_row_accepts_good_rows_and_drops_nulls():
    row = good_row(images=None, extra_info={"index": "a-1", "split": "test", "difficulty": None, "tag": "x"})
    clean = validate_row(row)
    assert "images" not in clean and clean["extra_info"] == {"index": "a-1", "split": "test", "tag": "x"}
    assert row["extra_info"]["difficulty"] is None  # the caller's row is not modified
    # Families kiln does not grade by tests keep free-form ground truth (a judge's reference answer).
    assert validate_row(good_row(data_source="vl_agent", reward_model={"style": "judge", "ground_truth": "3/4 m"}))
    # APPS holds integers longer than Python parses by default; validation must not choke on them.
    huge = "9" * 5000
    assert validate_row(good_row(reward_model={"style": "rule", "ground_truth":
                                               f'{{"inputs": [[{huge}]], "outputs": [1], "fn_name": "f"}}'}))


def test_row_id():
    assert row_id(good_row()) == "apps/7"
    assert row_id(good_row(data_source="humaneval", extra_info={"index": 0, "split": "test"})) == "humaneval/0"


# ------------------------------------------------------------------------------------------------ load / write


def test_verl_style_parquet_from_pandas_loads(tmp_path):
    # As verl's examples/data_preprocess scripts make it: a DataFrame of dicts, structs inferred by pyarrow.
    records = [
        {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "1+1? Let's think step by step."}],
         "ability": "math", "reward_model": {"style": "rule", "ground_truth": "2"},
         "extra_info": {"split": "train", "index": 0, "answer": "1+1=2 #### 2", "question": "1+1?"}},
        {"data_source": "codecontests", "prompt": [{"role": "user", "content": "unused"}], "ability": "code",
         "reward_model": {"style": "rule", "ground_truth": "{}"}, "extra_info": {"split": "train", "index": 2}},
        {"data_source": "codecontests", "prompt": [{"role": "user", "content": "Print the sum."}],
         "ability": "code",
         "reward_model": {"style": "rule", "ground_truth": json.dumps({"inputs": ["1 2\n"], "outputs": ["3\n"]})},
         "extra_info": {"split": "train", "index": 1}},
    ]
    frame = pd.DataFrame(records, index=["gsm8k-0", "unused", "cc-1"]).drop("unused")
    frame.to_parquet(tmp_path / "train.parquet")  # pandas stores a non-range index as a column too
    assert "__index_level_0__" in pq.read_schema(tmp_path / "train.parquet").names

    rows = load_rows(tmp_path / "train.parquet")
    assert [row_id(r) for r in rows] == ["openai/gsm8k/0", "codecontests/1"]
    assert rows[0]["extra_info"] == records[0]["extra_info"]
    assert rows[1] == records[2]  # the union-of-keys nulls (answer, question) do not come back


def test_bad_row_in_plain_pyarrow_parquet_is_reported_with_file_row_and_field(tmp_path):
    rows = [good_row(extra_info={"index": i, "split": "train"}) for i in range(20)]
    rows[17]["reward_model"]["ground_truth"] = "{'inputs': ['1']}"  # python repr, not JSON
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(RowError, match=rf"^{path} row 17: reward_model.ground_truth: not valid JSON"):
        load_rows(path)


def mixed_rows(humaneval, mbpp, apps, toy) -> list[dict]:
    rows = humaneval[:3] + mbpp[10:13] + apps + toy[0][:3] + toy[1][:2]
    rows.append(good_row(
        data_source="vl_agent",
        prompt=[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is shown?"}]}],
        images=[b"\x89PNG\r\n\x00raw"], ability="vision", reward_model={"style": "judge", "ground_truth": "a cat"},
        extra_info={"index": "img-1", "split": "test", "weights": [1, 2.5], "big": 2**70,
                    "instance": {"repo": "a/b", "F2P": ["t1"]}}))
    rows.append(good_row(extra_info={"index": 99, "split": "train", "instance": {"repo": "c/d", "env": {"X": "1"}}}))
    return rows


def assert_identical(a, b):
    a, b = list(a), list(b)  # a parquet file's rows come as a lazy task_rows.Rows
    assert a == b
    assert task_rows._same(a, b)  # also types: no int turned float, no str turned int


def test_parquet_round_trip_of_mixed_sources_is_exact(tmp_path, humaneval, mbpp, apps, toy):
    rows = mixed_rows(humaneval, mbpp, apps, toy)
    write_rows(rows, tmp_path / "mixed.parquet")
    assert_identical(load_rows(tmp_path / "mixed.parquet"), [validate_row(r) for r in rows])
    # Columns arrow can hold stay native (verl reads them as usual); only conflicting ones became JSON text:
    # task_id (str for humaneval, int for mbpp), weights (int and float), big (> int64), instance (keys differ),
    # prompt (string content and list-of-parts content).
    table = pq.read_table(tmp_path / "mixed.parquet")
    json_columns = json.loads(table.schema.metadata[task_rows.JSON_COLUMNS_KEY])
    # index too: "img-1" among ints.
    assert sorted(json_columns) == ["extra_info.big", "extra_info.index", "extra_info.instance",
                                    "extra_info.task_id", "extra_info.weights", "prompt"]
    extra_info = table.schema.field("extra_info").type
    assert table.column("extra_info").combine_chunks().field("index").to_pylist()[:4] == ["0", "1", "2", "11"]
    assert extra_info.field("split").type == pa.string()
    assert extra_info.field("solutions").type == pa.list_(pa.string())
    assert table.schema.field("images").type == pa.list_(pa.binary())


def test_parquet_of_one_converter_has_no_json_columns(tmp_path, mbpp):
    write_rows(mbpp, tmp_path / "mbpp.parquet")
    table = pq.read_table(tmp_path / "mbpp.parquet")
    assert json.loads(table.schema.metadata[task_rows.JSON_COLUMNS_KEY]) == []
    assert table.schema.field("extra_info").type.field("index").type == pa.int64()


def test_jsonl_round_trip_and_line_numbers(tmp_path, humaneval, mbpp, apps, toy):
    rows = [r for r in mixed_rows(humaneval, mbpp, apps, toy) if "images" not in r]
    write_rows(rows, tmp_path / "mixed.jsonl")
    assert_identical(load_rows(tmp_path / "mixed.jsonl"), [validate_row(r) for r in rows])

    lines = (tmp_path / "mixed.jsonl").read_text().splitlines()
    lines.insert(1, "")  # blank lines are skipped but still counted
    broken = json.loads(lines[3])
    broken["extra_info"]["split"] = 1
    lines[3] = json.dumps(broken)
    (tmp_path / "bad.jsonl").write_text("\n".join(lines))
    with pytest.raises(RowError, match=r"bad.jsonl line 4: extra_info.split: expected str, got int"):
        load_rows(tmp_path / "bad.jsonl")
    lines[3] = lines[3][:-1]
    (tmp_path / "bad.jsonl").write_text("\n".join(lines))
    with pytest.raises(RowError, match=r"bad.jsonl line 4: not valid JSON"):
        load_rows(tmp_path / "bad.jsonl")


def test_load_and_write_errors(tmp_path):
    pq.write_table(pa.Table.from_pylist([good_row(), good_row()]), tmp_path / "dup.parquet")
    with pytest.raises(RowError, match=r"dup.parquet row 1: extra_info.index: task id 'apps/7' repeats row 0"):
        load_rows(tmp_path / "dup.parquet")
    with pytest.raises(RowError, match=r"dup2.parquet row 1: extra_info.index: task id 'apps/7' repeats row 0"):
        write_rows([good_row(), good_row()], tmp_path / "dup2.parquet")
    with pytest.raises(RowError, match=r"out.parquet row 1: ability: missing"):
        write_rows([good_row(), {k: v for k, v in good_row().items() if k != "ability"}], tmp_path / "out.parquet")
    with pytest.raises(ValueError, match="no rows to write"):
        write_rows([], tmp_path / "empty.parquet")
    with pytest.raises(ValueError, match="cannot be JSON"):
        write_rows([good_row(images=[b"raw"], prompt=[{"role": "user", "content": [{"type": "image"}]}])],
                   tmp_path / "img.jsonl")
    with pytest.raises(FileNotFoundError, match="missing.parquet: no such file"):
        load_rows(tmp_path / "missing.parquet")
    with pytest.raises(ValueError, match="not a .parquet/.jsonl file or a Hugging Face dataset name"):
        load_rows("no such thing.csv")


def test_hub_names_fail_clearly_when_offline():
    # HF_HUB_OFFLINE makes the hub libraries refuse the network at once: no network is touched here.
    script = """
import data_prep
import task_rows
for load in (lambda: task_rows.load_rows("someone/rows"), lambda: data_prep.apps_rows("codeparrot/apps"),
             lambda: data_prep.mbpp_rows("google-research-datasets/mbpp")):
    try:
        load()
    except (RuntimeError, ValueError) as e:
        print(e)
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120).stdout.splitlines()
    assert len(out) == 3, out
    for line, name in zip(out[::2], ["someone/rows", "google-research-datasets/mbpp"]):  # hub.fetch's check
        assert line.startswith(f"{name}: no such file, nor a Hugging Face dataset in the local cache")
        assert f"fetch it first (`hf download {name} --repo-type dataset`) or unset HF_HUB_OFFLINE" in line
    assert out[1].startswith("could not get 'codeparrot/apps' from the Hugging Face hub")  # one file, hf_hub_download
    assert "pass a local path instead" in out[1]


# ------------------------------------------------------------------------------------------------ converters


def test_humaneval_rows(humaneval):
    assert len(humaneval) == 164
    assert [r["extra_info"]["index"] for r in humaneval] == list(range(164))
    first = humaneval[0]
    assert first["data_source"] == "humaneval" and first["extra_info"]["split"] == "test"
    assert first["extra_info"]["task_id"] == "HumanEval/0"
    assert first["extra_info"]["entry_point"] == "has_close_elements"
    gt = json.loads(first["reward_model"]["ground_truth"])
    assert set(gt) == {"test", "entry_point", "prompt"} and "def check(candidate)" in gt["test"]
    assert f"```python\n{gt['prompt']}```" in first["prompt"][0]["content"]
    assert "    for idx, elem in enumerate(numbers):" in first["extra_info"]["canonical_solution"]


def test_mbpp_rows(mbpp):
    assert len(mbpp) == 974  # the file has no trailing newline: the last record must not be lost
    assert [r["extra_info"]["index"] for r in mbpp] == list(range(1, 975))
    splits = [r["extra_info"]["split"] for r in mbpp]
    assert {s: splits.count(s) for s in set(splits)} == {"prompt": 10, "test": 500, "validation": 90, "train": 374}
    assert [data_prep.mbpp_split(t) for t in (1, 10, 11, 510, 511, 600, 601, 974)] == \
        ["prompt", "prompt", "test", "test", "validation", "validation", "train", "train"]
    row = mbpp[1]  # task 2
    gt = json.loads(row["reward_model"]["ground_truth"])
    assert gt == {"test_list": ["assert similar_elements((3, 4, 5, 6),(5, 7, 4, 10)) == (4, 5)",
                                "assert similar_elements((1, 2, 3, 4),(5, 4, 3, 7)) == (3, 4)",
                                "assert similar_elements((11, 12, 14, 13),(17, 15, 14, 13)) == (13, 14)"],
                  "test_setup_code": ""}
    message = row["prompt"][0]["content"]
    assert "Write a function to find the similar elements from the given two tuple lists." in message
    assert gt["test_list"][0] in message and gt["test_list"][1] not in message
    assert "def similar_elements" in row["extra_info"]["code"]


def test_apps_rows(apps):
    info = {r["extra_info"]["index"]: r["extra_info"] for r in apps}
    assert {i: e["difficulty"] for i, e in info.items()} == \
        {1: "interview", 111: "interview", 2287: "competition", 2404: "introductory", 4184: "introductory"}
    assert {i: len(e["solutions"]) for i, e in info.items()} == {1: 24, 111: 1, 2287: 10, 2404: 58, 4184: 8}
    assert {i: e.get("fn_name") for i, e in info.items()} == \
        {1: None, 111: None, 2287: None, 2404: "findKthPositive", 4184: "is_prime"}
    by_id = {r["extra_info"]["index"]: r for r in apps}
    for i, row in by_id.items():
        raw = (APPS_DIR / "train" / f"{i:04d}" / "input_output.json").read_text()
        assert row["reward_model"]["ground_truth"] == raw  # the APPS format as is
    assert len(json.loads(by_id[2287]["reward_model"]["ground_truth"])["inputs"]) == 3
    assert "```python\ndef is_prime(n):\n```" in by_id[4184]["prompt"][0]["content"]
    assert "class Solution:" in by_id[2404]["prompt"][0]["content"]
    assert "standard input" in by_id[1]["prompt"][0]["content"]
    assert "Mikhail walks on a Cartesian plane" in by_id[1]["prompt"][0]["content"]


def test_apps_skips_problems_without_tests_loudly(tmp_path, caplog):
    for name in ("0001", "4184", "2404"):
        shutil.copytree(APPS_DIR / "train" / name, tmp_path / "train" / name)
    (tmp_path / "train" / "4184" / "input_output.json").unlink()
    (tmp_path / "train" / "2404" / "input_output.json").write_text("")
    with caplog.at_level("WARNING", logger="kiln.data_prep"):
        rows = data_prep.apps_rows(tmp_path, "train")
    assert [r["extra_info"]["index"] for r in rows] == [1]
    assert "skipped 2 of 3 problems that have no tests (ids 2404, 4184)" in caplog.text

    (tmp_path / "train" / "2404" / "input_output.json").write_text('{"inputs": [[1]], "outputs": [')
    with pytest.raises(ValueError, match=r"problem 2404: input_output: not valid JSON"):
        data_prep.apps_rows(tmp_path, "train")


def test_apps_keeps_huge_integers_intact(tmp_path):
    problem = tmp_path / "train" / "0042"
    problem.mkdir(parents=True)
    huge = "1" + "0" * 6000
    (problem / "question.txt").write_text("Print n.")
    (problem / "input_output.json").write_text(f'{{"inputs": ["{huge}\\n"], "outputs": [{huge}]}}')
    (problem / "metadata.json").write_text('{"difficulty": "interview", "url": "u"}')
    (rows,) = [data_prep.apps_rows(tmp_path, "train")]
    assert huge in rows[0]["reward_model"]["ground_truth"]
    write_rows(rows, tmp_path / "apps.parquet")
    assert load_rows(tmp_path / "apps.parquet") == rows


def test_cli_writes_loadable_files(tmp_path):
    commands = [["mbpp", "--source", MBPP_FILE, "--split", "train", "--out", tmp_path / "mbpp.parquet"],
                ["apps", "--source", APPS_DIR, "--out", tmp_path / "apps.parquet"],
                ["toy", "--split", "test", "--n-train", "50", "--n-test", "20", "--out", tmp_path / "toy.jsonl"]]
    for args in commands:
        script_runner.run([sys.executable, "data_prep.py", *map(str, args)], cwd=REPO, check=True, timeout=120)
    assert len(load_rows(tmp_path / "mbpp.parquet")) == 374
    assert len(load_rows(tmp_path / "apps.parquet")) == 5
    toy = load_rows(tmp_path / "toy.jsonl")
    assert len(toy) == 20 and {r["extra_info"]["split"] for r in toy} == {"test"}
    assert toy == data_prep.toy_rows(50, 20, seed=0)[1]


# ------------------------------------------------------------------------------------------------ toy task


def test_toy_rows_shape_and_determinism(toy):
    train, test = toy
    assert len(train) == 600 and len(test) == 150
    assert [r["extra_info"]["index"] for r in train + test] == list(range(750))
    assert {r["extra_info"]["split"] for r in train} == {"train"}
    assert {r["extra_info"]["split"] for r in test} == {"test"}
    for row in train + test:
        validate_row(row)
        info = row["extra_info"]
        assert row["data_source"] == "toy" and row["ability"] == "code"
        assert info["difficulty"] == str(len(info["ops"])) == str(info["solution"].count("\n    x = "))
        assert row["prompt"][0]["content"].startswith("Write a function f(x) that ")
        assert info["solution"].startswith("def f(x):\n") and info["solution"].endswith("    return x\n")
    assert len({r["prompt"][0]["content"] for r in train + test}) == 750
    assert data_prep.toy_rows(600, 150, seed=3) == toy
    assert data_prep.toy_rows(600, 150, seed=4) != toy


def test_toy_example_by_hand():
    assert data_prep.toy_combos(2, ("add", "square", "sum", "reverse")) == [
        ("add",), ("square",), ("sum",), ("reverse",),
        ("add", "square"), ("square", "add"), ("sum", "add"), ("sum", "square"), ("reverse", "sum")]
    train, test = data_prep.toy_rows(6, 2, seed=0, max_ops=2, ops=("add", "square"))
    checked = 0
    for row in train + test:  # the phrase and the line for each op, constants copied through
        message, solution = row["prompt"][0]["content"], row["extra_info"]["solution"]
        if row["extra_info"]["ops"] == ["add", "square"]:
            k = message.removeprefix("Write a function f(x) that adds ").removesuffix(", then squares it.")
            assert solution == f"def f(x):\n    x = x + {k}\n    x = x * x\n    return x\n"
            tests = json.loads(row["reward_model"]["ground_truth"])["test_list"]
            assert len(tests) == 3
            for test in tests:  # "assert f(X) == Y"
                x, y = test.removeprefix("assert f(").split(") == ")
                assert int(y) == (int(x) + int(k)) ** 2
            checked += 1
    assert checked


def test_toy_test_split_is_unseen_combinations_of_seen_ops(toy):
    train, test = toy
    train_combos = {tuple(r["extra_info"]["ops"]) for r in train}
    test_combos = {tuple(r["extra_info"]["ops"]) for r in test}
    assert not train_combos & test_combos
    assert {op for c in test_combos for op in c} <= {op for c in train_combos for op in c}
    assert {len(c) for c in test_combos} == {2, 3} and len(test_combos) > 50


def passes(programs: list[str]) -> list[bool]:
    """Whether each program runs to the end (all its asserts hold), each in a fresh namespace of one plain
    python subprocess."""
    script = """
import json, signal, sys
verdicts = []
for program in json.load(sys.stdin):
    signal.setitimer(signal.ITIMER_PROF, 10)  # CPU seconds: a loaded machine does not make a program time out
    try:
        exec(program, {})
        verdicts.append(True)
    except BaseException:
        verdicts.append(False)
    signal.setitimer(signal.ITIMER_PROF, 0)
print(json.dumps(verdicts))
"""
    out = subprocess.run([sys.executable, "-I", "-c", script], input=json.dumps(programs), capture_output=True,
                         text=True, timeout=300, check=True)
    return json.loads(out.stdout)


def assert_program(row: dict, solution: str) -> str:
    """solution, then test_setup_code (MBPP 367 and 927 build trees from the solution's Node class), then asserts."""
    truth = json.loads(row["reward_model"]["ground_truth"])
    return "\n".join([solution, truth["test_setup_code"], *truth["test_list"]])


def test_reference_solutions_pass_their_ground_truth(tmp_path, humaneval, mbpp, monkeypatch):
    monkeypatch.chdir(tmp_path)  # in case a reference solution writes files
    programs = [assert_program(r, r["extra_info"]["code"]) for r in mbpp]
    for row in humaneval:
        truth = json.loads(row["reward_model"]["ground_truth"])
        programs.append(f"{truth['prompt']}{row['extra_info']['canonical_solution']}\n{truth['test']}\n"
                        f"check({truth['entry_point']})\n")
    verdicts = passes(programs)
    assert [row_id(r) for r, ok in zip(mbpp + humaneval, verdicts) if not ok] == []


def test_toy_reference_solutions_pass_their_tests(toy):
    rows = toy[0] + toy[1]
    assert all(passes([assert_program(r, r["extra_info"]["solution"]) for r in rows]))


def test_toy_tests_reject_a_solution_missing_any_op(toy):
    rows = [r for r in toy[0] + toy[1] if len(r["extra_info"]["ops"]) > 1]

    def drop_line(i):
        return lambda s: "".join(line for j, line in enumerate(s.splitlines(True)) if j != i)

    for i in (1, 2, 3):
        with_line = [r for r in rows if len(r["extra_info"]["ops"]) >= i]
        assert not any(passes([assert_program(r, drop_line(i)(r["extra_info"]["solution"])) for r in with_line]))
    assert not any(passes([assert_program(r, r["extra_info"]["solution"].replace("return x", "return 0"))
                           for r in rows]))


def test_toy_teacher_slips_at_its_rate_and_every_slip_is_caught_by_the_tests(toy):
    train, _ = toy
    prompt_and_answer = [(c["messages"][:-1], c["messages"][-1]["content"])
                         for c in data_prep.toy_teacher_conversations(train, slip_rate=0.0)]
    assert prompt_and_answer == [(r["prompt"], f"```python\n{r['extra_info']['solution']}\n```") for r in train]

    slipped = data_prep.toy_teacher_conversations(train, slip_rate=1.0)
    with_slip_op = [(r, c) for r, c in zip(train, slipped) if set(r["extra_info"]["ops"]) & set(data_prep.TOY_SLIPS)]
    assert len(with_slip_op) > 200
    for row, conversation in with_slip_op:
        lines = conversation["messages"][-1]["content"].splitlines()[2:-3]  # the body between def and return
        for op, k, line in zip(row["extra_info"]["ops"], row["extra_info"]["constants"], lines):
            expected = data_prep.TOY_SLIPS.get(op, data_prep.TOY_OPS[op][1]).format(k=k)
            assert line == f"    {expected}"
    # The task's own tests fail every slipped solution (checked by running them, as the reward will).
    for row, conversation in with_slip_op[:100]:
        namespace: dict = {}
        exec(conversation["messages"][-1]["content"].strip("`\n").removeprefix("python\n"), namespace)
        failures = 0
        for test in json.loads(row["reward_model"]["ground_truth"])["test_list"]:
            try:
                exec(test, namespace)
            except Exception:
                failures += 1
        assert failures, (row["prompt"][0]["content"], conversation["messages"][-1]["content"])

    # At 0.65 about 65% of the lines of slip ops are slips (hundreds of lines); other lines never are.
    slips = total = 0
    for row, conversation in zip(train, data_prep.toy_teacher_conversations(train, slip_rate=0.65, seed=1)):
        lines = conversation["messages"][-1]["content"].splitlines()[2:-3]
        for op, k, line in zip(row["extra_info"]["ops"], row["extra_info"]["constants"], lines):
            if op not in data_prep.TOY_SLIPS:
                assert line == "    " + data_prep.TOY_OPS[op][1].format(k=k)
                continue
            total += 1
            slips += line == "    " + data_prep.TOY_SLIPS[op].format(k=k)
    assert total > 300 and 0.58 < slips / total < 0.72, (slips, total)


SWE_5X = {"image": "kiln-swe/x:offline", "eval_script": "#!/bin/bash\npytest -rA tests\n",
          "log_parser": "parse_log_marshmallow", "eval_type": "pass_and_fail"}


def swe_lite_dev() -> list[dict]:
    return json.loads(SWE_LITE_DEV.read_text())


def test_swebench_refuses_classic_rows_and_says_how_to_get_5x(tmp_path):
    swe_lite_dev()
    with pytest.raises(RowError, match=r"sqlfluff__sqlfluff-1625: missing swebench 5.x fields \['image', "
                                       r"'eval_script', 'log_parser', 'eval_type'\].*swebench>=5"):
        data_prep.swebench_rows(SWE_LITE_DEV)
    with pytest.raises(RowError, match="not a SWE-bench row .missing .'instance_id'"):
        (tmp_path / "x.jsonl").write_text(json.dumps({"problem": "x"}) + "\n")
        data_prep.swebench_rows(tmp_path / "x.jsonl")


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".parquet"])
def test_swebench_rows_keep_the_gold_patch_out_of_the_prompt(tmp_path, suffix):
    records = [r | SWE_5X for r in swe_lite_dev()]
    for r in records:  # the Hugging Face datasets hold the test lists as JSON text
        r["PASS_TO_PASS"] = json.dumps(json.loads(r["PASS_TO_PASS"]) if isinstance(r["PASS_TO_PASS"], str)
                                       else r["PASS_TO_PASS"])
    source = tmp_path / f"swe{suffix}"
    if suffix == ".json":
        source.write_text(json.dumps(records))
    elif suffix == ".jsonl":
        source.write_text("".join(json.dumps(r) + "\n" for r in records))
    else:
        pq.write_table(pa.Table.from_pylist(records), source)
    wanted = ("marshmallow-code__marshmallow-1343", "marshmallow-code__marshmallow-1359")
    subprocess.run([sys.executable, str(REPO / "data_prep.py"), "swebench", "--source", str(source), "--out",
                    str(tmp_path / "rows.parquet"), "--instances", *wanted], check=True, cwd=tmp_path)
    rows = load_rows(tmp_path / "rows.parquet")
    assert [row_id(r) for r in rows] == [f"swebench/{i}" for i in wanted]
    by_id = {r["instance_id"]: r for r in records}
    for row in rows:
        record = by_id[row["extra_info"]["index"]]
        assert (row["data_source"], row["ability"], row["extra_info"]["repo"]) == ("swebench", "swe", record["repo"])
        system, user = row["prompt"]
        assert system["role"] == "system" and "submit" in system["content"] and "bash" in system["content"]
        assert user == {"role": "user", "content": record["problem_statement"]}
        assert system["content"] == data_prep.SWEBENCH_SYSTEM  # the prompt is the rules and the issue, nothing else
        visible = json.dumps({k: v for k, v in row.items() if k != "reward_model"})
        assert record["patch"] not in visible and record["test_patch"] not in visible
        truth = json.loads(row["reward_model"]["ground_truth"])
        assert truth["patch"] == record["patch"] and truth["image"] == SWE_5X["image"]
        assert truth["PASS_TO_PASS"] == json.loads(record["PASS_TO_PASS"]) and isinstance(truth["FAIL_TO_PASS"], list)
    with pytest.raises(RowError, match="no instance 'nope__nope-1'"):
        data_prep.swebench_rows(source, ("nope__nope-1",))


def test_swebench_ground_truth_is_validated(tmp_path):
    record = swe_lite_dev()[5] | SWE_5X
    (tmp_path / "one.json").write_text(json.dumps([record]))
    row = data_prep.swebench_rows(tmp_path / "one.json")[0]
    truth = json.loads(row["reward_model"]["ground_truth"])
    truth["FAIL_TO_PASS"] = []
    row["reward_model"]["ground_truth"] = json.dumps(truth)
    with pytest.raises(RowError, match="ground_truth.FAIL_TO_PASS: expected a non-empty list"):
        validate_row(row)


def test_vision_toy_rows_round_trip_and_image_parts_are_counted(tmp_path):
    data_prep.vision_toy(tmp_path / "train.parquet", split="train", n_train=3, n_test=1, size=128)
    rows = load_rows(tmp_path / "train.parquet")
    assert_identical(rows, data_prep.vision_toy_rows(3, 1, size=128)[0])
    assert [task_rows.count_image_parts(r["prompt"]) for r in rows] == [len(r["images"]) for r in rows] == [1, 1, 1]
    with pytest.raises(RowError, match=r"^row: images: 0 images but the prompt has 1 image parts$"):
        validate_row({k: v for k, v in rows[0].items() if k != "images"})
    data_prep.extract_images(tmp_path / "train.parquet", tmp_path / "images", tmp_path / "paths.parquet")
    with_paths = list(load_rows(tmp_path / "paths.parquet"))  # still kiln rows, plus where their images went
    assert [r["extra_info"].pop("image_file_path") for r in with_paths] == [
        str(tmp_path / "images" / f"{i}_0.png") for i in range(3)]
    assert [r["extra_info"].pop("image_file_paths") for r in with_paths] == [
        [str(tmp_path / "images" / f"{i}_0.png")] for i in range(3)]
    assert_identical(with_paths, rows)
