"""SWE-bench grading: an agent's diff, stripped of the test infrastructure it must not touch, applied in a fresh
container from the instance image, its tests run and the log graded by swebench 5.x (its parsers, get_logs_eval,
get_eval_tests_report, resolution status). +1 resolved, -1 otherwise; a missing image or an unreachable daemon raises.

Two graders give the same verdict format: kiln's (containers.py: no network, limits, labels, SIGKILL removal; what
training uses) and, for evaluation, swebench's own `run_instance` (`SweConfig.official`), which runs with a unique
run id, logs into a temporary folder of its own and removes its container at once. `swe_check` checks rows: each
gold patch must resolve and the unpatched tree must not. rewards.py dispatches data_source "swebench" here and holds
the CLI (`python rewards.py score` / `swe-check`).
"""
from __future__ import annotations

import atexit
import codecs
import functools
import json
import re
import shlex
import shutil
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import docker.errors
from swebench.harness import run_evaluation
from swebench.harness.constants import (APPLY_PATCH_FAIL, END_TEST_OUTPUT, FAIL_TO_PASS, LOG_INSTANCE,
                                        LOG_TEST_OUTPUT, PASS_TO_PASS, START_TEST_OUTPUT, EvalType, ResolvedStatus,
                                        TestStatus)
from swebench.harness.grading import get_eval_tests_report, get_logs_eval, get_resolution_status
from swebench.harness.log_parsers import PARSER_REGISTRY
from swebench.harness.utils import make_test_spec
from swebench.types import TestSpec

import containers
import swe_canaries

# Files the policy must not change, whatever its diff says: pytest loads them while grading (conftest.py, test
# configuration), the interpreter runs them at start-up (sitecustomize, usercustomize, .pth), or they are tests. A root
# conftest.py that marks every test passed is graded "resolved" by the official harness.
PROTECTED_NAMES = {"conftest.py", "pytest.ini", ".pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml", "noxfile.py",
                   "sitecustomize.py", "usercustomize.py"}
TEST_DIRS = {"tests", "testing"}  # not "test": Django's source has django/test/
TEST_FILE = re.compile(r"(^test_.*|.*_test|^tests)\.py$")
# The official harness's order; git apply is all-or-nothing, so only --3way can leave a half-applied tree behind.
APPLY = ("git apply --verbose {p}", "git apply --verbose --3way {p}", "patch --batch --forward --fuzz=5 -p1 -i {p}")
DIFF_HEADER = re.compile(rb"^diff --git ", re.M)
HEADER_PATHS = re.compile(rb'(?:"a/((?:[^"\\]|\\.)*)"|a/(.*?)) (?:"b/((?:[^"\\]|\\.)*)"|b/(.*))')
# Every line that can name a file to git apply or GNU patch (the last fallback, which also reads Index: lines and
# context diffs). A hunk line never starts like these, so no file can hide behind another's header.
NAME_LINE = re.compile(rb"^(--- |\+\+\+ |\*\*\* |Index: |rename from |rename to |copy from |copy to )(.*)$", re.M)
PYTEST_ID = re.compile(r"^([^:\s]+\.py)::")
UNITTEST_ID = re.compile(r"^\w+ \(([\w.]+)\)")  # Django's runner: "test_x (module.Class)" or "(module.Class.test_x)"
PASSING = {TestStatus.PASSED.value, TestStatus.XFAIL.value}
FAILING = {TestStatus.FAILED.value, TestStatus.ERROR.value}
CANARY_COPIES, CANARY_FAILS = 1, 1  # beside each renamed FAIL_TO_PASS test: copies that must agree, variants that fail
REWRITE_END = "EOF_KILN_REWRITE"
HARNESS_MODEL = "kiln"  # the model_name_or_path of run_instance's predictions (a folder of its log tree)
# run_instance logs through a logger named after the instance, shared by concurrent runs of it (and closed by the first
# to end): one run per instance at a time keeps each log whole, and its verdict on a patch that does not apply right.
HARNESS_LOCKS: defaultdict[str, threading.Lock] = defaultdict(threading.Lock)


@dataclass
class Grade:
    """A graded patch: +1.0 resolved, -1.0 otherwise; info holds instance_id, dropped (protected paths left out), f2p
    and p2p ([passed, total]), status (swebench's ResolvedStatus value), error (None when the tests ran and were
    graded, else empty_patch, patch_apply, eval_timeout, tests_not_run, diff, tampered or suspicious) and its reason,
    renamed (FAIL_TO_PASS test functions renamed for the grading) and canaries (the tests planted beside them),
    suspicious (screen_patch's findings in the patch), seconds."""
    score: float
    info: dict = field(default_factory=dict)


@dataclass(frozen=True)
class SweConfig:
    eval_timeout: float = 1800.0
    """wall seconds for the instance's eval script (the tests) before it is killed and scored -1"""
    require_p2p: bool = True
    """resolved needs every PASS_TO_PASS test to still pass, as in SWE-bench; False: the FAIL_TO_PASS tests only"""
    log_cap: int = 32_000_000
    """most bytes of test log kept (head and tail)"""
    max_patch_bytes: int = 20_000_000
    """an agent's diff over this is -1 (error "diff"), not graded"""
    limits: containers.ContainerLimits = containers.ContainerLimits()
    """the grading container's limits (kiln's grader)"""
    official: bool = False
    """grade with swebench's own run_instance (evaluation: slower, its container has network and no kiln limits)"""
    suspicious_fails: bool = False
    """a patch screen_patch flags scores -1 (error "suspicious") without running its tests; off by default, as some
    real fixes touch test utilities: the flag is then only reported (info["suspicious"], swe/suspicious)"""


def diff_files(diff: bytes) -> list[tuple[list[str], bytes]]:
    """A git diff split per `diff --git` section: (every path the section names, the section). Bytes throughout:
    binary patches and file names in any encoding pass through unchanged. A header that cannot be read names
    the path "?" (which is protected)."""
    starts = [m.start() for m in DIFF_HEADER.finditer(diff)]
    sections = [diff[a:b] for a, b in zip(starts, starts[1:] + [len(diff)])]
    return [(_section_paths(section), section) for section in sections]


def _section_paths(section: bytes) -> list[str]:
    header = HEADER_PATHS.fullmatch(section.split(b"\n", 1)[0][len(b"diff --git "):].rstrip(b"\r"))
    paths = [(_unquote(q) if q is not None else p) for q, p in ((header[1], header[2]), (header[3], header[4]))] \
        if header else [b"?"]
    for kind, name in NAME_LINE.findall(section):
        name = name.split(b"\t")[0].rstrip(b"\r")
        name = _unquote(name[1:-1]) if name[:1] == name[-1:] == b'"' else name
        if kind in (b"--- ", b"+++ ", b"*** ") and name != b"/dev/null":  # -p1: the first component goes
            name = name.partition(b"/")[2] or name
        paths.append(name)
    return list(dict.fromkeys(p.decode(errors="replace") for p in paths if p != b"/dev/null"))


def _unquote(name: bytes) -> bytes:
    """Git's C-style quoting of unusual file names ("a/t\\303\\251st.py") undone."""
    return codecs.escape_decode(name)[0]


def is_protected(path: str, test_patch_files: set[str]) -> bool:
    parts = path.split("/")
    return (path in test_patch_files or parts[-1] in PROTECTED_NAMES or parts[-1].endswith(".pth")
            or bool(TEST_DIRS.intersection(parts[:-1])) or bool(TEST_FILE.match(parts[-1])) or path == "?")


def filter_diff(diff: bytes, test_patch: str) -> tuple[bytes, list[str]]:
    """The diff without protected files (see PROTECTED_NAMES; the test patch's files and test files too), and the
    paths dropped. A rename counts as touching both of its paths."""
    test_patch_files = {p for paths, _ in diff_files(test_patch.encode()) for p in paths}
    kept, dropped = [], []
    for paths, section in diff_files(diff):
        if any(is_protected(p, test_patch_files) for p in paths):
            dropped.extend(p for p in paths if p not in dropped)
        else:
            kept.append(section)
    return b"".join(kept), dropped


def spec_of(truth: dict) -> TestSpec:
    """swebench's TestSpec of a row's ground truth; a log parser swebench does not know is refused, naming it."""
    if truth["log_parser"] not in PARSER_REGISTRY:
        raise ValueError(f"{truth['instance_id']}: unknown log_parser {truth['log_parser']!r} for swebench")
    return make_test_spec(truth)


@dataclass(frozen=True)
class Target:
    """A FAIL_TO_PASS test function that every grading renames and surrounds with canaries (swe_canaries.py)."""
    candidates: tuple[str, ...]
    """files that may hold it, in order; the first that exists is rewritten"""
    scope: tuple[str, ...]
    """its class chain in that file (empty: a module function)"""
    name: str
    """its name (the part of its test ids the renaming changes)"""
    key: tuple[str, ...]
    """what else identifies it in a test id: the file and classes (pytest), the module and class (Django)"""


@dataclass(frozen=True)
class Renamed:
    """A Target as the grading container renamed it: its fresh names and their roles (target, copy, fail)."""
    target: Target
    tests: dict[str, str]

    def named(self, role: str) -> list[str]:
        return [name for name, r in self.tests.items() if r == role]


def test_parts(test: str, log_parser: str) -> tuple[tuple[str, ...], str] | None:
    """(key, function name) of a pytest id ("path.py::Class::test[param]") or, for Django's runner, of a unittest id
    ("test_x (module.Class)", also "test_x (module.Class.test_x)"); None for other forms."""
    if PYTEST_ID.match(test):
        path, *scope, name = test.split("[")[0].split("::")
        return (path, *scope), name
    if log_parser == "parse_log_django" and (unittest_id := UNITTEST_ID.match(test)):
        name, parts = test.split(" ")[0], unittest_id[1].split(".")
        return tuple(parts[:-1] if parts[-1] == name else parts), name
    return None


def plan_canaries(spec: TestSpec) -> list[Target]:
    """The FAIL_TO_PASS test functions to rename (parametrized ids share one), for pytest ids and Django's runner ids;
    ids of other forms get none."""
    targets = {}
    for test in spec.FAIL_TO_PASS:
        parts = test_parts(test, spec.log_parser)
        if parts is None or not parts[1].isidentifier():
            continue
        key, name = parts
        if PYTEST_ID.match(test):
            candidates, scope = (key[0],), key[1:]
        else:  # runtests.py's labels are relative to tests/
            candidates, scope = (f"tests/{'/'.join(key[:-1])}.py", f"tests/{'/'.join(key[:-1])}/__init__.py"), key[-1:]
        targets[key, name] = Target(candidates, scope, name, key)
    return list(targets.values())


@functools.cache
def _rewriter_source() -> str:
    return Path(swe_canaries.__file__).read_text()


def plant_canaries(eval_script: str, targets: Sequence[Target]) -> str:
    """The eval script deleting itself (bash keeps reading it), then rewriting the test files with swe_canaries.py
    just before the tests run (its closing `git checkout` of the test files undoes it). The script holds no name the
    rewrite draws: those exist only in the container's Python while it runs, and in the log it writes."""
    lines = eval_script.split("\n")
    start = next((i for i, line in enumerate(lines) if START_TEST_OUTPUT in line), None)
    if start is None:
        raise ValueError(f"the eval script has no {START_TEST_OUTPUT!r} marker")
    plan = json.dumps({"targets": [{"candidates": t.candidates, "scope": t.scope, "name": t.name} for t in targets],
                       "copies": CANARY_COPIES, "fails": CANARY_FAILS})
    planted = ['rm -f "$0"']
    if targets:
        planted += [f'"$(command -v python3 || command -v python)" -I -S - {shlex.quote(plan)} <<\'{REWRITE_END}\'',
                    _rewriter_source().rstrip("\n"), REWRITE_END]
    return "\n".join(lines[:start] + planted + lines[start:])


def rename_records(log: str) -> list[str]:
    """The rewrite's records in a log, wherever a line holds one (run_instance's log interleaves stdout and stderr)."""
    return re.findall(re.escape(swe_canaries.RENAMED) + r"(\[.*\])$", log, re.M)


def read_renames(spec: TestSpec, targets: Sequence[Target], log: str) -> list[Renamed] | None:
    """What the rewrite reported (its one record; check_canaries distrusts a log with more), or None when it did not
    run. A rewrite that failed, or left a target out, is the row's fault or the grader's, not the patch's: RuntimeError
    naming the instance."""
    records = rename_records(log)
    if not records:
        if swe_canaries.FAILED in log:
            raise RuntimeError(f"{spec.instance_id}: the test files could not be rewritten for grading: "
                               + log.split(swe_canaries.FAILED)[1].split("\n")[0].strip())
        if START_TEST_OUTPUT in log and targets:
            raise RuntimeError(f"{spec.instance_id}: the tests ran, but the grading's rewrite of the test files "
                               "did not")
        return None
    for text in records:  # the first whole one (check_canaries distrusts a log with more than one)
        try:
            record = {(tuple(r["scope"]), r["name"], r["file"]): r["tests"] for r in json.loads(text)}
        except (ValueError, KeyError, TypeError):
            continue
        renames = [Renamed(target, tests) for target in targets for (scope, name, file), tests in record.items()
                   if scope == target.scope and name == target.name and file in target.candidates]
        if len(renames) == len(targets):
            return renames
    raise RuntimeError(f"{spec.instance_id}: the grading's rewrite of the test files left out a FAIL_TO_PASS test")


def map_back(log: str, renames: Sequence[Renamed]) -> str:
    """The log with each renamed test under its own name again (copies and variants keep their fresh names, which no
    expected test has)."""
    for renamed in renames:
        log = log.replace(renamed.named("target")[0], renamed.target.name)
    return log


def check_canaries(spec: TestSpec, renames: Sequence[Renamed], log: str) -> str | None:
    """Why the test report is not to be trusted, or None. Each log line is parsed on its own with the row's parser:
    - the log holds more than the rewrite's one record, or a failure line beside it (printed by the code under test);
    - a renamed test is reported under its own name (no runner saw that name);
    - a variant that must fail is reported passing (or xfail);
    - a renamed test passed but one of its copies did not, or one of its variants is missing;
    - an expected test (FAIL_TO_PASS, PASS_TO_PASS) is reported with two statuses, or more often than a renamed one.
    A run where the renamed tests all fail (unfixed, or a patch that breaks the test module) is no forgery: None."""
    if renames and (len(rename_records(log)) > 1 or swe_canaries.FAILED in log):
        return f"the log holds {len(rename_records(log))} records of the grading's rewrite of the tests; it wrote one"
    parser, reported = PARSER_REGISTRY[spec.log_parser], defaultdict(list)
    for line in log.split(START_TEST_OUTPUT, 1)[-1].split(END_TEST_OUTPUT)[0].split("\n"):
        for test, status in parser(line, spec).items():
            reported[test].append(status)
    roles = {(r.target.key, name): (r, role) for r in renames for name, role in r.tests.items()}
    originals = {(r.target.key, r.target.name) for r in renames}
    members = defaultdict(dict)  # the id under the renamed target's name -> role -> statuses
    for test, statuses in reported.items():
        parts = test_parts(test, spec.log_parser)
        if parts in originals:
            return f"{test} is reported, but the grading renamed it"
        if parts in roles:
            renamed, role = roles[parts]
            as_target = test.replace(parts[1], renamed.named("target")[0])
            members[as_target].setdefault(role, []).extend(statuses)
    for test, by_role in members.items():
        if set(by_role.get("fail", ())) & PASSING:
            return f"a variant of {test} that must fail is reported {sorted(set(by_role['fail']))}"
        if set(by_role.get("target", ())) & PASSING and not (set(by_role.get("copy", ())) <= PASSING
                                                             and len(by_role.get("copy", ())) >= CANARY_COPIES
                                                             and by_role.get("fail")):
            return (f"{test} passed, but its copies are reported {sorted(set(by_role.get('copy', ()))) or 'missing'}"
                    f" and its variants {sorted(set(by_role.get('fail', ()))) or 'missing'}")
    allowed = max([len(statuses) for test, statuses in reported.items()
                   if test_parts(test, spec.log_parser) in roles] + [1])
    mapped = defaultdict(list)
    for test, statuses in reported.items():
        mapped[map_back(test, renames)].extend(statuses)
    for test in [*spec.FAIL_TO_PASS, *spec.PASS_TO_PASS]:
        if len(set(mapped.get(test, ()))) > 1:
            return f"{test} is reported as {' and '.join(sorted(set(mapped[test])))}"
        if len(mapped.get(test, ())) > allowed:
            return f"{test} is reported {len(mapped[test])} times (a renamed test {allowed})"
    return None


PATCH_SCREEN = re.compile(
    r"\b(?:_pytest|pytest\.|import pytest|from pytest|PYTEST_CURRENT_TEST|unittest\.(?:case|result|runner|main)"
    r"|TestResult|TextTestResult|_Outcome|testPartExecutor|add(?:Success|Failure|Error|Skip|SubTest)\b"
    r"|(?:sys|threading)\.set(?:trace|profile)|sys\.monitoring|os\._exit|atexit|sys\._getframe|inspect\."
    r"(?:stack|currentframe|getouterframes|trace)|f_back|f_locals|tb_frame|gc\.get_(?:objects|referrers))")


def screen_patch(patch: bytes) -> list[str]:
    """What the added lines of a (filtered: no test files) diff reach for in the test runner: `path: match` for each
    reference to pytest's or unittest's machinery, tracing and profiling hooks, a hard exit or exit hooks, frame
    walking. A screen of the text, not a proof: obfuscated code passes it, and a real fix may match."""
    hits = []
    for paths, section in diff_files(patch):
        for line in section.split(b"\n"):
            if line.startswith(b"+") and not line.startswith(b"+++"):
                hits += [f"{paths[-1]}: {m}" for m in PATCH_SCREEN.findall(line.decode(errors="replace"))]
    return list(dict.fromkeys(hits))


def _ungraded(spec: TestSpec, dropped: list[str] = ()) -> dict:
    return {"instance_id": spec.instance_id, "dropped": list(dropped), "f2p": [0, len(spec.FAIL_TO_PASS)],
            "p2p": [0, len(spec.PASS_TO_PASS)], "status": ResolvedStatus.NO.value, "error": None}


def check_images(truths: Sequence[dict], where: str) -> None:
    """Checked before any grading: DockerUnavailable when instances need Docker and the daemon does not answer,
    ImageMissing when an instance image is not on the host (naming one and `where`)."""
    if not truths:
        return
    try:
        client = containers.connect()
    except containers.DockerUnavailable as e:
        raise containers.DockerUnavailable(f"{where}: swebench instances are graded in Docker: {e}") from None
    missing = containers.missing_images(client, {truth["image"] for truth in truths})
    if missing:
        raise containers.ImageMissing(f"{where}: {len(missing)} instance images are not on this Docker host, e.g. "
                                      f"{missing[0]}; pull or `docker load` them first (docs/swebench.md)")


def swebench_container_reward(truth: dict, container: containers.Container, client=None,
                              config: SweConfig = SweConfig()) -> Grade:
    """The grade of an agent's finished container: its diff since the base commit, graded by swebench_reward. No
    usable diff (see containers.DiffError) is -1 with error "diff"."""
    try:
        patch = containers.container_diff(container, truth["base_commit"], config.max_patch_bytes)
    except containers.DiffError as e:
        return Grade(-1.0, _ungraded(spec_of(truth)) | {"error": "diff", "reason": str(e)})
    return swebench_reward(truth, patch, client, config)


def swebench_reward(truth: dict, patch: bytes, client=None, config: SweConfig = SweConfig()) -> Grade:
    """+1 when the patch resolves the instance (every FAIL_TO_PASS test passes and, with require_p2p, every
    PASS_TO_PASS test still does), else -1. Protected files are dropped first (reported in info["dropped"]); the rest
    is graded by run_tests. A missing image or an unreachable daemon raises: it is never the patch's fault."""
    spec = spec_of(truth)
    git_diff = bool(diff_files(patch)) or not patch.strip()
    patch, dropped = filter_diff(patch, truth["test_patch"])
    suspicious = screen_patch(patch)
    info = _ungraded(spec, dropped) | {"suspicious": suspicious}
    if not git_diff:
        return Grade(-1.0, info | {"error": "patch_apply", "reason": "not a git diff (no `diff --git` header)"})
    if not patch.strip():
        return Grade(-1.0, info | {"error": "empty_patch"})
    if suspicious and config.suspicious_fails:
        return Grade(-1.0, info | {"error": "suspicious", "reason": "; ".join(suspicious)})
    grade = run_tests(truth, patch, client, config, dropped)
    grade.info["suspicious"] = suspicious
    return grade


def run_tests(truth: dict, patch: bytes | None, client=None, config: SweConfig = SweConfig(),
              dropped: Sequence[str] = ()) -> Grade:
    """Apply `patch` (None: none, the tree at the base commit) in a fresh container from the instance image, run the
    row's eval script and grade its log, with kiln's grader or (config.official) swebench's run_instance."""
    spec = spec_of(truth)
    client = client or containers.connect()
    targets = plan_canaries(spec)
    planted = spec_of(truth | {"eval_script": plant_canaries(truth["eval_script"], targets)})
    info = _ungraded(spec, dropped) | {"renamed": len(targets), "canaries": len(targets) * (CANARY_COPIES +
                                                                                           CANARY_FAILS)}
    grade = (_official if config.official else _kiln)(planted, targets, patch, client, config, info)
    grade.info["dropped"] = list(dropped)
    return grade


def _kiln(spec: TestSpec, targets: Sequence[Target], patch: bytes | None, client, config: SweConfig,
          info: dict) -> Grade:
    info, start = info | {"graded_by": "kiln"}, time.perf_counter()
    with containers.Container(client, spec.image, role="grade", run=spec.instance_id,
                              limits=config.limits) as container:
        if patch is not None:
            container.put_file("/kiln.patch", patch)
            for command in APPLY:
                applied = container.exec(command.format(p="/kiln.patch"), timeout=120, cap=4000)
                if applied.exit_code == 0:
                    info["applied_with"] = command.split(" -")[0] + (" --3way" if "3way" in command else "")
                    break
                container.exec("git reset --hard -q", timeout=60)
            else:
                return Grade(-1.0, info | {"error": "patch_apply", "reason": applied.output[-2000:]})
        container.put_file("/kiln_eval.sh", spec.eval_script.encode())
        run = container.exec("bash /kiln_eval.sh", timeout=config.eval_timeout, cap=config.log_cap, direct=True)
        info["docker_retries"] = container.retries
    info["seconds"] = time.perf_counter() - start
    if run.timed_out:
        return Grade(-1.0, info | {"error": "eval_timeout"})
    return _graded(spec, targets, run.output, info, config)


def _graded(spec: TestSpec, targets: Sequence[Target], log: str, info: dict, config: SweConfig) -> Grade:
    """The grade of a test log, by swebench's get_logs_eval and get_eval_tests_report once the renamed tests have
    their names back (map_back), unless check_canaries distrusts the log."""
    renames = read_renames(spec, targets, log)
    with tempfile.NamedTemporaryFile("w", suffix=".log") as mapped:
        mapped.write(map_back(log, renames or []))
        mapped.flush()
        status_map, ran = get_logs_eval(spec, mapped.name)
    if not ran:
        return Grade(-1.0, info | {"error": "tests_not_run", "log_tail": log[-2000:]})
    report = get_eval_tests_report(status_map, {FAIL_TO_PASS: spec.FAIL_TO_PASS, PASS_TO_PASS: spec.PASS_TO_PASS},
                                   eval_type=EvalType(spec.eval_type))
    return _verdict(spec, report, info, config, check_canaries(spec, renames or [], log))


def _verdict(spec: TestSpec, report: dict, info: dict, config: SweConfig, tampered: str | None) -> Grade:
    """The grade from swebench's tests report ({FAIL_TO_PASS: {"success", "failure"}, PASS_TO_PASS: ...}); -1 with
    error "tampered" and the reason when check_canaries distrusts the report."""
    info |= {"f2p": [len(report[FAIL_TO_PASS]["success"]), len(spec.FAIL_TO_PASS)],
             "p2p": [len(report[PASS_TO_PASS]["success"]), len(spec.PASS_TO_PASS)],
             "status": get_resolution_status(report),
             "tests": {kind: {"passed": report[key]["success"], "failed": report[key]["failure"]}
                       for kind, key in (("f2p", FAIL_TO_PASS), ("p2p", PASS_TO_PASS))}}
    if tampered:
        return Grade(-1.0, info | {"resolved": False, "error": "tampered", "reason": tampered})
    f2p_ok = not report[FAIL_TO_PASS]["failure"] and info["f2p"][0] == info["f2p"][1]
    p2p_ok = not report[PASS_TO_PASS]["failure"]
    resolved = f2p_ok and (p2p_ok or not config.require_p2p)
    return Grade(1.0 if resolved else -1.0, info | {"resolved": resolved})


@functools.cache
def _harness_log_root() -> Path:
    """run_instance, set up once per process for kiln: its logs in a temporary folder (not ./logs/run_evaluation,
    removed at exit), and its containers SIGKILLed and removed at once (its own cleanup `docker stop`s them, 15 s when
    PID 1 ignores SIGTERM, as `tail -f` in official images does)."""
    root = Path(tempfile.mkdtemp(prefix="kiln-swebench-"))
    atexit.register(shutil.rmtree, root, True)
    run_evaluation.RUN_EVALUATION_LOG_DIR = root
    run_evaluation.cleanup_container = _remove_harness_container
    return root


def _remove_harness_container(client, container, logger) -> None:
    """run_instance's cleanup_container, kiln's way: SIGKILL and remove, at once."""
    if container is not None:
        containers.force_remove(container)


def _official(spec: TestSpec, targets: Sequence[Target], patch: bytes | None, client, config: SweConfig,
              info: dict) -> Grade:
    """swebench's run_instance on the local image (never pulled: a missing one raises ImageMissing), under a unique
    run id (a reused one returns its old report without running anything) whose logs are deleted once read, one run
    per instance at a time (HARNESS_LOCKS). Its None (no report) is -1 when its log says the patch did not apply or the
    tests timed out; otherwise an error. Its test log is graded as kiln's is (_graded): its own report knows only the
    names the grading gave the renamed tests."""
    try:
        client.images.get(spec.image)
    except docker.errors.ImageNotFound:
        raise containers.ImageMissing(f"image {spec.image!r} is not on this Docker host (run_instance would pull "
                                      "it); `docker load` it first") from None
    root, run_id = _harness_log_root(), f"kiln-{uuid.uuid4().hex[:16]}"
    prediction = {"instance_id": spec.instance_id, "model_name_or_path": HARNESS_MODEL,
                  "model_patch": (patch or b"").decode(errors="replace")}  # the harness writes the patch as text
    info, start = info | {"graded_by": "run_instance"}, time.perf_counter()
    try:
        with HARNESS_LOCKS[spec.instance_id]:
            result = run_evaluation.run_instance(spec, prediction, client, run_id, timeout=int(config.eval_timeout),
                                                 skip_patch=patch is None)
        logs = root / run_id / HARNESS_MODEL / spec.instance_id
        log_text = (logs / LOG_INSTANCE).read_text(errors="replace") if (logs / LOG_INSTANCE).exists() else ""
        test_output = logs / LOG_TEST_OUTPUT
        test_text = test_output.read_text(errors="replace") if test_output.exists() else None
    finally:
        shutil.rmtree(root / run_id, ignore_errors=True)
    info["seconds"] = time.perf_counter() - start
    if result is None:
        if APPLY_PATCH_FAIL in log_text:
            return Grade(-1.0, info | {"error": "patch_apply", "reason": log_text[-2000:]})
        if "Test timed out" in log_text:
            return Grade(-1.0, info | {"error": "eval_timeout"})
        raise RuntimeError(f"{spec.instance_id}: swebench's run_instance failed, not because of the patch; its "
                           f"log ends:\n{log_text[-3000:]}")
    if test_text is None:
        return Grade(-1.0, info | {"error": "tests_not_run", "log_tail": log_text[-2000:]})
    return _graded(spec, targets, test_text, info, config)


def swe_check(truth: dict, client=None, config: SweConfig = SweConfig()) -> dict:
    """Whether a row can train: its gold patch must resolve and the tree at the base commit (no patch) must not, with
    at least one FAIL_TO_PASS test failing. Returns {"instance_id", "gold", "base" (their Grades), "ok", "problem"}."""
    gold = swebench_reward(truth, truth["patch"].encode(), client, config)
    base = run_tests(truth, None, client, config)
    problems = ([] if gold.score == 1.0 else [f"gold patch not resolved ({gold.info.get('error') or 'tests fail'}: "
                                             f"F2P {gold.info['f2p'][0]}/{gold.info['f2p'][1]}, P2P "
                                             f"{gold.info['p2p'][0]}/{gold.info['p2p'][1]})"])
    if base.score == 1.0 or base.info["error"] is not None or base.info["f2p"][0] == base.info["f2p"][1]:
        problems.append(f"without a patch: {base.info['error'] or 'the FAIL_TO_PASS tests already pass'}")
    if gold.info["dropped"]:
        problems.append(f"the gold patch touches protected files {gold.info['dropped']}")
    return {"instance_id": truth["instance_id"], "gold": gold, "base": base, "ok": not problems,
            "problem": "; ".join(problems)}


def swe_metrics(infos: Sequence[dict]) -> dict:
    """SWE-bench batch metrics from swebench grades' infos: the resolve rate; the FAIL_TO_PASS and PASS_TO_PASS pass
    fractions (mean per sample, over the samples whose tests ran); patches that did not apply; protected files
    dropped from the diffs; gradings whose report was tampered with (check_canaries); patches screen_patch flagged;
    Docker calls retried."""
    ran = [info for info in infos if info.get("error") is None]
    metrics = {"swe/resolve_rate": sum(bool(info.get("resolved")) for info in infos) / max(1, len(infos)),
               "swe/patch_apply_failures": sum(info.get("error") == "patch_apply" for info in infos),
               "swe/dropped_files": sum(len(info.get("dropped", [])) for info in infos),
               "swe/tampered": sum(info.get("error") == "tampered" for info in infos),
               "swe/suspicious": sum(bool(info.get("suspicious")) for info in infos),
               "swe/docker_retries": sum(info.get("docker_retries", 0) for info in infos)}
    for key in ("f2p", "p2p"):
        fractions = [info[key][0] / info[key][1] for info in ran if info[key][1]]
        if fractions:
            metrics[f"swe/{key}_pass_frac"] = sum(fractions) / len(fractions)
    return metrics
