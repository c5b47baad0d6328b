"""swe_instances.py takes its rows from the repository (no file outside it), a file or the hub, and builds an instance
from an empty cache folder. Django's sdist, committed whole, holds more
loose objects than git's gc.auto threshold: the commit used to start a background repack that raced the docker SDK
tarring the build context (FileNotFoundError in .git/objects, then no Django image at all on a fresh machine)."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import swe_instances  # noqa: E402
from data_files import SWE_LITE_DEV  # noqa: E402
from test_swebench import docker_client, swe_rows  # noqa: E402,F401 -- fixtures

MARSHMALLOW = ["marshmallow-code__marshmallow-1343", "marshmallow-code__marshmallow-1359"]


def test_the_rows_come_from_the_repository_a_file_or_the_hub(tmp_path, monkeypatch):
    """A clean clone builds from the bundled rows (the default --source, inside the checkout); a file passed in is
    read; a missing file or instance, or an unreachable hub, is one clear error before anything is built."""
    assert Path(swe_instances.Args(out=tmp_path).source).resolve().parent == ROOT
    rows = swe_instances.source_rows(swe_instances.Args(out=tmp_path).source, "dev", MARSHMALLOW)
    assert sorted(rows) == MARSHMALLOW and all(rows[i]["FAIL_TO_PASS"] and rows[i]["patch"] for i in MARSHMALLOW)
    upstream = {r["instance_id"]: r for r in json.loads(SWE_LITE_DEV.read_text())}  # the rows' source file
    assert all(rows[i] == upstream[i] for i in MARSHMALLOW)
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(rows[i]) + "\n" for i in MARSHMALLOW))
    assert swe_instances.source_rows(str(tmp_path / "rows.jsonl"), "dev", MARSHMALLOW[:1]) == {
        MARSHMALLOW[0]: rows[MARSHMALLOW[0]]}
    with pytest.raises(ValueError, match=r"--source .*/nope.json: no such file"):
        swe_instances.source_rows(str(tmp_path / "nope.json"), "dev", MARSHMALLOW)
    with pytest.raises(ValueError, match=r"no row for astropy__astropy-1"):
        swe_instances.source_rows(str(tmp_path / "rows.jsonl"), "dev", ["astropy__astropy-1"])
    # a hub name goes to task_rows' hub reader (tests/test_data_prep.py), with --split
    monkeypatch.setattr(swe_instances.task_rows, "hub_records", lambda name, split: [
        rows[MARSHMALLOW[1]] | {"FAIL_TO_PASS": json.dumps(rows[MARSHMALLOW[1]]["FAIL_TO_PASS"])}] if (
            name, split) == ("SWE-bench/SWE-bench_Lite", "dev") else [])
    assert list(swe_instances.source_rows("SWE-bench/SWE-bench_Lite", "dev", MARSHMALLOW[1:])) == MARSHMALLOW[1:]


@pytest.mark.docker
@pytest.mark.slow
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
