"""`run`: subprocess.run for `[sys.executable, "some_script.py", ...]`, each script still its own process (exit
status, stdout and stderr as the shell sees them), forked from a zygote (script_zygote.py) that has already imported
what kiln's scripts import. A fresh interpreter pays those imports (torch, transformers, swebench, wandb) for every
command-line test, several seconds each on 2 cores; the zygote pays them once per test worker. Anything else, and
a command that is not a Python script, goes to subprocess.run."""
import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ZYGOTE = Path(__file__).resolve().parent / "script_zygote.py"
_zygote: subprocess.Popen | None = None


def _started() -> subprocess.Popen:
    global _zygote
    if _zygote is None or _zygote.poll() is not None:
        _zygote = subprocess.Popen([sys.executable, str(ZYGOTE)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   text=True)
        atexit.register(_zygote.stdin.close)  # its loop ends with its stdin
    return _zygote


def _reply(zygote: subprocess.Popen, timeout: float | None) -> dict | None:
    if not select.select([zygote.stdout], [], [], timeout)[0]:
        return None
    line = zygote.stdout.readline()
    if not line:
        raise RuntimeError(f"{ZYGOTE.name} exited with status {zygote.wait()}")
    return json.loads(line)


def run(args: list, *, capture_output: bool = False, text: bool = False, timeout: float | None = None,
        cwd=None, env: dict | None = None, check: bool = False) -> subprocess.CompletedProcess:
    args = [str(a) for a in args]
    if args[0] != sys.executable or not args[1].endswith(".py"):
        return subprocess.run(args, capture_output=capture_output, text=text, timeout=timeout, cwd=cwd, env=env,
                              check=check)
    zygote = _started()
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        request = {"argv": args[1:], "cwd": str(cwd or os.getcwd()), "stdout": str(out), "stderr": str(err),
                   "env": dict(env if env is not None else os.environ)}
        zygote.stdin.write(json.dumps(request) + "\n")
        zygote.stdin.flush()
        pid = _reply(zygote, None)["pid"]
        done = _reply(zygote, timeout)
        if done is None:
            os.kill(pid, signal.SIGKILL)
            _reply(zygote, None)
            raise subprocess.TimeoutExpired(args, timeout, out.read_bytes(), err.read_bytes())
        stdout, stderr = out.read_bytes(), err.read_bytes()
    if text:
        stdout, stderr = stdout.decode(), stderr.decode()
    if not capture_output:  # as subprocess.run: the output goes where the caller's goes
        sys.stdout.write(stdout if text else stdout.decode(errors="replace"))
        sys.stderr.write(stderr if text else stderr.decode(errors="replace"))
        stdout = stderr = None
    result = subprocess.CompletedProcess(args, done["returncode"], stdout, stderr)
    if check:
        result.check_returncode()
    return result
