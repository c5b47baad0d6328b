"""What torchrun starts for each rank under ranks.torchrun: `rank_stub.py SCRIPT ARGS...` has the rank zygote
(tests/rank_zygote.py, at $KILN_RANK_ZYGOTE) fork a process that runs SCRIPT with this process's stdin, stdout,
stderr, working directory, environment and argv. It forwards the signals torchrun sends, and exits with the rank's
status (dying of the same signal), so torchrun sees its rank. Without a zygote it becomes `python -u SCRIPT ARGS`.
Standard library only: this interpreter starts in milliseconds."""
import json
import os
import signal
import socket
import sys

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def main() -> int:
    path = os.environ.get("KILN_RANK_ZYGOTE", "")
    if not os.path.exists(path):
        os.execv(sys.executable, [sys.executable, "-u", *sys.argv[1:]])
    alive, held = os.pipe()  # the rank dies when `held` closes: when this process exits, SIGKILL included
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    request = {"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ),
               "sigint_ignored": signal.getsignal(signal.SIGINT) is signal.SIG_IGN}
    socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [0, 1, 2, alive])
    os.close(alive)
    replies = conn.makefile("rb")
    pid = json.loads(replies.readline())["pid"]
    for sig in FORWARDED:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, lambda received, _: os.kill(pid, received))
    line = replies.readline()
    if not line:
        print(f"rank_stub: the rank zygote closed the connection before rank {pid} exited", file=sys.stderr)
        return 1
    code = json.loads(line)["returncode"]
    if code < 0:  # the rank died of a signal: so does this process
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    sys.exit(main())
