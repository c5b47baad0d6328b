"""Agent containers under load: N started at once on one daemon, a few tiny commands in each, then removed; and the
same N left behind by a trainer killed with SIGKILL, then swept.

For each N: start, exec and removal latency (p50 / p95 / max), failures by kind, Docker calls retried
(containers.docker_retries), wall time, and kiln containers left afterwards (must be 0). The kill round starts N
containers from a child process, SIGKILLs it once all run, then times containers.sweep and counts what is left.

    .venv/bin/python bench/swe_containers.py [--sizes 8 32 64 --execs 3 --image IMAGE]

Needs the Docker daemon and an instance image (default: the offline marshmallow-1359 one, swe_instances.py).
"""
from __future__ import annotations

import statistics
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import tyro

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import containers  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = ("git status --porcelain", "ls src", "python3 -c 'print(1)'")  # an agent's first, cheapest turns
KILLED_TRAINER = """import sys, time
from concurrent.futures import ThreadPoolExecutor
sys.path.insert(0, sys.argv[1])
import containers
client = containers.connect()
with ThreadPoolExecutor(int(sys.argv[3])) as pool:
    boxes = list(pool.map(lambda i: containers.Container(client, sys.argv[2], role="agent", run="bench-killed"),
                          range(int(sys.argv[3]))))
print("running", flush=True)
time.sleep(600)
"""


@dataclass
class Args:
    sizes: tuple[int, ...] = (8, 32, 64)
    """how many containers start at once, one round each"""
    execs: int = 3
    """tiny commands per container (cycling through COMMANDS)"""
    image: str = "kiln-swe/sweb.eval.x86_64.marshmallow-code_1776_marshmallow-1359:offline"
    """the instance image (agent containers run from its history-free copy, made before the rounds)"""
    kill: bool = True
    """also run the SIGKILL round at each size"""


def percentiles(values: list[float]) -> str:
    if not values:
        return "-"
    values = sorted(values)
    p95 = values[min(len(values) - 1, round(0.95 * (len(values) - 1)))]
    return f"{statistics.median(values):.2f} / {p95:.2f} / {values[-1]:.2f}"


def one_agent(client, image: str, execs: int) -> dict:
    """Start, `execs` commands, remove; latencies, or the failure's kind."""
    result = {"exec": []}
    try:
        begin = time.perf_counter()
        box = containers.Container(client, image, role="agent", run="bench")
        result["start"] = time.perf_counter() - begin
        try:
            for i in range(execs):
                begin = time.perf_counter()
                ran = box.exec(COMMANDS[i % len(COMMANDS)], timeout=120)
                result["exec"].append(time.perf_counter() - begin)
                if ran.exit_code != 0:
                    raise RuntimeError(f"exit {ran.exit_code}: {ran.output[-200:]}")
        finally:
            begin = time.perf_counter()
            box.remove()
            result["remove"] = time.perf_counter() - begin
    except Exception as e:  # counted by kind: the bench measures failures, it does not stop at the first
        result["failure"] = type(e).__name__
    return result


def left_behind(client, run: str) -> int:
    return len(client.containers.list(all=True, filters={"label": f"{containers.RUN}={run}"}))


def load_round(client, image: str, n: int, execs: int) -> str:
    retries = containers.docker_retries()
    begin = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(lambda _: one_agent(client, image, execs), range(n)))
    wall = time.perf_counter() - begin
    failures = Counter(r["failure"] for r in results if "failure" in r)
    after = containers.docker_retries()
    return (f"| {n} | {percentiles([r['start'] for r in results if 'start' in r])} | "
            f"{percentiles([t for r in results for t in r['exec']])} | "
            f"{percentiles([r['remove'] for r in results if 'remove' in r])} | "
            f"{sum(failures.values())}{' ' + str(dict(failures)) if failures else ''} | "
            f"{after['retries'] - retries['retries']} | {wall:.1f} | {left_behind(client, 'bench')} |")


def kill_round(client, image: str, n: int) -> str:
    child = subprocess.Popen([sys.executable, "-c", KILLED_TRAINER, str(ROOT), image, str(n)],
                             stdout=subprocess.PIPE, text=True)
    ready = child.stdout.readline().strip() == "running"
    running = left_behind(client, "bench-killed")
    child.kill()
    child.wait()
    begin = time.perf_counter()
    swept = len(containers.sweep(client))
    return (f"| {n} | {'yes' if ready else 'no'} | {running} | {swept} | {time.perf_counter() - begin:.1f} | "
            f"{left_behind(client, 'bench-killed')} |")


def main(args: Args) -> None:
    client = containers.connect()
    containers.sweep(client)
    begin = time.perf_counter()
    image = containers.history_free_image(client, args.image)
    print(f"history-free copy of {args.image}: {image} ({time.perf_counter() - begin:.1f} s, cached once made)")
    print(f"\n{args.execs} commands per container; seconds p50 / p95 / max\n")
    print("| N | start | exec | remove | failures | retries | wall s | left |\n|---|---|---|---|---|---|---|---|")
    for n in args.sizes:
        print(load_round(client, args.image, n, args.execs), flush=True)
    if args.kill:
        print("\ntrainer SIGKILLed with N agent containers running, then containers.sweep\n")
        print("| N | all started | running at kill | swept | sweep s | left |\n|---|---|---|---|---|---|")
        for n in args.sizes:
            print(kill_round(client, args.image, n), flush=True)


if __name__ == "__main__":
    main(tyro.cli(Args))
