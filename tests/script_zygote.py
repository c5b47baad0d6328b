"""The zygote behind script_runner.run: imports what kiln's command-line scripts import, once, then forks a child per
request that runs one script as `__main__` with its own argv, working directory, environment and stdout/stderr
files, and reports the child's exit status. One JSON request per stdin line; replies {"pid"} then {"returncode"}."""
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASE_PATH = sys.path[1:]  # the interpreter's own entries, after this script's directory
sys.path.insert(0, str(ROOT))

import data_prep  # noqa: E402,F401  the imports every script pays: done once, before any fork
import judge  # noqa: E402,F401
import merge  # noqa: E402,F401
import rewards  # noqa: E402,F401
from as_main import run_as_main  # noqa: E402


def run_child(request: dict) -> None:
    """In the forked child: become the script's process (stdin from /dev/null, stdout and stderr to the request's
    files) and run it; never returns."""
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    code = run_as_main(request["argv"], request["cwd"], request["env"], BASE_PATH)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            run_child(request)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    main()
