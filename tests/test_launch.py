"""run_h200.sh / run_a100.sh in DRY_RUN mode: the torchrun command they would run, and the Args it resolves to."""
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TUNED = {  # per-GPU defaults the scripts promise: (vLLM memory fraction, micro batch tokens)
    "run_h200.sh": ("0.6", "16384"),
    "run_a100.sh": ("0.5", "8192"),
}


def dry_run(script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k not in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
                                                                  "GPUS_PER_NODE", "SCRIPT")}
    full_env |= {"DRY_RUN": "1"} | env
    return subprocess.run([str(ROOT / script), *args], env=full_env, capture_output=True, text=True, timeout=300,
                          cwd="/")  # the scripts must find their own folder


def last_value(argv: list[str], flag: str) -> str:
    return argv[len(argv) - 1 - argv[::-1].index(flag) + 1]


@pytest.mark.parametrize("script", sorted(TUNED))
def test_dry_run_prints_the_torchrun_command(script):
    # PYTHON=true: the Args half of the dry run is a no-op here; only the torchrun line is checked
    out = dry_run(script, "--lr", "3e-6", "--wandb-project", "my project", "--activation-checkpointing", "selective",
                  PYTHON="true", NNODES="2", NODE_RANK="1", MASTER_ADDR="10.1.2.3", MASTER_PORT="29999",
                  GPUS_PER_NODE="4", SCRIPT="train_ppo.py")
    assert out.returncode == 0, out.stderr
    argv = shlex.split(out.stdout.strip())
    assert argv[:12] == ["torchrun", "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "4",
                         "--master-addr", "10.1.2.3", "--master-port", "29999", "train_ppo.py"]
    # overrides come after the defaults, so they win (tyro keeps the last value)
    assert argv.count("--lr") == 2 and last_value(argv, "--lr") == "3e-6"
    assert argv.count("--activation-checkpointing") == 2 and last_value(argv, "--activation-checkpointing") == "selective"
    assert last_value(argv, "--wandb-project") == "my project"
    memory, micro_batch = TUNED[script]
    assert last_value(argv, "--vllm-gpu-memory-utilization") == memory
    assert last_value(argv, "--micro-batch-tokens") == micro_batch
    assert last_value(argv, "--engine") == "vllm" and last_value(argv, "--model") == "Qwen/Qwen2.5-Coder-7B-Instruct"


def test_single_node_defaults():
    out = dry_run("run_h200.sh", PYTHON="true")
    assert out.returncode == 0, out.stderr
    assert shlex.split(out.stdout)[:12] == ["torchrun", "--nnodes", "1", "--node-rank", "0", "--nproc-per-node", "8",
                                            "--master-addr", "127.0.0.1", "--master-port", "29500", "train_grpo.py"]


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(TUNED))
def test_dry_run_resolves_every_default_into_train_grpo_args(script, tmp_path):
    out = dry_run(script, "--lr", "3e-6", "--activation-checkpointing", "selective", "--output-dir", str(tmp_path / "run"),
                  PYTHON=sys.executable)
    assert out.returncode == 0, out.stderr  # tyro refuses any default that is not an Args field
    command, _, printed = out.stdout.partition("\n")
    assert command.startswith("torchrun ")
    args = json.loads(printed)
    memory, micro_batch = TUNED[script]
    assert args["lr"] == 3e-6 and args["activation_checkpointing"] == "selective"
    assert args["vllm_gpu_memory_utilization"] == float(memory) and args["micro_batch_tokens"] == int(micro_batch)
    assert (args["model"], args["engine"], args["mixed_precision"]) == ("Qwen/Qwen2.5-Coder-7B-Instruct", "vllm", True)
    assert (args["attn_implementation"], args["compile_layers"]) == ("flex_attention", True)
    assert (args["group_size"], args["max_new_tokens"], args["vllm_max_model_len"]) == (8, 2048, 3072)
    assert (args["data"], args["eval_data"]) == ("data/apps_train.parquet", "data/apps_test.parquet")
    assert not (tmp_path / "run").exists()  # a dry run starts nothing
