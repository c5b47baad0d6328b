"""Docker containers for agent trajectories and SWE-bench grading, through the docker SDK.

One fresh container per trajectory (and one per grading) from an instance image: no network, a cpu quota, a memory
limit without swap, a pids limit and a sized tmpfs /tmp. Every container carries kiln labels (owner pid and host, an
expiry time), its PID 1 (SHELL) exits at the TTL and it is auto-removed, and `sweep()` at start-up removes the
containers of kiln processes that died, so nothing outlives a killed trainer. Every command runs under `timeout -s KILL` with its output
capped (head and tail kept); files go in and out as tar archives; containers end with `remove(force=True)` (SIGKILL),
never `stop` (15 s when PID 1 ignores SIGTERM).

Agents never see a repository's future: an agent container runs from a history-free copy of the instance image
(`history_free_image`, made once per image), whose /testbed/.git holds only what HEAD reaches. Under load the daemon
answers with timeouts, 5xx and conflicts: idempotent calls (inspect, list, archives, removal) are retried by urllib3
inside the SDK's HTTP adapter, and starting a container and creating an exec by an explicit loop with urllib3's
backoff; every retry is counted (`docker_retries`), and a container that cannot start after them raises
ContainerStartFailed.

PID 1 of every container is SHELL, a long-lived bash that the host reaches through the container's attach stream:
a command is one line written to it and one framed reply read back, with no daemon round trip (a `docker exec` costs
tens of milliseconds of daemon CPU each, seconds when a hundred agents call at once). PID 1 cannot be signalled from
inside the container, so an agent cannot kill its own container; the shell also ends it at its TTL. `ContainerPool`
starts containers ahead of their trajectories (the next step's, while this one trains), through a bounded start queue
and a cap on live containers. A daemon or container that fails under a trajectory raises InfraFailure: never a reward.

This is its own module, not part of sandbox.py: sandbox's zygote runs `python -I -S` without site-packages, and the
docker SDK lives there.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import io
import os
import signal
import socket
import struct
import sys
import tarfile
import threading
import time
import uuid
from collections import defaultdict, deque
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

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
PRESTARTED = "kiln.prestarted"  # on a container ContainerPool started ahead of its trajectory
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
# PID 1 of every container: $1 = TTL seconds. It reads one request per line from its stdin (the attach stream):
# timeout, output cap, then the working directory and the command as bash $'\xHH...' words (`_escaped`: eval turns
# them back into their bytes, and nothing in them is special to bash); runs the command as GUARD does (inline, to
# spare a dozen processes a call: four remain) and answers `kiln-reply <exit code> <truncated 0/1> <bytes>` and the
# output. It
# exits at the TTL (the container is then auto-removed), waiting or not. As PID 1 it reaps whatever a command leaves
# behind, and no signal sent from inside the container reaches it.
SHELL = r"""deadline=$((SECONDS + $1)) out=/tmp/.kiln-output
exec 2>/dev/null
while left=$((deadline - SECONDS)); [ "$left" -gt 0 ]; do
  IFS=' ' read -r -t "$left" seconds cap dir command
  status=$?
  [ $status -gt 128 ] && exit 0
  [ $status -ne 0 ] && { sleep "$left"; exit 0; }
  eval "dir=$dir command=$command"
  (cd -- "$dir" || exit 126; exec timeout -s KILL "$seconds" bash -c "$command") </dev/null >"$out" 2>&1 &
  group=$!
  wait $group
  rc=$?
  for ((i = 0; i < 100; i++)); do kill -9 -- -$group 2>/dev/null || break; done
  size=$(stat -c %s "$out")
  if [ "$size" -gt "$cap" ]; then
    half=$((cap / 2))
    printf -v cut '\n[... %s bytes cut ...]\n' $((size - 2 * half))
    printf 'kiln-reply %s 1 %s\n' "$rc" $((2 * half + ${#cut}))
    head -c "$half" "$out"; printf %s "$cut"; tail -c "$half" "$out"
  else
    printf 'kiln-reply %s 0 %s\n' "$rc" "$size"
    cat "$out"
  fi
  : >"$out"
done"""
# Seconds past a command's timeout that the host waits for SHELL's reply before it asks whether the container lives.
SHELL_GRACE = 30.0


class DockerUnavailable(RuntimeError):
    """The Docker daemon cannot be reached: an infrastructure error, never a model's failure."""


class ImageMissing(RuntimeError):
    """The instance image is not on this Docker host."""


class InfraFailure(RuntimeError):
    """The infrastructure failed under a trajectory (its container died or vanished, the daemon stopped answering):
    never the agent's doing, never a reward. The message says what happened."""


class ContainerStartFailed(InfraFailure):
    """The daemon would not start a container, even after retries, or not within the start budget."""


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
    """seconds the container lives at most, even if kiln is killed (PID 1 exits then; auto-removed)"""
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


def connect(base_url: str | None = None) -> docker.DockerClient:
    """A client for the daemon at `base_url` (default: what DOCKER_HOST, or the default socket, names);
    DockerUnavailable if none answers."""
    try:
        client = (docker.DockerClient(base_url=base_url, timeout=API_TIMEOUT, max_pool_size=64) if base_url else
                  docker.from_env(timeout=API_TIMEOUT, max_pool_size=64))  # a rank's tool calls run at once
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
    """Whether process `pid` of this host runs: a zombie (killed, not yet reaped by its parent) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # gone meanwhile, or no /proc
        return not Path("/proc/self").exists()
    return stat[stat.rindex(")") + 2:].split(" ", 1)[0] != "Z"  # the state follows the command name's ")"


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
    (role "agent") runs from history_free_image(image) unless history_free is False. `shell`: commands go through
    SHELL on the attach stream (else each is a `docker exec`). Calls raise InfraFailure when the container or the
    daemon fails under them. `user` and `environment`: the container's (PID 1 and the commands it runs); `mounts`:
    host paths bound read-only at container paths (an agent CLI and its runtime, the folder of the endpoint's unix
    socket)."""

    def __init__(self, client: docker.DockerClient, image: str, role: str, run: str = "",
                 limits: ContainerLimits = ContainerLimits(), workdir: str = "/testbed",
                 history_free: bool | None = None, shell: bool = True, extra_labels: dict | None = None,
                 user: str = "", environment: dict | None = None, mounts: dict[str, str] | None = None):
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
                image, ["bash", "-c", SHELL, "kiln-shell", str(limits.ttl)], detach=True, auto_remove=True,
                stdin_open=True, stop_signal="SIGKILL", network_mode="none", log_config={"Type": "none"},
                nano_cpus=int(limits.cpus * 1e9), mem_limit=limits.memory, memswap_limit=limits.memory,
                pids_limit=limits.pids, tmpfs={"/tmp": f"size={limits.tmpfs}"}, working_dir=workdir,
                volumes={host: {"bind": path, "mode": "ro"} for host, path in (mounts or {}).items()},
                user=user or None, environment=environment, labels=labels | (extra_labels or {})), f"start {image}",
                undo, self._count_retry)
        except (docker.errors.APIError, requests.exceptions.RequestException) as e:
            if not transient(e):
                raise
            _count("start_failures")
            raise ContainerStartFailed(f"could not start a container from {image} after {self.retries} retries: "
                                       f"{type(e).__name__}: {e}") from e
        self._shell: _Shell | None = None
        self.failed = ""  # the InfraFailure that ended it: later calls raise it again at once
        self.on_remove = None  # called once when it is removed (ContainerPool frees its slot)
        if shell:
            try:  # without it, commands go through `docker exec`
                self._shell = _Shell(client.api, self._container.id)
            except (docker.errors.APIError, requests.exceptions.RequestException, OSError):
                pass  # commands go through `docker exec`, as they do after a shell's stream is garbled

    @property
    def name(self) -> str:
        return self._container.name

    def exec(self, command: str, timeout: float | None = None, cap: int | None = None,
             workdir: str | None = None, direct: bool = False, user: str = "",
             environment: dict | None = None) -> ExecResult:
        """Run `command` with bash, SIGKILLed after `timeout` seconds, output capped; whatever it started in the
        background is killed when it ends (only files persist between commands). `direct`: the output leaves the
        container as it is written, never through a file in it that the command could read or rewrite (grading).
        Through the shell unless `direct` (or it has none) or the command has its own `user` or `environment`
        (instead of the container's); InfraFailure when the container or daemon fails."""
        timeout = self.limits.timeout if timeout is None else timeout
        cap = self.limits.output_cap if cap is None else cap
        if not 0 < timeout < API_TIMEOUT - 60:
            raise ValueError(f"command timeout {timeout}s must be in (0, {API_TIMEOUT - 60})")
        if self.failed:
            raise InfraFailure(self.failed)
        shell = self._shell
        if shell is not None and not direct and not user and not environment:
            return self._shell_exec(shell, command, timeout, cap, workdir or self.workdir)
        with self._infra_errors("exec"):
            return self._daemon_exec(command, timeout, cap, workdir or self.workdir, direct, user, environment)

    def _shell_exec(self, shell: _Shell, command: str, timeout: float, cap: int, workdir: str) -> ExecResult:
        """One command through SHELL. A reply that does not come (SHELL_GRACE after the timeout), a closed stream or
        a garbled reply while the container runs is the agent's doing (a command read or wrote PID 1's stream): the
        call fails and later ones go through `docker exec`."""
        if "\0" in command + workdir:
            raise ValueError("a command or working directory cannot hold a NUL byte")
        encoded = f"{_escaped(workdir)} {_escaped(command)}"
        start = time.monotonic()
        try:
            exit_code, truncated, out = shell.call(f"{timeout} {cap} {encoded}\n".encode(),
                                                   start + timeout + SHELL_GRACE)
        except (OSError, ValueError) as e:
            self._check_alive(f"no reply to a command ({type(e).__name__}: {e})")
            self._shell = None
            shell.close()
            return ExecResult(-1, f"[the command's reply was lost ({type(e).__name__}); later commands run in a new "
                                  "process]", timed_out=False, truncated=False)
        timed_out = exit_code == 137 and time.monotonic() - start >= timeout
        return ExecResult(exit_code, out.decode(errors="replace"), timed_out=timed_out, truncated=truncated)

    def _daemon_exec(self, command: str, timeout: float, cap: int, workdir: str, direct: bool, user: str = "",
                     environment: dict | None = None) -> ExecResult:
        """One command as a `docker exec` (as `user`, with `environment` added, when given)."""
        api = self._container.client.api
        guard = [GUARD_DIRECT, "guard", str(timeout)] if direct else [GUARD, "guard", str(timeout), str(cap)]
        exec_id = retry_transient(lambda: api.exec_create(
            self._container.id, ["bash", "-c", *guard, command],
            workdir=workdir, user=user, environment=environment)["Id"], f"exec in {self.name}",
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

    @contextlib.contextmanager
    def _infra_errors(self, what: str):
        """Daemon errors under `what` as InfraFailure when the daemon does not answer or the container is gone or
        stopped; other errors as they are."""
        if self.failed:
            raise InfraFailure(self.failed)
        try:
            yield
        except docker.errors.APIError as e:  # (an HTTPError too: first) the daemon answered, the call failed
            self._check_alive(f"{what}: {e}")
            raise
        except requests.exceptions.RequestException as e:
            self._fail(f"the Docker daemon did not answer ({what}: {type(e).__name__}: {e})")

    def _check_alive(self, what: str) -> None:
        """InfraFailure naming `what` unless the container is still running and the daemon answers."""
        try:
            self._container.reload()
        except docker.errors.NotFound:
            self._fail(f"the container is gone ({what})")
        except (docker.errors.APIError, requests.exceptions.RequestException) as e:
            self._fail(f"the Docker daemon did not answer ({what}; then {type(e).__name__}: {e})")
        if self._container.status != "running":
            self._fail(f"the container is {self._container.status} ({what})")

    def _fail(self, why: str) -> None:
        self.failed = f"{self.name}: {why}"
        raise InfraFailure(self.failed) from None

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
        with self._infra_errors(f"writing {path}"):
            written = self._container.put_archive(directory or "/", buffer.getvalue())
        if not written:
            raise OSError(f"{self.name}: could not write {path}")

    def put_tree(self, directory: str, tar: bytes) -> None:
        """Unpack the tar archive `tar` into the existing `directory` of the container (not the tmpfs /tmp)."""
        with self._infra_errors(f"unpacking into {directory}"):
            written = self._container.put_archive(directory, tar)
        if not written:
            raise OSError(f"{self.name}: could not unpack an archive into {directory}")

    def get_file(self, path: str) -> bytes:
        """The bytes of the regular file at `path` in the container (not under the tmpfs /tmp; see put_file)."""
        with self._infra_errors(f"reading {path}"):
            stream, _ = self._container.get_archive(path)
            archive = b"".join(stream)
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            member = tar.next()
            if member is None or not member.isfile():
                raise OSError(f"{self.name}: {path} is not a regular file")
            return tar.extractfile(member).read()

    def remove(self) -> None:
        """SIGKILL and delete, never `stop` (it waits for PID 1 to exit). A daemon that does not answer leaves it to
        its TTL and the next start's sweep."""
        if self._shell is not None:
            self._shell.close()
        on_remove, self.on_remove = self.on_remove, None
        try:
            force_remove(self._container)
        except requests.exceptions.RequestException:
            pass  # the daemon does not answer: the container's TTL and the next start's sweep remove it
        finally:
            if on_remove is not None:
                on_remove()

    def __enter__(self) -> Container:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


@dataclass(frozen=True)
class PoolLimits:
    max_live: int = 0
    """most containers of this process alive at once (0: host_live_cap(), this process's share of the host)"""
    max_starting: int = 8
    """container starts in flight at once (the daemon serialises much of a start: more only queue inside it)"""
    start_budget: float = 600.0
    """seconds a trajectory waits for a container (for a free slot, then its start) before ContainerStartFailed"""


AGENT_MEMORY = 128 << 20  # what an idle agent container costs the host, roughly (its shell, the shim, page cache)
AGENTS_PER_CORE = 64  # idle agent containers per core; what they run costs more, and is the agents' own time
POOL_MAX_WAIT = 1800  # seconds a pre-started container waits for its trajectory at most (its TTL is longer by this)


def host_live_cap() -> int:
    """Live containers this process may hold: the host's memory over AGENT_MEMORY and its cores times
    AGENTS_PER_CORE, whichever is less, shared among the local ranks (torchrun's LOCAL_WORLD_SIZE)."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cap = min(memory // AGENT_MEMORY, AGENTS_PER_CORE * len(os.sched_getaffinity(0)))
    return max(1, cap // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


class ContainerPool:
    """Agent containers for trajectories, started ahead of them (`prestart`) or when asked (`take`), each used by one
    trajectory only. Every start waits for a live slot (at most `max_live` containers of the pool alive) and a start
    slot (at most `max_starting` starting), both within `start_budget` seconds, else ContainerStartFailed. A
    pre-started container waits at most POOL_MAX_WAIT for its trajectory; its TTL is that much longer. `metrics()`:
    the caps, the live peak, the queue waits, hits and misses."""

    def __init__(self, client: docker.DockerClient, limits: PoolLimits = PoolLimits(), shell: bool = True):
        self.client, self.shell, self.budget = client, shell, limits.start_budget
        self.max_live, self.max_starting = limits.max_live or host_live_cap(), limits.max_starting
        self._live_slots = threading.Semaphore(self.max_live)
        self._start_slots = threading.Semaphore(self.max_starting)
        self._waiting: defaultdict[tuple, deque[Future]] = defaultdict(deque)  # pre-started, by (image, limits)
        self._lock = threading.Lock()
        self._live = self._peak = 0
        self._stats = {"hits": 0, "misses": 0, "waits": [], "starts": [], "discarded": 0}

    def prestart(self, wanted: list[tuple[str, str]], limits: ContainerLimits) -> list[Future]:
        """Start a container for each (image, run label) in the background, for a later `take`; their futures, in
        the order they start (those past the live cap wait for a slot)."""
        futures = []
        for image, run in wanted:
            future = Future()
            # a daemon thread each: one waiting for a slot must not hold up the interpreter's exit
            threading.Thread(target=self._fulfil, args=(future, image, run, limits), daemon=True,
                             name="kiln-prestart").start()
            with self._lock:
                self._waiting[(image, limits)].append(future)
            futures.append(future)
        return futures

    def _fulfil(self, future: Future, image: str, run: str, limits: ContainerLimits) -> None:
        future.set_running_or_notify_cancel()
        try:
            future.set_result(self._start(image, run, limits, True))
        except BaseException as e:  # noqa: B036 -- handed to whoever takes it
            future.set_exception(e)

    def take(self, image: str, run: str, limits: ContainerLimits) -> Container:
        """A running container of `image` for one trajectory: a pre-started one (waiting for it if it is still
        starting) or, if none is there or it failed, one started now. Its owner removes it (`remove`)."""
        with self._lock:
            waiting = self._waiting.get((image, limits)) or deque()
            future = next((f for f in waiting if f.done()), waiting[0] if waiting else None)  # a running one first
            if future is not None:
                waiting.remove(future)
        if future is not None:
            try:
                box = future.result()
                if time.monotonic() - box.started < POOL_MAX_WAIT:
                    self._note("hits")
                    return box
                box.remove()
            except InfraFailure:
                pass  # a pre-started container that died while it waited: a fresh one is started below
            self._note("discarded")
        self._note("misses")
        return self._start(image, run, limits, False)

    def _start(self, image: str, run: str, limits: ContainerLimits, ahead: bool) -> Container:
        begin = time.monotonic()
        if not self._live_slots.acquire(timeout=self.budget):
            raise ContainerStartFailed(f"{image}: no live container slot freed in {self.budget:.0f} s (--swe-max-live "
                                       f"{self.max_live}, all held)")
        try:
            if not self._start_slots.acquire(timeout=max(0.0, begin + self.budget - time.monotonic())):
                raise ContainerStartFailed(f"{image}: no start slot in {self.budget:.0f} s (--swe-max-starting "
                                           f"{self.max_starting})")
            waited = time.monotonic() - begin
            try:
                lifetime = dataclasses.replace(limits, ttl=limits.ttl + POOL_MAX_WAIT) if ahead else limits
                box = Container(self.client, image, role="agent", run=run, limits=lifetime, shell=self.shell,
                                extra_labels={PRESTARTED: "1"} if ahead else None)
            finally:
                self._start_slots.release()
        except BaseException:
            self._live_slots.release()
            raise
        box.started, box.on_remove = time.monotonic(), self._release
        with self._lock:
            self._live += 1
            self._peak = max(self._peak, self._live)
            self._stats["waits"].append(waited)
            self._stats["starts"].append(time.monotonic() - begin - waited)
        return box

    def _release(self) -> None:
        with self._lock:
            self._live -= 1
        self._live_slots.release()

    def _note(self, what: str) -> None:
        with self._lock:
            self._stats[what] += 1

    def metrics(self, reset: bool = True) -> dict:
        """swe/pool_* since the last reset: live cap and peak, start slots, hits (a pre-started container was there),
        misses, discarded (a pre-started one failed or waited too long), queue wait and start seconds (mean, max)."""
        with self._lock:
            stats, waits, starts = self._stats, self._stats["waits"], self._stats["starts"]
            metrics = {"swe/pool_live_cap": float(self.max_live), "swe/pool_start_slots": float(self.max_starting),
                       "swe/pool_live_peak": float(self._peak), "swe/pool_hits": float(stats["hits"]),
                       "swe/pool_misses": float(stats["misses"]), "swe/pool_discarded": float(stats["discarded"]),
                       "swe/pool_queue_wait_mean_s": sum(waits) / max(1, len(waits)),
                       "swe/pool_queue_wait_max_s": max(waits, default=0.0),
                       "swe/pool_start_mean_s": sum(starts) / max(1, len(starts)),
                       "swe/pool_start_max_s": max(starts, default=0.0)}
            if reset:
                self._stats = {"hits": 0, "misses": 0, "waits": [], "starts": [], "discarded": 0}
                self._peak = self._live
        return metrics

    def close(self) -> None:
        """Remove the pre-started containers no trajectory took (the taken ones are their owners')."""
        with self._lock:
            futures = [future for waiting in self._waiting.values() for future in waiting]
            self._waiting.clear()
        for future in futures:
            with contextlib.suppress(InfraFailure):
                future.result().remove()


_POOL: list[ContainerPool] = []


def configure_pool(limits: PoolLimits) -> ContainerPool:
    """This process's pool (shared_pool) with `limits`, made now; call before the first shared_pool()."""
    _POOL[:] = [ContainerPool(shared_client(), limits)]
    return _POOL[0]


def shared_pool() -> ContainerPool:
    """One pool per process for the agents' containers (PoolLimits() unless configure_pool ran)."""
    if not _POOL:
        configure_pool(PoolLimits())
    return _POOL[0]


def _escaped(text: str) -> str:
    """`text` as one bash word of \\xHH escapes in $'...', every byte escaped: SHELL's eval gives back its bytes."""
    return "$'" + "".join(f"\\x{byte:02x}" for byte in text.encode()) + "'"


class _Shell:
    """The host's end of a container's SHELL: its attach stream (stdin in; stdout as the daemon's frames of an
    8-byte header and a payload), one request at a time."""

    def __init__(self, api, container_id: str):
        self._socket = api.attach_socket(container_id, params={"stdin": 1, "stdout": 1, "stream": 1})
        self._raw = getattr(self._socket, "_sock", self._socket)
        self._received, self._payload = bytearray(), bytearray()  # frames not yet whole; stdout not yet read
        self._lock = threading.Lock()

    def call(self, request: bytes, deadline: float) -> tuple[int, bool, bytes]:
        """Send one request line; (exit code, truncated, output) of its reply. TimeoutError past `deadline`,
        ConnectionError when the stream ends, ValueError for a reply that is not SHELL's."""
        with self._lock:
            self._raw.settimeout(max(deadline - time.monotonic(), 0.001))
            self._raw.sendall(request)
            while b"\n" not in self._payload:
                self._receive(deadline)
            header, _, rest = bytes(self._payload).partition(b"\n")
            kind, exit_code, truncated, size = header.split(b" ")  # ValueError unless four fields
            if kind != b"kiln-reply":
                raise ValueError(f"not a reply: {header[:80]!r}")
            self._payload[:] = rest
            while len(self._payload) < int(size):
                self._receive(deadline)
            out = bytes(self._payload[:int(size)])
            del self._payload[:int(size)]
            return int(exit_code), truncated == b"1", out

    def _receive(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no reply in time")
        self._raw.settimeout(left)
        chunk = self._raw.recv(1 << 16)
        if not chunk:
            raise ConnectionError("the attach stream ended")
        self._received += chunk
        while len(self._received) >= 8:
            stream, size = struct.unpack(">BxxxL", self._received[:8])
            if len(self._received) < 8 + size:
                break
            if stream == 1:
                self._payload += self._received[8:8 + size]
            del self._received[:8 + size]

    def close(self) -> None:
        for end in (self._socket, self._raw):
            with contextlib.suppress(OSError):
                end.close()


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
