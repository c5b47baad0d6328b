"""Judge client throughput against a local OpenAI-compatible server that answers every request after a fixed latency.

    python bench/judge_throughput.py [--latency-s 0.2 --concurrency 32 --questions 640]

1. `questions` distinct equivalence questions from `concurrency` threads: achieved / ideal throughput, where ideal is
   concurrency / latency (the server is never the bottleneck: a thread per request). Goal >= 0.9, nothing lost.
2. A burst: `burst` distinct questions (two waves of `concurrency`) asked at once, as a training step's rewards
   are, `bursts` times: to a fresh Judge each time (its start-up: threads, connections) and to part 1's warm one (a
   trainer's Judge lives across steps). Achieved / ideal per burst (ideal: the waves x latency), median, min and max.
   Goal >= 0.85.
3. A GRPO-like batch through rewards.score_batch: `prompts` vl_agent rows x `group` samples whose final answers repeat
   within a group (a few distinct answers each) while the reasoning differs: the accuracy questions hit the cache, the
   rubric questions (whole trajectories) do not. Prints the cache hit rate and achieved / ideal over the requests sent.
"""
import multiprocessing
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import tyro

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import judge as judge_lib  # noqa: E402
import rewards  # noqa: E402
from judge_server import make_handler, request_kind, serve  # noqa: E402


@dataclass
class Args:
    latency_s: float = 0.2
    """the server's reply latency"""
    concurrency: int = 32
    """judge requests in flight (Judge.max_concurrency and the callers' threads)"""
    questions: int = 640
    """distinct questions of part 1"""
    burst: int = 64
    """distinct questions of one burst in part 2"""
    bursts: int = 10
    """bursts of part 2, each on a fresh Judge and as many on a warm one"""
    prompts: int = 32
    """GRPO-like batch of part 2: prompts ..."""
    group: int = 8
    """... times samples per prompt"""
    answers_per_group: int = 3
    """distinct final answers within a group"""
    seed: int = 0


def slow_answer(latency_s: float):
    def answer(payload):
        time.sleep(latency_s)
        return "TRUE" if request_kind(payload) == "verdict" else "0.75"
    return answer


def run_server(latency_s: float, urls: multiprocessing.Queue) -> None:
    with serve(make_handler("bench", slow_answer(latency_s))) as url:
        urls.put(url)
        while True:
            time.sleep(3600)


def main(args: Args) -> dict:
    # The server runs in its own process, as a judge on another node would: it does not share the client's GIL.
    urls = multiprocessing.Queue()
    server = multiprocessing.Process(target=run_server, args=(args.latency_s, urls), daemon=True)
    server.start()
    try:
        return measure(args, urls.get(timeout=30))
    finally:
        server.terminate()


def measure(args: Args, url: str) -> dict:
    results = {}
    judge = judge_lib.Judge(url, max_concurrency=args.concurrency, timeout_s=30)
    ideal = args.concurrency / args.latency_s
    start = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        verdicts = list(pool.map(lambda i: judge.equivalent(f"question {i}", "red", f"answer {i}"),
                                 range(args.questions)))
    seconds = time.perf_counter() - start
    stats = judge.stats(reset=True)
    lost = sum(v.ok is not True for v in verdicts)
    results["distinct"] = {"requests": stats["requests"], "seconds": seconds, "per_s": args.questions / seconds,
                           "ideal_per_s": ideal, "achieved_over_ideal": args.questions / seconds / ideal,
                           "lost": lost, "latency_p50_s": judge_lib.metrics([stats])["judge/latency_p50_s"]}

    ideal_s = -(-args.burst // args.concurrency) * args.latency_s
    for part, fresh in (("burst_fresh", True), ("burst_warm", False)):  # a new Judge each burst, or part 1's
        ratios, lost = [], 0
        for b in range(args.bursts):
            client = judge_lib.Judge(url, max_concurrency=args.concurrency, timeout_s=30) if fresh else judge
            start = time.perf_counter()
            with ThreadPoolExecutor(args.burst) as pool:  # every question asked at once
                verdicts = list(pool.map(lambda i: client.equivalent(f"{part} {b} question {i}", "red", f"answer {i}"),
                                         range(args.burst)))
            ratios.append(ideal_s / (time.perf_counter() - start))
            lost += sum(v.ok is not True for v in verdicts)
            if fresh:
                client.close()
        ratios.sort()
        results[part] = {"questions": args.burst * args.bursts, "lost": lost, "median": ratios[len(ratios) // 2],
                         "min": ratios[0], "max": ratios[-1]}
    judge.stats(reset=True)

    rng = random.Random(args.seed)
    rows, completions = [], []
    for p in range(args.prompts):
        row = {"data_source": "vl_agent", "prompt": [{"role": "user", "content": f"What colour is thing {p}?"}],
               "ability": "vision", "reward_model": {"style": "judge", "ground_truth": "red"},
               "extra_info": {"index": p, "split": "train"}}
        candidates = [f"colour {p}.{k}" for k in range(args.answers_per_group)]
        for j in range(args.group):
            rows.append(row)
            completions.append(f"<think>attempt {j}: looked at it</think><answer>{rng.choice(candidates)}</answer>")
    start = time.perf_counter()
    scored = rewards.score_batch(rows, completions, judge=judge)
    seconds = time.perf_counter() - start
    stats = judge.stats(reset=True)
    judge.close()
    lost = sum(rewards.judge_failed(r.info) for r in scored)
    results["grpo_like"] = {"samples": len(rows), "calls": stats["calls"], "requests": stats["requests"],
                            "cache_hits": stats["cache_hits"], "cache_hit_rate": stats["cache_hits"] / stats["calls"],
                            "seconds": seconds, "achieved_over_ideal": stats["requests"] / seconds / ideal,
                            "lost": lost}
    for part, numbers in results.items():
        print(part + ": " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                      for k, v in numbers.items()))
    return results


if __name__ == "__main__":
    main(tyro.cli(Args))
