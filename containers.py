"""Docker containers for agent trajectories and SWE-bench grading, through the docker SDK.

One fresh container per trajectory (and one per grading) from an instance image: no network, a cpu quota, a memory
limit without swap, a pids limit and a sized tmpfs /tmp. Every container carries kiln labels (owner pid and host, an
expiry time), its PID 1 is `sleep TTL` with auto-remove, and `sweep()` at start-up removes the containers of kiln
processes that died, so nothing outlives a killed trainer. Every command runs under `timeout -s KILL` with its output
capped (head and tail kept); files go in and out as tar archives; containers end with `remove(force=True)` (SIGKILL),
never `stop` (15 s when PID 1 ignores SIGTERM).

This is its own module, not part of sandbox.py: sandbox's zygote runs `python -I -S` without site-packages, and the
docker SDK lives there.
"""
from __future__ import annotations

import atexit
import functools
import io
import os
import signal
import socket
import sys
import tarfile
import time
from dataclasses import dataclass

import docker
import docker.errors
import requests.exceptions

OWNER = "kiln.owner"  # on every kiln container: "<hostname>:<pid>" of the process that started it
RUN = "kiln.run"
ROLE = "kiln.role"  # "agent" or "grade"
EXPIRES = "kiln.expires"  # unix time after which any sweep removes the container
# The SDK's HTTP read timeout bounds every API call, exec included: it must exceed the longest command timeout.
API_TIMEOUT = 3900
# The wrapper every command runs in: $1 = seconds, $2 = output cap in bytes, $3 = the command. `timeout` leads its own
# process group, which is SIGKILLed when the time is up and again when the command ends, so nothing a command starts
# (background jobs, a fork bomb) outlives it; the killing loop uses bash builtins only, since a fork bomb may hold
# every pid the container has. Output goes to a file on the tmpfs (bounded by its size); more than CAP bytes keep their
# first and last CAP/2 and say how much was cut.
GUARD = r"""out=$(mktemp /tmp/.kiln.XXXXXX)
timeout -s KILL "$1" bash -c "$3" </dev/null >"$out" 2>&1 &
group=$!
wait $group
rc=$?
for ((i = 0; i < 100; i++)); do kill -9 -- -$group 2>/dev/null || break; done
size=$(stat -c %s "$out")
if [ "$size" -gt "$2" ]; then
  half=$(($2 / 2))
  head -c "$half" "$out"; printf '\n[... %s bytes cut ...]\n' $((size - 2 * half)); tail -c "$half" "$out"
  echo truncated >&2
else
  cat "$out"
fi
rm -f "$out"
exit $rc"""


class DockerUnavailable(RuntimeError):
    """The Docker daemon cannot be reached: an infrastructure error, never a model's failure."""


class ImageMissing(RuntimeError):
    """The instance image is not on this Docker host."""


class DiffError(RuntimeError):
    """An agent's container yields no usable diff (its repository broken, changes over the cap): the agent's doing."""


@dataclass(frozen=True)
class ContainerLimits:
    cpus: float = 1.0
    """CPU quota in cores"""
    memory: str = "2g"
    """memory limit (swap is not allowed beyond it)"""
    pids: int = 512
    """most processes and threads at once (stops fork bombs)"""
    tmpfs: str = "512m"
    """size of the tmpfs mounted at /tmp (command output is staged there)"""
    ttl: int = 3600
    """seconds the container lives at most, even if kiln is killed (PID 1 is `sleep ttl`, auto-removed)"""
    timeout: float = 60.0
    """default per-command wall seconds before SIGKILL"""
    output_cap: int = 100_000
    """default most bytes of a command's output returned (head and tail kept)"""


@dataclass
class ExecResult:
    exit_code: int
    output: str
    """stdout and stderr interleaved, capped"""
    timed_out: bool
    truncated: bool


def connect() -> docker.DockerClient:
    """A client for the daemon that DOCKER_HOST (or the default socket) names; DockerUnavailable if none answers."""
    try:
        client = docker.from_env(timeout=API_TIMEOUT, max_pool_size=64)  # a rank's tool calls run at once
        client.ping()
    except (docker.errors.DockerException, requests.exceptions.RequestException) as e:
        raise DockerUnavailable(f"cannot reach the Docker daemon ({type(e).__name__}: {e}); start dockerd, or set "
                                "DOCKER_HOST to a reachable one") from e
    return client


@functools.cache
def shared_client() -> docker.DockerClient:
    """One client per process for the agents' containers (connect()'s checks, once)."""
    return connect()


def owner_label() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def sweep(client: docker.DockerClient) -> list[str]:
    """Remove kiln containers left behind: those started on this host by a process that is gone, and those past
    their expiry wherever they came from. Containers of live kiln processes stay. Returns the removed names."""
    host, removed = socket.gethostname(), []
    for container in client.containers.list(all=True, filters={"label": OWNER}):
        labels = container.labels
        owner_host, _, pid = labels.get(OWNER, "").rpartition(":")
        expired = float(labels.get(EXPIRES, "inf")) < time.time()
        orphaned = owner_host == host and pid.isdigit() and not _alive(int(pid))
        if expired or orphaned:
            force_remove(container)
            removed.append(container.name)
    return removed


def remove_owned(client: docker.DockerClient) -> list[str]:
    """Remove every container this process started (on exit, Ctrl-C included). Returns the removed names."""
    removed = []
    for container in client.containers.list(all=True, filters={"label": f"{OWNER}={owner_label()}"}):
        force_remove(container)
        removed.append(container.name)
    return removed


def remove_owned_at_exit(client: docker.DockerClient) -> None:
    """remove_owned when this process exits: normally, on an exception, on Ctrl-C and on SIGTERM (what torchrun sends
    its workers when the launcher is interrupted; it is turned into SystemExit so exit handlers run). SIGKILL leaves
    them to their TTL and the next start's sweep."""
    atexit.register(remove_owned, client)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def missing_images(client: docker.DockerClient, images) -> list[str]:
    """The names among `images` that are not on this Docker host, sorted."""
    return sorted(set(images) - {tag for image in client.images.list() for tag in image.tags})


def force_remove(container) -> None:
    """SIGKILL and delete; no error if it is gone or going already (auto-remove at its TTL)."""
    try:
        container.remove(force=True)
    except docker.errors.NotFound:
        pass
    except docker.errors.APIError as e:
        if "already in progress" not in str(e):
            raise


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Container:
    """One running container from `image`; use as a context manager so it is removed even on exceptions."""

    def __init__(self, client: docker.DockerClient, image: str, role: str, run: str = "",
                 limits: ContainerLimits = ContainerLimits(), workdir: str = "/testbed"):
        try:
            client.images.get(image)
        except docker.errors.ImageNotFound:
            raise ImageMissing(f"image {image!r} is not on this Docker host; `docker load` it (or build the offline "
                               "test instances with tests/swe_instances.py)") from None
        self.limits, self.workdir = limits, workdir
        labels = {OWNER: owner_label(), RUN: run, ROLE: role, EXPIRES: str(int(time.time() + limits.ttl))}
        self._container = client.containers.run(
            image, ["sleep", str(limits.ttl)], detach=True, auto_remove=True, init=True, network_mode="none",
            nano_cpus=int(limits.cpus * 1e9), mem_limit=limits.memory, memswap_limit=limits.memory,
            pids_limit=limits.pids, tmpfs={"/tmp": f"size={limits.tmpfs}"}, working_dir=workdir, labels=labels)

    @property
    def name(self) -> str:
        return self._container.name

    def exec(self, command: str, timeout: float | None = None, cap: int | None = None,
             workdir: str | None = None) -> ExecResult:
        """Run `command` with bash, SIGKILLed after `timeout` seconds, output capped; whatever it started in the
        background is killed when it ends (only files persist between commands)."""
        timeout = self.limits.timeout if timeout is None else timeout
        cap = self.limits.output_cap if cap is None else cap
        if not 0 < timeout < API_TIMEOUT - 60:
            raise ValueError(f"command timeout {timeout}s must be in (0, {API_TIMEOUT - 60})")
        start = time.monotonic()
        exit_code, (out, err) = self._container.exec_run(
            ["bash", "-c", GUARD, "guard", str(timeout), str(cap), command], demux=True,
            workdir=workdir or self.workdir)
        # 137 is SIGKILL: the timeout's when the full time has passed, otherwise the kernel's (out of memory)
        timed_out = exit_code == 137 and time.monotonic() - start >= timeout
        return ExecResult(exit_code, (out or b"").decode(errors="replace"), timed_out=timed_out,
                          truncated=b"truncated" in (err or b""))

    def put_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Write `data` to the absolute `path` in the container (its directory must exist, and not be the tmpfs /tmp:
        archives go to the container's own filesystem, beneath any tmpfs mounted over it)."""
        if path == "/tmp" or path.startswith("/tmp/"):
            raise ValueError(f"{path}: files cannot be copied into the tmpfs /tmp; use another directory")
        directory, _, name = path.rpartition("/")
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), mode, int(time.time())
            tar.addfile(info, io.BytesIO(data))
        if not self._container.put_archive(directory or "/", buffer.getvalue()):
            raise OSError(f"{self.name}: could not write {path}")

    def get_file(self, path: str) -> bytes:
        """The bytes of the regular file at `path` in the container (not under the tmpfs /tmp; see put_file)."""
        stream, _ = self._container.get_archive(path)
        with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
            member = tar.next()
            if member is None or not member.isfile():
                raise OSError(f"{self.name}: {path} is not a regular file")
            return tar.extractfile(member).read()

    def remove(self) -> None:
        """SIGKILL and delete, never `stop` (it waits for PID 1 to exit)."""
        force_remove(self._container)

    def __enter__(self) -> Container:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def container_diff(container: Container, base_commit: str, max_bytes: int = 20_000_000) -> bytes:
    """Everything the agent changed in /testbed since `base_commit`, new and binary files included, as a git diff
    (external diff drivers and textconv off, so repository config cannot rewrite it). DiffError when git fails or
    the diff is over `max_bytes`."""
    result = container.exec(f"git add -A && git diff --cached --binary --no-ext-diff --no-textconv {base_commit} "
                            "> /kiln.diff && stat -c %s /kiln.diff", timeout=120, cap=4000)
    if result.exit_code != 0:
        raise DiffError(f"git diff in {container.name} failed ({result.exit_code}): {result.output[-500:]}")
    size = int(result.output.split()[-1])
    if size > max_bytes:
        raise DiffError(f"the diff is {size} bytes, over the {max_bytes} allowed")
    return container.get_file("/kiln.diff")
