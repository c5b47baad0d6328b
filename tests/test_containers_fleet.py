"""The container fleet of SWE agents (containers.py): the pool that starts containers ahead of their trajectories
within its caps, the long-lived shell that runs their commands, and infrastructure failures (a killed container, a
stopped daemon, a SIGKILLed trainer) that are dropped and counted, never scored. Real Docker throughout: the shared
daemon for what cannot disturb other tests, a private dockerd of the test's own for stopping a daemon.
"""
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import docker
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
import containers  # noqa: E402
import engines  # noqa: E402
import policy  # noqa: E402
import ranks  # noqa: E402
import rewards  # noqa: E402
import rl_run  # noqa: E402
import rollout  # noqa: E402
import swe_instances  # noqa: E402
import system_parts  # noqa: E402
import task_rows  # noqa: E402
import tiny  # noqa: E402
import tools  # noqa: E402
import train_grpo  # noqa: E402
from test_multiturn import CORPUS, ScriptedEngine  # noqa: E402
from test_swe_agent import call, own_containers, tagged  # noqa: E402
from test_swebench import M1359, docker_client, swe_rows  # noqa: E402,F401 -- fixtures

pytestmark = pytest.mark.docker
BASE = swe_instances.BASE_IMAGE
LIMITS = rollout.AgentLimits(max_turns=4, max_total_tokens=200_000, max_tool_response_tokens=2000)
SHORT = containers.ContainerLimits(ttl=600, timeout=30)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return policy.load_tokenizer(tiny.make_tiny_model(tmp_path_factory.mktemp("tiny"), CORPUS))


def running(container, command: str) -> bool:
    """Whether `command` runs in the container (False once it is not running)."""
    try:
        return any(command in " ".join(process) for process in container.top().get("Processes") or [])
    except docker.errors.APIError:
        return False


def by_run(client, run: str) -> list:
    return client.containers.list(all=True, filters={"label": f"{containers.RUN}={run}"})


def test_pool_prestarts_within_its_caps_and_gives_each_container_to_one_trajectory(docker_client):
    pool = containers.ContainerPool(docker_client, containers.PoolLimits(max_live=2, max_starting=1,
                                                                         start_budget=120))
    pool.prestart([(BASE, "pool-test")] * 3, SHORT)  # the third waits for a live slot
    first, second = pool.take(BASE, "pool-test", SHORT), pool.take(BASE, "pool-test", SHORT)
    try:
        assert first.name != second.name
        assert {c.labels[containers.PRESTARTED] for c in by_run(docker_client, "pool-test")} == {"1"}
        assert first.exec("echo ready").output == "ready\n"
        first.remove()  # frees the slot the third pre-start waits for
        third = pool.take(BASE, "pool-test", SHORT)
        assert third.name not in (first.name, second.name) and third.exec("true").exit_code == 0
        third.remove()
        fourth = pool.take(BASE, "pool-test", SHORT)  # nothing pre-started is left: a miss
        metrics = pool.metrics()
        assert (metrics["swe/pool_hits"], metrics["swe/pool_misses"]) == (3, 1)
        assert metrics["swe/pool_live_peak"] == 2 and metrics["swe/pool_live_cap"] == 2
        fourth.remove()
    finally:
        second.remove()
        pool.close()
    assert by_run(docker_client, "pool-test") == []
    # a trajectory that gets no slot within the start budget is left out, never kept waiting
    tight = containers.ContainerPool(docker_client, containers.PoolLimits(max_live=1, start_budget=1))
    with tight.take(BASE, "pool-test", SHORT):
        with pytest.raises(containers.ContainerStartFailed, match="no live container slot"):
            tight.take(BASE, "pool-test", SHORT)
    assert by_run(docker_client, "pool-test") == [] and tight.metrics()["swe/pool_live_peak"] == 1
    assert 1 <= containers.host_live_cap() <= 64 * os.cpu_count()


def test_shell_and_docker_exec_agree_on_exit_codes_timeouts_and_caps(docker_client):
    commands = [("echo out; echo err >&2; exit 3", {}), ("printf 'no newline'", {}), ("pwd", {"workdir": "/tmp"}),
                ("sleep 30", {"timeout": 1}), ("head -c 30000 /dev/zero | tr '\\0' a", {"cap": 1000}),
                ("python3 -c 'print(\"\\u00e9\" * 3)'", {}), ("sleep 60 & echo started", {})]
    with containers.Container(docker_client, BASE, role="agent", run="shell-test", limits=SHORT,
                              workdir="/") as box:
        assert box._shell is not None
        for command, options in commands:
            shell = box.exec(command, **options)
            daemon = box._daemon_exec(command, options.get("timeout", 30), options.get("cap", 100_000),
                                      options.get("workdir", "/"), direct=False)
            assert shell == daemon, command
        assert shell.output == "started\n" and box.exec("cat /proc/[0-9]*/comm | grep -c sleep").output == "0\n"
        # A command that writes into PID 1's stream garbles its own reply: its doing, not an infrastructure failure;
        # later commands go through docker exec.
        garbled = box.exec("echo forged > /proc/1/fd/1")
        assert garbled.exit_code == -1 and "reply was lost" in garbled.output and box._shell is None
        assert box.exec("echo still here").output == "still here\n" and not box.failed


def test_infra_a_killed_container_drops_its_trajectory_and_counts_it(docker_client, swe_rows, tokenizer):
    rows = [tagged(swe_rows[M1359], "task-victim"), tagged(swe_rows[M1359], "task-fine")]
    engine = ScriptedEngine(tokenizer, {"task-victim": [call("bash", command="sleep 120"), call("submit")],
                                        "task-fine": [call("bash", command="echo fine"), call("submit")]})
    killed = []

    def kill_the_sleeper():  # `docker kill` from outside, as an OOM killer or an operator would
        for _ in range(600):
            for container in own_containers(docker_client):
                if running(container, "sleep 120"):
                    docker_client.api.kill(container.id)
                    killed.append(container.name)
                    return
            time.sleep(0.2)
    killer = threading.Thread(target=kill_the_sleeper)
    killer.start()
    samples, metrics = rollout.multi_turn(engine, tokenizer, rows, 1, engines.Sampling(max_new_tokens=400),
                                          tools.swe_toolbox, LIMITS)
    killer.join()
    victim, fine = samples
    assert killed and victim.finish_reason == "infra" and killed[0] in victim.info["infra_failed"]
    assert fine.finish_reason == "submit" and "infra_failed" not in fine.info
    assert metrics["swe/infra_failed"] == 1 and metrics["rollout/finish_infra_frac"] == 0.5
    assert own_containers(docker_client) == []
    # Never graded, never trained on: the reward is NaN with the reason, the grader never sees the sample, and a
    # --nonfinite-rewards stop run does not stop for it.
    graded = []

    def score_fn(rows, texts, sample_infos):
        graded.extend(sample_infos)
        return [rewards.Reward(-1.0, {})] * len(rows)
    rl_run.score(SimpleNamespace(score_fn=score_fn), samples)
    assert len(graded) == 1 and fine.reward == -1.0
    assert victim.reward != victim.reward and victim.reward_info["error"] == "infra"
    assert rl_run.refuse_or_count_nonfinite(SimpleNamespace(args=SimpleNamespace(nonfinite_rewards="stop"),
                                                            step=0), samples) == 0


def test_infra_a_group_trains_on_its_remaining_samples():
    """The documented group handling: the dropped sample leaves the batch; the advantages of its group are computed
    over the samples it has left (here -1 and +1: GRPO's +-0.707), as if it had been that size."""
    def sample(reward, infra=None):
        return rollout.Sample([1], [2], [1], [0.0], row={"data_source": "swebench"}, group=7, reward=reward,
                              shaped_reward=reward, info={"infra_failed": infra} if infra else {})
    samples = [sample(0.0, infra="c1: the container is gone"), sample(-1.0), sample(1.0)]
    rl_run.score(SimpleNamespace(score_fn=lambda rows, texts, sample_infos: [
        rewards.Reward(s.reward, {}) for s in samples[1:]]), samples)
    for s in samples:
        s.shaped_reward = s.reward
    batch = [s for s in samples if s.reward == s.reward]  # train_grpo.collect_batch's filter
    run = SimpleNamespace(args=SimpleNamespace(advantage="grpo", overlong_buffer=0, mask_truncated=False), rank=0)
    batch, _ = train_grpo.assign_advantages(run, samples, batch)
    assert samples[0] not in batch and [round(s.advantage, 3) for s in batch] == [-0.707, 0.707]


def tiny_rootfs(path: Path) -> Path:
    """A rootfs tarball of the host's bash and the few tools containers.SHELL and GUARD run, with their libraries."""
    files = set()
    for tool in ("bash", "timeout", "mktemp", "stat", "base64", "grep", "cat", "rm", "head", "tail", "sleep", "ls"):
        binary = shutil.which(tool)
        files.add(binary)
        for line in subprocess.run(["ldd", binary], capture_output=True, text=True).stdout.splitlines():
            for part in line.split():
                if part.startswith("/"):
                    files.add(part)
    with tarfile.open(path, "w") as tar:
        for name in ("tmp", "testbed", "root"):
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777
            tar.addfile(info)
        for file in sorted(files):
            tar.add(os.path.realpath(file), arcname=file.lstrip("/"))
    return path


class PrivateDaemon:
    """A dockerd of the test's own (socket, data and exec roots, pid file; no bridge, no iptables) in a network
    namespace of its own, so that stopping it disturbs no other test. (The namespace matters: a dockerd started with
    `--bridge none` deletes the host's docker0, the shared daemon's bridge.)"""

    def __init__(self):
        self.dir = Path(tempfile.mkdtemp(prefix="kd"))  # short: a unix socket path has at most 107 bytes
        self.url = f"unix://{self.dir}/docker.sock"
        self.process = None

    def start(self) -> docker.DockerClient:
        self.process = subprocess.Popen(
            ["unshare", "--net", "dockerd", "--host", self.url, "--data-root", str(self.dir / "root"), "--exec-root",
             str(self.dir / "exec"), "--pidfile", str(self.dir / "docker.pid"), "--bridge", "none",
             "--iptables=false", "--ip-masq=false", "--ip6tables=false"],
            stdout=subprocess.DEVNULL, stderr=open(self.dir / "dockerd.log", "ab"))
        for _ in range(300):
            if self.process.poll() is None and (self.dir / "docker.sock").exists():
                try:
                    return containers.connect(self.url)
                except containers.DockerUnavailable:
                    pass
            time.sleep(0.2)
        pytest.fail(f"the private dockerd did not start: {(self.dir / 'dockerd.log').read_text()[-2000:]}")

    def stop(self) -> None:  # `systemctl stop docker` sends SIGTERM
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=120)

    def remove(self) -> None:
        if self.process.poll() is None:
            self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.mark.slow  # starts a dockerd twice and waits out the client's retries on a stopped one: about a minute
def test_dockerd_stopped_mid_rollout_drops_the_trajectory_and_the_run_goes_on_after_its_restart(
        swe_rows, tokenizer, tmp_path):
    if not (shutil.which("dockerd") and shutil.which("unshare")) or os.geteuid() != 0:
        system_parts.require("docker", "a private dockerd needs dockerd, unshare (util-linux) and root")
    daemon = PrivateDaemon()
    try:
        client = daemon.start()
        client.api.import_image(src=str(tiny_rootfs(tmp_path / "rootfs.tar")), repository="kiln-test/tiny",
                                tag="1")
        truth = json.loads(swe_rows[M1359]["reward_model"]["ground_truth"]) | {"image": "kiln-test/tiny:1"}
        row = swe_rows[M1359] | {"reward_model": {"style": "rule", "ground_truth": json.dumps(truth)}}
        scripts = {"task-stopped": [call("bash", command="sleep 120"), call("submit")],
                   "task-after": [call("bash", command="echo after the restart"), call("submit")]}
        engine = ScriptedEngine(tokenizer, scripts)
        pool = containers.ContainerPool(client, containers.PoolLimits(max_live=4))
        toolbox = functools.partial(tools.swe_toolbox, limits=SHORT, pool=pool)

        def stop_during_the_command():
            for _ in range(600):
                if any(running(container, "sleep 120") for container in client.containers.list()):
                    daemon.stop()
                    return
                time.sleep(0.2)
        stopper = threading.Thread(target=stop_during_the_command)
        stopper.start()
        samples, metrics = rollout.multi_turn(engine, tokenizer, [tagged(row, "task-stopped")], 1,
                                              engines.Sampling(max_new_tokens=400), toolbox, LIMITS)
        stopper.join()
        assert daemon.process.poll() is not None  # it was stopped under the trajectory
        # the daemon's shutdown kills the container, then the daemon stops answering: either is what the sample says
        reason = samples[0].info["infra_failed"]
        assert samples[0].finish_reason == "infra"
        assert "daemon did not answer" in reason or "container is" in reason
        assert metrics["swe/infra_failed"] == 1
        daemon.start()
        samples, metrics = rollout.multi_turn(engine, tokenizer, [tagged(row, "task-after")], 1,
                                              engines.Sampling(max_new_tokens=400), toolbox, LIMITS)
        assert samples[0].finish_reason == "submit" and metrics["swe/infra_failed"] == 0
        assert "after the restart" in samples[0].info["tool_log"][0]["output"]
        assert client.containers.list(all=True, filters={"label": containers.OWNER}) == []
    finally:
        daemon.remove()


@pytest.mark.after_suite  # a 2-rank GRPO launch on the offline instances: about a minute (make test-long)
def test_sigkill_of_a_two_rank_trainer_with_prestarted_containers_leaves_nothing(docker_client, swe_rows, tmp_path):
    rows = [swe_rows[i] for i in sorted(swe_rows) if i.startswith("marshmallow")]
    task_rows.write_rows(rows, tmp_path / "swe.parquet")
    model = tiny.make_tiny_model(tmp_path / "model", CORPUS, max_position_embeddings=8192)
    networks = {n.name for n in docker_client.networks.list()}
    launch = subprocess.Popen([*ranks.torchrun(2, ROOT / "train_grpo.py"), "--model", str(model), "--data",
                               str(tmp_path / "swe.parquet"), "--output-dir", str(tmp_path / "out"),
                               "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "16",
                               "--total-steps", "50", "--save-every", "0", "--tools", "swe", "--max-turns", "2",
                               "--max-prompt-tokens", "4000", "--max-total-tokens", "4100"],
                              cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def ours() -> list[dict]:  # labels of the run's containers: their owners' working directory is the test's
        mine = []
        for container in docker_client.api.containers(all=True, filters={"label": containers.OWNER}):
            pid = container["Labels"][containers.OWNER].rpartition(":")[2]
            try:
                if os.readlink(f"/proc/{pid}/cwd") == str(tmp_path):
                    mine.append(container["Labels"])
            except OSError:
                pass
        return mine
    try:
        # Into the second step (the first is logged), with containers the ranks pre-started running: taken by the
        # step's agents, or waiting for the next step's.
        for _ in range(3000):
            held = ours()
            logged = tmp_path / "out" / "metrics.jsonl"
            if logged.exists() and logged.read_text().strip() and any(c.get(containers.PRESTARTED) for c in held):
                break
            assert launch.poll() is None, launch.stderr.read().decode()[-3000:]
            time.sleep(0.1)
        owners = {c[containers.OWNER] for c in held}
    finally:
        ranks.kill(launch)
    assert len(owners) == 2 and any(c.get(containers.PRESTARTED) for c in held)
    # the next start's sweep (rl_run.start_tools), from a process of its own, a few seconds later as a relaunch is
    # (starts the killed ranks had asked for may still be completing in the daemon)
    time.sleep(5)
    subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r}); import containers; "
                    "containers.sweep(containers.connect())"], check=True, timeout=300)
    left = [c["Names"] for c in docker_client.api.containers(all=True, filters={"label": containers.OWNER})
            if c["Labels"][containers.OWNER] in owners]
    assert left == []
    assert {n.name for n in docker_client.networks.list()} <= networks  # kiln makes none
    untagged = docker_client.images.list(all=True, filters={"label": containers.HISTORY_FREE_OF, "dangling": True})
    assert untagged == []  # every image kiln made is a tagged history-free copy it keeps on purpose


def test_a_killed_owner_not_yet_reaped_counts_as_gone_for_the_sweep():
    """A rank SIGKILLed while its parent has not reaped it yet is a zombie: its containers are the sweep's."""
    child = subprocess.Popen(["sleep", "60"])
    try:
        assert containers._alive(child.pid)
        child.kill()
        for _ in range(100):  # until the kernel has made it a zombie (never waited for here)
            if Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                break
            time.sleep(0.05)
        assert not containers._alive(child.pid)
    finally:
        child.wait()
    assert not containers._alive(child.pid)
