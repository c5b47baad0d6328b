"""Harbor-style task directories: read and checked into kiln rows, their images built offline, their tests run as the
reward in the agent's own container (Harbor's task format; docs/tasks.md has kiln's reading of it and the policy).

A task directory holds `task.toml`, `instruction.md` (the whole prompt, less leading canary comments),
`environment/Dockerfile` (its folder is the build context), `tests/test.sh` (writes /logs/verifier/reward.txt or
reward.json) and optionally `solution/solve.sh`. `task_rows_of(DIR)` turns every task under DIR into a row of
data_source "task": the prompt is the instruction alone, and the ground truth carries the three folders packed (so a
row trains without its directory) and the task.toml settings kiln applies. Nothing of tests/ or solution/ reaches the
agent: they enter the container only after the agent has finished (`verify`) or for the oracle (`grade_script`).

Images: `ensure_image` builds environment/ with the legacy builder and no network, once per content hash
(kiln-task/<name>:<hash>), so a Dockerfile must build FROM an image already on the host (kiln's base,
swe_instances.BASE_IMAGE). Containers run without network whatever task.toml says.

The reward (`verify`, after the agent, in its container): the agent's processes are killed, /tests and /logs are
emptied (a planted reward file or test does not survive), tests/ is copied to /tests, /tests/test.sh runs as the
verifier user from the workdir under [verifier].timeout_sec, stray processes are killed again and the reward file is
read: reward.json's "reward" (or its only value), else reward.txt; any finite number, partial credit included. No
readable reward file is an infrastructure failure (score None: the sample is left out and counted, never scored 0);
tests killed at their time limit score 0 (the agent's code can hang them).
"""
from __future__ import annotations

import base64
import dataclasses
import gzip
import hashlib
import io
import json
import math
import os
import re
import shlex
import tarfile
import tempfile
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import docker.errors
import requests.exceptions
from filelock import FileLock

import containers

DATA_SOURCE = "task"
REQUIRED = ("task.toml", "instruction.md", "environment/Dockerfile", "tests/test.sh")
IMAGE_REPO = "kiln-task"
TESTS, SOLUTION, LOGS, VERIFIER_LOGS = "/tests", "/solution", "/logs", "/logs/verifier"
DEFAULT_AGENT_TIMEOUT = 600.0  # seconds, when task.toml gives none (Harbor's default is no limit; RL needs one)
MAX_PACKED_BYTES = 50_000_000  # the most a task's three folders may hold, compressed: they travel inside the row
CANARY = re.compile(r"^\s*(<!--.*canary.*-->|#.*canary.*)\s*$", re.I)
ENV_REFERENCE = re.compile(r"\$\{(\w+)(?::-(.*?))?\}")
# Kills every process of the container but PID 1 (containers.SHELL, which runs the agent's commands and exits at the
# TTL) and this command's own ancestors (found with bash builtins): what the agent left running (a daemon that setsid
# took out of its command's process group) must not touch the tests or the reward file. A few rounds catch what forks
# meanwhile; prints how many it killed.
KILL_STRAYS = r"""keep=" 1 "
p=$$
while [ -n "$p" ] && [ "$p" != 0 ]; do
  keep="$keep$p "; parent=
  while read -r key value; do [ "$key" = PPid: ] && parent=$value; done < /proc/$p/status
  p=$parent
done
killed=0
for round in 1 2 3 4 5 6 7 8; do
  found=0
  for d in /proc/[0-9]*; do
    p=${d#/proc/}
    case "$keep" in *" $p "*) continue ;; esac
    kill -9 "$p" 2>/dev/null && found=1 && killed=$((killed + 1))
  done
  [ "$found" = 0 ] && break
done
echo $killed"""


class TaskError(ValueError):
    """A task directory kiln cannot use; the message names the directory (and the file and field)."""


@dataclass(frozen=True)
class TaskSpec:
    """What kiln applies of a task.toml (harbor_tasks.md §2); the rest is ignored, as Harbor ignores unknown keys."""
    name: str
    """[task].name, else the directory's name"""
    agent_timeout: float = DEFAULT_AGENT_TIMEOUT
    """[agent].timeout_sec: the agent's wall seconds; then its tools stop and the tests run"""
    agent_user: str = ""
    """[agent].user ("" = the image's user)"""
    verifier_timeout: float = 600.0
    """[verifier].timeout_sec: wall seconds of tests/test.sh before it is killed (scored 0)"""
    verifier_user: str = ""
    """[verifier].user ("" = the image's user)"""
    verifier_env: dict = field(default_factory=dict)
    """[verifier].env, for test.sh"""
    solution_env: dict = field(default_factory=dict)
    """[solution].env, for solve.sh"""
    env: dict = field(default_factory=dict)
    """[environment].env, in every command (${VAR} and ${VAR:-default} taken from kiln's environment at start)"""
    workdir: str = ""
    """[environment].workdir ("" = the image's WORKDIR)"""
    cpus: float = 1.0
    """[environment].cpus"""
    memory_mb: int = 2048
    """[environment].memory_mb (or the legacy memory string, e.g. "2G")"""
    build_timeout: float = 600.0
    """[environment].build_timeout_sec"""


@dataclass
class Verdict:
    """A run of the task's tests: score (None when there is none: an infrastructure failure, `infra_error` says
    why), rewards (the reward file's numbers), error (None, "verifier_timeout" or "infra"), the end of test.sh's
    output, seconds, and strays_after_tests: processes that outlived test.sh outside its process group (a daemon the
    tests started, or one the code under test did: the reward deserves a look when it is not 0)."""
    score: float | None
    rewards: dict = field(default_factory=dict)
    error: str | None = None
    infra_error: str | None = None
    output: str = ""
    seconds: float = 0.0
    strays_after_tests: int = 0


# ------------------------------------------------------------------------------------------------ reading a directory

def task_dirs_under(source: str | os.PathLike) -> list[Path]:
    """The task directories of `source`: itself when it holds a task.toml, else its subdirectories that do (sorted).
    TaskError when there is none, or a subdirectory looks like a task but has no task.toml."""
    root = Path(source)
    if not root.is_dir():
        raise TaskError(f"{root}: not a directory of tasks")
    if (root / "task.toml").is_file():
        return [root]
    found, strays = [], []
    for d in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if (d / "task.toml").is_file():
            found.append(d)
        elif (d / "instruction.md").exists() or (d / "tests").is_dir():
            strays.append(d)
    if strays:
        raise TaskError(f"{strays[0]}: looks like a task (instruction.md or tests/) but has no task.toml")
    if not found:
        raise TaskError(f"{root}: no task directories (folders with a task.toml)")
    return found


def read_spec(task_dir: Path) -> TaskSpec:
    """task.toml checked leniently (unknown keys ignored; `version` for schema_version, memory strings, allow_internet
    all accepted), refusing what kiln does not run: multi-step tasks, Windows, a separate verifier environment,
    docker-compose sidecars. TaskError names the file and field."""
    where = task_dir / "task.toml"
    try:
        config = tomllib.loads(where.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise TaskError(f"{where}: not valid TOML ({e})") from None

    def table(name: str) -> dict:
        value = config.get(name, {})
        if not isinstance(value, dict):
            raise TaskError(f"{where}: [{name}] must be a table")
        return value

    def number(section: str, key: str, default, positive: bool = True):
        value = table(section).get(key, default)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (positive and not value > 0):
            raise TaskError(f"{where}: [{section}].{key}: expected a number > 0, got {value!r}")
        return value

    def user(section: str) -> str:
        value = table(section).get("user")
        if value is None:
            return ""
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise TaskError(f"{where}: [{section}].user: expected a user name or id, got {value!r}")
        return str(value)

    def env(section: str) -> dict:
        value = table(section).get("env", {})
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, (str, int, float))
                                                  and not isinstance(v, bool) for k, v in value.items()):
            raise TaskError(f"{where}: [{section}].env: expected a table of names to strings")
        return {k: str(v) for k, v in value.items()}

    environment = table("environment")
    if config.get("steps"):
        raise TaskError(f"{where}: [[steps]]: multi-step tasks are not supported")
    if environment.get("os", "linux") != "linux":
        raise TaskError(f"{where}: [environment].os: only linux tasks run, got {environment['os']!r}")
    if table("verifier").get("environment_mode", "shared") != "shared":
        raise TaskError(f"{where}: [verifier].environment_mode: only 'shared' (the tests run in the agent's "
                        "container) is supported")
    if (task_dir / "environment" / "docker-compose.yaml").exists():
        raise TaskError(f"{task_dir}/environment/docker-compose.yaml: compose sidecars are not supported; kiln builds "
                        "environment/Dockerfile alone")
    memory = environment.get("memory_mb", environment.get("memory"))
    if isinstance(memory, str):
        match = re.fullmatch(r"\s*(\d+)\s*([MG])B?\s*", memory, re.I)
        if not match:
            raise TaskError(f"{where}: [environment].memory: expected e.g. '2G' or '512M', got {memory!r}")
        memory = int(match[1]) * (1024 if match[2].upper() == "G" else 1)
    name = table("task").get("name") or task_dir.name
    if not isinstance(name, str):
        raise TaskError(f"{where}: [task].name: expected a string, got {name!r}")
    workdir = environment.get("workdir") or ""
    if not isinstance(workdir, str) or workdir and not workdir.startswith("/"):
        raise TaskError(f"{where}: [environment].workdir: expected an absolute path, got {workdir!r}")
    spec = TaskSpec(name=name, agent_timeout=float(number("agent", "timeout_sec", DEFAULT_AGENT_TIMEOUT)),
                    agent_user=user("agent"),
                    verifier_timeout=float(number("verifier", "timeout_sec", 600.0)),
                    verifier_user=user("verifier"), verifier_env=env("verifier"), solution_env=env("solution"),
                    env=env("environment"), workdir=workdir, cpus=float(number("environment", "cpus", 1.0)),
                    memory_mb=int(memory if memory is not None else 2048),
                    build_timeout=float(number("environment", "build_timeout_sec", 600.0)))
    if spec.memory_mb <= 0:
        raise TaskError(f"{where}: [environment].memory_mb: expected a number > 0, got {spec.memory_mb}")
    resolve_env(spec.env, where)  # a variable kiln's environment lacks is refused now, not at the first rollout
    return spec


def instruction(task_dir: Path) -> str:
    """instruction.md less its leading canary comment lines and the blank lines after them (as Harbor strips them)."""
    lines = (task_dir / "instruction.md").read_text().splitlines()
    while lines and CANARY.match(lines[0]):
        lines.pop(0)
        while lines and not lines[0].strip():
            lines.pop(0)
    return "\n".join(lines).strip()


def pack(folder: Path) -> bytes:
    """A folder as a gzipped tar that depends on its contents alone (sorted, no times or owners; modes kept), so its
    hash names the image built from it."""
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as zipped, tarfile.open(fileobj=zipped, mode="w") as tar:
        for path in sorted(folder.rglob("*")):
            if path.is_symlink() or not (path.is_file() or path.is_dir()):
                raise TaskError(f"{path}: only plain files and folders can be part of a task")
            info = tar.gettarinfo(str(path), arcname=str(path.relative_to(folder)))
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "root", "root"
            if path.is_file():
                with open(path, "rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
    return buffer.getvalue()


def unpacked_tar(packed: str) -> bytes:
    """The plain tar of a packed folder (as the Docker API takes it)."""
    return gzip.decompress(base64.b64decode(packed))


def read_task(task_dir: Path, index: int | str | None = None, split: str = "train") -> dict:
    """One task directory -> a kiln row of data_source "task" (TaskError naming the directory and what is wrong)."""
    missing = [name for name in REQUIRED if not (task_dir / name).is_file()]
    if missing:
        raise TaskError(f"{task_dir}: missing {', '.join(missing)} (a task directory holds task.toml, "
                        "instruction.md, environment/Dockerfile and tests/test.sh)")
    if (task_dir / "solution").is_dir() and not (task_dir / "solution" / "solve.sh").is_file():
        raise TaskError(f"{task_dir}: solution/ has no solve.sh")
    for script in ("tests/test.sh", "solution/solve.sh"):
        if (task_dir / script).is_file() and b"\r\n" in (task_dir / script).read_bytes():
            raise TaskError(f"{task_dir}/{script}: has CRLF line endings (its #! line would name '/bin/bash\\r'); "
                            "convert it with dos2unix")
    spec = read_spec(task_dir)
    prompt = instruction(task_dir)
    if not prompt:
        raise TaskError(f"{task_dir}/instruction.md: empty")
    packed = {name: pack(task_dir / name) for name in ("environment", "tests", "solution")
              if (task_dir / name).is_dir()}
    size = sum(map(len, packed.values()))
    if size > MAX_PACKED_BYTES:
        raise TaskError(f"{task_dir}: environment/, tests/ and solution/ are {size} bytes compressed, over the "
                        f"{MAX_PACKED_BYTES} a row may carry")
    digest = hashlib.sha256(gzip.decompress(packed["environment"])).hexdigest()[:16]
    slug = re.sub(r"[^a-z0-9_.-]+", "-", spec.name.lower()).strip("-.") or "task"
    truth = dataclasses.asdict(spec) | {"image": f"{IMAGE_REPO}/{slug}:{digest}"} | {
        name: base64.b64encode(data).decode() for name, data in packed.items()}
    return {"data_source": DATA_SOURCE, "ability": "agent", "prompt": [{"role": "user", "content": prompt}],
            "reward_model": {"style": "rule", "ground_truth": json.dumps(truth)},
            "extra_info": {"index": index if index is not None else spec.name, "split": split, "name": spec.name,
                           "has_solution": "solution" in packed}}


def task_rows_of(source: str | os.PathLike, split: str = "train") -> list[dict]:
    """Every task under `source` as a row (index: the directory's name), in name order; names must be unique."""
    return [read_task(d, index=d.name, split=split) for d in task_dirs_under(source)]


def truth_of(row: dict) -> dict:
    return json.loads(row["reward_model"]["ground_truth"])


def spec_of(truth: dict) -> TaskSpec:
    return TaskSpec(**{f.name: truth[f.name] for f in dataclasses.fields(TaskSpec)})


def resolve_env(env: dict, where: object) -> dict:
    """${VAR} and ${VAR:-default} in the values, from kiln's environment (what Harbor does); a VAR that is not set
    and has no default is refused, naming `where`."""
    def value(match: re.Match) -> str:
        if match[1] in os.environ:
            return os.environ[match[1]]
        if match[2] is not None:
            return match[2]
        raise TaskError(f"{where}: [environment].env needs ${{{match[1]}}}, which is not set")
    return {k: ENV_REFERENCE.sub(value, v) for k, v in env.items()}


# ------------------------------------------------------------------------------------------------------------ images

def image_present(client, tag: str) -> bool:
    try:
        client.images.get(tag)
        return True
    except docker.errors.ImageNotFound:
        return False


def ensure_image(client, truth: dict) -> str:
    """The task's image, built from its packed environment/ unless already on the host: the legacy builder, no
    network (so FROM must name an image already here), at most one build of a tag at a time on this host. RuntimeError
    naming the task and the end of the build log when it fails."""
    tag = truth["image"]
    if image_present(client, tag):
        return tag
    lock = Path(tempfile.gettempdir()) / f"kiln-task-build-{tag.replace('/', '_').replace(':', '_')}.lock"
    with FileLock(str(lock)):
        if image_present(client, tag):
            return tag
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="kiln-task-context-") as context:
            with tarfile.open(fileobj=io.BytesIO(unpacked_tar(truth["environment"]))) as tar:
                tar.extractall(context, filter="data")
            try:
                client.images.build(path=context, tag=tag, network_mode="none", rm=True, forcerm=True,
                                    timeout=truth["build_timeout"])
            except docker.errors.BuildError as e:
                lines = "".join(step.get("stream", "") for step in e.build_log).splitlines()
                raise RuntimeError(f"task {truth['name']}: building environment/Dockerfile as {tag} failed (no "
                                   f"network: FROM must name an image on this host, e.g. kiln-swe/base:bullseye): "
                                   f"{e.msg}\n" + "\n".join(lines[-15:])) from None
            except (docker.errors.APIError, requests.exceptions.RequestException) as e:
                raise RuntimeError(f"task {truth['name']}: building {tag} failed: {e}") from None
        print(f"built {tag} for task {truth['name']} in {time.perf_counter() - start:.0f}s")
    return tag


def ensure_images(truths: list[dict], client=None) -> None:
    """Every task's image (each built once); DockerUnavailable when no daemon answers."""
    client = client or containers.shared_client()
    for truth in {t["image"]: t for t in truths}.values():
        ensure_image(client, truth)


# --------------------------------------------------------------------------------------------------------- containers

@dataclass
class TaskContainer:
    """A task's running container and what the verifier needs of it: the image's own user (the verifier's default),
    the resolved environment."""
    box: containers.Container
    truth: dict
    spec: TaskSpec
    image_user: str
    env: dict


def start(client, truth: dict, run: str = "", limits: containers.ContainerLimits | None = None) -> TaskContainer:
    """A fresh container of the task's image (no network; cpus and memory from task.toml), its commands run as
    [agent].user from the workdir with [environment].env, and /logs/{agent,verifier,artifacts} made (mode 777).
    ContainerStartFailed when the daemon will not start it (containers.Container)."""
    spec = spec_of(truth)
    try:
        config = client.images.get(truth["image"]).attrs["Config"]
    except docker.errors.ImageNotFound:
        raise containers.ImageMissing(f"task {spec.name}: image {truth['image']} is not on this Docker host; build it "
                                      "with `python data_prep.py tasks` (or task_dirs.ensure_images)") from None
    base = limits or containers.ContainerLimits()
    limits = dataclasses.replace(base, cpus=spec.cpus, memory=f"{spec.memory_mb}m",
                                 ttl=max(base.ttl, int(spec.agent_timeout + spec.verifier_timeout) + 600))
    env = resolve_env(spec.env, f"task {spec.name}")
    box = containers.Container(client, truth["image"], role="agent", run=spec.name, limits=limits,
                               workdir=spec.workdir or config.get("WorkingDir") or "/", history_free=False,
                               user=spec.agent_user, environment=env)
    try:
        made = box.exec(f"mkdir -p {LOGS}/agent {LOGS}/verifier {LOGS}/artifacts && chmod 777 {LOGS}/*", user="0",
                        cap=4000)
        if made.exit_code != 0:
            raise containers.ContainerStartFailed(f"task {spec.name}: setting up {box.name} failed: {made.output}")
    except BaseException:
        box.remove()
        raise
    return TaskContainer(box, truth, spec, config.get("User") or "", env)


def stop_strays(task: TaskContainer) -> int:
    """KILL_STRAYS in the task's container; returns how many processes it killed (a zombie counts each round)."""
    killed = task.box.exec(KILL_STRAYS, user="0", timeout=60, cap=4000).output.split()
    return int(killed[-1]) if killed and killed[-1].isdigit() else 0


def verify(task: TaskContainer) -> Verdict:
    """The task's tests on the container as the agent left it, and their reward (the module's docstring says how).
    Never raises for what the agent did: a container the daemon lost, a reward file missing or unreadable give a
    Verdict with score None and infra_error."""
    start_time, spec, box = time.perf_counter(), task.spec, task.box
    try:
        stop_strays(task)
        reset = box.exec(f"rm -rf {TESTS} {LOGS} && mkdir -p {TESTS} {LOGS}/agent {VERIFIER_LOGS} {LOGS}/artifacts "
                         f"&& chmod 777 {LOGS}/*", user="0", timeout=120, cap=4000)
        if reset.exit_code != 0:
            return _infra(f"emptying {TESTS} and {LOGS} failed: {reset.output[-500:]}", start_time)
        box.put_tree(TESTS, unpacked_tar(task.truth["tests"]))
        box.exec(f"chmod -R a+rX {TESTS} && chmod +x {TESTS}/test.sh", user="0", timeout=60, cap=4000)
        run = box.exec(f"{TESTS}/test.sh", timeout=spec.verifier_timeout, cap=200_000, direct=True,
                       user=spec.verifier_user or task.image_user or "0",
                       environment=task.env | {"TEST_DIR": TESTS} | spec.verifier_env)
        strays = stop_strays(task)
        output = run.output[-4000:]
        if run.timed_out:
            return Verdict(0.0, error="verifier_timeout", output=output, seconds=time.perf_counter() - start_time,
                           strays_after_tests=strays)
        rewards, problem = read_reward(box)
    except (containers.InfraFailure, docker.errors.DockerException, requests.exceptions.RequestException,
            OSError) as e:
        return _infra(f"the container failed under the tests ({type(e).__name__}: {e})", start_time)
    if problem:
        return _infra(problem, start_time, output)
    return Verdict(rewards["reward"], rewards, output=output, seconds=time.perf_counter() - start_time,
                   strays_after_tests=strays)


def _infra(reason: str, start_time: float, output: str = "") -> Verdict:
    return Verdict(None, error="infra", infra_error=reason, output=output, seconds=time.perf_counter() - start_time)


def read_reward(box: containers.Container) -> tuple[dict, str | None]:
    """({"reward": x, ...}, None) from reward.json (a flat object of numbers; "reward", else its only value) or else
    reward.txt (one number), or ({}, what is wrong) when neither gives a finite number."""
    for name in ("reward.json", "reward.txt"):
        try:
            text = box.get_file(f"{VERIFIER_LOGS}/{name}").decode(errors="replace")
        except docker.errors.NotFound:
            continue
        except OSError as e:
            return {}, f"{VERIFIER_LOGS}/{name}: {e}"
        try:
            if name == "reward.txt":
                rewards = {"reward": float(text.strip())}
            else:
                rewards = json.loads(text)
                if not isinstance(rewards, dict) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                            for v in rewards.values()):
                    raise ValueError("expected a flat object of numbers")
                if "reward" not in rewards:
                    if len(rewards) != 1:
                        raise ValueError(f"no \"reward\" among {sorted(rewards)[:5]}")
                    rewards = {"reward": next(iter(rewards.values()))} | rewards
        except ValueError as e:
            return {}, f"{VERIFIER_LOGS}/{name}: not a reward ({e}): {text[:200]!r}"
        if not all(math.isfinite(v) for v in rewards.values()):
            return {}, f"{VERIFIER_LOGS}/{name}: not finite: {text[:200]!r}"
        return {k: float(v) for k, v in rewards.items()}, None
    return {}, f"the tests wrote no {VERIFIER_LOGS}/reward.txt or reward.json"


def run_as_agent(task: TaskContainer, script: str, oracle: bool = False) -> containers.ExecResult:
    """`script` run as the agent in the task's container, under [agent].timeout_sec; with `oracle` it is the task's
    solution: solution/ goes to /solution first and solve.sh runs with [solution].env (Harbor's oracle agent)."""
    spec, box = task.spec, task.box
    environment = None
    if oracle:
        box.exec(f"rm -rf {SOLUTION} && mkdir -p {SOLUTION}", user="0", timeout=60, cap=4000)
        box.put_tree(SOLUTION, unpacked_tar(task.truth["solution"]))
        box.exec(f"chmod -R a+rX {SOLUTION} && chmod +x {SOLUTION}/solve.sh", user="0", timeout=60, cap=4000)
        command = f"{SOLUTION}/solve.sh"
        environment = task.env | {"DEBIAN_FRONTEND": "noninteractive"} | spec.solution_env
    else:
        box.put_file("/.kiln-agent.sh", script.encode(), mode=0o755)
        command = "bash /.kiln-agent.sh; code=$?; rm -f /.kiln-agent.sh; exit $code"
    return box.exec(command, timeout=spec.agent_timeout, cap=20_000, environment=environment)


def grade_script(truth: dict, script: str, oracle: bool = False, client=None) -> Verdict:
    """A fresh container of the task, `script` run in it as the agent (`oracle`: the task's solve.sh instead), then
    `verify`; the container is removed whatever happens. A container that does not start is an infrastructure
    failure (score None)."""
    if oracle and "solution" not in truth:
        raise TaskError(f"task {truth['name']}: has no solution/ to run")
    client = client or containers.shared_client()
    try:
        task = start(client, truth)
    except containers.ContainerStartFailed as e:
        return _infra(str(e), time.perf_counter())
    try:
        ran = run_as_agent(task, script, oracle)
        verdict = verify(task)
        verdict.output = f"[agent exit {ran.exit_code}{', timed out' if ran.timed_out else ''}]\n" + verdict.output
        return verdict
    finally:
        task.box.remove()


def check_tasks(rows: list[dict], client=None) -> list[dict]:
    """Every task's solve.sh must score 1 and doing nothing must score 0 (Harbor's oracle check): one result per row
    ({"task", "oracle", "noop", "ok", "problem"}), the tasks without a solution checked on the no-op only."""
    results = []
    for row in rows:
        truth = truth_of(row)
        oracle = grade_script(truth, "", oracle=True, client=client) if "solution" in truth else None
        noop = grade_script(truth, "true", client=client)
        problems = ([f"solve.sh scores {oracle.score} ({oracle.infra_error or oracle.error or 'tests ran'})"]
                    if oracle is not None and oracle.score != 1.0 else [])
        problems += [f"doing nothing scores {noop.score} ({noop.infra_error or noop.error or 'tests ran'})"] \
            if noop.score != 0.0 else []
        results.append({"task": truth["name"], "oracle": None if oracle is None else oracle.score,
                        "noop": noop.score, "ok": not problems, "problem": "; ".join(problems)})
    return results


def replay_command(command: str, timeout: float) -> str:
    """A bash tool call as a line of the replay script (rewards.py score runs such scripts)."""
    return f"timeout -s KILL {timeout:g} bash -c {shlex.quote(command)} </dev/null"


def replay_file(path: str, data: bytes, mode: str) -> str:
    """A file the editor wrote, as a line of the replay script that writes the same bytes and mode."""
    quoted = shlex.quote(path)
    return (f"mkdir -p \"$(dirname {quoted})\" && echo {base64.b64encode(data).decode()} | base64 -d > {quoted} "
            f"&& chmod {mode} {quoted}")
