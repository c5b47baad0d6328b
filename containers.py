"""Docker containers for agent trajectories and SWE-bench grading, through the docker SDK.

One fresh container per trajectory (and one per grading) from an instance image: no network, a cpu quota, a memory
limit without swap, a pids limit and a sized tmpfs /tmp. Every container carries kiln labels (owner pid and host, an
expiry time), its PID 1 is `sleep TTL` with auto-remove, and `sweep()` at start-up removes the containers of kiln
processes that died, so nothing outlives a killed trainer. Every command runs under `timeout -s KILL` with its output
capped (head and tail kept); files go in and out as tar archives; containers end with `remove(force=True)` (SIGKILL),
never `stop` (15 s when PID 1 ignores SIGTERM).

Agents never see a repository's future: an agent container runs from a history-free copy of the instance image
(`history_free_image`, made once per image), whose /testbed/.git holds only what HEAD reaches. Under load the daemon
answers with timeouts, 5xx and conflicts: idempotent calls (inspect, list, archives, removal) are retried by urllib3
inside the SDK's HTTP adapter, and starting a container and creating an exec by an explicit loop with urllib3's
backoff; every retry is counted (`docker_retries`), and a container that cannot start after them raises
ContainerStartFailed.

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
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass

import docker
import docker.errors
import requests.exceptions
from urllib3.exceptions import MaxRetryError
from urllib3.util.retry import Retry

OWNER = "kiln.owner"  # on every kiln container: "<hostname>:<pid>" of the process that started it
RUN = "kiln.run"
ROLE = "kiln.role"  # "agent" or "grade"
EXPIRES = "kiln.expires"  # unix time after which any sweep removes the container
START = "kiln.start"  # unique per Container: what a failed start attempt left behind is found and removed by it
HISTORY_FREE_OF = "kiln.history_free_of"  # on a history-free image: the image it was made from
HISTORY_FREE_REPO = "kiln-history-free"
# What dockerd answers under load (SkyRL#9, rllm#269): a timeout, a dropped connection, a 5xx, a conflict (409) or an
# unprocessable request (422) that the same call, a little later, does not meet again.
TRANSIENT_STATUS = (409, 422, 500, 502, 503, 504)
# Idempotent calls, inside the SDK's HTTP adapter (urllib3 retries neither POST nor the 409 a second removal answers).
ADAPTER_RETRY = dict(total=6, connect=6, read=2, status=6, backoff_factor=0.25, backoff_max=8.0, backoff_jitter=0.25,
                     status_forcelist=(500, 502, 503, 504), raise_on_status=False)
# Starts and exec creation, by retry_transient: 8 tries over about 30 s before ContainerStartFailed.
CALL_RETRY = Retry(total=7, other=7, connect=7, read=7, backoff_factor=0.5, backoff_max=10.0, backoff_jitter=0.5)
# Everything but HEAD's history goes: other refs, remotes, tags, stashes, reflogs, ORIG_HEAD/FETCH_HEAD and the other
# files git keeps beside them, alternates, grafts, commit graphs, and then every object HEAD does not reach. fsck then
# must find nothing unreachable. A container without /testbed/.git has nothing to scrub.
SCRUB_HISTORY = r"""set -eu
cd /testbed 2>/dev/null && [ -d .git ] || exit 0
branch=$(git symbolic-ref -q HEAD || true)
git rev-parse -q --verify 'HEAD^{commit}' >/dev/null
for remote in $(git remote); do git remote remove "$remote"; done
git for-each-ref --format='%(refname)' | while read -r ref; do
  [ "$ref" = "$branch" ] || git update-ref --no-deref -d "$ref"
done
if [ -s .git/objects/info/alternates ]; then git repack -a -d -q && rm -f .git/objects/info/alternates; fi
rm -rf .git/objects/pack/*.keep .git/objects/pack/multi-pack-index .git/objects/info/commit-graph   .git/objects/info/commit-graphs .git/info/grafts .git/info/refs
find .git -mindepth 1 -maxdepth 1 ! -name HEAD ! -name config ! -name description ! -name hooks ! -name index   ! -name info ! -name objects ! -name packed-refs ! -name refs ! -name shallow -exec rm -rf {} +
git -c gc.reflogExpire=now -c gc.reflogExpireUnreachable=now -c gc.rerereResolved=now -c gc.rerereUnresolved=now   gc -q --prune=now
left=$(git fsck --connectivity-only --unreachable --no-reflogs --no-progress 2>&1)
[ -z "$left" ] || { echo "after the scrub: $left" | head -5; exit 1; }"""
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
# GUARD for a command whose output the command itself must not read or rewrite (a grading's tests, which run the
# code under test): no file, the output goes straight to the exec's stream and is capped by the reader, outside.
GUARD_DIRECT = r"""timeout -s KILL "$1" bash -c "$2" </dev/null 2>&1 &
group=$!
wait $group
rc=$?
for ((i = 0; i < 100; i++)); do kill -9 -- -$group 2>/dev/null || break; done
exit $rc"""
# Seconds a direct exec's stream may stay open after its command ended (a process that left its process group still
# holding the output): then it is cut off.
DIRECT_GRACE = 5.0


class DockerUnavailable(RuntimeError):
    """The Docker daemon cannot be reached: an infrastructure error, never a model's failure."""


class ImageMissing(RuntimeError):
    """The instance image is not on this Docker host."""


class ContainerStartFailed(RuntimeError):
    """The daemon would not start a container, even after retries: an infrastructure failure, never the agent's."""


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
        for adapter in client.api.adapters.values():
            adapter.max_retries = CountedRetry(**ADAPTER_RETRY)
        client.ping()
    except (docker.errors.DockerException, requests.exceptions.RequestException) as e:
        raise DockerUnavailable(f"cannot reach the Docker daemon ({type(e).__name__}: {e}); start dockerd, or set "
                                "DOCKER_HOST to a reachable one") from e
    return client


@functools.cache
def shared_client() -> docker.DockerClient:
    """One client per process for the agents' containers (connect()'s checks, once)."""
    return connect()


class CountedRetry(Retry):
    """urllib3's Retry, each retry it grants counted in docker_retries."""

    def increment(self, *args, **kwargs) -> Retry:
        retry = super().increment(*args, **kwargs)  # raises when the retries are used up
        _count("retries")
        return retry


_STATS, _STATS_LOCK = {"retries": 0, "start_failures": 0}, threading.Lock()


def _count(what: str) -> None:
    with _STATS_LOCK:
        _STATS[what] += 1


def docker_retries() -> dict:
    """This process's Docker calls retried so far ("retries") and containers that never started ("start_failures")."""
    with _STATS_LOCK:
        return dict(_STATS)


def transient(error: BaseException) -> bool:
    """Whether a Docker error is one a later try may not meet: a timeout, a lost connection, TRANSIENT_STATUS."""
    if isinstance(error, docker.errors.APIError) and not isinstance(error, docker.errors.NotFound):
        return error.status_code in TRANSIENT_STATUS
    return isinstance(error, (requests.exceptions.ConnectionError, requests.exceptions.Timeout))


def retry_transient(call, what: str, undo=None, on_retry=None):
    """call(), tried again after transient errors with urllib3's backoff (CALL_RETRY), each retry counted (and
    on_retry() called); `undo()` cleans up after every failed try. The last error is raised once the tries are used
    up."""
    retry = CALL_RETRY
    while True:
        try:
            return call()
        except (docker.errors.APIError, requests.exceptions.RequestException) as e:
            if not transient(e):
                raise
            if undo is not None:
                undo()
            try:
                retry = retry.increment(method="POST", url=what, error=e)
            except MaxRetryError:
                raise e from None
            _count("retries")
            if on_retry is not None:
                on_retry()
            retry.sleep()


def owner_label() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def sweep(client: docker.DockerClient) -> list[str]:
    """Remove kiln containers left behind: those started on this host by a process that is gone, and those past
    their expiry wherever they came from. Containers of live kiln processes stay. Returns the removed names."""
    host, removed = socket.gethostname(), []
    # sparse: labels from the listing itself, not an inspect of each, which races with a removal in progress
    for container in client.containers.list(all=True, sparse=True, filters={"label": OWNER}):
        labels = container.attrs.get("Labels") or {}
        owner_host, _, pid = labels.get(OWNER, "").rpartition(":")
        expired = float(labels.get(EXPIRES, "inf")) < time.time()
        orphaned = owner_host == host and pid.isdigit() and not _alive(int(pid))
        if expired or orphaned:
            force_remove(container)
            removed.append((container.attrs.get("Names") or [container.id])[0].lstrip("/"))
    return removed


def remove_owned(client: docker.DockerClient) -> list[str]:
    """Remove every container this process started (on exit, Ctrl-C included). Returns the removed names."""
    removed = []
    for container in client.containers.list(all=True, sparse=True, filters={"label": f"{OWNER}={owner_label()}"}):
        force_remove(container)
        removed.append((container.attrs.get("Names") or [container.id])[0].lstrip("/"))
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


_HISTORY_FREE: dict[str, str] = {}
_HISTORY_FREE_LOCKS: defaultdict[str, threading.Lock] = defaultdict(threading.Lock)


def history_free_image(client: docker.DockerClient, image: str) -> str:
    """The tag of a copy of `image` whose /testbed repository holds nothing beyond what HEAD reaches (SCRUB_HISTORY):
    made once per image id on this host (a few seconds; `docker rmi` the kiln-history-free images to redo them), then
    reused. Later commits, a fix on another branch, a dangling object: none of them survive. ImageMissing when
    `image` is not here; RuntimeError naming it when the scrub fails."""
    try:
        image_id = client.images.get(image).id.split(":")[-1]
    except docker.errors.ImageNotFound:
        raise ImageMissing(f"image {image!r} is not on this Docker host; `docker load` it (or build the offline "
                           "test instances with swe_instances.py)") from None
    tag = f"{HISTORY_FREE_REPO}:{image_id[:32]}"
    with _HISTORY_FREE_LOCKS[image_id]:
        if image_id in _HISTORY_FREE:
            return _HISTORY_FREE[image_id]
        try:
            client.images.get(tag)
        except docker.errors.ImageNotFound:
            with Container(client, image, role="scrub", limits=ContainerLimits(ttl=1800), history_free=False) as box:
                scrub = box.exec(SCRUB_HISTORY, timeout=1200, cap=4000)
                if scrub.exit_code != 0:
                    raise RuntimeError(f"{image}: removing the repository's history beyond HEAD failed "
                                       f"({scrub.exit_code}): {scrub.output[-1500:]}")
                box._container.commit(HISTORY_FREE_REPO, image_id[:32], changes=[f"LABEL {HISTORY_FREE_OF}={image}"])
        _HISTORY_FREE[image_id] = tag
        return tag


class Container:
    """One running container from `image`; use as a context manager so it is removed even on exceptions. An agent's
    (role "agent") runs from history_free_image(image) unless history_free is False. `mounts`: host paths bound
    read-only at container paths (an agent CLI and its runtime, the folder of the endpoint's unix socket)."""

    def __init__(self, client: docker.DockerClient, image: str, role: str, run: str = "",
                 limits: ContainerLimits = ContainerLimits(), workdir: str = "/testbed",
                 history_free: bool | None = None, user: str = "", environment: dict | None = None,
                 mounts: dict[str, str] | None = None):
        if role == "agent" if history_free is None else history_free:
            image = history_free_image(client, image)
        try:
            client.images.get(image)
        except docker.errors.ImageNotFound:
            raise ImageMissing(f"image {image!r} is not on this Docker host; `docker load` it (or build the offline "
                               "test instances with swe_instances.py)") from None
        self.limits, self.workdir, self.image, self.retries = limits, workdir, image, 0
        start = uuid.uuid4().hex
        labels = {OWNER: owner_label(), RUN: run, ROLE: role, EXPIRES: str(int(time.time() + limits.ttl)),
                  START: start}

        def undo() -> None:  # a create that failed half-way may have left a container
            for container in client.containers.list(all=True, filters={"label": f"{START}={start}"}):
                force_remove(container)
        try:
            self._container = retry_transient(lambda: client.containers.run(
                image, ["sleep", str(limits.ttl)], detach=True, auto_remove=True, init=True, network_mode="none",
                nano_cpus=int(limits.cpus * 1e9), mem_limit=limits.memory, memswap_limit=limits.memory,
                pids_limit=limits.pids, tmpfs={"/tmp": f"size={limits.tmpfs}"}, working_dir=workdir,
                volumes={host: {"bind": path, "mode": "ro"} for host, path in (mounts or {}).items()},
                labels=labels, user=user or None, environment=environment), f"start {image}", undo,
                self._count_retry)
        except (docker.errors.APIError, requests.exceptions.RequestException) as e:
            if not transient(e):
                raise
            _count("start_failures")
            raise ContainerStartFailed(f"could not start a container from {image} after {self.retries} retries: "
                                       f"{type(e).__name__}: {e}") from e

    @property
    def name(self) -> str:
        return self._container.name

    def exec(self, command: str, timeout: float | None = None, cap: int | None = None,
             workdir: str | None = None, direct: bool = False, user: str = "",
             environment: dict | None = None) -> ExecResult:
        """Run `command` with bash, SIGKILLed after `timeout` seconds, output capped; whatever it started in the
        background is killed when it ends (only files persist between commands). `direct`: the output leaves the
        container as it is written, never through a file in it that the command could read or rewrite (grading).
        `user` and `environment`: the command's, instead of the container's."""
        timeout = self.limits.timeout if timeout is None else timeout
        cap = self.limits.output_cap if cap is None else cap
        if not 0 < timeout < API_TIMEOUT - 60:
            raise ValueError(f"command timeout {timeout}s must be in (0, {API_TIMEOUT - 60})")
        api = self._container.client.api
        guard = [GUARD_DIRECT, "guard", str(timeout)] if direct else [GUARD, "guard", str(timeout), str(cap)]
        exec_id = retry_transient(lambda: api.exec_create(
            self._container.id, ["bash", "-c", *guard, command],
            workdir=workdir or self.workdir, user=user, environment=environment)["Id"], f"exec in {self.name}",
            on_retry=self._count_retry)
        start = time.monotonic()
        if direct:
            out, truncated = self._read_capped(exec_id, cap)
        else:
            out, err = api.exec_start(exec_id, demux=True)  # never retried: the command may have run
            truncated = b"truncated" in (err or b"")
        exit_code = api.exec_inspect(exec_id)["ExitCode"]
        # 137 is SIGKILL: the timeout's when the full time has passed, otherwise the kernel's (out of memory)
        timed_out = exit_code == 137 and time.monotonic() - start >= timeout
        return ExecResult(exit_code, (out or b"").decode(errors="replace"), timed_out=timed_out, truncated=truncated)

    def _read_capped(self, exec_id: str, cap: int) -> tuple[bytes, bool]:
        """A direct exec's output as it streams (its first and last cap/2 bytes when longer, saying how much was cut),
        read until the stream ends or DIRECT_GRACE seconds after the command did."""
        api = self._container.client.api
        stream = api.exec_start(exec_id, stream=True)  # never retried: the command may have run
        head, tail, size, ended = bytearray(), bytearray(), 0, threading.Event()

        def read() -> None:
            nonlocal size
            try:
                for chunk in stream:
                    size += len(chunk)
                    room = max(0, cap // 2 - len(head))
                    head.extend(chunk[:room])
                    tail.extend(chunk[room:])
                    if len(tail) > cap:
                        del tail[:-(cap - cap // 2)]
            except (OSError, ValueError, AttributeError):  # the stream closed under it (cut off below)
                pass
            finally:
                ended.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        while not ended.wait(1.0):
            if not api.exec_inspect(exec_id)["Running"]:
                ended.wait(DIRECT_GRACE)
                break
        stream.close()
        reader.join(DIRECT_GRACE)
        if size <= cap:
            return bytes(head + tail), False
        kept = tail[-(cap - cap // 2):]
        return bytes(head) + f"\n[... {size - len(head) - len(kept)} bytes cut ...]\n".encode() + bytes(kept), True

    def _count_retry(self) -> None:
        self.retries += 1

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

    def put_tree(self, directory: str, tar: bytes) -> None:
        """Unpack the tar archive `tar` into the existing `directory` of the container (not the tmpfs /tmp)."""
        if not self._container.put_archive(directory, tar):
            raise OSError(f"{self.name}: could not unpack an archive into {directory}")

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
