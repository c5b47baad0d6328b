"""Test-session settings shared by every test file."""

# `make test` runs two workers a file at a time (pytest-xdist --dist loadfile), handed out in collection order: the
# longest files go first, so that no long file starts last and runs alone while the other worker idles. Their order
# is by the durations of a `make test` run on 2 cores (bench/RESULTS.md); files not listed keep pytest's order.
LONGEST_FIRST = ["test_demo.py", "test_swebench.py", "test_grpo.py", "test_swe_agent.py", "test_policy.py",
                 "test_ppo.py", "test_vision_grpo.py", "test_qwen_code.py", "test_swe_instances.py"]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable: the rest stay in order
