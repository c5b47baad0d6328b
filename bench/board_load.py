"""The run board's first view on a large run: synthesize a run of `records` rich sample records (as --rich-samples
writes them: tokens, their text, loss mask, both logprobs, a tool call with an image, messages) and `steps` lines of
metrics, start board.py's server, and time what a browser asks for when the page opens. Goal: first view < 2 s.

    python bench/board_load.py [--records 10000 --tokens 256 --steps 1000 --browser]

1. curves: the requests of the Curves tab (/api/runs, /api/status, /api/keys, /api/series of the default charts), on
   a server that has read nothing yet.
2. samples: the requests of the Samples tab (/api/steps: the offset index of samples.jsonl, built here; /api/samples:
   the summaries of the newest step, the only records parsed; /api/sample: one whole record).
3. with --browser (Debian chromium + chromium-driver): page load to the Curves tab drawn, and to the sample list shown.
"""
import io
import json
import random
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import tyro
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import board  # noqa: E402
import sample_files  # noqa: E402


@dataclass
class Args:
    records: int = 10000
    """sample records in samples.jsonl"""
    tokens: int = 256
    """completion tokens per record"""
    per_step: int = 256
    """records per sampled step (prompts x group size)"""
    steps: int = 1000
    """lines of metrics.jsonl"""
    browser: bool = False
    """also time the page in headless chromium"""
    repeats: int = 3
    """timed repetitions (each on a fresh server); the median is printed"""


def synthesize(run: Path, args: Args) -> None:
    rng = random.Random(0)
    buf = io.BytesIO()
    Image.new("RGB", (28, 28), "red").save(buf, format="PNG")
    image = buf.getvalue()
    name = sample_files.image_name(image)
    (run / sample_files.IMAGES_DIR).mkdir(parents=True)
    (run / sample_files.IMAGES_DIR / name).write_bytes(image)
    path = f"{sample_files.IMAGES_DIR}/{name}"
    with open(run / "samples.jsonl", "w") as f:
        for n in range(args.records):
            mask = [1] * (args.tokens // 2) + [0] * 20 + [1] * (args.tokens - args.tokens // 2 - 20)
            engine = [round(-rng.random() * 3, 6) if m else 0.0 for m in mask]
            record = {"step": 10 * (n // args.per_step + 1), "task_id": f"toy/{n // 8}",
                      "reward": rng.choice([0.0, 1.0]),
                      "completion": "x" * 400, "error": None, "data_source": "toy", "group": n // 8,
                      "shaped_reward": 0.0, "advantage": rng.gauss(0, 1), "finish_reason": "stop",
                      "info": {"passed": 1, "total": 2, "format": 1.0, "turns": 2, "tool_calls": 1},
                      "messages": [{"role": "user", "content": "Write f." * 20},
                                   {"role": "assistant", "content": "<tool_call>...</tool_call>"},
                                   {"role": "tool", "content": [{"type": "text", "text": "ok"},
                                                                {"type": "image", "image": path}]},
                                   {"role": "assistant", "content": "x" * 300}],
                      "images": [path], "prompt_tokens": 120, "prompt_images": 0,
                      "token_ids": [rng.randrange(1000) for _ in mask], "token_text": ["tok"] * len(mask),
                      "loss_mask": mask, "engine_logprobs": engine,
                      "trainer_logprobs": [round(e + rng.gauss(0, 1e-3), 6) if e else 0.0 for e in engine],
                      "tool_calls": [{"turn": 1, "name": "python", "arguments": {"code": "image.show()"},
                                      "output": "ok", "error": False, "seconds": 0.1, "images": [path]}]}
            f.write(json.dumps(record) + "\n")
    keys = ["critic/score/mean", "critic/score/toy/mean", "actor/entropy", "actor/pg_clipfrac", "actor/ppo_kl",
            "mismatch/engine_abs", "response_length/mean", "tools/calls_mean", "tools/errors_mean",
            "timing_s/rollout", "timing_s/update", "timing_s/reward", "actor/pg_loss", "actor/grad_norm"]
    with open(run / "metrics.jsonl", "w") as f:
        for step in range(1, args.steps + 1):
            f.write(json.dumps({k: rng.random() for k in keys} | {"step": step, "timestamp": time.time()}) + "\n")


def get(base: str, path: str) -> bytes:
    with urllib.request.urlopen(base + path) as response:
        return response.read()


def timed_views(run: Path) -> tuple[float, float]:
    """Seconds for the Curves tab's requests and for the Samples tab's, on a fresh server."""
    server = board.serve(board.Board.open([str(run)]), "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        start = time.perf_counter()
        get(base, "/")
        get(base, "/api/runs")
        get(base, "/api/status")
        keys = json.loads(get(base, "/api/keys?run=0"))
        get(base, "/api/series?run=0&keys=" + ",".join(keys))
        curves = time.perf_counter() - start
        start = time.perf_counter()
        steps = json.loads(get(base, "/api/steps?run=0"))
        page = json.loads(get(base, f"/api/samples?run=0&step={steps[-1][0]}&limit=50"))
        get(base, f"/api/sample?run=0&id={page['items'][0]['id']}")
        samples = time.perf_counter() - start
    finally:
        server.shutdown()
        server.server_close()
    return curves, samples


def browser_views(run: Path) -> tuple[float, float]:
    """Seconds from page load to the Curves tab drawn, and from a click on Samples to the list shown, in headless
    chromium."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.ui import WebDriverWait
    server = board.serve(board.Board.open([str(run)]), "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)
    try:
        start = time.perf_counter()
        driver.get(f"http://127.0.0.1:{server.server_address[1]}/")
        WebDriverWait(driver, 60).until(lambda d: d.execute_script("return document.body.dataset.ready"))
        curves = time.perf_counter() - start
        start = time.perf_counter()
        driver.find_element("id", "tab-samples").click()
        WebDriverWait(driver, 60).until(lambda d: d.execute_script(
            "return document.querySelectorAll('.sample-item').length > 0"))
        samples = time.perf_counter() - start
    finally:
        driver.quit()
        server.shutdown()
        server.server_close()
    return curves, samples


def main(args: Args) -> None:
    with tempfile.TemporaryDirectory(prefix="kiln-board-") as tmp:
        run = Path(tmp)
        start = time.perf_counter()
        synthesize(run, args)
        size = (run / "samples.jsonl").stat().st_size
        print(f"synthesized {args.records} records ({size / 2**20:.0f} MiB, {size / args.records / 1024:.1f} KiB each) "
              f"and {args.steps} metrics lines in {time.perf_counter() - start:.1f}s")
        views = sorted(timed_views(run) for _ in range(args.repeats))
        curves = sorted(c for c, _ in views)[len(views) // 2]
        samples = sorted(s for _, s in views)[len(views) // 2]
        print(f"HTTP, fresh server, median of {args.repeats}: curves first view {curves:.3f}s, "
              f"samples first view {samples:.3f}s (goal < 2 s each)")
        if args.browser:  # the first try also starts chromium cold: every try is printed
            tries = [browser_views(run) for _ in range(args.repeats)]
            print("headless chromium, page to curves drawn: " + ", ".join(f"{c:.2f}s" for c, _ in tries)
                  + "; click to the sample list: " + ", ".join(f"{s:.2f}s" for _, s in tries))


if __name__ == "__main__":
    main(tyro.cli(Args))
