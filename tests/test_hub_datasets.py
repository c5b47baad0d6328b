"""Datasets by hub name, against a local stand-in for the hub (tests/fake_hub.py serving dataset repos in the hub's
layout, through $HF_ENDPOINT): two ranks read `--data org/name` with one download (local rank 0 fetches, the other
waits, both read the files); offline the cached dataset loads, pinned to its commit, and asks the hub nothing; a
missing dataset, and offline one not cached, stop a run at start in one line; data_prep's single-process converters
download a hub source plainly. Fresh processes throughout (huggingface_hub reads its settings at import:
tests/test_hub_models.py)."""
import json
import shutil
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
from test_hub_models import env  # noqa: E402

pytestmark = pytest.mark.slow
REPO = "kiln-test/rows"
TRAIN = "train-00000-of-00001.parquet"
PATH = {"PYTHONPATH": str(ROOT)}  # for READ, a script outside the repository
READ = """import json, sys
import policy, task_rows
policy.init_distributed()
rows = task_rows.load_rows(sys.argv[1], split=sys.argv[2])
print("ROWS " + json.dumps([task_rows.row_id(row) for row in rows]))
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Toy rows as a hub dataset (data/<split>-00000-of-00001.parquet), MBPP's jsonl as another, the tiny model."""
    root = tmp_path_factory.mktemp("hub-data")
    train, test = data_prep.toy_rows(12, 4, seed=0, max_ops=2)
    task_rows.write_rows(train, root / "rows" / "data" / TRAIN)
    task_rows.write_rows(test, root / "rows" / "data" / "test-00000-of-00001.parquet")
    (root / "mbpp").mkdir()
    shutil.copy(ROOT / "tests" / "data" / "mbpp" / "mbpp.jsonl", root / "mbpp" / "mbpp.jsonl")
    model = tiny.make_tiny_model(root / "model", [r["prompt"][-1]["content"] for r in train], seed=0)
    (root / "read.py").write_text(READ)
    with FakeHub() as hub:
        sha = hub.add(REPO, root / "rows", kind="datasets")
        hub.add("kiln-test/mbpp", root / "mbpp", kind="datasets")
        yield root, model, hub, sha, [task_rows.row_id(r) for r in train]


def rows_read(out: str) -> list[list[str]]:
    return [json.loads(line[5:]) for line in out.splitlines() if line.startswith("ROWS ")]


def test_two_ranks_read_a_hub_dataset_with_one_download_then_offline_from_the_cache(served, tmp_path):
    root, _, hub, sha, ids = served
    home = tmp_path / "hf-home"
    hub.requests.clear()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(root / "read.py"), REPO, "train"], cwd=ROOT, env=env(hub, home) | PATH,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert rows_read(done.stdout) == [ids, ids]  # both ranks, the same rows
    assert hub.downloads(TRAIN) == [None] and done.stdout.count(f"{REPO}: downloading from {hub.url}") == 1
    snapshot = home / "hub" / "datasets--kiln-test--rows" / "snapshots" / sha
    assert (snapshot / "data" / TRAIN).read_bytes() == (root / "rows" / "data" / TRAIN).read_bytes()

    # Offline, cached: the dataset loads pinned to its commit, and the hub is asked nothing.
    hub.requests.clear()
    done = subprocess.run([sys.executable, str(root / "read.py"), f"{REPO}@{sha}", "test"], cwd=ROOT,
                          env=env(hub, home, offline=True) | PATH, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert rows_read(done.stdout) == [[f"toy/{i}" for i in range(12, 16)]] and hub.requests == []


def test_missing_dataset_and_offline_without_cache_stop_a_run_at_start_in_one_line(served, tmp_path):
    root, model, hub, _, _ = served
    grpo = [sys.executable, str(ROOT / "train_grpo.py"), "--model", str(model), "--prompts-per-step", "2",
            "--group-size", "2", "--max-new-tokens", "8", "--total-steps", "1"]
    done = subprocess.run([*grpo, "--data", "kiln-test/nope", "--output-dir", str(tmp_path / "a")],
                          env=env(hub, tmp_path / "home"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1:] == [
        f"error: kiln-test/nope: no such dataset on {hub.url} (or it is private or gated: log in with "
        "`hf auth login`)"]
    assert not [line for line in done.stderr.splitlines() if line.startswith("Traceback")]
    assert not (tmp_path / "a" / "metrics.jsonl").exists()

    hub.requests.clear()
    done = subprocess.run([*grpo, "--data", REPO, "--output-dir", str(tmp_path / "b")],
                          env=env(hub, tmp_path / "empty-home", offline=True), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 1 and hub.requests == []
    assert done.stderr.strip().splitlines() == [
        f"error: --data {REPO}: no such file, nor a Hugging Face dataset in the local cache "
        f"({tmp_path / 'empty-home' / 'hub'}), and HF_HUB_OFFLINE=1 forbids downloading it: fetch it first "
        f"(`hf download {REPO} --repo-type dataset`) or unset HF_HUB_OFFLINE"]


def test_data_prep_converts_a_hub_source_with_a_plain_download(served, tmp_path):
    """data_prep's converters run as one process: the hub source is downloaded (no ranks to wait for), then read."""
    _, _, hub, _, _ = served
    done = subprocess.run([sys.executable, str(ROOT / "data_prep.py"), "mbpp", "--source", "kiln-test/mbpp",
                           "--out", str(tmp_path / "mbpp.parquet"), "--split", "test"], cwd=ROOT,
                          env=env(hub, tmp_path / "home"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert hub.downloads("mbpp.jsonl") == [None]
    rows = task_rows.load_rows(tmp_path / "mbpp.parquet")
    assert len(rows) == 500 and {r["extra_info"]["split"] for r in rows} == {"test"}
    assert rows == data_prep.mbpp_rows(ROOT / "tests" / "data" / "mbpp" / "mbpp.jsonl")[10:510]
