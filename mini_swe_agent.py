"""mini-swe-agent (from PyPI) on one kiln swebench row through kiln's endpoint: a complete `--agent-cmd`.

    LITELLM_LOCAL_MODEL_COST_MAP=True MSWEA_COST_TRACKING=ignore_errors python mini_swe_agent.py \
        --base-url {base_url} --api-key {api_key} --row {row_file} --result {result}

mini-swe-agent's DefaultAgent and LitellmModel (its swebench config: one `bash` tool, a fresh subshell per command,
`echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat patch.txt` submits) against the endpoint, in its DockerEnvironment on
the row's instance image, its repository holding nothing past the base commit, with no network. The container is labelled as a kiln agent container of this process, so a
kiln sweep removes it when this process is killed, and it is removed when the run ends. The submission (the patch)
goes to --result. The two environment variables keep litellm and mini-swe-agent off the network.
"""
from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import tyro
import yaml
from minisweagent.agents.default import DefaultAgent
from minisweagent.config import builtin_config_dir
from minisweagent.environments.docker import DockerEnvironment
from minisweagent.models.litellm_model import LitellmModel

import cli
import containers

# For small models that cannot read mini-swe-agent's two-page instructions: the same protocol in a few lines.
SHORT_INSTANCE = ("Fix this issue in /testbed:\n{{task}}\nCall the bash tool. When done, submit with "
                  "`echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat patch.txt` (patch.txt: your git diff).")


@dataclass
class Args:
    base_url: str
    """kiln's endpoint ({base_url})"""
    api_key: str
    """the session key ({api_key})"""
    row: Path
    """the row as kiln gives it ({row_file})"""
    result: Path
    """where the submission goes ({result})"""
    short: bool = False
    """a few-line instance prompt instead of mini-swe-agent's swebench one (tiny models, tests)"""
    step_limit: int = 50
    """model calls before mini-swe-agent stops"""
    max_tokens: int = 2048
    """reply budget per model call"""
    command_timeout: int = 60
    """seconds per bash command"""
    container_seconds: int = 3600
    """the container's lifetime (its `sleep`, and kiln's expiry label)"""


def main(args: Args) -> None:
    row = json.loads(args.row.read_text())
    instance = row["instance"]
    config = yaml.safe_load((builtin_config_dir / "benchmarks" / "swebench.yaml").read_text())
    agent_config = config["agent"] | {"step_limit": args.step_limit, "cost_limit": 0}
    if args.short:
        agent_config["instance_template"] = SHORT_INSTANCE
    model = LitellmModel(
        model_name="openai/kiln", cost_tracking="ignore_errors",
        model_kwargs={"api_base": args.base_url, "api_key": args.api_key, "max_tokens": args.max_tokens,
                      "drop_params": True},
        observation_template=config["model"]["observation_template"],
        format_error_template=config["model"]["format_error_template"])
    labels = {containers.OWNER: containers.owner_label(), containers.ROLE: "agent", containers.RUN: args.api_key,
              containers.EXPIRES: str(int(time.time()) + args.container_seconds)}
    environment = DockerEnvironment(  # the instance's repository without its future (containers.history_free_image)
        image=containers.history_free_image(containers.connect(), instance["image"]), cwd="/testbed", timeout=args.command_timeout, interpreter=["bash", "-c"],
        env={k: v for k, v in config["environment"]["env"].items() if k != "BASH_ENV"},  # no conda in kiln's images
        run_args=["--rm", "--network", "none", "--init"] + [f"--label={k}={v}" for k, v in labels.items()],
        container_timeout=str(args.container_seconds))
    try:
        outcome = DefaultAgent(model, environment, **agent_config).run(instance["problem_statement"])
    finally:  # SIGKILL now rather than mini-swe-agent's `docker stop` in the background
        subprocess.run(["docker", "rm", "-f", environment.container_id], capture_output=True)
        environment.container_id = None
    args.result.write_text(outcome.get("submission", ""))
    print(f"mini-swe-agent: {outcome.get('exit_status')}, {len(outcome.get('submission', ''))} characters submitted")


if __name__ == "__main__":
    with cli.one_line_errors():
        main(tyro.cli(Args))
