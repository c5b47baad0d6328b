"""sandbox.py: program runs, the three test drivers, output comparison, the batch API, zygote restarts."""
import hashlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import docker.errors
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import sandbox  # noqa: E402
import swe_instances  # noqa: E402
from test_swebench import docker_client  # noqa: E402,F401 -- the fixture (a missing daemon fails under CI=true)
from sandbox import Limits, outputs_match, run, run_assert_tests, run_batch, run_call_tests, run_stdio_tests  # noqa

FAST = Limits(timeout=2.0, total_timeout=30.0)  # a busy machine stretches CPU limits in wall time


def statuses(verdicts) -> list[str]:
    return [v.status for v in verdicts]


# ------------------------------------------------------------------------------------------------ run()

def test_run_feeds_stdin_and_captures_both_streams():
    result = run("import sys\nname = input()\nprint('hello', name)\nprint('warn', file=sys.stderr)", "kiln\n")
    assert (result.stdout, result.stderr, result.returncode) == ("hello kiln\n", "warn\n", 0)
    assert not (result.timed_out or result.memory_exceeded or result.output_overflow) and result.wall_time > 0


def test_exit_statuses_like_python():
    assert run("import sys\nsys.exit(3)").returncode == 3
    assert run("exit()").returncode == 0  # exit/quit exist although site.py is skipped
    assert run("raise SystemExit('bye')").returncode == 1
    crashed = run("x = 1\n1 / x - 1 / 0")
    assert crashed.returncode == 1 and crashed.stderr.endswith("ZeroDivisionError: division by zero\n")
    assert 'File "solution.py", line 2' in crashed.stderr and "1 / x - 1 / 0" in crashed.stderr
    assert "sandbox.py" not in crashed.stderr
    assert run("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)").returncode == -signal.SIGSEGV


def test_binary_and_large_stdin():
    data = bytes(range(256)) * 4096  # 1 MiB, more than a pipe holds
    result = run("import sys, hashlib\nprint(hashlib.md5(sys.stdin.buffer.read()).hexdigest())", data)
    assert result.stdout.strip() == hashlib.md5(data).hexdigest()


def test_limits_are_enforced():
    assert run("while True: pass", limits=Limits(timeout=0.5)).timed_out
    assert run("x = bytes(300 << 20)", limits=Limits(memory_mb=200)).memory_exceeded
    flood = run("print('x' * 5000)", limits=Limits(max_output=1000))
    assert flood.output_overflow and len(flood.stdout) == 1000


def test_threads_are_joined_and_atexit_runs():
    source = "import atexit, threading, time\natexit.register(lambda: print('bye'))\n" \
             "threading.Thread(target=lambda: (time.sleep(0.2), print('late'))).start()"
    assert run(source).stdout == "late\nbye\n"


def test_deep_recursion_through_c_frames_has_stack():
    source = "import functools, sys\nsys.setrecursionlimit(10 ** 6)\n@functools.lru_cache(None)\n" \
             "def f(n): return 0 if n == 0 else 1 + f(n - 1)\nprint(f(50000))"
    assert run(source).stdout == "50000\n"


def test_programs_run_as_an_unprivileged_uid_in_a_fresh_dir():
    result = run("import os\nprint(os.getuid(), os.getcwd() == os.environ['HOME'], os.listdir('.'))")
    uid, same, listing = result.stdout.split(maxsplit=2)
    if sandbox.default_sandbox().mode.endswith("+uids"):
        assert int(uid) >= sandbox.default_sandbox().uid_base
    assert same == "True" and listing.strip() == "['solution.py']"


def test_run_batch_keeps_order_and_survives_many_at_once():
    programs = [(f"import time\ntime.sleep({(i % 3) * 0.05})\nprint(int(input()) * 2)", f"{i}\n") for i in range(30)]
    results = run_batch(programs, max_workers=8)
    assert [r.stdout for r in results] == [f"{2 * i}\n" for i in range(30)]


# ------------------------------------------------------------------------------------------- isolation levels

def test_a_package_under_tmp_is_importable_with_full_isolation(tmp_path, monkeypatch):
    """A checkout or venv in a temp dir: the view's own /tmp used to hide it, and the sandbox fell back to plain."""
    assert str(tmp_path).startswith("/tmp/")
    (tmp_path / "kiln_tmp_probe").mkdir()
    (tmp_path / "kiln_tmp_probe" / "__init__.py").write_text("VALUE = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    box = sandbox.Sandbox(packages=("kiln_tmp_probe",))
    try:
        assert box.start() == "full"
        source = f"import os, kiln_tmp_probe\nprint(kiln_tmp_probe.VALUE, os.path.exists({str(tmp_path)!r}))"
        assert run(source, sandbox=box).stdout == "42 False\n"  # importable, and the host's folder is not there
    finally:
        box.close()


def test_an_interpreter_under_tmp_behind_a_symlink_runs_with_full_isolation(tmp_path):
    """The interpreter's prefix reached through a symlink in a temp dir: its stdlib (lib-dynload included) works in
    the view, where it sits under /kiln/host, and its site-packages stay hidden."""
    (tmp_path / "python").symlink_to(sys.base_prefix)
    python = tmp_path / "python" / "bin" / Path(sys.executable).resolve().name
    check = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        import sandbox
        box = sandbox.Sandbox()
        print(box.start())
        source = "import json, os, sys; dynload = [p for p in sys.path if p.endswith('lib-dynload')][0]; " \\
                 "print(json.dumps(1), os.listdir(dynload.replace('lib-dynload', 'site-packages')))"
        print(sandbox.run(source, sandbox=box).stdout, end="")
    """)
    out = subprocess.run([str(python), "-c", check], capture_output=True, text=True, timeout=120)
    assert out.stdout == "full\n1 []\n", out.stderr[-2000:]


def test_without_unshare_the_sandbox_refuses_and_runs_plain_only_when_asked(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no unshare on it
    with pytest.raises(sandbox.IsolationError) as refused:
        sandbox.Sandbox().start()
    message = str(refused.value)
    assert "`unshare` (util-linux) is not on PATH" in message and "--sandbox-isolation userns or plain" in message
    box = sandbox.Sandbox(isolation="plain")
    try:
        assert box.start() == "plain" and run("print(6 * 7)", sandbox=box).stdout == "42\n"
    finally:
        box.close()
    with pytest.raises(ValueError, match="must be one of full, userns, plain"):
        sandbox.Sandbox(isolation="none")


def test_require_holds_the_shared_sandboxes_and_reports_the_level():
    assert sandbox.require("full") == "full" == sandbox.isolation_level()
    assert "filesystem view" in sandbox.describe("full") and "NETWORK ACCESS" in sandbox.describe("plain")
    with pytest.raises(ValueError):
        sandbox.require("partial")


def test_a_container_without_cap_sys_admin_refuses(docker_client, tmp_path):
    """Docker's offline base image (python 3.9, which imports sandbox.py: the stdlib only) with every capability
    dropped, the repository mounted read-only: the full level is refused, naming CAP_SYS_ADMIN and what to do."""
    client = docker_client
    try:
        client.images.get(swe_instances.BASE_IMAGE)
    except docker.errors.ImageNotFound:
        swe_instances.build_base(client, Path(os.environ.get("KILN_SWE_DIR", tmp_path)))
    check = textwrap.dedent("""
        import sys
        sys.path.insert(0, "/kiln")
        import sandbox
        try:
            print(sandbox.Sandbox().start())
        except sandbox.IsolationError as e:
            print("refused:", e)
    """)
    output = client.containers.run(swe_instances.BASE_IMAGE, ["python3", "-B", "-c", check], cap_drop=["ALL"],
                                   network_mode="none", remove=True,
                                   volumes={str(ROOT): {"bind": "/kiln", "mode": "ro"}}).decode()
    assert output.startswith("refused: the sandbox cannot isolate programs at the level required (full)"), output
    assert "full: no CAP_SYS_ADMIN (namespaces and mounts need it); unshare said: unshare: unshare failed" in output
    assert "--cap-add SYS_ADMIN --security-opt seccomp=unconfined" in output
    assert "--sandbox-isolation userns or plain" in output


def test_a_dead_zygote_is_replaced():
    box = sandbox.Sandbox()
    assert run("print(1)", sandbox=box).stdout == "1\n"
    os.kill(box._proc.pid, signal.SIGKILL)
    box._proc.wait()
    assert run("print(2)", sandbox=box).stdout == "2\n"
    box.close()


# ------------------------------------------------------------------------------------- output comparison

@pytest.mark.parametrize("got, expected, strict, lenient", [
    ("3\n", "3", True, True),
    ("  1 2  \n3\n\n", "1 2\n3", True, True),  # per stripped line
    ("1.50\n", "1.5\n", True, True),  # numerically equal
    ("1e2", "100", True, True),
    ("1 2", "1  2", True, True),  # tokens
    ("0.333333", "0.3333333", False, True),  # close, not equal
    ("1\n\n2", "1\n2", False, True),  # blank line inside
    ("2 1", "1 2", False, False),  # order matters in both
    ("yes", "YES", False, False),
    ("1.0001", "1", False, False),  # beyond rel 1e-5
    ("", "0", False, False),
    ("nan", "nan", True, True),  # equal as text
])
def test_outputs_match(got, expected, strict, lenient):
    assert outputs_match(got, expected) is strict
    assert outputs_match(got, expected, lenient=True) is lenient


# --------------------------------------------------------------------------------------- stdin/stdout tests

def test_stdio_tests():
    source = "a, b = map(int, input().split())\nif a < 0:\n    while True: pass\nif a == 0:\n    raise ValueError\nprint(a + b)"
    verdicts = run_stdio_tests(source, ["1 2\n", "3 4\n", "-1 0\n", "0 0\n"], ["3\n", "8\n", "0", "0"], FAST)
    assert statuses(verdicts) == ["pass", "wrong_answer", "timeout", "runtime_error"]
    assert "expected '8\\n', got '7\\n'" in verdicts[1].detail and "ValueError" in verdicts[3].detail


def test_stdio_syntax_error_and_apps_top_level_return():
    assert statuses(run_stdio_tests("print(", ["\n"], ["\n"])) == ["syntax_error"]
    source = "n = int(input())\nif n == 0:\n    print('zero')\n    return\nprint('nonzero')"
    assert statuses(run_stdio_tests(source, ["0\n", "5\n"], ["zero", "nonzero"])) == ["pass", "pass"]


def test_total_timeout_stops_the_suite():
    verdicts = run_stdio_tests("while True: pass", ["\n"] * 5, [""] * 5, Limits(timeout=0.4, total_timeout=1.0))
    assert statuses(verdicts) == ["timeout"] * 5 and "not run" in verdicts[-1].detail


# ------------------------------------------------------------------------------------------ call-based tests

def test_call_tests_apps_and_livecodebench_formats():
    source = "def add(a, b):\n    return a + b"
    assert statuses(run_call_tests(source, "add", [[1, 2], [2, 2]], [3, [4]])) == ["pass", "pass"]  # [4]: APPS wraps
    assert statuses(run_call_tests(source, "add", ["1\n2", "[1]\n[2]"], ["3", "[1, 2]"])) == ["pass", "pass"]
    assert statuses(run_call_tests(source, "add", [[1, 2]], [4])) == ["wrong_answer"]


def test_call_tests_class_solution_tuples_and_typing_names():
    source = "class Solution:\n    def pair(self, xs: List[int]) -> Tuple[int, int]:\n        return min(xs), max(xs)"
    assert statuses(run_call_tests(source, "pair", [[[3, 1, 2]]], [[1, 3]])) == ["pass"]


def test_call_tests_compare_exactly():
    source = "def third(x):\n    return x / 3 + 1e-9 * (x > 1)"
    assert statuses(run_call_tests(source, "third", [[1], [2]], [1 / 3, 2 / 3])) == ["pass", "wrong_answer"]
    assert statuses(run_call_tests("def f(x):\n    return [x]", "f", [[1]], [[[1]]])) == ["pass"]  # APPS wrapping


def test_call_tests_missing_function_and_crashes():
    assert statuses(run_call_tests("def other(): pass", "f", [[1]], [1])) == ["runtime_error"]
    assert statuses(run_call_tests("def f(x): return [][x]", "f", [[1]], [1])) == ["runtime_error"]


# ---------------------------------------------------------------------------------------- assert-based tests

def test_mbpp_style_asserts_with_stop_on_failure():
    source = "def sq(x):\n    return x * x if x < 3 else 0"
    asserts = ["assert sq(2) == 4", "assert sq(3) == 9", "assert sq(1) == 1"]
    assert statuses(run_assert_tests(source, asserts)) == ["pass", "wrong_answer", "pass"]
    assert statuses(run_assert_tests(source, asserts, stop_on_failure=True)) == ["pass", "wrong_answer", "not_run"]


def test_humaneval_style_replaces_the_prompt_stub():
    prompt = 'def inc(x: int) -> int:\n    """Add one."""\n'
    test = "def check(candidate):\n    assert candidate(1) == 2\n    assert candidate(-1) == 0\n"
    def grade(source):
        return statuses(run_assert_tests(source, ["check(inc)"], setup=prompt + test, remote=["inc"]))

    assert grade(prompt + "    return x + 1\n") == ["pass"]
    assert grade(prompt + "    return x\n") == ["wrong_answer"]
    assert grade("def other(x):\n    return x + 1\n") == ["runtime_error"]  # the stub must not stand in


def test_names_from_the_program_the_tests_and_the_stdlib():
    node = "class Node:\n    def __init__(self, v):\n        self.v, self.next = v, None\n" \
           "def length(n):\n    return 0 if n is None else 1 + length(n.next)"
    setup = "head = Node(1)\nhead.next = Node(2)"  # the setup builds objects of the program's class
    assert statuses(run_assert_tests(node, ["assert length(head) == 2"], setup=setup)) == ["pass"]
    # MBPP task 126 names its function `sum`; `math` in a test is the tests' own module
    assert statuses(run_assert_tests("def sum(a, b):\n    return a - b", ["assert sum(3, 1) == 2"])) == ["pass"]
    source = "import math as m\ndef area(r):\n    return m.pi * r * r\nmath = None"
    assert statuses(run_assert_tests(source, ["assert math.isclose(area(1), 3.14159, rel_tol=1e-3)"])) == ["pass"]


def test_program_objects_come_back_as_handles():
    source = "class Box:\n    def __init__(self, v): self.v = v\n    def get(self): return self.v\n" \
             "def make(v): return Box(v)\ndef gen(n): return (i for i in range(n))"
    asserts = ["assert make(3).get() == 3 and make(4).v == 4", "assert list(gen(3)) == [0, 1, 2]",
               "assert make(3) != 3", "b = make(1)\nb.v = 7\nassert b.get() == 7"]
    assert statuses(run_assert_tests(source, asserts)) == ["pass"] * 4


def test_plain_values_cross_with_their_types():
    source = "from collections import Counter, OrderedDict, deque, defaultdict\nfrom fractions import Fraction\n" \
             "from decimal import Decimal\ndef values():\n    d = defaultdict(list)\n    d[1].append(2)\n" \
             "    return [Counter('aab'), OrderedDict(a=1), deque([1]), d, Fraction(1, 3), Decimal('0.1'), " \
             "1j, b'x', bytearray(b'y'), frozenset({1}), {2}, (3,), range(2), None, True, 10 ** 100]"
    expected = "[Counter('aab'), OrderedDict(a=1), deque([1]), {1: [2]}, Fraction(1, 3), Decimal('0.1'), 1j, " \
               "b'x', bytearray(b'y'), frozenset({1}), {2}, (3,), range(2), None, True, 10 ** 100]"
    setup = "from collections import Counter, OrderedDict, deque\nfrom fractions import Fraction\n" \
            "from decimal import Decimal"
    assert statuses(run_assert_tests(source, [f"assert values() == {expected}"], setup=setup)) == ["pass"]


def test_exceptions_keep_their_builtin_type():
    source = "def f(x):\n    if x < 0:\n        raise ValueError('negative')\n    return x"
    asserts = ["try:\n    f(-1)\n    assert False\nexcept ValueError:\n    pass", "assert f(-1) == 0"]
    verdicts = run_assert_tests(source, asserts)
    assert statuses(verdicts) == ["pass", "runtime_error"] and "negative" in verdicts[1].detail


def test_broken_ground_truth_is_a_harness_error():
    assert statuses(run_assert_tests("def f(): return 1", ["assert f() == 1"], setup="1 / 0")) == ["harness_error"]
    with pytest.raises(ValueError, match="do not parse"):
        run_assert_tests("def f(): return 1", ["assert f() =="])


def test_syntax_errors_are_reported_without_running():
    assert sandbox.syntax_error("def f(:\n  pass").startswith("SyntaxError")
    assert sandbox.syntax_error("x = 1") is None
    verdicts = run_assert_tests("def f(x) return x", ["assert f(1) == 1", "assert f(2) == 2"])
    assert statuses(verdicts) == ["syntax_error"] * 2 and "line 1" in verdicts[0].detail


def test_each_test_has_its_own_time_limit():
    """A test that hangs is a timeout, and a fresh program runs the tests after it (state from before is gone)."""
    source = textwrap.dedent("""
        calls = []
        def f(x):
            calls.append(x)
            while x > 1:
                pass
            return len(calls)
    """)
    verdicts = run_assert_tests(source, ["assert f(1) == 1", "assert f(2) == 2", "assert f(1) == 1"],
                                limits=Limits(timeout=0.5))
    assert statuses(verdicts) == ["pass", "timeout", "pass"]
    verdicts = run_call_tests(source, "f", [[1], [2], [1], [1]], [1, 0, 1, 2], limits=Limits(timeout=0.5))
    assert statuses(verdicts) == ["pass", "timeout", "pass", "pass"]
