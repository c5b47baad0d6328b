"""The LLM judge (judge.py) and the vl_agent reward (rewards.py) against real HTTP servers on 127.0.0.1: a scripted
server (replies, 5xx then OK, 429 with Retry-After, stalls, resets, malformed bodies) and a server that answers with a
tiny model through kiln's HFEngine. Judge failures are counted and leave the reward missing, never 0."""
import base64
import io
import json
import math
import re
import socket
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import engines  # noqa: E402
import judge as judge_lib  # noqa: E402
import policy  # noqa: E402
import rewards  # noqa: E402
import task_rows  # noqa: E402
import tiny  # noqa: E402
import train_grpo  # noqa: E402
import script_runner  # noqa: E402
from checkpoint import latest_checkpoint  # noqa: E402
from judge_server import Script, engine_answer, make_handler, scripted_judge, serve  # noqa: E402


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def vl_row(question: str, truth: str, source: str = "vl_agent", style: str = "judge", index: int = 0,
           images: list[bytes] | None = None, **extra) -> dict:
    row = {"data_source": source, "prompt": [{"role": "user", "content": question}], "ability": "vision",
           "reward_model": {"style": style, "ground_truth": truth},
           "extra_info": {"index": index, "split": "test", "question": question, **extra}}
    return row | ({"images": images} if images else {})


def test_parsing_is_strict():
    assert [judge_lib.parse_verdict(t) for t in ("TRUE", "true.", "**False**", "`FALSE`", "Reasoning...\nTRUE",
                                                  "<think>FALSE?</think>\nTRUE")] == [True, True, False, False,
                                                                                       True, True]
    for text in ("garbage", "TRUE or FALSE", "It is TRUE that it is wrong", "1", "", "Answer: TRUE"):
        assert judge_lib.parse_verdict(text) is None, text
    assert [judge_lib.parse_score(t) for t in ("0.75", "1", "1.0", "0.", ".5", "**0.25**", "Hmm.\n0.5")] == [
        0.75, 1.0, 1.0, 0.0, 0.5, 0.25, 0.5]
    for text in ("Score: 0.75", "0.7", "3/4", "2", "0.75 or 1", "nan", "I give it 1"):
        assert judge_lib.parse_score(text) is None, text
    assert judge_lib.parse_score("0.5", allowed=(0.0, 1.0)) is None


def test_scripted_replies_retries_timeouts_and_counts():
    script = Script({
        ("ok", "verdict"): ["TRUE"], ("dot", "verdict"): ["true."], ("junk", "verdict"): ["garbage"],
        ("score", "rubric"): ["0.75"], ("first", "rubric"): ["Score: 1"],
        ("flaky", "verdict"): [("status", 500), "FALSE"],
        ("busy", "verdict"): [("status", 429, 1), "TRUE"],
        ("slow", "verdict"): [("sleep", 4, "TRUE")],
        ("reset", "verdict"): [("reset",), "TRUE"],
        ("dead", "verdict"): [("reset",)],
        ("bad", "verdict"): [("malformed",)],
        ("down", "verdict"): [("status", 503)],
    })
    with scripted_judge(script) as url:
        judge = judge_lib.Judge(url, timeout_s=2.5, retries=2)
        assert judge.model == "scripted" and judge.base_url == url

        def ask(key):
            return judge.equivalent(f"[[{key}]] question", "reference", "answer")

        assert ask("ok") == judge_lib.Verdict(True, "TRUE", None)
        assert ask("dot").ok is True
        junk = ask("junk")
        assert junk.ok is None and junk.raw == "garbage" and junk.error.startswith("parse")
        assert judge.rubric("rubric", ["[[score]] parts"]).value == 0.75
        first = judge.rubric("rubric", ["[[first]] parts"])  # never "the first number in the text"
        assert first.value is None and first.raw == "Score: 1"
        assert ask("flaky").ok is False and script.count("flaky") == 2  # retried after the 500
        busy = ask("busy")
        times = [t for t, _, key, _ in script.requests if key == "busy"]
        assert busy.ok is True and len(times) == 2 and times[1] - times[0] >= 0.9  # Retry-After: 1 respected
        start = time.monotonic()
        slow = ask("slow")
        assert slow.ok is None and "timeout" in slow.error and url in slow.error and time.monotonic() - start < 3.5
        assert ask("reset").ok is True and script.count("reset") == 2  # a reset connection is retried (POST too)
        dead = ask("dead")
        assert dead.ok is None and dead.error.startswith(f"judge {url}") and script.count("dead") == 3
        bad = ask("bad")
        assert bad.ok is None and "malformed" in bad.error and script.count("bad") == 1
        down = ask("down")
        assert down.ok is None and "503" in down.error and script.count("down") == 3
        stats = judge.stats(reset=True)
        judge.close()
    assert stats["calls"] == 12 and stats["cache_hits"] == 0
    assert stats["parse_failures"] == 2  # garbage, "Score: 1"
    assert stats["errors"] == 4 and stats["error_kinds"].keys() == {"timeout", "connection", "malformed", "http_503"}
    assert stats["retries"] >= 1 + 1 + 1 + 2 + 2  # flaky, busy, reset, dead, down (urllib3's retry history)
    assert len(stats["latencies"]) == 8  # the replies that came back
    latencies = stats["latencies"]
    assert stats["latency_p95_s"] == latencies[7] and stats["latency_p50_s"] == (latencies[3] + latencies[4]) / 2
    metrics = judge_lib.metrics([stats, stats])
    assert metrics["judge/calls"] == 24 and metrics["judge/failure_rate"] == pytest.approx(6 / 12)
    assert metrics["judge/latency_p95_s"] >= metrics["judge/latency_p50_s"] > 0


def test_cache_holds_answers_and_calls_in_flight_but_not_failures():
    script = Script({("slow", "verdict"): [("sleep", 0.3, "TRUE")],
                     ("once", "verdict"): [("status", 400), "FALSE"], ("img", "rubric"): ["1"]})
    with scripted_judge(script) as url:
        judge = judge_lib.Judge(url, timeout_s=5)
        assert judge.equivalent("[[k]] q", "r", "a").ok is True
        assert judge.equivalent("[[k]] q", "r", "a").ok is True
        assert judge.equivalent("[[k]] q", "r", "b").ok is True  # another answer: another request
        with ThreadPoolExecutor(16) as pool:  # a GRPO group repeating one answer, graded at once
            verdicts = list(pool.map(lambda _: judge.equivalent("[[slow]] q", "r", "a"), range(16)))
        assert all(v.ok is True for v in verdicts) and script.count("slow") == 1
        assert judge.equivalent("[[once]] q", "r", "a").error  # a 400 is not retried, and not an answer...
        assert judge.equivalent("[[once]] q", "r", "a").ok is False  # ...so the next identical call asks again
        stats = judge.stats()
        image = png(Image.new("RGB", (8, 8), "red"))
        other = png(Image.new("RGB", (8, 8), "blue"))
        for parts in (["[[img]]", image], ["[[img]]", image], ["[[img]]", other]):
            judge.rubric("rubric", parts)
        judge.close()
        uncached = judge_lib.Judge(url, cache=False)
        uncached.equivalent("[[k]] q", "r", "a")
        uncached.equivalent("[[k]] q", "r", "a")
        assert uncached.stats()["requests"] == 2 and uncached.stats()["cache_hits"] == 0
        uncached.close()
    assert stats["calls"] == 21 and stats["cache_hits"] == 1 + 15 and stats["requests"] == 5
    assert script.count("img") == 2  # images are part of the key: the same image hits, another one asks
    payload = next(p for _, _, key, p in script.requests if key == "img")
    sent = payload["messages"][1]["content"][1]["image_url"]["url"]
    assert sent == "data:image/png;base64," + base64.b64encode(image).decode()
    assert payload["temperature"] == 0 and payload["seed"] == 0 and payload["model"] == "scripted"


def test_check_cli_probes_a_server(capsys):
    script = Script({("x", "verdict"): ["TRUE"]})
    with scripted_judge(script) as url:
        stats = judge_lib.check(judge_lib.CheckArgs(base_url=url))
    printed = capsys.readouterr().out
    assert stats["calls"] == 2 and stats["errors"] == 0 and script.count(kind="verdict") == 1
    assert f"judge {url}: model scripted" in printed and "-> True" in printed and "rubric -> 0.75" in printed
    assert '"judge/calls": 2.0' in printed


def test_check_cli_fails_when_the_judge_fails_and_names_its_status():
    """`judge.py check` against a judge that answers every question with HTTP 500: exit status 1, and the last line
    names the status, whether the deadline passed mid-retry or the retries ran out (with --timeout-s 60)."""
    script = Script(default={"verdict": ("status", 500), "rubric": ("status", 500)})
    with scripted_judge(script) as url:
        proc = script_runner.run([sys.executable, str(ROOT / "judge.py"), "check", "--base-url", url,
                                  "--timeout-s", "1.5"], capture_output=True, text=True, timeout=120)
        last = proc.stderr.strip().splitlines()[-1]
        assert proc.returncode == 1 and last.startswith("error: judge check failed (2 of 2 questions): equivalence: ")
        assert len(re.findall(r"no reply within 1.5s \(the last of \d+ tries got HTTP 500\)", last)) == 2, last
        judge = judge_lib.Judge(url, timeout_s=60, retries=1)
        verdict = judge.equivalent("q", "r", "a")
        judge.close()
    assert verdict.ok is None and verdict.error.endswith('http_500: {"error": "scripted"}')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_dead_or_wrong_judge_stops_before_any_work(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(judge_lib.JudgeUnreachable, match=dead.replace(".", r"\.")):
        judge_lib.Judge(dead)
    with scripted_judge(Script()) as url:
        with pytest.raises(judge_lib.JudgeUnreachable, match=r"does not serve model 'qwen'.*\['scripted'\]"):
            judge_lib.Judge(url, model="qwen")
    data, samples = tmp_path / "rows.jsonl", tmp_path / "samples.jsonl"
    task_rows.write_rows([vl_row("What colour?", "red")], data)
    samples.write_text(json.dumps({"task_id": "vl_agent/0", "completion": "<answer>red</answer>"}) + "\n")
    with pytest.raises(ValueError, match="1 rows .*'vl_agent'.* scored with an LLM judge: pass --judge-url"):
        rewards.main(rewards.ScoreArgs(str(samples), data=str(data)))
    with pytest.raises(judge_lib.JudgeUnreachable, match=f"judge server {dead}/models does not answer"):
        rewards.main(rewards.ScoreArgs(str(samples), data=str(data), judge_url=dead))
    with pytest.raises(ValueError, match="vl_agent/0: scored with an LLM judge, but none is configured"):
        rewards.score(vl_row("What colour?", "red"), "<answer>red</answer>")


def test_answer_extraction_and_format_rules():
    cases = {  # completion: (answer, format ok)
        "<think>look</think><code>crop()</code><answer>42</answer>": ("42", True),
        "so the result is \\boxed{7}": ("7", True),
        "\\boxed{1} or \\boxed{2}": ("2", False),
        "<answer>1</answer> no, <answer>2</answer>": ("2", False),
        "<answer>3</answer><code>more()</code>": ("3", False),
        "<code>unclosed<answer>3</answer>": ("3", False),
        "<think>a</think><answer>open": (None, False),
        "no answer at all": (None, False),
        "<answer>x</answer><|vision_start|>": ("x", False),
    }
    for text, expected in cases.items():
        assert (rewards.extract_answer(text)[0], rewards.vl_format_ok(text)) == expected, text
    assert rewards.math_equal("0.5", "1/2") and rewards.math_equal("Red", " red ") and not rewards.math_equal("3", "4")


def test_vl_agent_components_and_judge_failures_left_missing():
    """acc by math-verify (no judge call) else by the judge; tool by the rubric judge; score = acc + 0.3 format +
    0.5 tool. A failed judge call makes its component None and the score NaN (never 0), and is counted."""
    script = Script({("syn", "verdict"): ["TRUE"], ("wrong", "verdict"): ["FALSE"],
                     ("accdown", "verdict"): [("malformed",)], ("tooljunk", "rubric"): ["a solid 1"],
                     ("tool1", "rubric"): ["1"], ("math", "verdict"): ["FALSE"], ("math", "rubric"): ["0.75"],
                     ("norule", "verdict"): ["TRUE"]})
    image, made = png(Image.new("RGB", (16, 16), "white")), png(Image.new("RGB", (4, 4), "black"))
    rows = [vl_row("[[math]] 6 x 7?", "42", index=0), vl_row("[[syn]] colour?", "red", index=1),
            vl_row("[[wrong]] colour?", "red", index=2), vl_row("[[accdown]] colour?", "red", index=3),
            vl_row("[[tooljunk]] 6 x 7?", "42", index=4), vl_row("[[tool1]] zoom?", "cat", source="vstar",
                                                                   index=5, images=[image]),
            vl_row("[[norule]] colour?", "red", source="chart", style="rule", index=6)]
    completions = ["<code>print(6*7)</code><answer>42.0</answer>", "<answer>crimson</answer>",
                   "<answer>blue</answer>", "<answer>scarlet</answer>", "<answer>42</answer>",
                   "<code>crop()</code><answer>a cat</answer><code>x</code>", "<answer>crimson</answer>"]
    infos = [{}] * 5 + [{"images": [made], "messages": [{"role": "user", "content": "q"},
                                                        {"role": "assistant", "content": "<code>crop()</code>"},
                                                        {"role": "tool", "content": "saved crop.png"}]}, {}]
    with scripted_judge(script) as url:
        judge = judge_lib.Judge(url, timeout_s=5)
        out = rewards.score_batch(rows, completions, judge=judge, sample_infos=infos)
        stats = judge.stats()
        judge.close()
    info = [r.info for r in out]
    assert (info[0]["acc"], info[0]["acc_by"], info[0]["format"], info[0]["tool"]) == (1.0, "math_verify", 1.0, 0.75)
    assert out[0].score == pytest.approx(1.0 + 0.3 + 0.5 * 0.75)
    assert script.count("math", "verdict") == 0  # math-verify settled it
    assert (info[1]["acc"], info[1]["acc_by"]) == (1.0, "judge") and out[1].score == pytest.approx(1.675)
    assert info[2]["acc"] == 0.0 and out[2].score == pytest.approx(0.3 + 0.375)
    for failed, component in ((3, "acc"), (4, "tool")):  # missing, not zero
        assert math.isnan(out[failed].score) and info[failed][component] is None
        assert rewards.judge_failed(info[failed]) and info[failed]["judge_error"].startswith(f"{component}: ")
    assert url in info[3]["judge_error"] and "a solid 1" in info[4]["judge_error"]
    assert info[3]["tool"] == 0.75 and info[4]["acc"] == 1.0  # the other component is still reported
    assert (info[5]["acc"], info[5]["format"], info[5]["tool"]) == (1.0, 0.0, 1.0)  # judged TRUE; code after answer
    assert info[6]["acc"] == 0.0 and script.count("norule", "verdict") == 0  # style "rule": no judge for acc
    assert stats["calls"] == 7 + 4 and stats["errors"] == 1 and stats["parse_failures"] == 1
    # The rubric request: the vstar rubric, the question, the input image, the response, the tool output, the image
    # the tool made (as data URLs); a sample without tool images says so.
    vstar = next(p for _, kind, key, p in script.requests if key == "tool1")
    assert "region the question is about" in vstar["messages"][0]["content"]
    parts = vstar["messages"][1]["content"]
    urls = [p["image_url"]["url"] for p in parts if p["type"] == "image_url"]
    assert urls == ["data:image/png;base64," + base64.b64encode(b).decode() for b in (image, made)]
    text = "\n".join(p["text"] for p in parts if p["type"] == "text")
    assert "[[tool1]] zoom?" in text and "saved crop.png" in text and "crop()" in text and "(1 of 1)" in text
    math_rubric = next(p for _, kind, key, p in script.requests if key == "math" and kind == "rubric")
    assert "no image was produced" not in json.dumps(math_rubric)
    assert "produced: none." in json.dumps(math_rubric) and "Input image: none." in json.dumps(math_rubric)
    assert "print(6*7)" in json.dumps(math_rubric)


def test_vision_toy_tool_rule_needs_no_judge():
    """vision_toy: tool = 1 when a tool image is an unscaled crop of the input that holds the target box."""
    canvas = Image.new("RGB", (64, 48), "white")
    for x in range(40, 46):
        for y in range(10, 14):
            canvas.putpixel((x, y), (200, 30, 30))
    canvas.putpixel((5, 5), (0, 0, 255))
    source = png(canvas)
    row = vl_row("What is in the red box?", "7", source="vision_toy", style="rule", images=[source],
                 target_box=[40, 10, 46, 14])
    assert not rewards.needs_judge(row)
    holds, misses = png(canvas.crop((30, 0, 60, 30))), png(canvas.crop((0, 0, 30, 30)))
    cut, zoomed = png(canvas.crop((42, 8, 60, 30))), png(canvas.crop((30, 0, 60, 30)).resize((60, 60)))
    scores = {name: rewards.score(row, "<answer>7</answer>", sample_info={"images": images}).info["tool"]
              for name, images in (("holds", [misses, holds]), ("misses", [misses]), ("cut", [cut]),
                                   ("zoomed", [zoomed]), ("none", []))}
    assert scores == {"holds": 1.0, "misses": 0.0, "cut": 0.0, "zoomed": 0.0, "none": 0.0}
    assert rewards.score(row, "<answer>7</answer>", sample_info={"images": [holds]}).score == pytest.approx(1.8)
    with pytest.raises(ValueError, match="needs images\\[0\\] and extra_info.target_box"):
        rewards.score(vl_row("q", "7", source="vision_toy", style="rule"), "<answer>7</answer>")


def test_score_cli_reports_judge_failures_apart(tmp_path, capsys):
    script = Script({("down", "verdict"): [("malformed",)]})
    data, samples = tmp_path / "rows.parquet", tmp_path / "samples.jsonl"
    task_rows.write_rows([vl_row("[[up]] colour?", "red", index=0), vl_row("[[down]] colour?", "red", index=1)],
                         data)
    samples.write_text("".join(json.dumps({"task_id": f"vl_agent/{i}", "completion": c}) + "\n"
                               for i, c in ((0, "<answer>crimson</answer>"), (1, "<answer>crimson</answer>"),
                                            (0, "no answer"))))
    with scripted_judge(script) as url:
        summary = rewards.main(rewards.ScoreArgs(str(samples), data=str(data), judge_url=url,
                                                 out=str(tmp_path / "out.jsonl")))
    printed = capsys.readouterr().out
    assert summary["samples"] == 2 and summary["pass"]["all"]["tasks"] == 1  # vl_agent/1 could not be graded
    assert "1 samples not graded (the judge failed)" in printed and "vl_agent/1" in printed and url in printed
    results = [json.loads(line) for line in open(tmp_path / "out.jsonl")]
    assert [r["task_id"] for r in results] == ["vl_agent/0", "vl_agent/0"]


def test_end_to_end_through_a_tiny_model_server(tmp_path):
    """A real OpenAI-compatible server whose replies come from kiln's HFEngine on a tiny model: the verdicts mean
    nothing, so this checks the plumbing: each question reaches the model, the model's exact text comes back, and its
    parse outcome decides whether the component is present or missing (and counted)."""
    model_dir = tiny.make_tiny_model(tmp_path / "judge", ["TRUE FALSE 0 0.25 0.5 0.75 1 question answer"] * 50)
    tokenizer = policy.load_tokenizer(str(model_dir))
    model = policy.load_model(str(model_dir), attn_implementation="sdpa").eval()
    answer = engine_answer(engines.HFEngine(model, pad_token_id=tokenizer.pad_token_id), tokenizer)
    seen = []

    def recorded(payload):
        reply = answer(payload)
        seen.append((payload, reply))
        return reply

    image = png(Image.new("RGB", (8, 8), "green"))
    rows = [vl_row("colour?", "red", index=0, images=[image]), vl_row("sum?", "4", index=1)]
    with serve(make_handler("tiny", recorded)) as url:
        judge = judge_lib.Judge(url, timeout_s=60, max_tokens=8)
        out = rewards.score_batch(rows, ["<answer>crimson</answer>", "<answer>4</answer>"], judge=judge)
        stats = judge.stats()
        judge.close()
    assert answer.calls == {"verdict": 1, "rubric": 2} and len(seen) == 3 and judge.model == "tiny"
    assert stats["calls"] == 3 and stats["errors"] == 0
    expected_failures = 0
    for payload, reply in seen:
        assert answer(payload) == reply  # the model's deterministic text, unchanged through HTTP and the client
        kind = "verdict" if "TRUE or FALSE" in payload["messages"][0]["content"] else "rubric"
        parsed = judge_lib.parse_verdict(reply) if kind == "verdict" else judge_lib.parse_score(reply)
        expected_failures += parsed is None
        index = 0 if kind == "verdict" or "colour?" in json.dumps(payload) else 1
        component = out[index].info["acc" if kind == "verdict" else "tool"]
        assert component == (None if parsed is None else float(parsed)), (kind, reply)
    assert stats["parse_failures"] == expected_failures
    for r in out:
        missing = r.info["acc"] is None or r.info["tool"] is None
        assert math.isnan(r.score) == missing == rewards.judge_failed(r.info)
    assert out[1].info["acc_by"] == "math_verify"  # "4" needed no judge
    rubric = next(p for p, _ in seen if "colour?" in json.dumps(p) and "TRUE or FALSE" not in json.dumps(p))
    assert [p["type"] for p in rubric["messages"][1]["content"]].count("image_url") == 1  # the row's image


@pytest.fixture(scope="module")
def vl_task(tmp_path_factory):
    root = tmp_path_factory.mktemp("vl_grpo")
    rows = [vl_row(f"[[mix]] What is {i} + 2?", str(i + 2), index=i, split="train") for i in range(8)]
    for row in rows:
        row["extra_info"]["split"] = "train"
    task_rows.write_rows(rows, root / "train.parquet")
    model = tiny.make_tiny_model(root / "model", [r["prompt"][0]["content"] + " the answer" for r in rows] * 20)
    return root, model


def grpo_args(root, model, out, url, **overrides):

    return train_grpo.Args(**{"model": str(model), "data": str(root / "train.parquet"), "output_dir": str(out),
                              "total_steps": 2, "prompts_per_step": 2, "group_size": 4, "max_new_tokens": 8,
                              "lr": 1e-3, "save_every": 1000, "sample_every": 1, "judge_url": url,
                              "best_metric": "val-core/all/pass@1",
                              "judge_timeout_s": 10.0} | overrides)


def rubric_by_completion(fail: set[int]):
    """A scripted rubric judge whose reply depends only on the graded completion (so neither the order of concurrent
    requests nor cache hits change which samples fail): crc32 % 5 in `fail` -> a malformed body, else 0.25 x (1 + k)."""
    def outcome(completion: str):
        k = zlib.crc32(completion.encode()) % 5
        return ("malformed",) if k in fail else f"{0.25 * (1 + k % 4):g}"

    def answer(payload):
        text = "\n".join(p.get("text", "") for p in payload["messages"][1]["content"])
        completion = text.split("characters):\n", 1)[1].rsplit("\nSandbox outputs:", 1)[0]
        return outcome(completion)

    answer.outcome = outcome
    return answer


@pytest.mark.slow
def test_grpo_leaves_out_judge_failures_and_counts_them(vl_task, tmp_path, monkeypatch):
    """Two GRPO steps on vl_agent rows with a rubric judge that sends a malformed body for some completions: exactly
    those samples have no reward (not 0), leave the update and are counted; every other sample's reward is the rubric
    score's share, and every metric stays finite."""

    root, model = vl_task
    answer = rubric_by_completion(fail={0})
    updates = []  # (reward, group, advantage) of the samples each update trained on

    def update_policy(run, batch, *rest):
        updates.append([(s.reward, s.group, s.advantage) for s in batch])
        return real_update(run, batch, *rest)

    real_update = train_grpo.update_policy
    monkeypatch.setattr(train_grpo, "update_policy", update_policy)
    with serve(make_handler("scripted", answer)) as url:
        run = train_grpo.main(grpo_args(root, model, tmp_path, url, judge_max_failure_rate=0.9,
                                        eval_data=str(root / "train.parquet")))
    run.judge.close()
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    # Before and after: judge failures left out, not fails.
    evals = [m for m in records if "val-aux/judge_ungraded" in m]
    assert [m["step"] for m in evals] == [0, 2]
    for m in evals:
        assert m.get("val-aux/all/tasks", 0) + m["val-aux/judge_ungraded"] == 8
        reward = "val-core/all/reward/mean"
        assert math.isfinite(m.get(reward, 0.0)) and (reward in m) == (m["val-aux/judge_ungraded"] < 8)
    steps = [m for m in records if "critic/score/mean" in m]
    samples = [json.loads(line) for line in open(tmp_path / "samples.jsonl")]
    assert [m["step"] for m in steps] == [1, 2] and len(samples) == 16
    failed = 0
    for sample in samples:  # no <answer> from an untrained model: acc 0, format 0, so reward = 0.5 x tool
        reply = answer.outcome(sample["completion"])
        failed += reply == ("malformed",)
        if reply == ("malformed",):
            assert math.isnan(sample["reward"]) and sample["error"] == "judge"
        else:
            assert sample["reward"] == pytest.approx(0.5 * float(reply)) and sample["error"] == "no_answer"
    assert 0 < failed < 16  # this seed's completions include both kinds
    # The updates saw exactly the graded samples; each group's advantages are GRPO's over its graded samples alone.
    assert len(updates) == 2 and sum(map(len, updates)) == 16 - failed
    for update in updates:
        assert not any(math.isnan(r) for r, _, _ in update)
        for group in {g for _, g, _ in update}:
            graded = torch.tensor([r for r, g, _ in update if g == group], dtype=torch.float64)
            want = (graded - graded.mean()) / (graded.std() + 1e-6) if len(graded) > 1 else torch.zeros(1)
            assert [a for _, g, a in update if g == group] == pytest.approx(want.tolist(), abs=1e-4)
    assert sum(m["judge/excluded_samples"] for m in steps) == sum(m["judge/errors"] for m in steps) == failed
    for m, step_samples in zip(steps, (samples[:8], samples[8:])):
        scored = [s["reward"] for s in step_samples if not math.isnan(s["reward"])]
        assert m["judge/calls"] == 8 and m["judge/parse_failures"] == 0 and m["judge/latency_p50_s"] > 0
        assert m["judge/failure_rate"] == m["judge/errors"] / 8 == m["judge/excluded_frac"]
        assert m["critic/score/vl_agent/acc"] == 0.0 and m["critic/score/vl_agent/format"] == 0.0
        assert m["critic/score/mean"] == pytest.approx(sum(scored) / len(scored))  # over the graded samples only
        assert m["critic/score/vl_agent/tool"] == pytest.approx(2 * m["critic/score/mean"])
        assert math.isfinite(m["actor/pg_loss"])


@pytest.mark.slow
def test_grpo_stops_on_a_failing_judge_naming_it(vl_task, tmp_path):
    """Past --judge-max-failure-rate the run stops before the update, naming the judge and its errors; a dead judge,
    or vl_agent rows without --judge-url, stop it at setup."""

    root, model = vl_task
    with serve(make_handler("scripted", rubric_by_completion(fail={0, 1, 2, 3}))) as url:
        with pytest.raises(RuntimeError, match=rf"judge {url}: \d+% of this step's 8 judge questions failed "
                                             r"\(> --judge-max-failure-rate 20%\): (\d+) errors \{'malformed': \1\}, "
                                             r"0 unparsable replies; \1 samples without a reward, e.g. tool: judge "
                                             rf"{url}: malformed: .*Stopped before training on them \(step 1\)"):
            train_grpo.main(grpo_args(root, model, tmp_path, url))
    assert not (tmp_path / "metrics.jsonl").exists() or not (tmp_path / "metrics.jsonl").read_text()
    assert latest_checkpoint(tmp_path) is None
    dead = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(judge_lib.JudgeUnreachable, match=f"judge server {dead}/models does not answer"):
        train_grpo.setup(grpo_args(root, model, tmp_path, dead), rewards.score_batch)
    with pytest.raises(ValueError, match="8 rows .* scored with an LLM judge: pass --judge-url"):
        train_grpo.setup(grpo_args(root, model, tmp_path, None), rewards.score_batch)
