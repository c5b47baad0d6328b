"""The zygote behind ranks.torchrun: imports what kiln's trainers import, once, then forks one child per torchrun rank
(tests/rank_stub.py asks for it over a Unix socket). The child takes the stub's stdin, stdout and stderr, its
working directory, environment, argv and SIGINT disposition, runs the script as `__main__` and exits the way the
interpreter would, atexit handlers included. It kills itself when its stub dies, however it dies (a pipe whose other
end only the stub holds). The zygote reports each child's exit status to its stub and exits when its stdin closes.

    python tests/rank_zygote.py SOCKET_PATH"""
import json
import os
import select
import signal
import socket
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASE_PATH = sys.path[1:]  # the interpreter's own entries, after this script's directory
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import train_grpo  # noqa: E402,F401  the imports every rank pays: done once, before any fork
import train_ppo  # noqa: E402,F401
import train_sft  # noqa: E402,F401
from as_main import run_as_main  # noqa: E402

MAX_FDS = 4  # the stub's stdin, stdout, stderr and the read end of its life pipe


def receive(conn: socket.socket) -> tuple[dict, list[int]]:
    """One request: a JSON line, with the stub's file descriptors attached to its first bytes."""
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, MAX_FDS)
    while not data.endswith(b"\n"):
        more = conn.recv(1 << 16)
        if not more:
            raise ConnectionError("the stub closed its connection mid-request")
        data += more
    return json.loads(data), fds


def die_with(alive: int) -> None:
    """Block until the stub's end of the pipe closes (it never writes), then die as the stub did."""
    os.read(alive, 1)
    os.kill(os.getpid(), signal.SIGKILL)


def become_rank(request: dict, fds: list[int]) -> None:
    """In the forked child: take the stub's place and run its script; exits through SystemExit, never returns."""
    stdin, stdout, stderr, alive = fds
    for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
        os.close(fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN if request["sigint_ignored"] else signal.default_int_handler)
    if "OMP_NUM_THREADS" in request["env"]:  # read by a fresh interpreter's torch at import, here set by hand
        torch.set_num_threads(int(request["env"]["OMP_NUM_THREADS"]))
    threading.Thread(target=die_with, args=(alive,), daemon=True).start()
    raise SystemExit(run_as_main(request["argv"], request["cwd"], request["env"], BASE_PATH))


def serve(path: str) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    children: dict[int, socket.socket] = {}  # pid -> the connection of its stub
    while True:
        readable, _, _ = select.select([listener, sys.stdin], [], [], 0.1)
        if sys.stdin in readable and not sys.stdin.readline():
            return
        if listener in readable:
            conn, _ = listener.accept()
            request, fds = receive(conn)
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in children.values():
                    other.close()
                conn.close()
                become_rank(request, fds)
            for fd in fds:
                os.close(fd)
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            children[pid] = conn
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid)
            try:
                conn.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            except OSError:
                pass  # its stub is gone: nobody waits for this status
            conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
