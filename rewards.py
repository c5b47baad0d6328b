"""Turning a finished sample into a number: reward functions keyed by `data_source`, and the eval CLI.

    python rewards.py score SAMPLES.jsonl --data ROWS.parquet [--out results.jsonl]

grades completions alone (one JSON object per line: {"task_id": "<data_source>/<index>", "completion": ...}, what
`python generate.py` writes) and prints, overall, by data source and by difficulty: pass@1 and unbiased pass@k,
the mean test pass rate (passed tests / total tests) and its distribution in five bands (0.0-0.2 very poor ... 0.8-1.0
excellent), error categories and throughput; `--json`, `--markdown` and `--plot` write the same report to files.
For swebench rows the completion is the patch (a git diff), graded in Docker by swebench's own grading (swe_grading.py);
SAMPLES may also be a SWE-bench predictions file ({"instance_id", "model_patch", "model_name_or_path"} per line), and
`--official` grades through swebench's run_instance instead of kiln's grader.

    python rewards.py swe-check ROWS.parquet

checks swebench rows: each gold patch must resolve and the unpatched tree must not (a table; exit 1 if any fails).
"""
from __future__ import annotations

import dataclasses
import io
import json
import logging
import math
import os
import re
import statistics
import sys
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol, Sequence

import math_verify
import numpy as np
import tyro
from PIL import Image
from tqdm import tqdm

import cli
import eval_report
import judge as judge_lib
import sandbox
import swe_grading
import task_dirs
import task_rows

# Big APPS answers have thousands of digits; int() refuses them by default.
sys.set_int_max_str_digits(0)
# math-verify warns on every call that its timeouts are off; they are off on purpose (see math_equal).
logging.getLogger("math_verify").setLevel(logging.ERROR)


@dataclass
class Reward:
    score: float
    info: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ScoreContext:
    """What a reward function may need besides the row and the completion; each family reads only its own part."""
    limits: sandbox.Limits = sandbox.Limits()
    """the sandbox limits the code families' tests run under"""
    judge: judge_lib.Judge | None = None
    """the LLM judge of vl_agent rows (None: none is configured)"""
    sample_info: dict = field(default_factory=dict)
    """the rollout's Sample.info: the messages and tool images the vl_agent rubric judge sees"""
    swe: swe_grading.SweConfig = swe_grading.SweConfig()
    """how swebench patches are graded"""


# One data source's reward: (row, completion, context) -> the completion's Reward; registered in REWARDS.
RewardFn = Callable[[dict, str, ScoreContext], Reward]


class ScoreFn(Protocol):
    """What the trainers call to score a batch: one Reward per completion, in order.

    The trainers always pass `sample_infos`, each sample's rollout info (Sample.info: the messages and tool images a
    vl_agent judge sees); a custom score function may ignore it. They bind their LLM judge onto the default,
    rewards.score_batch, alone (functools.partial(score_batch, judge=judge)): a custom one brings its own."""

    def __call__(self, rows: list[dict], completions: list[str], *, sample_infos: list[dict]) -> list[Reward]: ...


FENCE = re.compile(r"^[ \t]*```[ \t]*([\w+-]*).*$", re.M)
PYTHON_TAGS = ("", "python", "python3", "py")


def code_blocks(text: str) -> list[str]:
    """The closed fenced blocks tagged python/py/python3 or untagged, in order (fences pair up line by line, so
    a block in another language never swallows the next one)."""
    blocks, tag, start = [], None, None
    for fence in FENCE.finditer(text):
        if start is None:
            tag, start = fence.group(1).lower(), fence.end() + 1
        else:
            if tag in PYTHON_TAGS:
                blocks.append(text[start:fence.start()])
            start = None
    return blocks


def extract_code(text: str) -> str | None:
    """The program in a completion. Policy: the *last* closed fenced block tagged python/py/python3 or untagged
    (a model's final answer comes last; blocks in other languages are skipped); with no fence at all, the whole
    text if it compiles (raw code, e.g. from a base model); otherwise None, scored as "no_code" (this includes a
    block cut off before its closing fence)."""
    blocks = code_blocks(text)
    if blocks:
        return blocks[-1]
    if "```" not in text and text.strip() and sandbox.syntax_error(text) is None:
        return text
    return None


def format_reward(text: str) -> float:
    """1.0 when the completion holds exactly one fenced python block (the answer format we ask for), else 0.0."""
    return float(len(code_blocks(text)) == 1)


def _from_verdicts(verdicts: list[sandbox.Verdict], all_or_nothing: bool) -> Reward:
    """Score from per-test verdicts; the error category is the first failing test's status."""
    broken = [v.detail for v in verdicts if v.status == "harness_error"]
    if broken:  # not the completion's fault: scoring it 0 would hide a data problem
        raise ValueError(f"the ground truth fails by itself: {broken[0]}")
    passed = sum(v.status == "pass" for v in verdicts)
    failed = [v.status for v in verdicts if v.status not in ("pass", "not_run")]
    score = float(passed == len(verdicts)) if all_or_nothing else passed / len(verdicts)
    return Reward(score, {"passed": passed, "total": len(verdicts), "verdicts": [list(v) for v in verdicts],
                          "error": failed[0] if failed else None, "sandbox_isolation": sandbox.isolation_level()})


def io_reward(code: str, truth: dict, limits: sandbox.Limits) -> Reward:
    """APPS / CodeContests / TACO: fraction of test cases passed (stdin/stdout, or calls when fn_name is set)."""
    if truth.get("fn_name"):
        verdicts = sandbox.run_call_tests(code, truth["fn_name"], truth["inputs"], truth["outputs"], limits)
    else:
        verdicts = sandbox.run_stdio_tests(code, truth["inputs"], truth["outputs"], limits)
    return _from_verdicts(verdicts, all_or_nothing=False)


def humaneval_reward(code: str, truth: dict, limits: sandbox.Limits) -> Reward:
    """HumanEval: 1 if `check(entry_point)` passes. A completion that only writes the body gets the prompt."""
    entry = truth["entry_point"]
    if not re.search(rf"^\s*def\s+{re.escape(entry)}\s*\(", code, re.M):
        code = truth["prompt"] + code
    verdicts = sandbox.run_assert_tests(code, [f"check({entry})"], setup=truth["prompt"] + "\n" + truth["test"],
                                        remote=[entry], limits=limits)
    return _from_verdicts(verdicts, all_or_nothing=True)


# A code family's test run: (program, the row's parsed ground truth, sandbox limits) -> its Reward.
CodeGrader = Callable[[str, dict, sandbox.Limits], Reward]


def assert_reward(all_or_nothing: bool) -> CodeGrader:
    """MBPP (all asserts pass -> 1, else 0; stops at the first failure) and the toy task (fraction passed)."""
    def reward(code: str, truth: dict, limits: sandbox.Limits) -> Reward:
        verdicts = sandbox.run_assert_tests(code, truth["test_list"], setup=truth.get("test_setup_code", ""),
                                            limits=limits, stop_on_failure=all_or_nothing)
        return _from_verdicts(verdicts, all_or_nothing)
    return reward


def code_reward(grade: CodeGrader, body_after_prompt: bool = False) -> RewardFn:
    """A code family's RewardFn: the completion's program (extract_code; with `body_after_prompt` also a bare body
    continuing ground_truth's "prompt", HumanEval's native format) run by `grade`, plus its format_reward. Whatever
    the program does, this returns: no program is error "no_code"; a failure of the grading itself (a supervisor that
    died) is a Reward of 0 with error "grader_error", logged and counted (`critic/score/grader_errors`). Broken tests
    (a data problem the program cannot cause) raise ValueError naming the task."""
    def reward(row: dict, completion: str, context: ScoreContext) -> Reward:
        truth = json.loads(row["reward_model"]["ground_truth"])
        code = extract_code(completion)
        if code is None and body_after_prompt and sandbox.syntax_error(truth["prompt"] + completion) is None:
            code = completion
        if code is None:
            return Reward(0.0, {"error": "no_code", "passed": 0, "total": None, "format": 0.0})
        try:
            result = grade(code, truth, context.limits)
        except ValueError as e:  # the row's tests themselves are broken: a data problem, never the program's doing
            raise ValueError(f"task {row['data_source']}/{row['extra_info']['index']}: {e}") from e
        except Exception as e:
            reason = f"task {row['data_source']}/{row['extra_info']['index']}: {type(e).__name__}: {e}"
            logging.getLogger("kiln.rewards").warning("grader error, scored 0: %s", reason)
            result = Reward(0.0, {"error": "grader_error", "reason": reason, "passed": 0, "total": None})
        result.info["format"] = format_reward(completion)
        return result
    return reward


def answer_reward(row: dict, completion: str, context: ScoreContext) -> Reward:
    """Exact answers (calc and vision_count: `make demo-agent`'s and `make demo-vision`'s tasks): 1 when the
    completion's answer (extract_answer: its last <answer>...</answer>) is ground_truth, as text. Nothing is run, so a
    policy gets one right only by working it out, e.g. with its python tool."""
    answer, _ = extract_answer(completion)
    right = answer is not None and answer == row["reward_model"]["ground_truth"].strip()
    return Reward(float(right), {"answer": answer, "error": None if right else
                                 ("no_answer" if answer is None else "wrong_answer")})


def swebench_reward(row: dict, completion: str, context: ScoreContext) -> Reward:
    """SWE-bench: the completion is the patch, graded in Docker by swebench's own grading (swe_grading, settings
    context.swe). Grading errors raise: a patch is never scored -1 for the grader's fault."""
    grade = swe_grading.swebench_reward(json.loads(row["reward_model"]["ground_truth"]),
                                        completion.encode(errors="surrogateescape"), config=context.swe)
    return Reward(grade.score, grade.info)


def task_reward(row: dict, completion: str, context: ScoreContext) -> Reward:
    """A task directory (task_dirs): the task's tests' reward, as they scored the agent's own container at the end
    of its trajectory (context.sample_info["task_verdict"], from tools.task_toolbox), or else the completion run as
    a script in a fresh container of the task and then the tests (`python rewards.py score`). No reward file (an
    infrastructure failure) is no score: NaN with info["infra_failed"], left out and counted, never a 0."""
    verdict = context.sample_info.get("task_verdict")
    if verdict is None:
        verdict = dataclasses.asdict(task_dirs.grade_script(task_dirs.truth_of(row), completion))
    info = {k: verdict[k] for k in ("rewards", "error", "output", "seconds", "strays_after_tests")}
    if verdict["score"] is None:
        return Reward(math.nan, info | {"infra_failed": verdict["infra_error"]})
    return Reward(verdict["score"], info)


def ungraded(info: dict) -> bool:
    """Whether a reward's info says it has no score through no fault of the sample (the judge failed, or the task's
    tests left no reward file): it is left out and counted, never trained on or counted as 0."""
    return judge_failed(info) or "infra_failed" in info


# ------------------------------------------------------------------------- vl_agent: CodeV's code-with-images reward
# score = 1.0 acc + 0.3 format + 0.5 tool (CodeV's weights). A component the judge failed to give is missing, and so
# is the score (NaN, info["judge_error"] says why): the trainer leaves such samples out, it never scores them 0.
VL_AGENT_WEIGHTS = {"acc": 1.0, "format": 0.3, "tool": 0.5}
VISUAL_SEARCH_SOURCES = ("vstar", "chart", "high_res")
COUNTING_SOURCES = ("iconqa",)
RULE_TOOL_SOURCES = ("vision_toy",)  # tool scored by a rule: an unscaled crop of the input holding the target
VL_AGENT_SOURCES = ("vl_agent", "geoqa", "geometry3k", "tabmwp", *VISUAL_SEARCH_SOURCES, *COUNTING_SOURCES,
                    *RULE_TOOL_SOURCES)
RESPONSE_CHARS, OUTPUT_CHARS, MAX_TOOL_IMAGES = 6000, 2000, 3  # what of a trajectory the rubric judge sees

def is_vl_agent(row: dict) -> bool:
    """Rows of the vl_agent family: CodeV's data sources, and any row whose reward_model.style is "judge"."""
    return row["data_source"].lower() in VL_AGENT_SOURCES or row["reward_model"].get("style") == "judge"


def needs_judge(row: dict) -> bool:
    """Whether scoring `row` may call the LLM judge: it is scored by vl_agent_reward, whose accuracy falls back to the
    judge for style "judge" rows and whose tool score is a rubric judge's except for RULE_TOOL_SOURCES."""
    return reward_fn(row) is vl_agent_reward and (row["reward_model"].get("style") == "judge"
                                                  or row["data_source"].lower() not in RULE_TOOL_SOURCES)


def check_judge_configured(rows: list[dict], judge_url: str | None, where: str) -> None:
    """Stop before any work when `rows` need an LLM judge and none is configured."""
    judged = Counter(r["data_source"] for r in task_rows.summaries(rows) if needs_judge(r))
    if judged and not judge_url:
        raise ValueError(f"{where}: {sum(judged.values())} rows ({dict(judged)}) are scored with an LLM judge: pass "
                         "--judge-url (an OpenAI-compatible server, e.g. `vllm serve`)")


def extract_answer(text: str) -> tuple[str | None, int]:
    """CodeV's answer extraction: after the last </think>, the content of the last closed <answer>...</answer>, else
    of the last \\boxed{...}. Returns (answer or None, how many answers the text offers)."""
    text = text.rsplit("</think>", 1)[-1]
    answers = re.findall(r"<answer>(.*?)</answer>", text, re.S)
    if answers:
        return answers[-1].strip(), text.count("<answer>")
    boxed = re.findall(r"\\boxed\{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\}", text)
    return (boxed[-1].strip(), len(boxed)) if boxed else (None, 0)


def vl_format_ok(text: str) -> bool:
    """CodeV's format rules: balanced <code>, <think> and vision tags; after the last </think> balanced <answer> tags
    and exactly one answer (an <answer> block, else one \\boxed{}); no <code> after the last </answer> (CodeV also
    fails a \\boxed{} answer whose text holds any <code>: here code before a boxed answer is fine)."""
    balanced = all(text.count(a) == text.count(b) for a, b in (("<code>", "</code>"), ("<think>", "</think>"),
                                                               ("<|vision_start|>", "<|vision_end|>")))
    tail = text.rsplit("</think>", 1)[-1]
    answer, count = extract_answer(text)
    after_answer = text.rsplit("</answer>", 1)[-1] if "</answer>" in text else ""
    return (balanced and tail.count("<answer>") == tail.count("</answer>") and answer is not None and count == 1
            and "<code>" not in after_answer)


def math_equal(reference: str, answer: str) -> bool:
    """Equal as text (case and surrounding space aside), or by math-verify (its SIGALRM timeouts off: they fail
    outside the main thread)."""
    if reference.strip().lower() == answer.strip().lower():
        return True
    gold = math_verify.parse(reference, parsing_timeout=None)
    guess = math_verify.parse(answer, parsing_timeout=None)
    return bool(gold and guess and math_verify.verify(gold, guess, timeout_seconds=None))


def row_question(row: dict) -> str:
    """extra_info.question, else the text of the last user message (image markers dropped)."""
    if row["extra_info"].get("question"):
        return row["extra_info"]["question"]
    content = next(m["content"] for m in reversed(row["prompt"]) if m["role"] == "user")
    text = content if isinstance(content, str) else "\n".join(p.get("text", "") for p in content
                                                              if p.get("type") == "text")
    return text.replace("<image>", "").strip()


def crop_holds_target(source: bytes, crop: bytes, box: Sequence[int]) -> bool:
    """Whether `crop` is an unscaled piece of the `source` image that contains box = (x0, y0, x1, y1) of it. Found by
    matching the crop's rarest colour, so a large uniform background costs nothing."""
    big = np.asarray(Image.open(io.BytesIO(source)).convert("RGB"))
    small = np.asarray(Image.open(io.BytesIO(crop)).convert("RGB"))
    h, w = small.shape[:2]
    if h > big.shape[0] or w > big.shape[1]:
        return False
    colours, first, counts = np.unique(small.reshape(-1, 3), axis=0, return_index=True, return_counts=True)
    rare = int(np.argmin(counts))
    cy, cx = divmod(int(first[rare]), w)
    for y, x in np.argwhere((big == colours[rare]).all(axis=-1)):
        top, left = y - cy, x - cx
        if (0 <= top <= big.shape[0] - h and 0 <= left <= big.shape[1] - w
                and np.array_equal(big[top:top + h, left:left + w], small)):
            x0, y0, x1, y1 = box
            if left <= x0 and top <= y0 and left + w >= x1 and top + h >= y1:
                return True
    return False


def tool_outputs(row: dict, completion: str, sample_info: dict) -> str:
    """The sandbox outputs of a trajectory: its tool/user turns after the prompt when the rollout recorded messages
    (sample_info["messages"]), else the <sandbox_output> blocks of the completion text."""
    messages = sample_info.get("messages")
    if messages:
        turns = [m["content"] for m in messages[len(row["prompt"]):] if m["role"] in ("tool", "user")]
        texts = [c if isinstance(c, str) else "\n".join(p.get("text", "") for p in c) for c in turns]
    else:
        texts = re.findall(r"<sandbox_output>(.*?)</sandbox_output>", completion, re.S)
    return "\n---\n".join(t.strip() for t in texts)


def vl_tool_score(row: dict, completion: str, judge: judge_lib.Judge | None,
                  sample_info: dict) -> judge_lib.Score:
    """The tool component: a rule for RULE_TOOL_SOURCES, else the rubric judge over the question, the input images,
    the end of the response, the sandbox outputs and the images the tools produced (sample_info["images"], PNG bytes,
    as multi-turn rollouts record them; without them the judge is told that no image was produced)."""
    source = row["data_source"].lower()
    tool_images = list(sample_info.get("images") or [])
    inputs = task_rows.row_images(row)
    if source in RULE_TOOL_SOURCES:
        box = row["extra_info"].get("target_box")
        if not inputs or box is None:
            raise ValueError(f"a {source} row needs images[0] and extra_info.target_box")
        return judge_lib.Score(float(any(crop_holds_target(inputs[0], image, box) for image in tool_images)))
    rubric = judge_lib.RUBRICS["visual_search" if source in VISUAL_SEARCH_SOURCES else
                     "counting" if source in COUNTING_SOURCES else "calculation"]
    outputs = tool_outputs(row, completion, sample_info)
    parts = [f"Question:\n{row_question(row)}", "Input image:" if inputs else "Input image: none.", *inputs,
             f"Agent response (last {RESPONSE_CHARS} characters):\n{completion[-RESPONSE_CHARS:]}",
             f"Sandbox outputs:\n{outputs[-OUTPUT_CHARS:] or 'none'}",
             f"Images the agent's code produced ({min(len(tool_images), MAX_TOOL_IMAGES)} of {len(tool_images)}):"
             if tool_images else "Images the agent's code produced: none.", *tool_images[:MAX_TOOL_IMAGES]]
    return judge.rubric(rubric, parts)


def vl_agent_reward(row: dict, completion: str, context: ScoreContext) -> Reward:
    """CodeV's reward: acc (math-verify on the extracted answer, else context.judge's TRUE/FALSE for style "judge"
    rows), format (vl_format_ok), tool (vl_tool_score over context.sample_info); each reported in info. A judge
    failure leaves its component None and the score NaN, with info["judge_error"]."""
    judge = context.judge
    if needs_judge(row) and judge is None:
        raise ValueError(f"task {task_rows.row_id(row)}: scored with an LLM judge, but none is configured "
                         "(--judge-url)")
    truth = row["reward_model"]["ground_truth"]
    answer, _ = extract_answer(completion)
    info = {"answer": answer, "format": float(vl_format_ok(completion)), "error": None if answer else "no_answer"}
    errors = []
    if answer is None:
        info["acc"], info["acc_by"] = 0.0, "none"
    elif math_equal(truth, answer):
        info["acc"], info["acc_by"] = 1.0, "math_verify"
    elif row["reward_model"].get("style") == "judge":
        verdict = judge.equivalent(row_question(row), truth, answer)
        info["acc"], info["acc_by"] = (None if verdict.ok is None else float(verdict.ok)), "judge"
        errors += [f"acc: {verdict.error}"] if verdict.error else []
    else:
        info["acc"], info["acc_by"] = 0.0, "math_verify"
    tool = vl_tool_score(row, completion, judge, context.sample_info)
    info["tool"] = tool.value
    errors += [f"tool: {tool.error}"] if tool.error else []
    if errors:
        return Reward(math.nan, info | {"error": "judge", "judge_error": "; ".join(errors)})
    return Reward(sum(w * info[k] for k, w in VL_AGENT_WEIGHTS.items()), info)


def judge_failed(info: dict) -> bool:
    """Whether a reward's info says the judge could not complete it: it has no score (NaN) and must not be trained
    on or counted as 0."""
    return "judge_error" in info


def component_metrics(data_sources: Sequence[str], infos: Sequence[dict]) -> dict:
    """Means of the reward components (vl_agent: acc, format, tool) by data source, over the samples that have them:
    critic/score/<source>/<component>."""
    values = defaultdict(list)
    for source, info in zip(data_sources, infos):
        for name in VL_AGENT_WEIGHTS:
            if "acc_by" in info and info.get(name) is not None:
                values[f"critic/score/{source}/{name}"].append(info[name])
    return {k: statistics.fmean(v) for k, v in values.items()}


# ----------------------------------------------------------------- the registry: one reward function per data_source
# Adding a reward is one line: REWARDS["my_source"] = my_fn, a RewardFn (row, completion, context) -> Reward.
REWARDS: dict[str, RewardFn] = {
    **dict.fromkeys(("apps", "codecontests", "taco", "livecodebench"), code_reward(io_reward)),
    "humaneval": code_reward(humaneval_reward, body_after_prompt=True),
    "mbpp": code_reward(assert_reward(all_or_nothing=True)),
    "toy": code_reward(assert_reward(all_or_nothing=False)),
    "calc": answer_reward,
    "vision_count": answer_reward,
    "swebench": swebench_reward,
    task_dirs.DATA_SOURCE: task_reward,
    **dict.fromkeys(VL_AGENT_SOURCES, vl_agent_reward),
}


def reward_fn(row: dict) -> RewardFn | None:
    """The reward function of `row` (None: it has none), the one lookup score and check_sources share: REWARDS by
    data_source, else vl_agent_reward for the other is_vl_agent rows (style "judge", CodeV's sources in any case)."""
    return REWARDS.get(row["data_source"]) or (vl_agent_reward if is_vl_agent(row) else None)


def score(row: dict, completion: str, limits: sandbox.Limits = sandbox.Limits(), judge: judge_lib.Judge | None = None,
          sample_info: dict | None = None, swe: swe_grading.SweConfig = swe_grading.SweConfig()) -> Reward:
    """The reward of one completion for one row (kiln's row schema), from its reward_fn: tests run in the sandbox
    under `limits`, vl_agent rows go to `judge` (sample_info: the rollout's Sample.info, whose tool images and
    messages the rubric judge sees), swebench rows to swe_grading (the completion is the patch; `swe` its settings).
    A program never makes it raise (code_reward); broken tests and a row without a reward function do."""
    fn = reward_fn(row)
    if fn is None:
        raise KeyError(f"no reward function for data_source {row['data_source']!r}; known: {sorted(REWARDS)}")
    return fn(row, completion, ScoreContext(limits, judge, sample_info or {}, swe))


def score_batch(rows: list[dict], completions: list[str], max_workers: int | None = None,
                limits: sandbox.Limits = sandbox.Limits(), judge: judge_lib.Judge | None = None,
                sample_infos: list[dict] | None = None, swe: swe_grading.SweConfig = swe_grading.SweConfig()
                ) -> list[Reward]:
    """`score` for many samples at once, in parallel (each test still runs in its own sandboxed process). With a
    judge, twice as many samples at once as it takes requests: a sample asks its questions one after the other, and a
    cache hit on a question in flight waits without a request of its own. `swe`: the settings of swebench rows."""
    if len(rows) != len(completions):
        raise ValueError(f"{len(rows)} rows but {len(completions)} completions")
    infos = sample_infos or [{}] * len(rows)
    workers = max_workers or max(sandbox.default_workers(), 2 * judge.max_concurrency if judge else 0)
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda rci: score(rci[0], rci[1], limits, judge, rci[2], swe),
                             zip(rows, completions, infos)))


def make_judge(url: str | None, model: str | None, rows: list[dict], where: str, **options) -> judge_lib.Judge | None:
    """The judge `rows` need (None when none does), checked at once: a missing --judge-url or a server that does not
    answer stops here, naming what and where, before any expensive work."""
    check_judge_configured(rows, url, where)
    if url is None:
        return None
    return judge_lib.Judge(url, model=model, **options)  # JudgeUnreachable: it does not answer


def for_report(reward: Reward) -> Reward:
    """What `report` reads of a Reward (score, error, test counts): small enough to gather from every rank."""
    return Reward(reward.score, {k: reward.info[k] for k in ("error", "passed", "total") if k in reward.info})


def batch_metrics(data_sources: Sequence[str], scores: Sequence[float], errors: Sequence[str | None],
                  response_lengths: Sequence[int], isolations: Sequence[str | None] = ()) -> dict:
    """A training batch's scores (critic/score/: mean, std, max, min, pass rate, mean by data source, fraction of each
    error kind) and response lengths (response_length/: mean, max, min), over every rank's samples; verl's names.
    `isolations`: the sandbox level that graded each sample (None: no sandbox), as sandbox/graded_<level>_frac."""
    metrics = {"critic/score/mean": statistics.fmean(scores),
               "critic/score/std": statistics.stdev(scores) if len(scores) > 1 else 0.0,
               "critic/score/max": max(scores), "critic/score/min": min(scores),
               "critic/score/pass_rate": sum(s >= 1.0 for s in scores) / len(scores),
               "response_length/mean": statistics.fmean(response_lengths),
               "response_length/max": float(max(response_lengths)),
               "response_length/min": float(min(response_lengths))}
    by_source = defaultdict(list)
    for source, score in zip(data_sources, scores):
        by_source[source].append(score)
    metrics |= {f"critic/score/{source}/mean": sum(v) / len(v) for source, v in by_source.items()}
    kinds = Counter(error for error in errors if error)
    metrics["critic/score/grader_errors"] = float(kinds["grader_error"])  # a count, always logged: it should stay 0
    levels = Counter(level for level in isolations if level)
    metrics |= {f"sandbox/graded_{level}_frac": n / len(scores) for level, n in levels.items()}
    return metrics | {f"critic/score/error/{kind}": n / len(scores) for kind, n in kinds.items()}


def refuse_nonfinite(offenders: list[tuple[str, float]], step: int) -> None:
    """Stop a run at a non-finite reward (a judge that failed to parse, a reward bug), naming the task: one NaN in
    the advantages turns every parameter into NaN. `offenders`: (task id, reward) of every rank, gathered."""
    if offenders:
        task, value = offenders[0]
        raise RuntimeError(f"step {step}: non-finite reward {value} for task {task} ({len(offenders)} sample(s) in "
                         f"all); the reward function must return a finite number")


def check_sources(rows: list[dict], where: str) -> None:
    """Refuse rows whose data_source has no reward function, naming the source and `where`, before any work."""
    unknown = sorted({row["data_source"] for row in task_rows.summaries(rows) if reward_fn(row) is None})
    if unknown:
        raise ValueError(f"{where}: no reward function for data_source {', '.join(map(repr, unknown))}; known: "
                         f"{', '.join(sorted(REWARDS))} (rewards.REWARDS)")


def read_samples(path: str, rows_by_id: dict[str, dict],
                 step: int | None = None) -> tuple[list[str], list[str], list[int | None]]:
    """(task ids, completions, training steps) of a JSONL of kiln samples ({"task_id", "completion"}, and "step" in a
    trainer's samples.jsonl; None without) or SWE-bench predictions ({"instance_id", "model_patch",
    "model_name_or_path"}: task "swebench/<instance_id>", the patch its completion; a null patch is an empty one);
    lines of both kinds may mix. Every task must be among the rows. `step`: only the samples of that training step."""
    if not Path(path).is_file():
        run = Path(path).parent
        if (run / "metrics.jsonl").is_file():
            raise ValueError(f"{path} does not exist: the run in {run} has written no samples (a trainer writes "
                             f"samples.jsonl every --sample-every steps, 10 by default, and at its last step)")
        raise ValueError(f"{path}: no such samples file")
    task_ids, completions, steps, seen_steps = [], [], [], set()
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                sample = json.loads(line)
                prediction = isinstance(sample, dict) and "model_patch" in sample
                if prediction:
                    task_id, completion = f"swebench/{sample['instance_id']}", sample["model_patch"] or ""
                else:
                    task_id, completion = sample["task_id"], sample["completion"]
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path} line {number}: a sample must be a JSON object with \"task_id\" and "
                                 f"\"completion\", or a SWE-bench prediction with \"instance_id\" and \"model_patch\" "
                                 f"({type(e).__name__}: {e})")
            if not isinstance(completion, str):
                raise ValueError(f"{path} line {number}: \"{'model_patch' if prediction else 'completion'}\" must "
                                 "be a string")
            if task_id not in rows_by_id:
                if prediction:
                    swe = sum(row["data_source"] == "swebench" for row in rows_by_id.values())
                    raise ValueError(f"{path} line {number}: instance {sample['instance_id']!r} is not among the "
                                     f"{swe} swebench rows of --data")
                raise ValueError(f"{path} line {number}: unknown task id {task_id!r} (not in the --data rows)")
            sample_step = sample.get("step") if not prediction else None
            seen_steps.add(sample_step)
            if step is not None and sample_step != step:
                continue
            task_ids.append(task_id)
            completions.append(completion)
            steps.append(sample_step)
    if not task_ids:
        if step is not None:
            known = sorted(s for s in seen_steps if s is not None)
            raise ValueError(f"{path}: no samples of step {step} (steps in the file: "
                             f"{', '.join(map(str, known)) or 'none'})")
        raise ValueError(f"{path}: no samples")
    return task_ids, completions, steps


@dataclass
class ScoreArgs:
    samples: tyro.conf.Positional[str]
    """JSONL of {"task_id": "<data_source>/<index>", "completion": "..."}"""
    data: str
    """the rows the samples answer (parquet / jsonl / HF dataset name), in kiln's row schema"""
    out: str | None = None
    """write one result per sample (task_id, score, info) here"""
    workers: int | None = None
    """samples graded at once (default: 2 x cores + 1)"""
    timeout: float = 6.0
    """wall seconds per test run"""
    json: str | None = None
    """write the report (pass@k, test pass rate and bands by group, errors) here as JSON"""
    markdown: str | None = None
    """write the report here as a markdown table"""
    plot: str | None = None
    """draw the band histogram of test pass rates per difficulty into this PNG"""
    judge_url: str | None = None
    """OpenAI-compatible base URL of the LLM judge (vl_agent rows), e.g. http://judge-node:8000/v1"""
    judge_model: str | None = None
    """the judge's model name (default: the first one the server lists)"""
    official: bool = False
    """swebench rows: grade with swebench's own run_instance instead of kiln's grader (same verdicts, slower)"""
    step: int | None = None
    """grade only the samples of this training step (the `step` of a trainer's samples.jsonl); without it, samples
    of several steps are reported step by step as well as pooled"""


def main(args: ScoreArgs) -> dict:
    if (args.workers is not None and args.workers < 1) or args.timeout <= 0:
        raise ValueError(f"--workers and --timeout must be > 0, got {args.workers} and {args.timeout}")
    for path in (args.out, args.json, args.markdown, args.plot):
        if path and not Path(path).parent.is_dir():
            raise ValueError(f"{path}: its folder does not exist (checked before grading)")
    if args.out:  # checked before any grading: a result file that cannot be written would lose all of it
        out = Path(args.out)
        if out.is_dir():
            raise ValueError(f"--out {args.out}: is a directory")
        if not os.access(out.parent, os.W_OK):
            raise ValueError(f"--out {args.out}: the directory {out.parent} is not writable")
    rows = task_rows.load_rows(args.data)
    check_sources(rows, args.data)
    rows_by_id = {task_rows.row_id(r): r for r in rows}
    task_ids, completions, steps = read_samples(args.samples, rows_by_id, args.step)
    swe_truths = [json.loads(rows_by_id[t]["reward_model"]["ground_truth"]) for t in sorted(set(task_ids))
                  if rows_by_id[t]["data_source"] == "swebench"]
    if args.official and not swe_truths:
        raise ValueError(f"--official grades swebench rows; no sample of {args.samples} answers one")
    swe_grading.check_images(swe_truths, args.samples)
    task_truths = [task_dirs.truth_of(rows_by_id[t]) for t in sorted(set(task_ids))
                   if rows_by_id[t]["data_source"] == task_dirs.DATA_SOURCE]
    if task_truths:  # a task's completion is a script, run in a fresh container of its image
        task_dirs.ensure_images(task_truths)
    swe = swe_grading.SweConfig(official=args.official)
    judge = make_judge(args.judge_url, args.judge_model, [rows_by_id[t] for t in set(task_ids)], where=args.samples)
    limits = sandbox.Limits(timeout=args.timeout)
    start = time.perf_counter()
    workers = args.workers or max(sandbox.default_workers(), 2 * judge.max_concurrency if judge else 0)
    with ThreadPoolExecutor(workers) as pool:
        results = list(tqdm(pool.map(lambda tc: score(rows_by_id[tc[0]], tc[1], limits, judge, swe=swe),
                                     zip(task_ids, completions)),
                            total=len(task_ids), desc="grading", disable=len(task_ids) < 50))
    seconds = time.perf_counter() - start
    if judge is not None:  # samples the judge could not grade are reported, not scored 0
        failed = [(t, r) for t, r in zip(task_ids, results) if judge_failed(r.info)]
        print(f"judge {judge.base_url}: {json.dumps(judge_lib.metrics([judge.stats()]))}")
        if failed:
            print(f"{len(failed)} samples not graded (the judge failed), left out of the report; first: "
                  f"{failed[0][0]}: {failed[0][1].info['judge_error']}")
        judge.close()
    infra = [(t, r) for t, r in zip(task_ids, results) if "infra_failed" in r.info]
    if infra:
        print(f"{len(infra)} samples not graded (the task's tests left no reward: an infrastructure failure), left "
              f"out of the report; first: {infra[0][0]}: {infra[0][1].info['infra_failed']}")
    graded = [(t, r, s) for t, r, s in zip(task_ids, results, steps) if not ungraded(r.info)]
    if not graded:
        raise RuntimeError("no sample could be graded")
    task_ids, results, steps = [t for t, _, _ in graded], [r for _, r, _ in graded], [s for _, _, s in graded]
    summary = eval_report.report(rows_by_id, task_ids, results) | {"seconds": seconds, "samples_per_s": len(results) / seconds}
    if len(set(steps)) > 1:  # a changing policy: the pooled pass@k mixes them, so each step is reported too
        summary["by_step"] = by_step(rows_by_id, task_ids, results, steps)
    if swe_truths:
        summary["swe"] = swe_grading.swe_metrics([r.info for t, r in zip(task_ids, results)
                                                  if rows_by_id[t]["data_source"] == "swebench"])
    eval_report.print_report(summary)
    if "by_step" in summary:
        print(f"\nthe samples come from {len(summary['by_step'])} training steps, pooled above; by step (or pass "
              "--step N):")
        for step, row in summary["by_step"].items():
            print(f"step {step:>6}: {row['samples']:>5} samples, pass@1 {row['pass@1']:.3f}, mean reward "
                  f"{row['mean_reward']:.3f}")
    if args.out:  # replaced whole, never mixed with a concurrent run's
        task_rows.write_atomically(args.out, ({"task_id": task_id, "score": r.score, "info": r.info}
                                              for task_id, r in zip(task_ids, results)))
        print(f"results: {args.out}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(eval_report.report_markdown(summary, f"{args.samples} on {args.data}"))
    if args.plot:
        eval_report.plot_report(summary, args.plot, f"{Path(args.samples).name}: test pass rate (passed / total tests)")
    return summary


def by_step(rows_by_id: dict[str, dict], task_ids: list[str], results: list[Reward],
            steps: list[int | None]) -> dict:
    """Per training step (None: lines without one, last): its sample count, pass@1 and mean reward."""
    table = {}
    for step in sorted(set(steps), key=lambda s: (s is None, s or 0)):
        picked = [i for i, s in enumerate(steps) if s == step]
        part = eval_report.report(rows_by_id, [task_ids[i] for i in picked], [results[i] for i in picked])
        table[str(step)] = {"samples": part["samples"], "pass@1": part["pass"]["all"]["pass@1"],
                            "mean_reward": part["mean_reward"]}
    return table


@dataclass
class SweCheckArgs:
    data: tyro.conf.Positional[str]
    """swebench rows (parquet / jsonl) in kiln's row schema (`data_prep.py swebench`)"""
    workers: int = 2
    """rows checked at once (each runs two gradings, one after the other)"""
    official: bool = False
    """grade with swebench's own run_instance instead of kiln's grader"""
    eval_timeout: float = 1800.0
    """wall seconds for each run of a row's tests"""


def swe_check_main(args: SweCheckArgs) -> list[dict]:
    """Every row's gold patch must resolve and its unpatched tree must not (swe_grading.swe_check): a table, and exit
    status 1 naming the rows that fail."""
    rows = task_rows.load_rows(args.data)
    others = Counter(row["data_source"] for row in rows if row["data_source"] != "swebench")
    if others:
        raise ValueError(f"{args.data}: swe-check checks swebench rows; {sum(others.values())} rows are not "
                         f"({dict(others)})")
    if args.workers < 1 or args.eval_timeout <= 0:
        raise ValueError(f"--workers and --eval-timeout must be > 0, got {args.workers} and {args.eval_timeout}")
    truths = [json.loads(row["reward_model"]["ground_truth"]) for row in rows]
    swe_grading.check_images(truths, args.data)
    config = swe_grading.SweConfig(eval_timeout=args.eval_timeout, official=args.official)
    with ThreadPoolExecutor(args.workers) as pool:
        checks = list(tqdm(pool.map(lambda truth: swe_grading.swe_check(truth, config=config), truths),
                           total=len(truths), desc="swe-check"))
    width = max(len("instance"), *(len(c["instance_id"]) for c in checks))
    print(f"{'instance':<{width}}  {'gold':<14}{'F2P':>7}{'P2P':>9}  {'no patch':<14}{'F2P':>7}{'seconds':>9}  ok")

    def cells(grade: swe_grading.Grade) -> str:
        f2p, p2p = grade.info["f2p"], grade.info["p2p"]
        return (f"{grade.info['error'] or grade.info['status'].removeprefix('RESOLVED_').lower():<14}"
                f"{f2p[0]:>4}/{f2p[1]:<2}{p2p[0]:>5}/{p2p[1]:<3}")
    for c in checks:
        seconds = c["gold"].info.get("seconds", 0) + c["base"].info.get("seconds", 0)
        print(f"{c['instance_id']:<{width}}  {cells(c['gold'])}  {cells(c['base'])[:21]}{seconds:>9.1f}  "
              + ("ok" if c["ok"] else f"FAIL: {c['problem']}"))
    failed = [c["instance_id"] for c in checks if not c["ok"]]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(checks)} rows fail the check: {', '.join(failed)}")
    print(f"all {len(checks)} rows ok")
    return checks


if __name__ == "__main__":
    with cli.one_line_errors():
        args = tyro.extras.subcommand_cli_from_dict({"score": ScoreArgs, "swe-check": SweCheckArgs})
        (swe_check_main if isinstance(args, SweCheckArgs) else main)(args)
