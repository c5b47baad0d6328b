"""Models by hub name, against a local stand-in for the hub (tests/fake_hub.py, through $HF_ENDPOINT): a 2-rank
torchrun run starts from a hub name with one download that both ranks load; a dropped connection resumes where it
broke; a pinned revision; offline with the model cached works, offline without it and a missing repo fail at start in
one line. Each process here is a fresh interpreter: huggingface_hub reads $HF_ENDPOINT, $HF_HOME and $HF_HUB_OFFLINE
once, at import, so the test workers' zygotes (which imported it already) cannot stand in."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import data_prep  # noqa: E402
import task_rows  # noqa: E402
import tiny  # noqa: E402
from fake_hub import FakeHub  # noqa: E402

pytestmark = pytest.mark.slow
REPO = "kiln-test/tiny"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The tiny model and toy rows, and a fake hub serving the model as REPO."""
    root = tmp_path_factory.mktemp("hub")
    train, _ = data_prep.toy_rows(8, 0, seed=0, max_ops=2)
    task_rows.write_rows(train, root / "train.parquet")
    model = tiny.make_tiny_model(root / "model", [r["prompt"][-1]["content"] for r in train], seed=0)
    with FakeHub() as hub:
        sha = hub.add(REPO, model)
        yield root, model, hub, sha


def env(hub: FakeHub, home: Path, offline: bool = False) -> dict:
    """A fresh process's environment: the fake hub, its own cache, no zygote (see the module's docstring)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KILN_RANK_ZYGOTE", "HF_"))}
    return base | {"HF_ENDPOINT": hub.url, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1" if offline else "0",
                   "HF_HUB_DISABLE_XET": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def grpo(root: Path, model: str, out: Path, *extra: str) -> list[str]:
    return [str(ROOT / "train_grpo.py"), "--model", model, "--data", str(root / "train.parquet"), "--output-dir",
            str(out), "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "8", "--save-every", "0",
            "--sample-every", "0", *extra]


def test_two_ranks_start_from_a_hub_name_with_one_download_then_offline_from_the_cache(served, tmp_path):
    root, model, hub, sha = served
    home, out = tmp_path / "hf-home", tmp_path / "run"
    hub.requests.clear()
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
              *grpo(root, REPO, out, "--total-steps", "1")]
    done = subprocess.run(launch, env=env(hub, home), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    # One download per file, by local rank 0; rank 1 waited, then both loaded the same snapshot and trained a step.
    assert hub.downloads("model.safetensors") == [None]
    assert done.stdout.count(f"--model {REPO}: downloading from {hub.url}") == 1
    snapshot = home / "hub" / "models--kiln-test--tiny" / "snapshots" / sha
    assert (snapshot / "model.safetensors").read_bytes() == (model / "model.safetensors").read_bytes()
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1]
    assert json.loads((out / "run_config.json").read_text())["args"]["model"] == REPO  # the name, not the folder

    # Offline with the model cached: the run starts and asks the hub nothing.
    hub.requests.clear()
    done = subprocess.run([sys.executable, *grpo(root, REPO, tmp_path / "offline", "--total-steps", "0")],
                          env=env(hub, home, offline=True), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert hub.requests == []


def test_dropped_download_resumes_and_a_revision_pins_the_snapshot(served, tmp_path):
    """The weights' first GET is cut half-way (past huggingface_hub's first 10 MB chunk, so bytes have landed): the
    download goes on with a Range request from there and the snapshot is whole. The model is named at its commit."""
    _, model, hub, sha = served
    big = tmp_path / "big"
    big.mkdir()
    for f in model.iterdir():
        (big / f.name).write_bytes(f.read_bytes())
    (big / "extra.bin").write_bytes(os.urandom(24 << 20))
    big_sha = hub.add("kiln-test/big", big)
    hub.cut_once.add("extra.bin")
    hub.requests.clear()
    script = ("import hub, policy, sys; policy.init_distributed(); print(hub.fetch(sys.argv[1], '--model'))")
    done = subprocess.run([sys.executable, "-c", script, f"kiln-test/big@{big_sha}"], cwd=ROOT,
                          env=env(hub, tmp_path / "home"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    local = Path(done.stdout.strip().splitlines()[-1])
    assert local == tmp_path / "home" / "hub" / "models--kiln-test--big" / "snapshots" / big_sha
    ranges = hub.downloads("extra.bin")
    assert ranges[0] is None and len(ranges) == 2 and ranges[1].startswith("bytes=") and ranges[1] != "bytes=0-"
    assert (local / "extra.bin").read_bytes() == (big / "extra.bin").read_bytes()
    assert not [r for r in hub.requests if "/revision/" in r[1]]  # a commit needs no lookup


def test_missing_repo_and_offline_without_cache_fail_at_start_in_one_line(served, tmp_path):
    root, _, hub, _ = served
    hub.requests.clear()
    done = subprocess.run([sys.executable, *grpo(root, "kiln-test/nope", tmp_path / "a")],
                          env=env(hub, tmp_path / "home"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1:] == [
        f"error: --model kiln-test/nope: no such model on {hub.url} (or it is private or gated: log in with "
        "`hf auth login`)"]
    assert not [line for line in done.stderr.splitlines() if line.startswith("Traceback")]
    assert not (tmp_path / "a" / "metrics.jsonl").exists()

    done = subprocess.run([sys.executable, *grpo(root, REPO, tmp_path / "b")],
                          env=env(hub, tmp_path / "empty-home", offline=True), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --model {REPO}: no such model folder, nor a Hugging Face "
                                                   "model in the local cache") and "HF_HUB_OFFLINE=1" in lines[0]
