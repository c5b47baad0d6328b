"""ranks.torchrun, the launcher of the suite's 2-rank runs: its ranks fork from a zygote with the trainers' imports
done, and must still look like fresh ranks to torchrun, to the script and to a test that kills them."""
import os
import subprocess
import sys
import time
from pathlib import Path

import ranks

PROBE = r"""
import json, os, sys, time
sys.stdout.write(json.dumps({"rank": os.environ["RANK"], "argv": sys.argv[1:], "cwd": os.getcwd(),
                             "path0": sys.path[0], "preimported": "transformers" in sys.modules}) + "\n")  # one write
if sys.argv[1] == "fail" and os.environ["RANK"] == "1":
    raise SystemExit(3)
if sys.argv[1] == "hang":
    open(f"pid.{os.environ['RANK']}", "w").write(str(os.getpid()))
    time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_ranks_run_the_script_as_fresh_ranks_would(tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    run = subprocess.run(ranks.torchrun(2, "probe.py", "ok", "two words"), cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = sorted(run.stdout.splitlines())
    assert [line.count('"preimported": true') for line in lines] == [1, 1]  # forked from the zygote
    for rank, line in enumerate(lines):
        assert f'"rank": "{rank}", "argv": ["ok", "two words"], "cwd": "{tmp_path}", "path0": "{tmp_path}"' in line
    failed = subprocess.run(ranks.torchrun(2, "probe.py", "fail"), cwd=tmp_path, capture_output=True, text=True,
                            timeout=300)
    assert failed.returncode != 0 and "exitcode  : 3" in failed.stderr, failed.stderr[-2000:]


def test_killing_the_launch_kills_its_ranks(tmp_path):
    """ranks.kill (a crash of the whole job, in the kill-and-resume tests) leaves no rank running; a SIGKILL to
    torchrun's process group alone would leave them."""
    (tmp_path / "probe.py").write_text(PROBE)
    launch = subprocess.Popen(ranks.torchrun(2, "probe.py", "hang"), cwd=tmp_path, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    pid_files = [tmp_path / "pid.0", tmp_path / "pid.1"]
    deadline = time.monotonic() + 120
    while not all(p.exists() and p.read_text() for p in pid_files) and time.monotonic() < deadline:
        time.sleep(0.1)
    pids = [int(p.read_text()) for p in pid_files]
    assert all(alive(pid) for pid in pids) and launch.poll() is None
    ranks.kill(launch)
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in pids)


def test_without_a_zygote_the_stub_is_a_fresh_interpreter(tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    env = {k: v for k, v in os.environ.items() if k != "KILN_RANK_ZYGOTE"} | {"RANK": "0"}
    run = subprocess.run([sys.executable, str(ranks.HERE / "rank_stub.py"), "probe.py", "ok"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and '"preimported": false' in run.stdout, run.stderr[-2000:]
