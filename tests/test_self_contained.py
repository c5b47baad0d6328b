"""A plain clone runs its own suite: every file the tests read lies inside the checkout, as tests/data/SHA256SUMS
lists it, no code climbs out of the repository, and a missing system part is named with the command that brings it
in (a skip here, a failure under CI=true)."""
import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import system_parts
from data_files import DATA

REPO = Path(__file__).resolve().parent.parent
# Code that may name a path: product scripts, benches, tests, the CI and build files.
CODE = sorted([*REPO.glob("*.py"), *REPO.glob("bench/*.py"), *REPO.glob("tests/*.py"), *REPO.glob("tests/vllm/*.py"),
               *REPO.glob("*.sh"), REPO / "Makefile", REPO / ".ci" / "run"])
CLIMBS = (r"\b(ROOT|REPO)\.parent\b", r"""["']\.\./""", r"/work/shared", r"""["']shared["']\s*/""")
# Climbing paths that are inputs a test refuses, not paths anything reads: file -> the one expected match.
REFUSED_INPUTS = {"tests/test_board.py": "\"../"}  # the board must not serve ../metrics.jsonl


def levels_up(source: str) -> list[int]:
    """How far each `Path(__file__)` chain in `source` climbs: `.parent` counts 1, `.parents[n]` counts n + 1."""
    climbs = []
    for chain in re.findall(r"Path\(__file__\)\.resolve\(\)((?:\.parent\b|\.parents\[\d+\])+)", source):
        climbs.append(sum(1 if step == ".parent" else int(step[9:-1]) + 1
                          for step in re.findall(r"\.parents\[\d+\]|\.parent\b", chain)))
    return climbs


def test_every_fixture_matches_its_checksum_and_none_is_unlisted():
    listed = dict(line.split("  ", 1)[::-1] for line in (DATA / "SHA256SUMS").read_text().splitlines())
    present = {str(p.relative_to(DATA)) for p in DATA.rglob("*") if p.is_file()} - {"README.md", "SHA256SUMS"}
    assert set(listed) == present and len(present) == 24
    assert {name: hashlib.sha256((DATA / name).read_bytes()).hexdigest() for name in listed} == listed
    assert all(name.split("/")[0] in (DATA / "README.md").read_text() for name in listed)  # each source is named


def test_no_code_climbs_out_of_the_repository():
    offenders = []
    for path in CODE:
        if path == Path(__file__).resolve():  # its patterns, not paths
            continue
        name, source = str(path.relative_to(REPO)), path.read_text()
        depth = len(path.relative_to(REPO).parts) - 1  # folders between the file and the repository root
        offenders += [f"{name}: Path(__file__) climbs {climb} folders" for climb in levels_up(source)
                      if climb > depth + 1]  # the file's own folder is one .parent
        for pattern in CLIMBS:
            for match in re.finditer(pattern, source):
                if REFUSED_INPUTS.get(name) != match.group(0):
                    offenders.append(f"{name}:{source.count(chr(10), 0, match.start()) + 1}: {match.group(0)!r}")
    assert offenders == []


def test_the_scan_sees_a_climb():
    """The scan above would catch what issue 44 found: data read from a folder beside the checkout."""
    beside = "A = Path(__file__).resolve()" + ".parent" * 2 + " / 'sha' 'red'"  # built, so it is no climb itself
    assert levels_up(beside) == [2]
    assert levels_up("B = Path(__file__).resolve().parents[2]") == [3]
    assert levels_up("C = Path(__file__).resolve().parent") == [1]


def test_a_missing_part_is_one_line_naming_it_and_the_command(tmp_path):
    (tmp_path / "test_needs_docker.py").write_text(
        "import system_parts\n"
        "def test_a():\n    system_parts.require('docker', 'no daemon at unix:///nowhere')\n"
        "def test_b():\n    system_parts.require('docker', 'no daemon at unix:///nowhere')\n"
        "def test_c():\n    pass\n")
    env = dict(os.environ, PYTHONPATH=str(REPO / "tests"))
    env.pop("CI", None)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider", "-p", "no:xdist",
               str(tmp_path)]
    skipped = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert skipped.returncode == 0, skipped.stdout[-2000:]
    summary = [line for line in skipped.stdout.splitlines() if line.startswith("skipped 2 tests for lack of")]
    assert summary == [f"skipped 2 tests for lack of {system_parts.PARTS['docker']}: run `make system`"]

    failed = subprocess.run(command, cwd=tmp_path, env=env | {"CI": "true"}, capture_output=True, text=True,
                            timeout=120)
    assert failed.returncode == 1 and "2 failed, 1 passed" in failed.stdout, failed.stdout[-2000:]
    assert "CI=true and missing system part docker: no daemon at unix:///nowhere" in failed.stdout
