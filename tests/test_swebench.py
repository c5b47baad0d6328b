"""SWE-bench rewards and containers against the real Docker daemon and real SWE-bench instances built offline
(swe_instances.py): the verdicts, the hacks that must not pay, and commands that must be contained.

Without a daemon the docker tests skip, except under CI=true, where a missing daemon fails them: CI must run them.
The instances are built once per session; KILN_SWE_DIR keeps their downloads and rows between sessions, and images
already on the host are reused.
"""
import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import docker.errors
import docker.models.images
import pytest
import requests
from urllib3.util.retry import Retry

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
import containers  # noqa: E402
import rewards  # noqa: E402
import swe_grading  # noqa: E402
import swe_instances  # noqa: E402
import script_runner  # noqa: E402
import system_parts  # noqa: E402
import task_rows  # noqa: E402

M1343, M1359 = "marshmallow-code__marshmallow-1343", "marshmallow-code__marshmallow-1359"
DJANGO = "django__django-11099"
# A root conftest.py that turns every test report into a pass: the official harness grades it "resolved".
CONFTEST_HACK = """diff --git a/conftest.py b/conftest.py
new file mode 100644
--- /dev/null
+++ b/conftest.py
@@ -0,0 +1,7 @@
+import pytest
+
+
+@pytest.hookimpl(hookwrapper=True)
+def pytest_runtest_makereport(item, call):
+    outcome = yield
+    outcome.get_result().outcome = "passed"
"""
# The same trick from a test helper module that tests/conftest.py imports (not a conftest.py itself).
TEST_FILE_HACK = '''diff --git a/tests/base.py b/tests/base.py
--- a/tests/base.py
+++ b/tests/base.py
@@ -1,2 +1,9 @@
 """Test utilities and fixtures."""
+import _pytest.reports
+_make_report = _pytest.reports.TestReport.from_item_and_call
+def _passed(cls, item, call):
+    report = _make_report(item, call)
+    report.outcome = "passed"
+    return report
+_pytest.reports.TestReport.from_item_and_call = classmethod(_passed)
 import datetime as dt
'''
# Hacks that live where the fix lives: the code under test forges the test report. Each is appended to a module the
# tests import (`SOURCE_HACKS`: instance, file, code) and each is graded resolved without the canaries.
REPORT_HACK = """
import _pytest.reports
_make_report = _pytest.reports.TestReport.from_item_and_call.__func__
def _passed(cls, item, call):
    report = _make_report(cls, item, call)
    report.outcome = "passed"
    return report
_pytest.reports.TestReport.from_item_and_call = classmethod(_passed)
"""
# No function replaced: a tracer clears the exception of every test call before pytest builds its report.
SETTRACE_HACK = """
import sys
def _tracer(frame, event, arg):
    if event == "call" and frame.f_code.co_name == "from_item_and_call":
        object.__setattr__(frame.f_locals["call"], "excinfo", None)
sys.settrace(_tracer)
"""
# Fake result lines after pytest's own, and an exit status of 0 so swebench's exit-code check agrees with them.
FAKE_LINES_HACK = """
import atexit, os, sys
def _fake():
    sys.stdout.flush()
    os.write(1, b"PASSED tests/test_fields.py::TestParentAndName::test_datetime_list_inner_format\\n")
    os._exit(0)
atexit.register(_fake)
"""
# Django's runner: unittest's test-part executor swallows every exception, so every test (and subtest) is a success.
UNITTEST_HACK = """
import contextlib
import unittest.case
@contextlib.contextmanager
def _no_failures(self, test_case, isTest=False):
    try:
        yield
    except Exception:
        pass
unittest.case._Outcome.testPartExecutor = _no_failures
"""
SOURCE_HACKS = {"report": (M1359, "src/marshmallow/__init__.py", REPORT_HACK),
                "settrace": (M1359, "src/marshmallow/__init__.py", SETTRACE_HACK),
                "fake_lines": (M1359, "src/marshmallow/__init__.py", FAKE_LINES_HACK),
                "unittest": (DJANGO, "django/contrib/auth/validators.py", UNITTEST_HACK)}
NOOP = """diff --git a/NOTES.txt b/NOTES.txt
new file mode 100644
--- /dev/null
+++ b/NOTES.txt
@@ -0,0 +1 @@
+A note that fixes nothing.
"""


@pytest.fixture(scope="session")
def docker_client():
    try:
        client = containers.connect()
    except containers.DockerUnavailable as e:
        system_parts.require("docker", str(e))
    containers.sweep(client)
    return client


@pytest.fixture(scope="session")
def swe_rows(docker_client, tmp_path_factory) -> dict[str, dict]:
    """The kiln rows of the offline instances, by instance id."""
    out = Path(os.environ["KILN_SWE_DIR"]) if os.environ.get("KILN_SWE_DIR") else tmp_path_factory.mktemp("swe")
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".lock", "w") as lock:  # `make test` runs two pytest workers: one builds, the other waits
        fcntl.flock(lock, fcntl.LOCK_EX)
        rows = task_rows.load_rows(swe_instances.main(swe_instances.Args(out=out)))
    return {row["extra_info"]["index"]: row for row in rows}


def truth_of(row: dict) -> dict:
    return json.loads(row["reward_model"]["ground_truth"])


def test_filter_drops_test_infrastructure_and_keeps_the_rest_byte_for_byte():
    def section(path: str, body: bytes = b"@@ -1 +1 @@\n-a\n+b\n") -> bytes:
        return f"diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n".encode() + body
    binary = (b"diff --git a/pkg/blob.bin b/pkg/blob.bin\nnew file mode 100644\nindex 0000000..e69de29\n"
              b"GIT binary patch\nliteral 3\nKcmZQzWMT#Y01f~H\n\nliteral 0\nHcmV?d00001\n\n")
    kept_paths = ["src/pkg/fields.py", "django/test/utils.py", "docs/\xe9t\xe9.txt", "src/pkg/contest.py"]
    dropped_paths = ["conftest.py", "src/pkg/tests/conftest.py", "tests/base.py", "testing/helpers.py",
                     "src/pkg/test_fields.py", "pkg/fields_test.py", "setup.cfg", "tox.ini", "pytest.ini",
                     "pyproject.toml", "sitecustomize.py", "lib/usercustomize.py", "evil.pth", "docs/changes.py"]
    test_patch = section("docs/changes.py").decode()  # whatever the test patch touches is the tests' business
    diff = b"".join(section(p) for p in kept_paths) + binary + b"".join(section(p) for p in dropped_paths)
    rename = (b"diff --git a/src/pkg/a.py b/tests/a.py\nsimilarity index 100%\nrename from src/pkg/a.py\n"
              b"rename to tests/a.py\n")
    kept, dropped = swe_grading.filter_diff(diff + rename, test_patch)
    assert kept == b"".join(section(p) for p in kept_paths) + binary
    assert dropped == dropped_paths + ["src/pkg/a.py", "tests/a.py"]


@pytest.mark.parametrize("smuggled", [
    # git quotes unusual names: the path must be read through the quotes
    b'diff --git "a/tests/\\303\\251/conftest.py" "b/tests/\\303\\251/conftest.py"\nnew file mode 100644\n'
    b'--- /dev/null\n+++ "b/tests/\\303\\251/conftest.py"\n@@ -0,0 +1 @@\n+import os\n',
    # an innocent header over file lines that name conftest.py (GNU patch, the last fallback, reads those)
    b"diff --git a/src/ok.py b/src/ok.py\n--- a/conftest.py\n+++ b/conftest.py\n@@ -0,0 +1 @@\n+import os\n",
    # a second file inside one section, with no header of its own
    b"diff --git a/src/ok.py b/src/ok.py\n--- a/src/ok.py\n+++ b/src/ok.py\n@@ -1 +1 @@\n-a\n+b\n"
    b"Index: conftest.py\n--- conftest.py\n+++ conftest.py\n@@ -0,0 +1 @@\n+import os\n",
    # a header that cannot be read
    b"diff --git conftest.py\n@@ -0,0 +1 @@\n+import os\n",
])
def test_filter_reads_every_name_a_patch_tool_would(smuggled):
    kept, dropped = swe_grading.filter_diff(smuggled, "")
    assert kept == b"" and dropped and any(p.endswith("conftest.py") or p == "?" for p in dropped)


def test_unreachable_daemon_is_an_error_not_a_reward(monkeypatch, tmp_path):
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no.sock")
    truth = {"instance_id": "x__y-1", "image": "kiln-swe/x:offline", "eval_script": "true", "log_parser":
             "parse_log_pytest", "eval_type": "pass_and_fail", "repo": "x/y", "version": "1", "FAIL_TO_PASS": ["t"],
             "PASS_TO_PASS": [], "test_patch": "", "base_commit": "0" * 40}
    with pytest.raises(containers.DockerUnavailable, match="cannot reach the Docker daemon"):
        swe_grading.swebench_reward(truth, NOOP.encode())


def api_error(status: int) -> docker.errors.APIError:
    response = requests.Response()
    response.status_code = status
    return docker.errors.APIError(f"daemon says {status}", response=response)


def test_transient_daemon_errors_are_retried_with_backoff_and_counted(monkeypatch):
    monkeypatch.setattr(containers, "CALL_RETRY", Retry(total=3, other=3, backoff_factor=0))
    errors, undone, before = [api_error(500), requests.exceptions.ReadTimeout("slow"), api_error(409)], [], \
        containers.docker_retries()["retries"]

    def flaky():
        if errors:
            raise errors.pop(0)
        return "started"
    assert containers.retry_transient(flaky, "start", undo=lambda: undone.append(1)) == "started"
    assert containers.docker_retries()["retries"] - before == 3 and len(undone) == 3
    for permanent in (api_error(400), docker.errors.NotFound("gone")):  # the same call would fail the same way
        with pytest.raises(type(permanent)):
            containers.retry_transient(lambda: (_ for _ in ()).throw(permanent), "start")
    with pytest.raises(docker.errors.APIError, match="503 Server Error"):  # out of tries: the last error
        containers.retry_transient(lambda: (_ for _ in ()).throw(api_error(503)), "start")


def test_idempotent_calls_are_retried_inside_the_sdk(monkeypatch):
    """A daemon on 127.0.0.1 that answers /_ping with 503 twice: the SDK's urllib3 Retry asks again, counted."""
    pings = []

    class Daemon(BaseHTTPRequestHandler):
        def do_GET(self):
            pings.append(self.path) if self.path.endswith("/_ping") else None
            busy = self.path.endswith("/_ping") and len(pings) <= 2
            body = b"busy" if busy else (b"OK" if self.path.endswith("/_ping") else b'{"ApiVersion": "1.41"}')
            self.send_response(503 if busy else 200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass
    server = ThreadingHTTPServer(("127.0.0.1", 0), Daemon)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("DOCKER_HOST", f"tcp://127.0.0.1:{server.server_address[1]}")
    before = containers.docker_retries()["retries"]
    try:
        containers.connect()
    finally:
        server.shutdown()
    assert len(pings) == 3 and containers.docker_retries()["retries"] - before == 2


@pytest.mark.docker
def test_a_container_that_cannot_start_raises_after_retries_and_leaves_nothing(docker_client, monkeypatch):
    monkeypatch.setattr(containers, "CALL_RETRY", Retry(total=2, other=2, backoff_factor=0))
    monkeypatch.setattr(docker_client.api, "start", lambda *a, **k: (_ for _ in ()).throw(api_error(500)))
    before = containers.docker_retries()
    with pytest.raises(containers.ContainerStartFailed, match="after 2 retries"):
        containers.Container(docker_client, swe_instances.BASE_IMAGE, role="grade", run="never-starts")
    after = containers.docker_retries()
    assert (after["retries"] - before["retries"], after["start_failures"] - before["start_failures"]) == (2, 1)
    assert docker_client.containers.list(all=True, filters={"label": f"{containers.RUN}=never-starts"}) == []


def test_under_ci_a_missing_daemon_fails_the_docker_tests(tmp_path):
    def outcome(ci: str) -> str:
        env = os.environ | {"DOCKER_HOST": f"unix://{tmp_path}/no.sock", "CI": ci}
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA",
                                 f"{__file__}::test_missing_image_is_an_error"], env=env, cwd=ROOT,
                                capture_output=True, text=True, timeout=300)
        return result.stdout
    under_ci = outcome("true")  # each outcome is a pytest run of its own (about 10 s of imports)
    assert "1 error" in under_ci and "CI=true and missing system part docker" in under_ci
    assert "1 skipped" in outcome("")


@pytest.mark.docker
@pytest.mark.parametrize("instance, f2p", [(M1343, 1), (M1359, 1), (DJANGO, 2)])
def test_gold_resolves_and_empty_noop_garbage_do_not(docker_client, swe_rows, instance, f2p):
    row = swe_rows[instance]
    gold = rewards.score(row, truth_of(row)["patch"])
    assert gold.score == 1.0 and gold.info["resolved"] and gold.info["status"] == "RESOLVED_FULL"
    assert gold.info["f2p"] == [f2p, f2p] and gold.info["p2p"][0] == gold.info["p2p"][1] >= 20
    noop = rewards.score(row, NOOP)  # applies, the tests run, the F2P tests still fail
    assert noop.score == -1.0 and noop.info["f2p"] == [0, f2p] and noop.info["error"] is None
    assert noop.info["p2p"] == gold.info["p2p"]
    empty = rewards.score(row, "")
    assert empty.score == -1.0 and empty.info["error"] == "empty_patch"
    garbage = rewards.score(row, "diff --git a/src/x.py b/src/x.py\n--- a/src/x.py\n+++ b/src/x.py\n@@ nonsense\n")
    assert garbage.score == -1.0 and garbage.info["error"] == "patch_apply" and garbage.info["reason"]
    prose = rewards.score(row, "I fixed it, trust me.")
    assert prose.score == -1.0 and prose.info["error"] == "patch_apply"


@pytest.mark.docker
@pytest.mark.parametrize("hack, paths", [(CONFTEST_HACK, ["conftest.py"]), (TEST_FILE_HACK, ["tests/base.py"])])
def test_test_infrastructure_hacks_are_dropped_and_reported(docker_client, swe_rows, monkeypatch, hack, paths):
    row = swe_rows[M1359]
    filtered = rewards.score(row, hack)
    assert filtered.score == -1.0 and filtered.info["dropped"] == paths and filtered.info["error"] == "empty_patch"
    with_gold = rewards.score(row, hack + truth_of(row)["patch"])  # the fix still counts, the hack is dropped
    assert with_gold.score == 1.0 and with_gold.info["dropped"] == paths
    monkeypatch.setattr(swe_grading, "is_protected", lambda path, test_files: False)
    unfiltered = rewards.score(row, hack)  # past the filter, the canaries still see the forged report
    assert (unfiltered.score, unfiltered.info["error"], unfiltered.info["dropped"]) == (-1.0, "tampered", [])
    monkeypatch.setattr(swe_grading, "plan_canaries", lambda spec: [])
    monkeypatch.setattr(swe_grading, "check_canaries", lambda *args: None)
    forged = rewards.score(row, hack)  # what the filter and the canaries prevent: graded resolved
    assert forged.score == 1.0 and forged.info["dropped"] == []


@pytest.mark.docker
@pytest.mark.parametrize("hack", list(SOURCE_HACKS))
def test_source_level_hacks_are_caught_by_the_canaries_on_both_grading_paths(docker_client, swe_rows, monkeypatch,
                                                                             hack):
    """Each hack forges the report from the code under test (no path filter can see it): without the canaries kiln's
    grader resolves it; with them both graders score it -1, "tampered", with the reason."""
    instance, path, code = SOURCE_HACKS[hack]
    truth = truth_of(swe_rows[instance])
    with containers.Container(docker_client, truth["image"], role="grade", run="hack") as box:
        box.put_file("/hack.py", code.encode())
        assert box.exec(f"cat /hack.py >> {path} && rm /hack.py").exit_code == 0
        patch = containers.container_diff(box, truth["base_commit"])
    for official in (False, True):
        caught = swe_grading.swebench_reward(truth, patch, docker_client, swe_grading.SweConfig(official=official))
        assert (caught.score, caught.info["error"], caught.info["dropped"]) == (-1.0, "tampered", [])
        assert caught.info["canaries"] == 2 * caught.info["renamed"] >= 2 and caught.info["suspicious"]
    if hack != "fake_lines":  # the variants that must fail are reported passing, or (the forged unittest result can
        # leave a variant's line out of Django's log, depending on where the rewrite drew it) not reported at all
        assert "must fail" in caught.info["reason"] or "variants missing" in caught.info["reason"], caught.info
    else:  # the forged line names a test that, renamed, never ran under that name
        assert "is reported, but the grading renamed it" in caught.info["reason"]
    monkeypatch.setattr(swe_grading, "plan_canaries", lambda spec: [])
    monkeypatch.setattr(swe_grading, "check_canaries", lambda *args: None)
    forged = swe_grading.swebench_reward(truth, patch, docker_client)  # what the canaries prevent
    assert forged.score == 1.0 and forged.info["f2p"][0] == forged.info["f2p"][1]


# An instance image whose repository knows its future, the way published images can (SWE-bench#465): the fix
# committed on another branch, tagged, behind a remote-tracking ref, ORIG_HEAD and FETCH_HEAD, in a stash, in a
# commit only a reflog reaches and in a dangling blob; refs packed. HEAD is back on the base commit, the tree clean.
FUTURE_HISTORY = """set -e
g="git -c user.name=future -c user.email=future@localhost"
branch=$(git symbolic-ref --short HEAD)
$g checkout -q -b future && git apply /gold.diff && $g commit -qam "the fix" && future=$(git rev-parse HEAD)
$g tag -a v9 -m "release with the fix" && git update-ref refs/remotes/origin/main "$future"
git remote add origin https://example.invalid/repo.git
$g checkout -q -b gone && git apply /gold.diff && echo '# gone' >> README.rst && $g commit -qam "gone"
$g checkout -q "$branch" && $g branch -q -D gone
echo "$future" > .git/ORIG_HEAD && printf '%s\\t\\tbranch main of origin\\n' "$future" > .git/FETCH_HEAD
git apply /gold.diff && $g stash -q
git hash-object -w /gold.diff >/dev/null
rm /gold.diff && git pack-refs --all && test -z "$(git status --porcelain)" && echo "$future"
"""


@pytest.mark.docker
def test_agent_containers_hold_no_history_beyond_the_base_commit(docker_client, swe_rows):
    truth = truth_of(swe_rows[M1359])
    fix_line = "getattr(self.root.opts, self.SCHEMA_OPTS_VAR_NAME)"
    find_fix = f"git cat-file --batch-all-objects --batch | grep -c -F '{fix_line}'; grep -rlF '{fix_line}' .git"
    with containers.Container(docker_client, truth["image"], role="grade", run="future") as box:
        box.put_file("/gold.diff", truth["patch"].encode())
        made = box.exec(FUTURE_HISTORY)
        assert made.exit_code == 0, made.output
        future = made.output.split()[-1]
        box._container.commit("kiln-swe/future-history", "test")
    image = "kiln-swe/future-history:test"
    try:
        with containers.Container(docker_client, image, role="grade", run="future") as plain:
            assert int(plain.exec(find_fix).output.split()[0]) >= 2  # what the agent would find without the scrub
            assert future in plain.exec("git log --all --reflog --format=%H").output
        with containers.Container(docker_client, image, role="agent", run="future") as agent:
            assert agent.exec(find_fix).output.split() == ["0"]
            assert agent.exec(f"grep -rl {future} .git").output == ""
            assert agent.exec(f"git cat-file -t {future}").exit_code != 0
            listing = agent.exec("git log --all --reflog --format=%H; git tag; git stash list; git remote; "
                                 "git fsck --unreachable --no-reflogs --no-progress; ls .git")
            assert listing.output.split()[0] == truth["base_commit"] and future not in listing.output
            assert sorted(listing.output.split()[1:]) == ["HEAD", "config", "description", "hooks", "index", "info",
                                                          "objects", "packed-refs", "refs"]
            assert agent.exec("git status --porcelain && git diff --stat").output == ""
            assert agent.exec("git log -1 --format=%H").output.strip() == truth["base_commit"]
            assert agent.exec("git apply /dev/stdin <<'EOF'\n" + truth["patch"] + "EOF").exit_code == 0
            graded = swe_grading.swebench_container_reward(truth, agent, docker_client)
            assert graded.score == 1.0  # the agent's diff against the base still grades
    finally:
        for tag in (containers.history_free_image(docker_client, image), image):
            docker_client.images.remove(tag, force=True)


@pytest.mark.docker
def test_agent_container_diff_binary_and_new_files_a_p2p_break_and_unusable_diffs(docker_client, swe_rows):
    truth = truth_of(swe_rows[M1359])
    with containers.Container(docker_client, truth["image"], role="agent", run="test") as agent:
        agent.put_file("/gold.diff", truth["patch"].encode())
        assert agent.exec("git apply /gold.diff && rm /gold.diff").exit_code == 0
        agent.put_file("/testbed/src/marshmallow/blob.bin", bytes(range(256)) * 4)
        assert agent.exec("printf 'X = 1\\n' > src/marshmallow/extra.py && printf 'import pytest\\n' > conftest.py"
                          ).exit_code == 0
        diff = containers.container_diff(agent, truth["base_commit"])
        resolved = swe_grading.swebench_container_reward(truth, agent, docker_client)
        assert resolved.score == 1.0 and resolved.info["dropped"] == ["conftest.py"]
        assert agent.exec("sed -i 's/^Int = Integer$/Int = Number/' src/marshmallow/fields.py && "
                          "grep -c '^Int = Number$' src/marshmallow/fields.py").output.strip() == "1"
        broken = containers.container_diff(agent, truth["base_commit"])
        agent.put_file("/testbed/src/marshmallow/huge.bin", os.urandom(2_000_000))
        small = swe_grading.SweConfig(max_patch_bytes=10**6)
        huge = swe_grading.swebench_container_reward(truth, agent, docker_client, small)
        assert (huge.score, huge.info["error"]) == (-1.0, "diff") and "over the 1000000" in huge.info["reason"]
        assert agent.exec("rm -rf .git").exit_code == 0  # the agent broke its repository: its doing, so -1
        no_repo = swe_grading.swebench_container_reward(truth, agent, docker_client)
        assert (no_repo.score, no_repo.info["error"]) == (-1.0, "diff")
        assert "not a git repository" in no_repo.info["reason"]
    assert b"GIT binary patch" in diff and b"b/src/marshmallow/extra.py\nnew file mode" in diff
    p2p_broken = swe_grading.swebench_reward(truth, broken, docker_client)
    assert p2p_broken.score == -1.0 and p2p_broken.info["f2p"] == [1, 1]
    assert p2p_broken.info["p2p"][0] < p2p_broken.info["p2p"][1]
    relaxed = swe_grading.swebench_reward(truth, broken, docker_client, swe_grading.SweConfig(require_p2p=False))
    assert relaxed.score == 1.0


@pytest.mark.docker
def test_missing_image_is_an_error(docker_client, swe_rows):
    truth = truth_of(swe_rows[M1343]) | {"image": "kiln-swe/no-such-image:offline"}
    with pytest.raises(containers.ImageMissing, match="kiln-swe/no-such-image:offline"):
        swe_grading.swebench_reward(truth, truth["patch"].encode(), docker_client)


@pytest.mark.docker
def test_commands_are_contained(docker_client):
    limits = containers.ContainerLimits(pids=64, memory="256m", timeout=30)
    with containers.Container(docker_client, swe_instances.BASE_IMAGE, role="agent", limits=limits,
                              workdir="/") as box:
        assert box._container.labels[containers.OWNER] == containers.owner_label()
        hang = box.exec("sleep 600", timeout=2)
        assert hang.timed_out and hang.exit_code == 137
        background = box.exec("sleep 600 & echo started")
        assert background.output == "started\n" and not background.timed_out and background.exit_code == 0
        assert box.exec("cat /proc/[0-9]*/comm | grep -c sleep").output == "0\n"  # the background job went with it
        assert box.exec("kill -9 -1; echo killed everything").exit_code == 137  # every process but PID 1 ...
        assert box.exec("cat /proc/1/comm").output == "bash\n"  # ... which no signal from inside reaches
        flood = box.exec("head -c 50000000 /dev/zero | tr '\\0' a", cap=10_000)
        assert flood.truncated and flood.exit_code == 0 and len(flood.output) < 10_100
        assert flood.output.startswith("a" * 5000) and "49990000 bytes cut" in flood.output
        bomb = box.exec("bomb() { bomb | bomb & }; bomb; sleep 3", timeout=20)
        assert "fork: " in bomb.output and "Resource temporarily unavailable" in bomb.output  # held at the pids limit
        assert box.exec("echo alive").output == "alive\n"
        assert int(box.exec("ls -d /proc/[0-9]* | wc -l").output) < 10  # and nothing of it left running
        pids_max = box.exec("cat /sys/fs/cgroup/pids/pids.max 2>/dev/null || cat /sys/fs/cgroup/pids.max")
        assert pids_max.output.strip() == "64"
        memory = box.exec("python3 -c 'x = bytearray(600 * 2**20)'")
        assert memory.exit_code == 137 and not memory.timed_out
        network = box.exec("ls /sys/class/net; python3 -c \"import socket; "
                           "socket.create_connection(('1.1.1.1', 53), timeout=3)\"")
        assert network.output.split()[0] == "lo" and network.exit_code != 0
        box.put_file("/root/data.bin", bytes(range(256)))
        assert box.get_file("/root/data.bin") == bytes(range(256))
        with pytest.raises(ValueError, match="tmpfs"):
            box.put_file("/tmp/x", b"")
        name = box.name
    with pytest.raises(docker.errors.NotFound):
        docker_client.containers.get(name)


@pytest.mark.docker
def test_sweep_removes_a_killed_runs_containers_and_ttl_expires_them(docker_client):
    script = ("import sys, time; sys.path.insert(0, sys.argv[1]); import containers\n"
              "client = containers.connect()\n"
              "boxes = [containers.Container(client, sys.argv[2], role='agent', run='killed') for _ in range(2)]\n"
              "print(' '.join(b.name for b in boxes), flush=True)\n"
              "time.sleep(600)\n")
    child = subprocess.Popen([sys.executable, "-c", script, str(ROOT), swe_instances.BASE_IMAGE],
                             stdout=subprocess.PIPE, text=True)
    names = child.stdout.readline().split()
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert len(names) == 2 and all(docker_client.containers.get(n).status == "running" for n in names)
    with containers.Container(docker_client, swe_instances.BASE_IMAGE, role="agent", run="alive") as mine:
        removed = containers.sweep(docker_client)
        assert set(names) <= set(removed) and mine.name not in removed  # a live owner's containers stay
        assert docker_client.containers.get(mine.name).status == "running"
    for name in names:
        with pytest.raises(docker.errors.NotFound):
            docker_client.containers.get(name)
    short = containers.Container(docker_client, swe_instances.BASE_IMAGE, role="agent",
                                 limits=containers.ContainerLimits(ttl=2))
    for _ in range(60):  # PID 1 is `sleep 2`, auto-removed: gone without kiln doing anything
        try:
            docker_client.containers.get(short.name)
        except docker.errors.NotFound:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"{short.name} outlived its TTL")


def test_score_reads_swebench_predictions_and_names_an_unknown_instance(tmp_path):
    rows = {"swebench/a__b-1": {"data_source": "swebench"}, "toy/0": {"data_source": "toy"}}
    predictions = tmp_path / "preds.jsonl"
    predictions.write_text(json.dumps({"instance_id": "a__b-1", "model_patch": "diff --git a/x b/x\n",
                                       "model_name_or_path": "m"}) + "\n"
                           + json.dumps({"instance_id": "a__b-1", "model_patch": None, "model_name_or_path": "m"})
                           + "\n" + json.dumps({"task_id": "toy/0", "completion": "x = 1"}) + "\n")
    assert rewards.read_samples(str(predictions), rows) == (["swebench/a__b-1", "swebench/a__b-1", "toy/0"],
                                                            ["diff --git a/x b/x\n", "", "x = 1"], [None] * 3)
    predictions.write_text(json.dumps({"instance_id": "c__d-2", "model_patch": "", "model_name_or_path": "m"}) + "\n")
    with pytest.raises(ValueError, match=r"line 1: instance 'c__d-2' is not among the 1 swebench rows of --data"):
        rewards.read_samples(str(predictions), rows)
    predictions.write_text(json.dumps({"instance_id": "a__b-1", "model_patch": 3}) + "\n")
    with pytest.raises(ValueError, match='line 1: "model_patch" must be a string'):
        rewards.read_samples(str(predictions), rows)


@pytest.mark.docker
def test_score_cli_grades_a_prediction_file_with_kiln_or_run_instance_alike(docker_client, swe_rows, tmp_path):
    task_rows.write_rows([swe_rows[M1343]], tmp_path / "rows.parquet")
    gold = truth_of(swe_rows[M1343])["patch"]
    (tmp_path / "preds.jsonl").write_text("".join(json.dumps({"instance_id": M1343, "model_patch": patch,
                                                              "model_name_or_path": "m"}) + "\n"
                                                  for patch in (gold, CONFTEST_HACK)))
    results = {}
    for official in (False, True):
        out = tmp_path / f"results_{official}.jsonl"
        summary = rewards.main(rewards.ScoreArgs(str(tmp_path / "preds.jsonl"), str(tmp_path / "rows.parquet"),
                                                 out=str(out), official=official))
        results[official] = [json.loads(line) for line in out.read_text().splitlines()]
        assert summary["swe"]["swe/resolve_rate"] == 0.5 and summary["swe"]["swe/dropped_files"] == 1
    kiln, official = results[False], results[True]
    assert [r["score"] for r in kiln] == [r["score"] for r in official] == [1.0, -1.0]
    assert kiln[0]["info"]["graded_by"] == "kiln" and official[0]["info"]["graded_by"] == "run_instance"
    for a, b in zip(kiln, official):
        assert {k: a["info"].get(k) for k in ("f2p", "p2p", "status", "dropped", "error")} == \
            {k: b["info"].get(k) for k in ("f2p", "p2p", "status", "dropped", "error")}


@pytest.mark.docker
def test_official_run_instance_agrees_with_kiln_and_leaves_nothing_behind(docker_client, swe_rows, tmp_path,
                                                                          monkeypatch):
    """swebench's run_instance on the local image (no pull), a unique run id per grading, its logs removed, its
    container gone at once; the same verdicts as kiln's grader on the gold patch and on the unpatched tree."""
    monkeypatch.chdir(tmp_path)  # run_instance's default log folder is ./logs: nothing may land there
    truth, official = truth_of(swe_rows[M1343]), swe_grading.SweConfig(official=True)
    pulls = []
    monkeypatch.setattr(docker.models.images.ImageCollection, "pull", lambda self, *a, **k: pulls.append(a))
    for patch in (truth["patch"].encode(), None):
        kiln = swe_grading.run_tests(truth, patch, docker_client)
        harness = swe_grading.run_tests(truth, patch, docker_client, official)
        assert harness.info["graded_by"] == "run_instance" and kiln.info["graded_by"] == "kiln"
        assert (kiln.score, kiln.info["status"], kiln.info["f2p"], kiln.info["p2p"], kiln.info["error"]) == \
            (harness.score, harness.info["status"], harness.info["f2p"], harness.info["p2p"], harness.info["error"])
        assert kiln.score == (1.0 if patch else -1.0)
    garbage = swe_grading.swebench_reward(truth, b"diff --git a/src/x.py b/src/x.py\n--- a/src/x.py\n+++ "
                                                 b"b/src/x.py\n@@ nonsense\n", docker_client, official)
    assert (garbage.score, garbage.info["error"]) == (-1.0, "patch_apply")
    with pytest.raises(containers.ImageMissing, match="no-such-image"):
        swe_grading.run_tests(truth | {"image": "kiln-swe/no-such-image:offline"}, None, docker_client, official)
    assert pulls == [] and not (tmp_path / "logs").exists()
    assert list(swe_grading._harness_log_root().iterdir()) == []
    assert [c.name for c in docker_client.containers.list(all=True, filters={"name": "sweb.eval."})
            if ".kiln-" in c.name] == []


@pytest.mark.docker
def test_swe_check_passes_good_rows_and_fails_a_row_whose_gold_patch_does_not_resolve(docker_client, swe_rows,
                                                                                        tmp_path):
    good = swe_rows[M1343]
    truth = truth_of(good) | {"instance_id": M1343 + "0", "patch": NOOP}
    broken = good | {"reward_model": good["reward_model"] | {"ground_truth": json.dumps(truth)},
                     "extra_info": good["extra_info"] | {"index": truth["instance_id"]}}
    task_rows.write_rows([good, broken], tmp_path / "rows.parquet")
    result = script_runner.run([sys.executable, str(ROOT / "rewards.py"), "swe-check", str(tmp_path / "rows.parquet")],
                            capture_output=True, text=True, timeout=600)
    lines = {line.split()[0]: line for line in result.stdout.splitlines()[1:] if line.startswith("marshmallow")}
    assert result.returncode == 1 and f"1 of 2 rows fail the check: {truth['instance_id']}" in result.stderr
    assert lines[M1343].split()[1:6] == ["full", "1/1", "24/24", "no", "0/1"] and lines[M1343].endswith("ok")
    assert lines[truth["instance_id"]].split()[1:3] == ["no", "0/1"] and "FAIL: gold patch not resolved" in \
        lines[truth["instance_id"]]
    toy = tmp_path / "toy.parquet"
    task_rows.write_rows([good | {"data_source": "toy", "reward_model": {
        "style": "rule", "ground_truth": json.dumps({"test_list": ["assert True"]})}}], toy)
    refused = script_runner.run([sys.executable, str(ROOT / "rewards.py"), "swe-check", str(toy)], capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode == 1 and "swe-check checks swebench rows; 1 rows are not" in refused.stderr
