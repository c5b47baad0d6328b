"""Agent containers at scale on one daemon: N trajectories at once, each taking its container from a
containers.ContainerPool, running a few tiny commands and removing it; with the pool filled ahead (what the trainer does
for the next step while a step trains) and without (each trajectory waits for its own start).

Per round: time from "the trajectory starts" to "its first tool call is answered" (p50 / p95), the later commands'
latency, how long filling the pool took, failures by kind, Docker calls retried, the live-container peak and cap,
the daemon's memory (dockerd + containerd, and all containerd shims, peak RSS), the host's load average, and the kiln
containers left afterwards (must be 0). `--via exec` runs the commands as `docker exec` instead of through the
containers' shell (the comparison behind the shell). Ends with one line `RESULT {json}`.

    .venv/bin/python bench/swe_containers.py                       # N = 64, 128, 256, with and without the pool
    .venv/bin/python bench/swe_containers.py --sizes 8 --pool-only  # a quick look

Needs the Docker daemon and an instance image (default: the offline marshmallow-1359 one, swe_instances.py).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import tyro

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import containers  # noqa: E402

# The first call is `pwd`: what it measures is the fleet (the container's start or the pool, the way in), not the
# command's own CPU; the later ones are an agent's first, cheapest turns.
COMMANDS = ("pwd", "git status --porcelain", "ls src", "python3 -c 'print(1)'")
RUN = "bench"  # the kiln.run label of the bench's containers


@dataclass
class Args:
    sizes: tuple[int, ...] = (64, 128, 256)
    """how many trajectories start at once, one round (or two: without and with the pool) each"""
    pool_only: bool = False
    """skip the rounds without the pool"""
    execs: int = 4
    """tiny commands per trajectory (cycling through COMMANDS); the first is the one timed from the start"""
    image: str = "kiln-swe/sweb.eval.x86_64.marshmallow-code_1776_marshmallow-1359:offline"
    """the instance image (agent containers run from its history-free copy, made before the rounds)"""
    max_live: int = 0
    """the pool's live-container cap (0: containers.host_live_cap(), what a trainer uses)"""
    max_starting: int = 8
    """the pool's starts in flight at once"""
    via: Literal["shell", "exec"] = "shell"
    """how commands reach the container: its long-lived shell, or one `docker exec` each"""


def quantiles(values: list[float]) -> tuple[float, float]:
    """p50 and p95 (nearest rank), None for none."""
    if not values:
        return None, None
    values = sorted(values)
    return statistics.median(values), values[min(len(values) - 1, round(0.95 * (len(values) - 1)))]


def rss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:  # the process ended while it was read: it holds no memory now
            pass
    return total / 1024


def daemon_pids() -> tuple[list[int], list[int]]:
    """(dockerd and its containerd, every containerd shim) on this host."""
    daemon, shims = [], []
    for status in Path("/proc").glob("[0-9]*/comm"):
        try:
            name = status.read_text().strip()
        except OSError:
            continue
        pid = int(status.parent.name)
        if name in ("dockerd", "containerd"):
            daemon.append(pid)
        elif name.startswith("containerd-shim"):
            shims.append(pid)
    return daemon, shims


class MemoryPeak:
    """The daemon's and the shims' peak RSS while it runs, sampled every half second."""

    def __init__(self):
        self.daemon = self.shims = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            daemon, shims = daemon_pids()
            self.daemon, self.shims = max(self.daemon, rss_mb(daemon)), max(self.shims, rss_mb(shims))
            self._stop.wait(0.5)

    def __enter__(self) -> MemoryPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def trajectory(pool: containers.ContainerPool, image: str, execs: int, limits: containers.ContainerLimits) -> dict:
    """Take a container, run `execs` commands, remove it: seconds to the first answer, the later commands', or the
    failure's kind."""
    result = {"later": []}
    begin = time.perf_counter()
    try:
        box = pool.take(image, RUN, limits)
        try:
            for i in range(execs):
                start = time.perf_counter()
                ran = box.exec(COMMANDS[i % len(COMMANDS)])
                if ran.exit_code != 0:
                    raise RuntimeError(f"exit {ran.exit_code}: {ran.output[-200:]}")
                if i == 0:
                    result["first_call"] = time.perf_counter() - begin
                else:
                    result["later"].append(time.perf_counter() - start)
        finally:
            box.remove()
    except Exception as e:  # counted by kind: the bench measures failures, it does not stop at the first
        result["failure"] = f"{type(e).__name__}: {str(e)[:120]}"
    return result


def one_round(client, args: Args, n: int, use_pool: bool) -> dict:
    limits = containers.ContainerLimits(timeout=120)
    pool = containers.ContainerPool(client, containers.PoolLimits(args.max_live, args.max_starting),
                                    shell=args.via == "shell")
    retries, load = containers.docker_retries()["retries"], os.getloadavg()[0]
    with MemoryPeak() as memory:
        fill = None
        if use_pool:  # what the trainer does while the previous step trains
            begin = time.perf_counter()
            futures = pool.prestart([(args.image, RUN)] * n, limits)
            while sum(future.done() for future in futures) < min(n, pool.max_live):  # past the cap they wait for
                time.sleep(0.05)  # trajectories to end
            fill = time.perf_counter() - begin
        begin = time.perf_counter()
        with ThreadPoolExecutor(n) as threads:
            results = list(threads.map(lambda _: trajectory(pool, args.image, args.execs, limits), range(n)))
        wall = time.perf_counter() - begin
    pool.close()
    failures = Counter(r["failure"] for r in results if "failure" in r)
    first = quantiles([r["first_call"] for r in results if "first_call" in r])
    later = quantiles([t for r in results for t in r["later"]])
    metrics = pool.metrics()
    return {"n": n, "pool": use_pool, "via": args.via, "first_call_p50_s": first[0], "first_call_p95_s": first[1],
            "later_call_p50_s": later[0], "later_call_p95_s": later[1], "pool_fill_s": fill, "wall_s": wall,
            "failures": sum(failures.values()), "failure_kinds": dict(failures),
            "retries": containers.docker_retries()["retries"] - retries, "live_peak": metrics["swe/pool_live_peak"],
            "live_cap": pool.max_live, "queue_wait_max_s": metrics["swe/pool_queue_wait_max_s"],
            "daemon_rss_mb": round(memory.daemon), "shims_rss_mb": round(memory.shims), "load_1m": load,
            "leftover": len(client.containers.list(all=True, filters={"label": f"{containers.RUN}={RUN}"}))}


def cpu_model() -> str:
    lines = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("Model name")), "?")


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main(args: Args) -> None:
    client = containers.connect()
    containers.sweep(client)
    containers.remove_owned_at_exit(client)  # an interrupted bench leaves nothing either
    begin = time.perf_counter()
    image = containers.history_free_image(client, args.image)
    print(f"history-free copy of {args.image}: {image} ({time.perf_counter() - begin:.1f} s, cached once made)")
    print(f"{cpu_model()}, {len(os.sched_getaffinity(0))} cores; commands via {args.via}; {args.execs} per trajectory; "
          "seconds\n")
    print("| N | pool | first call p50 / p95 | later calls p50 / p95 | pool fill | wall | failures | retries | "
          "live peak / cap | dockerd+containerd MB | shims MB | load 1m | left |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    rounds = []
    for n in args.sizes:
        for use_pool in ([True] if args.pool_only else [False, True]):
            row = one_round(client, args, n, use_pool)
            rounds.append(row)
            print(f"| {n} | {'yes' if use_pool else 'no'} | {seconds(row['first_call_p50_s'])} / "
                  f"{seconds(row['first_call_p95_s'])} | {seconds(row['later_call_p50_s'])} / "
                  f"{seconds(row['later_call_p95_s'])} | {seconds(row['pool_fill_s'])} | {row['wall_s']:.1f} | "
                  f"{row['failures']}{' ' + json.dumps(row['failure_kinds']) if row['failures'] else ''} | "
                  f"{row['retries']} | {row['live_peak']:.0f} / {row['live_cap']} | {row['daemon_rss_mb']} | "
                  f"{row['shims_rss_mb']} | {row['load_1m']:.1f} | {row['leftover']} |", flush=True)
    print("RESULT " + json.dumps({"rounds": rounds, "cpu": cpu_model(), "cores": len(os.sched_getaffinity(0))}))


if __name__ == "__main__":
    main(tyro.cli(Args))
