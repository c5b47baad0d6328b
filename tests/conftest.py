"""Test-session settings shared by every test file."""
import os

import system_parts

# Nothing a test runs reaches the Hugging Face hub (tests/fake_hub.py stands in for it where a test needs one): the
# hub libraries refuse the network at once instead of timing out.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# `make test` runs three workers on two cores. PyTorch sizes its intra-op pool to the machine's cores, so the workers
# training in-process would run two spinning OpenMP threads each; one thread each keeps the cores busy without that
# contention (subprocesses such as torchrun ranks inherit it).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# The workers take a file at a time (pytest-xdist --dist loadfile --no-loadscope-reorder), handed out in collection
# order: the longest files go first, so that no long file starts last and runs alone while the other workers idle.
# Their order is by the durations of a `make test` run on 2 cores (bench/RESULTS.md); files not listed keep pytest's
# order.
LONGEST_FIRST = ["test_demo.py", "test_demo_agent.py", "test_swebench.py", "test_swe_agent.py", "test_swe_instances.py",
                 "test_ppo.py", "test_grpo.py", "test_mini_swe_agent.py", "test_harness_in_container.py", "test_policy.py",
                 "test_agent_server.py", "test_reward_grading.py", "test_readme.py", "test_adversarial.py",
                 "test_data_prep.py"]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable: the rest stay in order


def pytest_terminal_summary(terminalreporter):
    """One line per missing system part (tests/system_parts.py): what it skipped and the command that brings it in."""
    reasons = [report.longrepr[2] for report in terminalreporter.stats.get("skipped", [])
               if isinstance(report.longrepr, tuple)]
    for line in system_parts.summary_lines(reasons):
        terminalreporter.write_line(line, yellow=True, bold=True)
