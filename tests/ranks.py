"""`torchrun(...)`: the command line of a real torchrun launch whose ranks fork from a zygote that has already
imported kiln's trainers (rank_zygote.py; torchrun starts rank_stub.py, which asks the zygote for the rank). A fresh
rank pays those imports (torch, transformers, FSDP, swebench, wandb) before any work: about 12 s of CPU each on
2 cores, two ranks per launch and some thirty launches in the suite. The zygote pays them once per test worker.
torchrun itself, its rendezvous, the process groups, signals, exit codes and output are all the real ones."""
import atexit
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
_zygote: subprocess.Popen | None = None


def _started() -> str:
    """The socket of this process's zygote, started on first use; $KILN_RANK_ZYGOTE names it for the stubs."""
    global _zygote
    if _zygote is None or _zygote.poll() is not None:
        path = str(Path(tempfile.mkdtemp(prefix="kiln-ranks-"), "zygote.sock"))
        _zygote = subprocess.Popen([sys.executable, "-u", str(HERE / "rank_zygote.py"), path], stdin=subprocess.PIPE)
        atexit.register(_zygote.stdin.close)  # its loop ends with its stdin
        while not os.path.exists(path):
            if _zygote.poll() is not None:
                raise RuntimeError(f"rank_zygote.py exited with status {_zygote.returncode} before listening")
            time.sleep(0.05)
        os.environ["KILN_RANK_ZYGOTE"] = path
    return os.environ["KILN_RANK_ZYGOTE"]


def torchrun(nproc: int, script, *args, standalone: bool = True) -> list[str]:
    """`python -m torch.distributed.run [--standalone] --nproc-per-node NPROC SCRIPT ARGS`, ranks from the zygote.
    Its environment must carry $KILN_RANK_ZYGOTE (os.environ does once this returns); without it each rank is a
    fresh `python -u SCRIPT`."""
    _started()
    return [sys.executable, "-m", "torch.distributed.run", *(["--standalone"] if standalone else []),
            f"--nproc-per-node={nproc}", str(HERE / "rank_stub.py"), str(script), *map(str, args)]


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, children first (from /proc/PID/task/TID/children)."""
    found, frontier = [], [pid]
    while frontier:
        children = []
        for tasks in frontier:
            for listing in Path(f"/proc/{tasks}/task").glob("*/children"):
                try:
                    children += map(int, listing.read_text().split())
                except OSError:
                    pass  # exited meanwhile
        found += children
        frontier = children
    return found


def kill(launch: subprocess.Popen) -> None:
    """SIGKILL a torchrun launch and its ranks at once, as a machine that dies would. Killing torchrun's process group
    is not enough: torchrun starts each rank in a session of its own, and a rank whose torchrun is gone trains on.
    (Here a rank is rank_stub.py's process, and its forked rank dies with it.)"""
    for pid in [launch.pid, *descendants(launch.pid)]:
        with contextlib.suppress(ProcessLookupError):  # exited meanwhile
            os.kill(pid, signal.SIGKILL)
    launch.wait()
