"""codex, claude-code and qwen-code as whole SWE agents inside an offline instance's container (harness_agent.py, the
real CLIs from npm), their only way out kiln's endpoint through a unix socket and relay.py: the container reaches
nothing else; a scripted engine's gold fix through each CLI's own tools is graded resolved with mask 1 exactly on the
sampled ids and no drift; a 2-rank GRPO step whose groups mix the three harnesses completes; no container outlives its
agent. Needs the CLIs (`make .npm-tools/.kiln-installed-codex`: npm install --prefix .npm-tools @openai/codex@0.171.0
@anthropic-ai/claude-code@2.1.332 @qwen-code/qwen-code@0.15.10)."""
import base64
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
import containers  # noqa: E402
import engines  # noqa: E402
import harness_agent  # noqa: E402
import policy  # noqa: E402
import ranks  # noqa: E402
import rewards  # noqa: E402
import rollout  # noqa: E402
import task_rows  # noqa: E402
import tiny  # noqa: E402
from test_agent_server import RuleEngine, Served  # noqa: E402
from test_mini_swe_agent import left_behind, tagged  # noqa: E402
from test_multiturn import CORPUS  # noqa: E402
from test_swe_agent import orphans  # noqa: E402
from test_swebench import M1359, docker_client, swe_rows  # noqa: E402,F401 -- fixtures
import system_parts  # noqa: E402

missing = [h for h, path in harness_agent.NEEDS.items() if not path.exists()]
if missing:
    system_parts.require("agent-clis", f"not installed: {', '.join(missing)} ({harness_agent.NPM_TOOLS})", module=True)
pytestmark = pytest.mark.docker
DRIVER = (f"{sys.executable} {ROOT / 'harness_agent.py'} --harness {{harness}} --base-url {{base_url}} "
          "--api-key {api_key} --row {row_file} --result {result} --short")
# What each CLI's shell tool is called and takes, and its file-editing tool (codex: apply_patch, offered with --short).
SHELL = {"codex": ("exec_command", "cmd"), "claude-code": ("Bash", "command"),
         "qwen-code": ("run_shell_command", "command")}
WRITE = {"claude-code": ("Write", "file_path", "content"), "qwen-code": ("write_file", "file_path", "content")}


def call(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def codex_patch(diff: str) -> str:
    """A git diff in codex's apply_patch format: an Update File section per file, its hunks after bare @@ lines."""
    lines = ["*** Begin Patch"]
    for line in diff.splitlines():
        if line.startswith("+++ "):
            lines.append("*** Update File: " + line[len("+++ b/"):])
        elif line.startswith("@@"):
            lines.append("@@")
        elif line[:1] in (" ", "-", "+") and not line.startswith("--- "):
            lines.append(line)
    return "\n".join(lines + ["*** End Patch"])


def gold_script(harness: str, gold: str) -> list[tuple[str, str]]:
    """RuleEngine rules that fix the row with the gold patch through the harness's own tools: its file tool (codex:
    apply_patch) edits the repository or writes the patch, its shell checks or applies it, then a final message. A
    written patch goes in base64: claude-code sends a Write's content back with a blank line's trailing space removed
    (a rewritten history)."""
    shell, argument = SHELL[harness]
    if harness == "codex":
        return [("[task-gold]", "I fix it.\n" + call("apply_patch", {"input": codex_patch(gold)})),
                ("Success. Updated", "I check it.\n" + call(shell, {argument: "git diff --stat && echo KILN-APPLIED"})),
                ("KILN-APPLIED\n", "The fix is applied.")]
    write, path, content = WRITE[harness]
    encoded = base64.b64encode(gold.encode()).decode()
    apply = call(shell, {argument: "base64 -d /tmp/kiln-gold.b64 | git apply && echo KILN-APPLIED"})
    return [("[task-gold]", "I write the fix.\n" + call(write, {path: "/tmp/kiln-gold.b64", content: encoded})),
            ("uccessfully", "I apply it.\n" + apply),
            ("KILN-APPLIED\n", "The fix is applied.")]


@pytest.mark.parametrize("harness", harness_agent.HARNESSES)
def test_scripted_gold_fix_through_the_cli_in_the_container_is_rewarded_with_an_exact_mask(
        harness, docker_client, swe_rows, tmp_path):
    row = tagged(swe_rows[M1359], "task-gold")
    gold = json.loads(row["reward_model"]["ground_truth"])["patch"]
    engine = RuleEngine(policy.load_tokenizer(tiny.make_tiny_model(tmp_path / "tiny", CORPUS)),
                        gold_script(harness, gold))
    samples, metrics = rollout.external_agents(DRIVER.replace("{harness}", harness), engine, engine.tokenizer, [row],
                                               1, engines.Sampling(max_new_tokens=4096), "swe",
                                               rollout.AgentLimits(max_total_tokens=200_000, max_seconds=400),
                                               check=True)
    main = [s for s in samples if s.info["opened"] == "first"]
    assert len(main) == 1 and samples[0].info["agent_status"] == "ok", [s.info["agent_status"] for s in samples]
    (sample,) = main
    turns = len(gold_script(harness, gold))
    assert metrics["tools/tito_drift_frac"] == 0.0
    assert [i for i, m in zip(sample.completion_ids, sample.loss_mask) if m] == [
        i for ids in engine.emitted[:turns] for i in ids]  # the main thread: every sampled id, nothing else
    assert "KILN-APPLIED" in sample.info["messages"][-2]["content"]  # the shell ran in the container
    assert rewards.score(row, sample.text).score == 1.0  # its diff, graded in a fresh container
    assert left_behind(docker_client, [sample.session]) == []


PROBE = r"""python3 - <<'EOF'
import json, socket, urllib.request
interfaces = [line.split(":")[0].strip() for line in open("/proc/net/dev").readlines()[2:]]
def refused(host, port):
    try:
        socket.create_connection((host, port), timeout=3)
        return "connected"
    except OSError as e:
        return type(e).__name__
def resolves(name):
    try:
        return socket.gethostbyname(name)
    except OSError:
        return None
def writable(path):
    try:
        open(path + "/kiln-probe", "w").close()
        return True
    except OSError:
        return False
request = urllib.request.Request("http://127.0.0.1:8080/v1/chat/completions", data=json.dumps(
    {"messages": [{"role": "user", "content": "kiln-probe"}]}).encode(),
    headers={"Authorization": "Bearer probe-session", "Content-Type": "application/json"})
reply = json.loads(urllib.request.urlopen(request, timeout=60).read())
print("KILN-PROBE " + json.dumps({"interfaces": interfaces, "internet": refused("1.1.1.1", 443),
    "host_endpoint": refused("172.17.0.1", 8080), "dns": resolves("github.com"),
    "reply": reply["choices"][0]["message"]["content"], "link_writable": writable("/run/kiln"),
    "tools_writable": writable("/opt/kiln/npm")}))
EOF"""


def test_the_container_reaches_nothing_but_the_endpoint(docker_client, swe_rows, tmp_path):
    tokenizer = policy.load_tokenizer(tiny.make_tiny_model(tmp_path / "tiny", CORPUS))
    engine = RuleEngine(tokenizer, [("kiln-probe", "KILN-ANSWER")])
    instance = json.loads(swe_rows[M1359]["reward_model"]["ground_truth"])
    with Served(engine, tokenizer) as served, tempfile.TemporaryDirectory() as work:
        link = Path(work)
        (link / "home").mkdir()
        endpoint = harness_agent.link_endpoint(served.server.base_url, link)
        try:
            with containers.Container(docker_client, instance["image"], "agent", "probe",
                                      mounts=harness_agent.mounts("claude-code", link)) as box:
                ran = box.exec(harness_agent.launcher(PROBE), timeout=120)
        finally:
            endpoint.close()
        record = served.session("probe-session")
    assert ran.exit_code == 0, ran.output
    found = json.loads(ran.output.split("KILN-PROBE ", 1)[1])
    assert found["interfaces"] == ["lo"]
    assert found["internet"] == found["host_endpoint"] == "OSError"  # ENETUNREACH: no route anywhere
    assert found["dns"] is None
    assert found["reply"] == "KILN-ANSWER" and record["segments"][0]["turns"] == 1  # the endpoint saw it
    assert found["link_writable"] is False and found["tools_writable"] is False


@pytest.mark.after_suite  # 2 ranks, 4 CLIs in containers, prompts of 6,000-18,000 tokens through the tiny model: 2-5
# min, too long for make test (make test-long)
def test_a_two_rank_grpo_step_mixing_the_three_harnesses_completes_and_leaves_no_container(docker_client, swe_rows,
                                                                                          tmp_path):
    rows = [swe_rows[i] for i in sorted(swe_rows) if i.startswith("marshmallow")]
    task_rows.write_rows(rows, tmp_path / "swe.parquet")
    model = tiny.make_tiny_model(tmp_path / "model", CORPUS, max_position_embeddings=65536)
    agent_cmd = DRIVER + " --max-turns 2 --agent-seconds 400"
    subprocess.run([*ranks.torchrun(2, ROOT / "train_grpo.py"), "--model", str(model),
                    "--data", str(tmp_path / "swe.parquet"), "--output-dir", str(tmp_path / "out"),
                    "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "16", "--total-steps", "1",
                    "--save-every", "0", "--best-metric", "", "--tools", "swe", "--max-prompt-tokens", "16384",
                    "--max-total-tokens", "65536", "--max-agent-seconds", "500", "--check-tito",
                    "--agent-cmd", agent_cmd, "--agent-harnesses", *harness_agent.HARNESSES, "--agent-mix-groups",
                    "--agent-keep-failed"],  # codex and claude-code end their run on a reply cut at 16 tokens
                   check=True, timeout=1500, cwd=tmp_path)
    step = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[-1])
    assert step["step"] == 1 and step["agents/timeout_frac"] == 0, step
    # trajectories 0-3 of the run take the harnesses in turn: codex, claude-code | qwen-code, codex
    shares = {"codex": 0.5, "claude-code": 0.25, "qwen-code": 0.25}
    for harness in harness_agent.HARNESSES:
        assert step[f"agents/harness/{harness}/frac"] == shares[harness]
        assert step[f"agents/harness/{harness}/segments_mean"] >= 1  # each reached the endpoint from its container
        assert step[f"agents/harness/{harness}/score_mean"] == -1.0  # the untrained model fixes nothing
    assert "tools/tito_drift_frac" in step  # sampled at temperature 1, random bytes may not round-trip as text
    assert orphans(docker_client) == []  # every agent's and grading's container is gone
