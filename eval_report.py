"""Evaluation reports: pass@k, the mean test pass rate and its five bands (the APPS pipeline's view), overall, by
data source and by difficulty; as metrics, a markdown table, a band histogram and the trainers' eval_report files.

`report` reads each graded sample's score and info (rewards.Reward, or anything with those two attributes).
"""
from __future__ import annotations

import json
import statistics
from collections import Counter, defaultdict
from math import comb
from pathlib import Path

from matplotlib.figure import Figure


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): 1 - C(n-c, k) / C(n, k) for n samples of which c pass."""
    return 1.0 if n - c < k else 1.0 - comb(n - c, k) / comb(n, k)


# The APPS pipeline's bands of a sample's test pass rate: [0, 0.2) very poor, [0.2, 0.4) poor, ... [0.8, 1] excellent.
BANDS = ("very_poor", "poor", "fair", "good", "excellent")
BAND_LABELS = ("0.0-0.2 very poor", "0.2-0.4 poor", "0.4-0.6 fair", "0.6-0.8 good", "0.8-1.0 excellent")
DIFFICULTY_ORDER = {"introductory": 0, "interview": 1, "competition": 2, "easy": 0, "medium": 1, "hard": 2}


def test_pass_rate(reward) -> float | None:
    """passed tests / total tests of a graded sample; 0.0 for a completion without a program (no test passed); None
    for a reward not counted in tests (it is left out of the pass-rate view, which says how many samples it rates)."""
    if reward.info.get("total"):
        return reward.info["passed"] / reward.info["total"]
    return 0.0 if reward.info.get("error") == "no_code" else None


def band(rate: float) -> int:
    """The index in BANDS of a test pass rate (the epsilon keeps 3/5 = 0.6 in "good" whatever its rounding)."""
    return min(len(BANDS) - 1, int(rate * len(BANDS) + 1e-9))


def report_groups(row: dict) -> list[str]:
    """The groups a row is reported in: all, its data source, and <data source>/<difficulty> when it has one."""
    difficulty = row.get("extra_info", {}).get("difficulty")
    return ["all", row["data_source"]] + ([f"{row['data_source']}/{difficulty}"] if difficulty is not None else [])


def group_order(group: str) -> tuple:
    """Sort key of report groups: all first, then each data source followed by its difficulties, easiest first."""
    return (group != "all", group.split("/")[0], "/" in group, DIFFICULTY_ORDER.get(group.split("/")[-1], 3), group)


def report(rows_by_id: dict[str, dict], task_ids: list[str], rewards: list) -> dict:
    """pass@k for every k the samples allow (k <= the fewest samples of any task), overall, by data source and by
    difficulty ("pass"); the same groups' mean test pass rate and band counts and fractions, over their samples
    ("tests", groups with no sample counted in tests left out); mean reward; counts of error categories."""
    per_task, rates = defaultdict(list), defaultdict(list)
    for task_id, reward in zip(task_ids, rewards):
        per_task[task_id].append(reward.score >= 1.0)
        rate = test_pass_rate(reward)
        for group in report_groups(rows_by_id[task_id]):
            rates[group].append(rate)
    groups = defaultdict(list)
    for task_id, passes in per_task.items():
        for group in report_groups(rows_by_id[task_id]):
            groups[group].append(passes)
    fewest = min(len(p) for p in per_task.values())
    ks = sorted({k for k in (1, 2, 4, 5, 8, 10, 16, 20, 32, 50, 64, 100) if k <= fewest} | {fewest})
    table = {}
    for name, tasks in groups.items():
        table[name] = {"tasks": len(tasks)} | {
            f"pass@{k}": sum(pass_at_k(len(p), sum(p), k) for p in tasks) / len(tasks) for k in ks}
    tests = {name: pass_rate_bands(group_rates) for name, group_rates in rates.items()
             if any(r is not None for r in group_rates)}
    return {"pass": table, "tests": tests, "mean_reward": sum(r.score for r in rewards) / len(rewards),
            "samples": len(rewards),
            "errors": dict(Counter(r.info.get("error") for r in rewards if r.info.get("error")))}


def pass_rate_bands(rates: list[float | None]) -> dict:
    """Samples, samples counted in tests ("rated"), their mean test pass rate, and per band its count and fraction."""
    rated = [r for r in rates if r is not None]
    counts = Counter(band(r) for r in rated)
    return {"samples": len(rates), "rated": len(rated), "test_pass_rate": statistics.fmean(rated),
            "bands": {name: {"count": counts[i], "fraction": counts[i] / len(rated)} for i, name in enumerate(BANDS)}}


def report_metrics(summary: dict) -> dict:
    """A `report` as flat metrics (verl's val-core/val-aux families): val-core/<group>/pass@k and /test_pass_rate,
    val-core/all/reward/mean; val-aux/<group>/tasks, val-aux/<group>/band/<band> and val-aux/error/<kind>
    (fractions)."""
    metrics = {f"val-{'aux' if k == 'tasks' else 'core'}/{group}/{k}": v
               for group, table in summary["pass"].items() for k, v in table.items()}
    for group, tests in summary.get("tests", {}).items():
        metrics[f"val-core/{group}/test_pass_rate"] = tests["test_pass_rate"]
        metrics |= {f"val-aux/{group}/band/{name}": b["fraction"] for name, b in tests["bands"].items()}
    metrics["val-core/all/reward/mean"] = summary["mean_reward"]
    return metrics | {f"val-aux/error/{kind}": n / summary["samples"] for kind, n in summary["errors"].items()}


def report_markdown(summary: dict, title: str = "") -> str:
    """A `report` as one markdown table: per group its tasks, pass@k, mean test pass rate and band counts (fraction)."""
    ks = sorted({k for row in summary["pass"].values() for k in row if k.startswith("pass@")}, key=lambda k: int(k[5:]))
    lines = [f"# {title}", ""] if title else []
    lines += ["| group | tasks | " + " | ".join(ks) + " | samples | test pass rate | " + " | ".join(BAND_LABELS) + " |",
              "|---|---:|" + "---:|" * (len(ks) + 2 + len(BANDS))]
    for group in sorted(summary["pass"], key=group_order):
        row, tests = summary["pass"][group], summary.get("tests", {}).get(group)
        cells = [group, str(row["tasks"])] + [f"{row[k]:.3f}" for k in ks]
        if tests is None:
            cells += ["-"] * (2 + len(BANDS))
        else:
            rated = "" if tests["rated"] == tests["samples"] else f" ({tests['rated']} in tests)"
            cells += [f"{tests['samples']}{rated}", f"{tests['test_pass_rate']:.3f}"]
            cells += [count_and_fraction(b) for b in tests["bands"].values()]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"mean reward {summary['mean_reward']:.3f} over {summary['samples']} samples; errors: "
              + (", ".join(f"{k} {v}" for k, v in sorted(summary["errors"].items())) or "none")]
    return "\n".join(lines) + "\n"


def count_and_fraction(band_entry: dict) -> str:
    return f"{band_entry['count']} ({band_entry['fraction']:.0%})"


def plot_report(summary: dict, png, title: str = "") -> Path:
    """The band histogram of test pass rates: one panel for all samples, then one per difficulty (per data source
    when no row has a difficulty and there are several sources); bars are fractions, labelled with counts."""
    groups = sorted(summary["tests"], key=group_order)
    if "all" not in groups:
        raise ValueError("no sample of this report is counted in tests: there is no test pass rate to plot")
    difficulties = [g for g in groups if "/" in g]
    sources = [g for g in groups if g != "all" and "/" not in g]
    panels = ["all"] + (difficulties or (sources if len(sources) > 1 else []))
    fig = Figure(figsize=(2.8 * len(panels) + 0.6, 3.6))  # no pyplot: nothing to display, no backend to pick
    axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
    for ax, group in zip(axes, panels):
        tests = summary["tests"][group]
        bars = ax.bar(range(len(BANDS)), [b["fraction"] for b in tests["bands"].values()],
                      color=["#c0392b", "#e67e22", "#f1c40f", "#7fb800", "#1e8449"])
        ax.bar_label(bars, labels=[str(b["count"]) for b in tests["bands"].values()], fontsize=8)
        ax.set_xticks(range(len(BANDS)), [label.replace(" ", "\n", 1) for label in BAND_LABELS], fontsize=7)
        ax.set_title(f"{group}\n{tests['rated']} samples, mean {tests['test_pass_rate']:.2f}", fontsize=9)
        ax.set_ylim(0, 1.1)
    axes[0].set_ylabel("fraction of samples")
    fig.suptitle(title or "test pass rate (passed / total tests)", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    return Path(png)


def write_eval_report(out_dir, evals: list[dict], best: dict, eval_data: str) -> None:
    """A trainer's evaluations in out_dir: eval_report.json (each eval's `report` and step; the best step),
    eval_report.md (pass@1 by group per eval step, difficulties in APPS order, then the last evaluation's full table)
    and eval_report.png (the last evaluation's band histogram per difficulty, when its rewards count tests)."""
    out, last = Path(out_dir), evals[-1]
    (out / "eval_report.json").write_text(json.dumps({"best": best, "evals": evals}, indent=1))
    groups = sorted(last["pass"], key=group_order)
    kept = f"best policy (kept in best/): step {best['step']}" if best else "no best policy kept"
    lines = [f"# pass@1 on {eval_data}; {kept}", "",
             "| step | " + " | ".join(f"{g} ({last['pass'][g]['tasks']})" for g in groups) + " | reward |",
             "|---:|" + "---:|" * (len(groups) + 1)]
    for e in evals:
        cells = [f"{e['pass'][g]['pass@1']:.3f}" if g in e["pass"] else "-" for g in groups]
        mark = " (best)" if best and e["step"] == best["step"] else ""
        lines.append(f"| {e['step']}{mark} | " + " | ".join(cells) + f" | {e['mean_reward']:.3f} |")
    lines += ["", report_markdown(last, f"Step {last['step']} (the last evaluation)").replace("# ", "## ", 1)]
    (out / "eval_report.md").write_text("\n".join(lines))
    if last.get("tests"):
        plot_report(last, out / "eval_report.png", f"{eval_data}, step {last['step']}: test pass rate (passed / total "
                    "tests)")


def print_report(summary: dict) -> None:
    ks = sorted({k for row in summary["pass"].values() for k in row if k.startswith("pass@")},
                key=lambda k: int(k[5:]))
    print(f"{'group':<28}{'tasks':>7}" + "".join(f"{k:>10}" for k in ks))
    for name, row in sorted(summary["pass"].items(), key=lambda kv: group_order(kv[0])):
        print(f"{name:<28}{row['tasks']:>7}" + "".join(f"{row[k]:>10.3f}" for k in ks))
    if summary["tests"]:
        print(f"\n{'group':<28}{'samples':>8}{'pass rate':>10}"
              + "".join(f"{name.replace('_', ' '):>12}" for name in BANDS)
              + "   (bands of passed / total tests: " + ", ".join(label.split()[0] for label in BAND_LABELS) + ")")
    for name, tests in sorted(summary["tests"].items(), key=lambda kv: group_order(kv[0])):
        print(f"{name:<28}{tests['rated']:>8}{tests['test_pass_rate']:>10.3f}"
              + "".join(f"{count_and_fraction(b):>12}" for b in tests["bands"].values()))
    if "swe" in summary:
        print("swebench: " + ", ".join(f"{k.removeprefix('swe/')} {v:.3g}" for k, v in summary["swe"].items()))
    print(f"mean reward {summary['mean_reward']:.3f}; errors: "
          + (", ".join(f"{k} {v}" for k, v in sorted(summary["errors"].items())) or "none"))
    print(f"{summary['samples']} samples in {summary['seconds']:.1f}s ({summary['samples_per_s']:.1f}/s)")
