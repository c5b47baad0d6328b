"""The run board end to end: a short real GRPO run (a tiny model warm-started to call the python tool on the row's
image, then answer) writes rich sample records; they hold what board.py shows, and board.py serves them to a real
headless chromium. Cost: one in-process GRPO run of 2 steps (evaluated before and after) after a 60-step warm start
(69-95 s of fixture on the shared 2-core machine at a load average of 6-10; not timed idle), a 1-step PPO run (5-20 s),
2-4 s per browser test; the whole file took 118-147 s there."""
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.support.ui import Select, WebDriverWait
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import board  # noqa: E402
import chat  # noqa: E402
import policy  # noqa: E402
import runlog  # noqa: E402
import sample_files  # noqa: E402
import task_rows  # noqa: E402
import tiny  # noqa: E402
import tools  # noqa: E402
import train_grpo  # noqa: E402
import train_ppo  # noqa: E402
import system_parts  # noqa: E402

pytestmark = pytest.mark.slow

# Screenshots of the main views, kept after the tests (runs/ is ignored by git; CI may collect the folder).
ARTIFACTS = Path(os.environ.get("KILN_TEST_ARTIFACTS", ROOT / "runs" / "test-artifacts")) / "board"
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")

CALL = '<tool_call>\n{"name": "python", "arguments": {"code": "image.show()"}}\n</tool_call>'
ANSWER = "```python\ndef f(x):\n    return x + 1\n```"


def png(colour: str) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), colour).save(buf, format="PNG")
    return buf.getvalue()


def conversation(row: dict) -> list[dict]:
    """The warm start's target: show the row's image with the tool, then answer."""
    return [*row["prompt"], {"role": "assistant", "content": CALL},
            {"role": "tool", "content": [{"type": "text", "text": "(no output)"}, {"type": "image"}]},
            {"role": "assistant", "content": ANSWER}]


def warm_start(model_dir: Path, rows: list[dict], steps: int = 60) -> None:
    tokenizer = policy.load_tokenizer(model_dir)
    model = policy.load_model(model_dir, attn_implementation="packed_sdpa")
    encoded = [chat.encode_conversation(tokenizer, conversation(r), tools=tools.TOOL_SCHEMAS["python"]) for r in rows]
    mask = torch.tensor([m for _, ms in encoded for m in ms], dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        logprobs, _ = policy.packed_logprobs(model, [ids for ids, _ in encoded])
        loss = -(logprobs * mask).sum() / mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(model_dir)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A finished 2-step GRPO run with --rich-samples: two rows (one whose tests the warm-started answer passes, one it
    fails, so REINFORCE++'s batch-whitened advantages differ), the python tool on the row's image, every step
    sampled, the same rows evaluated before and after."""
    root = tmp_path_factory.mktemp("board")
    rows = [task_rows.make_row("toy", "f", {"test_list": [test], "test_setup_code": ""}, {"index": i, "split": "train",
                                                                                        "difficulty": str(i + 1)})
            | {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Write f."}]}],
               "images": [png(colour)]}
            for i, (test, colour) in enumerate([("assert f(1) == 2", "red"), ("assert f(1) == 3", "blue")])]
    task_rows.write_rows(rows, root / "train.parquet")
    corpus = [json.dumps(conversation(r)) for r in rows] * 4 + [json.dumps(tools.TOOL_SCHEMAS["python"])] * 4
    model = tiny.make_tiny_model(root / "model", corpus, vocab_size=1024, seed=0)
    warm_start(model, rows)
    train_grpo.main(train_grpo.Args(
        model=str(model), data=str(root / "train.parquet"), eval_data=str(root / "train.parquet"),
        output_dir=str(root / "grpo"), tools="python",
        max_turns=2, prompts_per_step=2, group_size=2, max_new_tokens=48, max_total_tokens=1024,
        max_prompt_tokens=1000, temperature=0.5, advantage="reinforce++", total_steps=2, lr=1e-4, sample_every=1,
        rich_samples=True, save_every=0, micro_batch_tokens=4096, seed=1, best_metric=""))
    return root / "grpo"


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in open(run / "samples.jsonl")]


def test_rich_records_hold_tokens_logprobs_advantages_and_tool_images(run_dir):
    tokenizer = policy.load_tokenizer(run_dir.parent / "model")
    lines = records(run_dir)
    assert [r["step"] for r in lines] == [1] * 4 + [2] * 4
    for r in lines:
        n = len(r["token_ids"])
        assert n > 0 and len(r["token_text"]) == len(r["loss_mask"]) == len(r["engine_logprobs"]) == n
        assert len(r["trainer_logprobs"]) == n
        assert "".join(r["token_text"]) == tokenizer.decode(r["token_ids"])
        policy_tokens = [k for k, m in enumerate(r["loss_mask"]) if m]
        # The HF engine is the policy itself: the trainer's logprobs match the engine's on every sampled token.
        assert max(abs(r["trainer_logprobs"][k] - r["engine_logprobs"][k]) for k in policy_tokens) <= 1e-3
        assert all(r["engine_logprobs"][k] == 0 for k in range(n) if not r["loss_mask"][k])
        assert r["finish_reason"] in ("stop", "length", "max_turns", "max_total_tokens")
        assert r["data_source"] == "toy" and r["group"] in (0, 1, 2, 3)
        assert "passed" in r["info"] and "format" in r["info"]  # the toy reward's components
        assert r["info"]["tool_calls"] == len(r["tool_calls"])
    for step in (1, 2):  # REINFORCE++ whitens over the batch: the advantages of a step sum to zero
        assert abs(sum(r["advantage"] for r in lines if r["step"] == step)) < 1e-4
    assert {r["reward"] for r in lines} == {0.0, 1.0}


def test_images_are_files_named_by_their_content_and_placed_in_the_messages(run_dir):
    shown = [r for r in records(run_dir) if any(c["images"] for c in r["tool_calls"])]
    assert shown, "no trajectory showed an image"
    for r in shown:
        call = next(c for c in r["tool_calls"] if c["images"])
        assert call["name"] == "python" and call["arguments"] == {"code": "image.show()"} and not call["error"]
        assert call["seconds"] > 0 and call["output"] == "(no output)"
        parts = [p["image"] for m in r["messages"] if isinstance(m["content"], list) for p in m["content"]
                 if p.get("type") == "image"]
        assert parts == r["images"] and r["prompt_images"] == 1 and parts[1:] == call["images"]
        for path in parts:
            data = (run_dir / path).read_bytes()
            assert path == f"{sample_files.IMAGES_DIR}/{hashlib.sha256(data).hexdigest()[:16]}.png"
        # The tool image is the row's own, shown by PIL (and scaled up to the least size tools.fit_images allows).
        assert [colour for _, colour in Image.open(run_dir / parts[1]).convert("RGB").getcolors()] == [
            Image.open(run_dir / parts[0]).getpixel((0, 0))]


def test_ppo_records_keep_per_token_advantages(run_dir, tmp_path):
    """PPO's rich records (one step on the same warm-started model and rows): its old logprobs as the trainer's, and
    GAE's advantages per token, zero off the loss mask. About 20 s."""
    train_ppo.main(train_ppo.Args(
        model=str(run_dir.parent / "model"), data=str(run_dir.parent / "train.parquet"), output_dir=str(tmp_path),
        tools="python", max_turns=2, prompts_per_step=2, group_size=2, max_new_tokens=48, max_total_tokens=1024,
        max_prompt_tokens=1000, temperature=0.5, total_steps=1, minibatches=1, sample_every=1, rich_samples=True,
        save_every=0, micro_batch_tokens=4096, seed=1, best_metric=""))
    lines = records(tmp_path)
    assert len(lines) == 4
    for r in lines:
        mask = r["loss_mask"]
        assert len(r["token_advantages"]) == len(mask) == len(r["trainer_logprobs"])
        assert all(a == 0 for a, m in zip(r["token_advantages"], mask) if not m)
        assert any(a != 0 for a in r["token_advantages"])
        assert max(abs(t - e) for t, e, m in zip(r["trainer_logprobs"], r["engine_logprobs"], mask) if m) <= 1e-3


def test_samples_rotate_and_unnamed_images_go(tmp_path):
    """A run's sample files stay within --samples-max-mb; the board reads both generations, in order, and starts its
    index over when the files rotate under it."""
    log = runlog.RunLog(tmp_path, rank=0, samples_max_bytes=4000)
    for k in range(14):  # about 380 bytes a line: rotated after the 6th and the 12th
        name = f"{k:016x}.png"
        log.samples([{"step": k, "images": [f"{sample_files.IMAGES_DIR}/{name}"], "pad": "x" * 300,
                      "_images": {name: png("red")}}])
        if k == 3:
            app = board.Board.open([str(tmp_path)])
            assert [s for s, _ in app.api("/api/steps", 0, {})] == [0, 1, 2, 3]
    assert [s for s, _ in app.api("/api/steps", 0, {})] == list(range(6, 14))
    assert app.api("/api/sample", 0, {"id": "0"})["step"] == 6
    current, old = records(tmp_path), [json.loads(line) for line in open(tmp_path / "samples.old.jsonl")]
    assert [r["step"] for r in old + current] == list(range(6, 14))  # two generations, in order
    assert (tmp_path / "samples.jsonl").stat().st_size + (tmp_path / "samples.old.jsonl").stat().st_size <= 4000
    kept = sorted(p.name for p in (tmp_path / sample_files.IMAGES_DIR).iterdir())
    assert kept == sorted(r["images"][0].split("/")[1] for r in old + current)
    assert all("_images" not in r for r in old + current)


# ---- the board in a real browser ----


SWE_RECORD = {"step": 3, "task_id": "swebench/astropy__astropy-12907", "reward": -1.0, "error": None,
              "completion": "--- a/m.py\n+++ b/m.py\n@@ -1 +1 @@\n-return a\n+return b\n", "data_source": "swebench",
              "group": 0, "advantage": -1.0, "finish_reason": "submit",
              "info": {"f2p": [1, 2], "p2p": [1, 1], "status": "RESOLVED_NO", "resolved": False,
                       "suspicious": ["m.py: os._exit"],
                       "tests": {"f2p": {"passed": ["test_a"], "failed": ["test_b"]},
                                 "p2p": {"passed": ["test_c"], "failed": []}}},
              "messages": [{"role": "user", "content": "Fix it."}, {"role": "assistant", "content": "done"}]}


@contextmanager
def serving(*runs: Path):
    """board.py on a free port of 127.0.0.1 serving the runs: its URL while the block runs."""
    process = subprocess.Popen([sys.executable, str(ROOT / "board.py"), *map(str, runs), "--port", "0"],
                               stdout=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        url = re.search(r"http://\S+", line)
        assert url, f"board.py did not start: {line!r}"
        yield url.group(0)
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.fixture(scope="module")
def board_url(run_dir):
    """board.py on a free port of 127.0.0.1, serving the run and (for the comparison) a copy of its metrics."""
    other = run_dir.parent / "other"
    other.mkdir(exist_ok=True)
    with open(other / "metrics.jsonl", "w") as f:  # a second run: the same steps, rewards shifted
        for line in open(run_dir / "metrics.jsonl"):
            m = json.loads(line)
            if "critic/score/mean" in m:
                f.write(json.dumps(m | {"critic/score/mean": m["critic/score/mean"] + 0.25}) + "\n")
    with open(other / "samples.jsonl", "w") as f:  # a swebench record as a rich one holds swe_grading's verdict
        f.write(json.dumps(SWE_RECORD) + "\n")
    with serving(run_dir, other) as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    """Headless Debian chromium through chromium-driver (apt-get install chromium chromium-driver). Without them the
    tests skip, except under CI=true, where they fail."""
    if not (CHROMIUM and CHROMEDRIVER):
        system_parts.require("browser", "chromium and chromium-driver are not installed")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,1000"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_script_timeout(20)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    yield driver
    driver.quit()


def wait_for(driver, script: str, timeout: float = 15):
    """The value of a JS expression once it is truthy."""
    return WebDriverWait(driver, timeout).until(lambda d: d.execute_script(f"return {script}"))


def test_curves_draw_both_runs_on_one_chart(browser, board_url):
    browser.get(board_url)
    wait_for(browser, "document.body.dataset.ready")
    titles = browser.execute_script("return [...document.querySelectorAll('.chart h3')].map(h => h.textContent)")
    assert {"reward by data source", "train / engine mismatch", "seconds per phase", "entropy"} <= set(titles)
    reward = browser.execute_script(
        "const c = [...document.querySelectorAll('.chart')].find(c => c.querySelector('h3').textContent === "
        "'reward by data source'); return [...c.querySelectorAll('.legend span')].map(s => s.textContent)")
    assert "— grpo: critic/score/mean" in reward and "— other: critic/score/mean" in reward
    browser.save_screenshot(str(ARTIFACTS / "curves.png"))


def test_a_multi_turn_sample_with_a_tool_image_and_its_mismatch_colouring(browser, board_url, run_dir):
    browser.get(board_url)
    wait_for(browser, "document.body.dataset.ready")
    browser.find_element("id", "tab-samples").click()
    wait_for(browser, "$('f-step').options.length > 1")
    Select(browser.find_element("id", "f-step")).select_by_value("")  # every step, only samples with tool images
    browser.find_element("id", "f-toolimages").click()
    wait_for(browser, "document.querySelector('.sample-item') && $('f-toolimages').checked && "
                      "$('page').textContent.includes('of') && !$('list').dataset.loading")  # the filtered list
    browser.find_elements("css selector", ".sample-item")[0].click()
    wait_for(browser, "document.querySelectorAll('#tokens .tok').length > 0 && "
                      "[...document.querySelectorAll('img.tool-image')].every(i => i.complete && i.naturalWidth > 0)")
    sample_id = int(browser.execute_script("return document.querySelector('.sample-item.on').dataset.id"))
    record = records(run_dir)[sample_id]
    assert any(c["images"] for c in record["tool_calls"])
    # The tool's image is shown in the conversation, the tool table and among the tokens, from its file.
    shown = browser.execute_script("return [...document.querySelectorAll('img.tool-image')].map(i => "
                                   "new URL(i.src).searchParams.get('path'))")
    assert shown == record["images"][record["prompt_images"]:]
    assert browser.execute_script("return document.querySelectorAll('#tokens .pad img').length") == len(shown)
    assert len(browser.find_elements("css selector", "#group .member")) == 2  # the group side by side
    browser.find_element("id", "mode-mismatch").click()
    painted = wait_for(browser, "[...document.querySelectorAll('#tokens .tok')].map(s => "
                                "[s.dataset.value, getComputedStyle(s).backgroundColor])")
    differences = [abs(t - e) if m else None for t, e, m in
                   zip(record["trainer_logprobs"], record["engine_logprobs"], record["loss_mask"])]
    scale = max(d for d in differences if d is not None)
    assert len(painted) == len(differences)
    for (value, background), d in zip(painted, differences):
        if d is None:
            assert value == "" and background == "rgba(0, 0, 0, 0)"
            continue
        assert float(value) == pytest.approx(d, abs=1e-9)
        alpha = re.match(r"rgba?\(230, 81, 0(?:, ([\d.]+))?\)", background)
        assert alpha, background
        assert float(alpha.group(1) or 1) == pytest.approx(d / scale if scale else 0, abs=2e-3)
    hover = browser.execute_script("return document.querySelector('#tokens .tok[data-value]:not([data-value=\"\"])')"
                                   ".title")
    assert "trainer" in hover and "engine" in hover and "|Δ|" in hover
    browser.set_window_size(1400, 2200)  # the whole sample: conversation, tool calls and coloured tokens
    browser.save_screenshot(str(ARTIFACTS / "sample.png"))
    browser.set_window_size(1400, 1000)
    browser.find_element("id", "mode-advantage").click()
    advantages = wait_for(browser, "[...document.querySelectorAll('#tokens .tok')].filter(s => s.dataset.value !== '')"
                                   ".map(s => Number(s.dataset.value))")
    assert advantages == [pytest.approx(record["advantage"], abs=1e-9)] * sum(record["loss_mask"])


def test_evaluation_before_and_after_and_live_growth(browser, board_url, run_dir):
    """The evaluations view shows the run's first and last evaluation (before and after training) side by side, pass@1
    first, by data source and difficulty; an evaluation appended to metrics.jsonl becomes the last one without
    reloading the page (the board follows a live run)."""
    evals = [m for m in map(json.loads, open(run_dir / "metrics.jsonl")) if "val-core/all/pass@1" in m]
    assert [m["step"] for m in evals] == [0, 2]
    browser.get(board_url)
    wait_for(browser, "document.body.dataset.ready")
    browser.find_element("id", "tab-evals").click()
    wait_for(browser, "document.querySelector('#eval')")
    names, steps, table = eval_table(browser)
    assert names[0] == "pass@1" and "test_pass_rate" in names and steps == ["step 0", "step 2"]
    assert list(table) == ["all", "toy", "toy/1", "toy/2"]
    for group in table:
        for name in ("pass@1", "test_pass_rate"):
            for evaluation in evals:
                cell = table[group][name, f"step {evaluation['step']}"]
                assert float(cell) == pytest.approx(evaluation[f"val-core/{group}/{name}"], abs=1e-3)
    assert float(table["all"]["tasks", "step 2"]) == 2 and float(table["toy/2"]["tasks", "step 0"]) == 1
    browser.save_screenshot(str(ARTIFACTS / "evaluations.png"))
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"val-core/all/pass@1": 0.5, "val-core/toy/pass@1": 0.5, "val-core/toy/1/pass@1": 0.75,
                            "val-aux/all/band/all_pass": 0.25, "step": 3}) + "\n")
    wait_for(browser, "[...document.querySelectorAll('#eval th')].some(h => h.textContent === 'band/all_pass')")
    names, steps, table = eval_table(browser)
    assert names[0] == "pass@1" and steps == ["step 0", "step 3"]
    assert table["toy/1"]["pass@1", "step 3"] == "0.75" and table["all"]["band/all_pass", "step 3"] == "0.25"
    assert float(table["toy/1"]["pass@1", "step 0"]) == pytest.approx(evals[0]["val-core/toy/1/pass@1"], abs=1e-3)
    assert table["all"]["band/all_pass", "step 0"] == "-"  # not measured then


def eval_table(browser) -> tuple[list[str], list[str], dict]:
    """The evaluations view's table: its metric names, its evaluation steps, and {group: {(metric, step): text}}."""
    rows = browser.execute_script("return [...document.querySelectorAll('#eval tr')].map(r => "
                                  "[...r.children].map(c => c.textContent))")
    assert rows[0][0] == "data source / difficulty"
    names, steps = rows[0][1:], rows[1][: len(rows[1]) // len(rows[0][1:])]
    assert rows[1] == steps * len(names)
    columns = [(name, step) for name in names for step in steps]
    return names, steps, {r[0]: dict(zip(columns, r[1:])) for r in rows[2:]}


def test_evaluations_drawn_as_measured_axes_ticked_and_a_busy_port(browser, tmp_path):
    """On a run whose pass@1 jumps (0.40 -> 0.91 at its third evaluation), the default smoothing smooths the training
    reward but draws the evaluation through its measured points; the axes carry round, compact tick labels inside the
    chart; a sample of a group of 12 fits a 1400 px window; a second board on the same port says so in one line."""
    rewards = [0.1 + 0.02 * step for step in range(1, 21)]
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step, pass_at_1 in [(0, 0.40), (10, 0.42), (20, 0.91)]:
            f.write(json.dumps({"val-core/all/pass@1": pass_at_1, "step": step}) + "\n")
        for step, reward in enumerate(rewards, 1):
            f.write(json.dumps({"critic/score/mean": reward, "timing_s/step": 1200 + 4842 * (step - 1) / 19,
                                "step": step}) + "\n")
    with open(tmp_path / "samples.jsonl", "w") as f:
        for k in range(12):
            f.write(json.dumps({"step": 20, "task_id": f"toy/{k}", "group": 0, "reward": k % 2, "finish_reason": "stop",
                                "completion": "answer_" * 200}) + "\n")
    with serving(tmp_path) as url:
        browser.get(url)
        wait_for(browser, "document.body.dataset.ready")
        assert browser.execute_script("return $('smoothing').value") == "0.6"
        drawn = browser.execute_script("return Object.fromEntries([...document.querySelectorAll('path.series')].map("
                                       "p => [p.dataset.key, JSON.parse(p.dataset.values)]))")
        assert drawn["val-core/all/pass@1"] == [0.40, 0.42, 0.91]
        average, smoothed = 0.0, []  # TensorBoard's debiased moving average at weight 0.6
        for n, reward in enumerate(rewards, 1):
            average = 0.6 * average + 0.4 * reward
            smoothed.append(average / (1 - 0.6 ** n))
        assert drawn["critic/score/mean"] == pytest.approx(smoothed) and smoothed[-1] < rewards[-1] - 0.02
        labels = browser.execute_script(
            "return Object.fromEntries([...document.querySelectorAll('.chart')].map(c => [c.querySelector('h3')"
            ".textContent, ['y-tick', 'x-tick'].map(k => [...c.querySelectorAll('.' + k)].map(t => t.textContent))]))")
        assert labels["seconds per phase"] == [["2k", "4k", "6k"], ["5", "10", "15", "20"]]
        assert labels["pass@1 (evaluations)"] == [["0.4", "0.6", "0.8"], ["0", "5", "10", "15", "20"]]
        inside = browser.execute_script("return [...document.querySelectorAll('.y-tick')].map(t => t.getBBox().x)")
        assert inside and min(inside) >= 0  # no label runs off the chart's left edge
        browser.save_screenshot(str(ARTIFACTS / "jump.png"))
        browser.find_element("id", "tab-samples").click()
        wait_for(browser, "document.querySelector('.sample-item')")
        browser.find_element("css selector", ".sample-item").click()
        wait_for(browser, "document.querySelectorAll('#group .member').length === 12")
        width, visible = browser.execute_script("return [document.documentElement.scrollWidth, "
                                                "document.documentElement.clientWidth]")
        assert width <= visible and visible > 1300  # the open sample scrolls inside its pane, not the page
        port = url.rstrip("/").rsplit(":", 1)[1]
        second = subprocess.run([sys.executable, str(ROOT / "board.py"), str(tmp_path), "--port", port],
                                capture_output=True, text=True, timeout=60)
    assert second.returncode == 1 and second.stdout == ""
    lines = second.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and f"port {port} " in lines[0] and "--port" in lines[0]


def test_a_swe_sample_shows_its_diff_and_tests(browser, board_url):
    browser.get(board_url)
    wait_for(browser, "document.body.dataset.ready")
    browser.find_element("id", "tab-samples").click()
    wait_for(browser, "$('f-step').options.length > 1")
    Select(browser.find_element("id", "sample-run")).select_by_visible_text("other")
    wait_for(browser, "document.querySelector('.sample-item') && $('page').textContent.includes('of 1 ')")
    browser.find_element("css selector", ".sample-item").click()
    wait_for(browser, "document.querySelector('#swe')")
    added = browser.execute_script("return [...document.querySelectorAll('#swe .add')].map(s => s.textContent)")
    removed = browser.execute_script("return [...document.querySelectorAll('#swe .del')].map(s => s.textContent)")
    assert added == ["+++ b/m.py\n", "+return b\n"] and removed == ["--- a/m.py\n", "-return a\n"]
    text = browser.find_element("id", "swe").text
    assert "F2P: 1 passed, 1 failed" in text and "✗ test_b" in text and "✓ test_a" in text
    assert "P2P: 1 passed, 0 failed" in text and "✓ test_c" in text
    assert browser.find_element("id", "suspicious").text == \
        "⚠ suspicious: the patch reaches into the test runner (m.py: os._exit)"
    browser.save_screenshot(str(ARTIFACTS / "swe.png"))


def test_generate_output_and_the_api_page_through_samples(tmp_path):
    """generate.py's lines (no step, a tool-call count) open as step 0; /api/samples pages and filters by parsing
    only the chosen step's lines; a partly written last line waits for its end."""
    lines = [{"task_id": f"toy/{k}", "sample": 0, "completion": "x", "finish_reason": "stop" if k % 2 else "length",
              "completion_tokens": 3, "tool_calls": k} for k in range(7)]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"task_id": "to')
    app = board.Board.open([str(tmp_path)])
    assert app.api("/api/steps", 0, {}) == [[0, 7]]
    page = app.api("/api/samples", 0, {"step": "0", "finish": "stop", "offset": "1", "limit": "2"})
    assert page["total"] == 3 and [s["task_id"] for s in page["items"]] == ["toy/3", "toy/5"]
    assert page["items"][0]["tool_calls"] == 3 and page["finish_reasons"] == ["length", "stop"]
    with open(tmp_path / "samples.jsonl", "a") as f:
        f.write('y/7", "completion": "z"}\n')
    assert app.api("/api/steps", 0, {}) == [[0, 8]] and app.api("/api/sample", 0, {"id": "7"})["task_id"] == "toy/7"
    with pytest.raises(KeyError, match="no sample 8"):
        app.answer("/api/sample", {"id": "8"})
    status, _, _ = app.answer("/file", {"path": "../metrics.jsonl"})
    assert status == 404  # only sample_images/<hash>.<format> files are served
