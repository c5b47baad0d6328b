"""Seconds per SWE-bench grading: kiln's grader versus swebench's run_instance on the same instances, and throughput
with several gradings at once, as a rollout batch grades them.

Graders: `kiln` (swe_grading: fresh container with kiln's limits, git apply, eval script, swebench's log grading,
SIGKILL removal), `official` (swe_grading with SweConfig(official=True): swebench's run_instance with a unique run
id, logs in a temporary folder and kiln's SIGKILL removal) and `stock` (run_instance exactly as swebench's CLI runs
it: its `docker stop` + `docker rm` clean-up, ./logs under a temporary working folder). Each grades the gold patch
(resolves) and a no-op patch (applies, fixes nothing) of every instance; the verdicts must agree. Rounds alternate the
graders; medians are reported. Throughput: `--batch` gold gradings at concurrency 1 and `--concurrency`, per grader.

    .venv/bin/python bench/swe_grading.py [--rows runs/swe-instances/rows.parquet --rounds 3 --concurrency 4]

Needs the Docker daemon and the offline instances (`python swe_instances.py --out DIR`).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import tyro
from swebench.harness import run_evaluation

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import containers  # noqa: E402
import swe_grading  # noqa: E402
import task_rows  # noqa: E402

STOCK_CLEANUP = run_evaluation.cleanup_container  # before swe_grading's official grader replaces it
NOOP = b"diff --git a/NOTES.txt b/NOTES.txt\nnew file mode 100644\n--- /dev/null\n+++ b/NOTES.txt\n@@ -0,0 +1 @@\n+x\n"


@dataclass
class Args:
    rows: str = os.environ.get("KILN_SWE_DIR", "runs/swe-instances") + "/rows.parquet"
    """swebench rows whose images are on this Docker host"""
    rounds: int = 3
    """timed rounds per grader, patch and instance (alternating graders)"""
    concurrency: int = 4
    """gradings at once in the throughput part"""
    batch: int = 8
    """gold gradings per throughput measurement (instances in turn)"""
    parts: tuple[Literal["sequential", "throughput", "sigterm"], ...] = ("sequential", "throughput", "sigterm")
    """what to measure (sigterm: one instance on a retag of its image whose stop signal is SIGTERM, as in swebench's
    published images)"""


@contextlib.contextmanager
def stock_harness():
    """run_instance as swebench's CLI runs it, for the block: its own clean-up (`docker stop`, `docker rm`) and its
    ./logs/run_evaluation, under a throwaway folder. The official grader's settings come back afterwards."""
    saved = run_evaluation.cleanup_container, run_evaluation.RUN_EVALUATION_LOG_DIR
    with tempfile.TemporaryDirectory() as folder:
        run_evaluation.cleanup_container = STOCK_CLEANUP
        run_evaluation.RUN_EVALUATION_LOG_DIR = Path(folder) / "logs" / "run_evaluation"
        try:
            yield
        finally:
            run_evaluation.cleanup_container, run_evaluation.RUN_EVALUATION_LOG_DIR = saved


def stock_run_instance(truth: dict, patch: bytes, client) -> dict:
    """One stock run_instance (inside stock_harness) under a unique run id; the verdict fields of swe_grading's."""
    spec = swe_grading.spec_of(truth)
    _, report = run_evaluation.run_instance(spec, {"instance_id": spec.instance_id, "model_name_or_path": "m",
                                                   "model_patch": patch.decode()}, client,
                                            f"stock-{uuid.uuid4().hex[:12]}", timeout=1800)
    status = report[spec.instance_id]["tests_status"]
    return {"resolved": report[spec.instance_id]["resolved"],
            "f2p": [len(status["FAIL_TO_PASS"]["success"]), len(spec.FAIL_TO_PASS)],
            "p2p": [len(status["PASS_TO_PASS"]["success"]), len(spec.PASS_TO_PASS)]}


def grade(grader: str, truth: dict, patch: bytes, client) -> tuple[float, dict]:
    """(seconds, verdict {resolved, f2p, p2p}) of one grading."""
    start = time.perf_counter()
    if grader == "stock":
        verdict = stock_run_instance(truth, patch, client)
    else:
        info = swe_grading.swebench_reward(truth, patch, client,
                                           swe_grading.SweConfig(official=grader == "official")).info
        verdict = {"resolved": bool(info.get("resolved")), "f2p": info["f2p"], "p2p": info["p2p"]}
    return time.perf_counter() - start, verdict


GRADERS = ("kiln", "official", "stock")


def timed_grade(grader: str, truth: dict, patch: bytes, client) -> tuple[float, dict]:
    with stock_harness() if grader == "stock" else contextlib.nullcontext():
        return grade(grader, truth, patch, client)


def main(args: Args) -> dict:
    client = containers.connect()
    truths = [json.loads(row["reward_model"]["ground_truth"]) for row in task_rows.load_rows(args.rows)]
    result = {}
    if "sequential" in args.parts:
        result["median_s_per_grading"] = sequential(args, truths, client)
    if "throughput" in args.parts:
        result["gradings_per_s"] = throughput(args, truths, client)
    if "sigterm" in args.parts:
        result["sigterm_s"] = sigterm(truths[0], client)
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f} ({os.cpu_count()} cores)")
    return result


def sequential(args: Args, truths: list[dict], client) -> dict:
    graders = GRADERS
    seconds = {(g, t["instance_id"], p): [] for g in graders for t in truths for p in ("gold", "noop")}
    verdicts = {}
    for truth in truths:  # one untimed grading each: image layers and page cache warm for every grader alike
        grade("kiln", truth, truth["patch"].encode(), client)
    for r in range(args.rounds):
        for truth in truths:
            for name, patch in (("gold", truth["patch"].encode()), ("noop", NOOP)):
                for grader in graders[r % 3:] + graders[:r % 3]:
                    took, verdict = timed_grade(grader, truth, patch, client)
                    seconds[grader, truth["instance_id"], name].append(took)
                    verdicts.setdefault((truth["instance_id"], name), {})[grader] = verdict
    print(f"sequential, median of {args.rounds} rounds (seconds per grading)\n")
    print("| instance | patch | kiln | run_instance, kiln's clean-up | run_instance, stock | stock / kiln | verdicts |")
    print("|---|---|---:|---:|---:|---:|---|")
    for (instance, name), by_grader in verdicts.items():
        med = {g: statistics.median(seconds[g, instance, name]) for g in graders}
        agree = all(v == by_grader["kiln"] for v in by_grader.values())
        v = by_grader["kiln"]
        print(f"| {instance} | {name} | {med['kiln']:.2f} | {med['official']:.2f} | {med['stock']:.2f} | "
              f"{med['stock'] / med['kiln']:.2f}x | {'agree' if agree else 'DIFFER ' + json.dumps(by_grader)}: "
              f"resolved {v['resolved']}, F2P {v['f2p'][0]}/{v['f2p'][1]}, P2P {v['p2p'][0]}/{v['p2p'][1]} |")
    overall = {g: statistics.median([s for (gg, _, _), ss in seconds.items() if gg == g for s in ss]) for g in graders}
    print("\nmedian over all: " + ", ".join(f"{g} {s:.2f} s" for g, s in overall.items()))
    return overall


def throughput(args: Args, truths: list[dict], client) -> dict:
    graders, rates = GRADERS, {}

    print(f"\nthroughput: {args.batch} gold gradings (instances in turn)\n")
    print("| grader | concurrency | wall s | gradings/s |")
    print("|---|---:|---:|---:|")
    work = [truths[i % len(truths)] for i in range(args.batch)]
    for concurrency in (1, args.concurrency):
        for grader in graders:
            start = time.perf_counter()
            harness = stock_harness() if grader == "stock" else contextlib.nullcontext()
            with harness, ThreadPoolExecutor(concurrency) as pool:
                results = list(pool.map(lambda t: grade(grader, t, t["patch"].encode(), client)[1], work))
            wall = time.perf_counter() - start
            assert all(v["resolved"] for v in results), f"{grader}: a gold patch was not resolved"
            print(f"| {grader} | {concurrency} | {wall:.1f} | {args.batch / wall:.2f} |")
            rates[f"{grader}@{concurrency}"] = args.batch / wall
    return rates


def sigterm(truth: dict, client) -> dict:
    """The gold patch of one instance on a retag of its image with STOPSIGNAL SIGTERM, as swebench's published images
    have it: their PID 1 (`tail -f`, no init) ignores SIGTERM, so the stock clean-up's `docker stop` waits its 15 s."""
    tag = "kiln-swe/bench-sigterm:latest"
    client.images.build(fileobj=io.BytesIO(f"FROM {truth['image']}\nSTOPSIGNAL SIGTERM\n".encode()), tag=tag,
                        network_mode="none", forcerm=True)
    seconds = {}
    try:
        print(f"\n{truth['instance_id']}, gold, image with STOPSIGNAL SIGTERM (seconds, verdict)\n")
        for grader in GRADERS:
            took, verdict = timed_grade(grader, truth | {"image": tag}, truth["patch"].encode(), client)
            print(f"| {grader} | {took:.2f} | resolved {verdict['resolved']} |")
            seconds[grader] = took
    finally:
        client.images.remove(tag)
    return seconds


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(tyro.cli(Args))))
