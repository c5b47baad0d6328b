"""tests/swe_instances.py builds an instance from an empty cache folder. Django's sdist, committed whole, holds more
loose objects than git's gc.auto threshold: the commit used to start a background repack that raced the docker SDK
tarring the build context (FileNotFoundError in .git/objects, then no Django image at all on a fresh machine)."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import swe_instances  # noqa: E402
from test_swebench import docker_client, swe_rows  # noqa: E402,F401 -- fixtures

pytestmark = [pytest.mark.docker, pytest.mark.slow]


def test_django_instance_builds_from_an_empty_cache_without_git_maintenance(docker_client, swe_rows, tmp_path):
    """About 30 s: the sdist and wheels come from pip's own cache, the image layers from Docker's."""
    row = swe_instances.build_instance(docker_client, swe_instances.DJANGO_ROW, tmp_path, rebuild=True)
    shared = json.loads(swe_rows["django__django-11099"]["reward_model"]["ground_truth"])
    assert row["base_commit"] == shared["base_commit"]  # the same fixed-date commit as every other build
    # No maintenance can start in the agent's or the grader's repository either, and the tree is the commit.
    out = docker_client.containers.run(row["image"], ["bash", "-c", "cd /testbed && git config gc.auto && git config "
                                                      "maintenance.auto && git status --porcelain && git count-objects "
                                                      "-v | grep '^packs:'"], remove=True, network_disabled=True)
    assert out.decode().split() == ["0", "false", "packs:", "0"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("tmp")]  # the build context is gone
