"""`run_as_main`: what `python SCRIPT ARGS` does with a script, in a process forked from a zygote that has already
imported the script's modules (script_zygote.py for the command-line tests, rank_zygote.py for torchrun ranks)."""
import os
import runpy
import signal
import sys
import traceback
from pathlib import Path


def run_as_main(argv: list[str], cwd: str, env: dict, base_path: list[str]) -> int:
    """Take `cwd` and `env`, the argv and `sys.path` a fresh `python argv[0] ...` would start with (`base_path`: the
    interpreter's own entries), run argv[0] as `__main__` and return the exit status the interpreter would give it.
    An uncaught KeyboardInterrupt prints its traceback and kills this process with SIGINT, as the interpreter does."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    script = str(Path(cwd, argv[0]))
    sys.argv = [script, *argv[1:]]
    pythonpath = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    sys.path[:] = [str(Path(script).parent), *pythonpath, *base_path]
    try:
        runpy.run_path(script, run_name="__main__")
    except KeyboardInterrupt:
        traceback.print_exc()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        return e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:  # what the interpreter does with an uncaught exception
        traceback.print_exc()
        return 1
    return 0
