"""Running untrusted code: isolated program runs and test drivers that a program cannot fool.

The first call starts a *zygote*: a fresh `python -I -S` with an empty environment that `unshare` makes PID 1 of
new network (a downed loopback only), IPC, UTS, mount and PID namespaces. Its root is a *view* made for programs
(`_enter_view`, pivot_root into a new tmpfs), all read-only: /usr/bin, the shared libraries (/usr/lib/<multiarch>,
/usr/lib64), time zones, the interpreter's prefix with its stdlib (site-packages hidden), the allow-list of packages
the Sandbox was made with (`packages`, under /kiln/packages; none for reward programs, SESSION_PACKAGES for the
agent's Python tool), /dev's null, zero, full, random and urandom, and a /proc that shows a program only its own
processes (`hidepid=2`). Task data, the caller's rows, the checkout, the venv, /etc, /home and the host's processes
are not there. The zygote never looks at jobs; from its own small, clean memory it forks
  - *supervisors* (root, trusted, reused): one job at a time from the caller; they run the tests, enforce the
    time limits and clean up;
  - one *program* per run, on a supervisor's request: its own mount namespace (a private tmpfs /tmp of `tmp_mb`
    as cwd and HOME, which dies with the run), network and IPC namespaces that no concurrent run shares and that
    hold nothing from an earlier run (its supervisor's, replaced whenever a run left a socket or an IPC object in
    them), own session, a fresh unprivileged uid, rlimits (address space, CPU, processes, file size, open files),
    a minimal environment, stdin always supplied. It receives its code (compiled by the caller) and nothing else.
Function and assert tests run in the supervisor (as a second fresh uid, under its own address-space and CPU limits),
which calls the program over a socket: arguments go in, return values come back as plain data (restricted
unpickling: builtin numbers, str, bytes, containers, Counter/deque/OrderedDict/defaultdict, Decimal, Fraction;
bounded in bytes and in items) or as opaque handles. Verdicts are computed where the program cannot reach, and
expected values never enter its memory (stdout is compared by the caller), so `exit(0)`, `os._exit(0)`, SkipTest,
patched builtins or asserts, fake PASS lines, disarmed signals and a rigged `__eq__` all fail. Every test (and every
stdin run) has its own time limit, in CPU seconds so that a busy machine gives the same verdicts, with a wall-clock
cap for programs that wait: a test that hangs is a timeout, the program is killed and a fresh one runs the tests
after it. After
each run the supervisor kills every process of the run's uids (`kill(-1)` as that uid reaches double-forked daemons
too; /proc confirms). A supervisor that dies fails only its own job (SandboxError); the zygote and the other jobs
go on.

Speed: a fork copies the parent's page tables and an exit frees them, so the zygote stays small (modules only
the caller needs are imported in the functions that use them), and a function/assert suite costs one fork.
Isolation levels (ISOLATION, docs/sandbox.md): all of the above is `full` and needs root with CAP_SYS_ADMIN. A
Sandbox never runs at less than its `isolation` (default full) and decides its level once, at its first start: a
weaker one only when named (`userns`: a user namespace, one uid for every run, tracked by process group and
environment marker; `plain`: no namespaces, programs with network access that see the whole filesystem by
permissions and the allow-listed packages' folders on sys.path). Otherwise IsolationError says what is missing.
`require` holds the shared sandboxes to a level and starts them; `isolation_level` is what graded their samples.

`PythonSession`, the agent's stateful Python tool, is a long-lived program of the same kind (same view, namespaces,
uid and rlimits), with its working dir holding the input image; closing it kills every process it started.

Test statuses: pass, wrong_answer, runtime_error, timeout, memory, syntax_error, output_limit, not_run (after a
failure with stop_on_failure), harness_error (the ground truth itself failed: a data problem).
"""
from __future__ import annotations

import _thread
import bisect  # noqa: F401  (preloaded for programs, as are collections, heapq, itertools, random, re, string)
import builtins
import collections
import ctypes
import fcntl
import functools
import gc
import heapq  # noqa: F401
import io
import itertools  # noqa: F401
import marshal
import math
import os
import pickle
import random
import re  # noqa: F401
import reprlib
import resource
import select
import signal
import socket
import string  # noqa: F401
import struct
import sys
import time
import typing
from typing import NamedTuple, Sequence

STATUSES = ("pass", "wrong_answer", "runtime_error", "timeout", "memory", "syntax_error", "output_limit",
            "not_run", "harness_error")
# Run k of a zygote uses uid base + 2k (mod UID_RANGE) for the program and the next uid for its tests. Each zygote
# draws its own base, so two zygotes never share a uid (nor its RLIMIT_NPROC count).
UID_RANGE = 65536
# The view's /proc hides other uids' processes (hidepid=2) except from this group: the tests' side joins it to read
# the program's CPU time; programs never do. Below every zygote's uid range (bases are 2^30 and up).
PROC_READER_GID = (1 << 30) - 1
WORLD_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")  # where plain-mode runs may leave files
PACKAGES_DIR = "/kiln/packages"  # the allow-listed packages, inside the view
HOST_DIR = "/kiln/host"  # where the view places an interpreter that lives under a path the view uses itself (/tmp)
# What the agent's Python tool may import besides the stdlib: images, arrays, plots (and matplotlib's dependencies).
SESSION_PACKAGES = ("PIL", "numpy", "matplotlib", "contourpy", "cycler", "dateutil", "fontTools", "kiwisolver",
                    "packaging", "pyparsing", "six")
SESSION_CPU_SECONDS = 600  # CPU time of a whole PythonSession (its calls have wall-clock timeouts)
MAX_REPLY_BYTES = 64 << 20  # one value from the program, pickled
MAX_REPLY_ITEMS = 2_000_000  # containers and their items, counted as a tree (shared references count each time)
MAX_FRACTION_DIGITS = 10_000  # rebuilding a Fraction costs a gcd (or a parse): more than linear time
# Values that cross from the program to the tests as data (exact types); anything else becomes a handle.
PLAIN = {"builtins": ("NoneType", "bool", "int", "float", "complex", "str", "bytes", "bytearray", "list", "tuple",
                      "dict", "set", "frozenset", "range"),
         "collections": ("OrderedDict", "Counter", "deque", "defaultdict"), "decimal": ("Decimal",),
         "fractions": ("Fraction",)}
LEETCODE_MODULES = ("bisect", "collections", "functools", "heapq", "itertools", "math", "re", "string")
JOBS_PER_SUPERVISOR = 500  # then a fresh one: test code may leave state behind


class Limits(NamedTuple):
    timeout: float = 6.0  # CPU seconds per program run; per test for function/assert suites
    wall_factor: float = 3.0  # and at most timeout x this of wall clock (for programs that wait rather than compute)
    total_timeout: float = 60.0  # wall seconds for a whole suite; tests past it count as timeouts
    memory_mb: int = 1024  # address space of the program (RLIMIT_AS)
    max_output: int = 1 << 20  # bytes of stdout, and of stderr, before the run is killed
    nproc: int = 64  # processes + threads of the run's uid
    nofile: int = 256
    fsize_mb: int = 64
    tmp_mb: int = 128  # the run's private /tmp (its working dir), a tmpfs of its own


class RunResult(NamedTuple):
    stdout: str
    stderr: str
    returncode: int | None  # negative: killed by that signal; None: still running when killed
    timed_out: bool
    memory_exceeded: bool
    output_overflow: bool
    wall_time: float


class Verdict(NamedTuple):
    status: str  # one of STATUSES
    detail: str = ""


# The isolation levels, strongest first, and what each keeps programs from. Which one a Sandbox runs at is decided
# once, when its zygote first starts; it never runs at less than its `isolation` (the weakest level allowed).
ISOLATION = {
    "full": "namespaces, the filesystem view and a fresh uid per run: programs see no task data, checkout or host "
            "files, have no network, see only their own processes, and cannot signal or trace the tests or each other",
    "userns": "the namespaces and the filesystem view of full, but one uid for every run (a user namespace): a "
              "program can signal or trace the tests' side and concurrent runs, and so forge its verdicts",
    "plain": "no namespaces and no view: programs have NETWORK ACCESS and read the whole filesystem (task answers "
             "included) as far as its permissions allow; only rlimits, and with root a fresh uid per run",
}


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the program): no zygote could start, or a supervisor died."""


class IsolationError(SandboxError):
    """The machine does not allow the isolation level asked for; the message names what is missing and what to do."""


# ----------------------------------------------------------------------------------------------------------
# Public API (the caller's process)

def run(source: str, stdin: str | bytes = "", limits: Limits = Limits(), sandbox: Sandbox | None = None) -> RunResult:
    """Run `source` as a Python program (`__main__`) fed `stdin`; never raises for anything the program does."""
    return _run_many(source, [stdin], limits, sandbox)[0]


def run_batch(programs: list[tuple[str, str | bytes]], limits: Limits = Limits(), max_workers: int | None = None,
              sandbox: Sandbox | None = None) -> list[RunResult]:
    """`run` for many (source, stdin) pairs, at most `max_workers` at a time; results in order."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers or default_workers()) as pool:
        return list(pool.map(lambda p: run(p[0], p[1], limits, sandbox), programs))


def default_workers() -> int:
    return 2 * (os.cpu_count() or 1) + 1  # a run also waits on forks and pipes


def run_stdio_tests(source: str, inputs: list[str], outputs: list[str], limits: Limits = Limits(),
                    lenient: bool = False, sandbox: Sandbox | None = None) -> list[Verdict]:
    """One fresh program run per test; stdout is compared (`outputs_match`) here, outside the sandbox. A `return`
    at the top level ends the program, as under APPS's harness (which wraps programs in a function, and whose
    reference solutions rely on it)."""
    if len(inputs) != len(outputs):
        raise ValueError(f"{len(inputs)} inputs but {len(outputs)} outputs")
    if (error := syntax_error(source)) and "'return' outside function" in error:
        source, error = _returns_to_exits(source), None
    if error:
        return [Verdict("syntax_error", error)] * len(inputs)
    return [_stdio_verdict(r, want, lenient) for r, want in zip(_run_many(source, inputs, limits, sandbox), outputs)]


def run_call_tests(source: str, fn_name: str, inputs: list, outputs: list, limits: Limits = Limits(),
                   sandbox: Sandbox | None = None) -> list[Verdict]:
    """Call `fn_name` (a top-level function, else a method of `Solution()`) per test; compare the result.

    Inputs are argument lists (APPS) or strings with one JSON value per line (LiveCodeBench), outputs the value
    or its JSON text. Results compare with == (tuples as lists); a one-element list also matches its element
    (APPS wraps outputs so).
    """
    import json

    if len(inputs) != len(outputs):
        raise ValueError(f"{len(inputs)} inputs but {len(outputs)} outputs")
    args, expected = [], []
    for i, (given, wanted) in enumerate(zip(inputs, outputs)):
        try:
            if isinstance(given, str):
                given = [json.loads(line) for line in given.split("\n") if line.strip()]
                wanted = json.loads(wanted) if isinstance(wanted, str) else wanted
        except ValueError as e:
            raise ValueError(f"test {i}: input or output is not JSON ({e})") from e
        args.append(list(given))
        expected.append(wanted)
    suite = {"kind": "call", "fn_name": fn_name, "args": args, "expected": expected}
    return _run_suite(source, suite, len(inputs), limits, sandbox)


def run_assert_tests(source: str, asserts: list[str], setup: str = "", remote: list[str] | None = None,
                     limits: Limits = Limits(), stop_on_failure: bool = False,
                     sandbox: Sandbox | None = None) -> list[Verdict]:
    """Run trusted `setup`, then each statement of `asserts`, outside the program. Names they use but never bind
    are the program's objects (stdlib module names are the tests' own modules; builtin names stay builtins
    unless the tests use nothing else, like an MBPP function called `sum`). `remote` names are taken from the
    program after `setup`, replacing setup's own (the HumanEval prompt's stub).

    HumanEval: setup = prompt + test, asserts = ["check(entry_point)"], remote = [entry_point].
    MBPP: setup = test_setup_code, asserts = test_list.
    """
    try:
        modules, before = _free_names(setup, tuple(asserts), remote is None)
        code = _compiled_tests(setup, tuple(asserts))
    except SyntaxError as e:
        raise ValueError(f"the tests do not parse: {e}") from e
    suite = {"kind": "assert", "code": code, "asserts": asserts, "modules": modules, "before": before,
             "after": list(remote or []), "stop": stop_on_failure}
    return _run_suite(source, suite, len(asserts), limits, sandbox)


_warnings_lock = _thread.allocate_lock()
# CPython 3.11's ast module keeps a recursion counter per interpreter, not per thread: concurrent ast.parse calls
# (score_batch grades from a thread pool) can fail with "AST constructor recursion depth mismatch".
_ast_lock = _thread.allocate_lock()


def syntax_error(source: str) -> str | None:
    """The compile error of `source` ("SyntaxError: ... (line N)"), or None if it compiles. The program's compile
    warnings (invalid escapes, `is` with a literal) are not the caller's: they are silenced."""
    return _compile(source)[1]


@functools.lru_cache(maxsize=256)  # a reward checks a program's syntax (syntax_error) before it runs it
def _compile(source: str) -> tuple[bytes | None, str | None]:
    """(the program's code, marshalled, or None; its compile error or None). Programs get the code compiled here:
    compiling in every fresh program cost more than a millisecond of CPU each (the compiler's memory is new pages)."""
    import warnings

    try:
        with _warnings_lock, warnings.catch_warnings():  # catch_warnings is process-wide state
            warnings.simplefilter("ignore")
            return marshal.dumps(compile(source, "solution.py", "exec", dont_inherit=True)), None
    except (SyntaxError, ValueError, MemoryError, RecursionError) as e:  # ValueError: null bytes
        line = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
        return None, f"{type(e).__name__}: {getattr(e, 'msg', e)}{line}"


def outputs_match(got: str, expected: str, lenient: bool = False) -> bool:
    """Strict but sane: after stripping the whole text, the stripped lines must pair up, each equal as text or as
    whitespace-separated tokens where numbers compare by exact decimal value ("1.50" == "1.5").

    `lenient` (APPS-like): blank lines ignored, numbers equal within rel 1e-5 / abs 1e-8 (numpy allclose).
    APPS's order-insensitive token sets and 3-decimal rounding are left out: they accept wrong answers.
    """
    got_lines = [line.strip() for line in got.strip().splitlines()]
    want_lines = [line.strip() for line in expected.strip().splitlines()]
    if lenient:
        got_lines, want_lines = [x for x in got_lines if x], [x for x in want_lines if x]
    return len(got_lines) == len(want_lines) and all(
        a == b or _tokens_match(a.split(), b.split(), lenient) for a, b in zip(got_lines, want_lines))


def _tokens_match(got: list[str], want: list[str], lenient: bool) -> bool:
    """Tokens equal as text or as exact decimal values. NaNs (signalling ones raise on comparison) and tokens that are
    not numbers compare as text; the lenient tolerance is computed at 28 digits with every trap off, so an exponent
    of a billion costs nothing and raises nothing."""
    import decimal

    if len(got) != len(want):
        return False
    for a, b in zip(got, want):
        try:
            x, y = decimal.Decimal(a), decimal.Decimal(b)
        except (ArithmeticError, ValueError):
            x = y = None
        if x is None or x.is_nan() or y.is_nan():
            if a != b:
                return False
            continue
        if x != y and not (lenient and x.is_finite() and y.is_finite() and _within_tolerance(x, y)):
            return False
    return True


def _within_tolerance(x, y) -> bool:
    import decimal

    with decimal.localcontext(decimal.Context(Emax=decimal.MAX_EMAX, Emin=decimal.MIN_EMIN, traps=[])):
        return abs(x - y) <= decimal.Decimal("1e-8") + decimal.Decimal("1e-5") * abs(y)


def _stdio_verdict(result: RunResult | None, expected: str, lenient: bool) -> Verdict:
    if result is None:
        return Verdict("timeout", "not run: the suite's total_timeout was used up")
    last_line = (result.stderr.strip().splitlines() or [""])[-1][:300]
    if result.timed_out:
        return Verdict("timeout", f"no exit within the time limit ({result.wall_time:.1f}s)")
    if result.output_overflow:
        return Verdict("output_limit", "output exceeded max_output")
    if result.memory_exceeded:
        return Verdict("memory", last_line)
    if result.returncode != 0:
        return Verdict("runtime_error", f"exit status {result.returncode}: {last_line}")
    if outputs_match(result.stdout, expected, lenient):
        return Verdict("pass")
    return Verdict("wrong_answer", f"expected {expected[:200]!r}, got {result.stdout[:200]!r}")


def _returns_to_exits(source: str) -> str:
    import ast

    class TopLevel(ast.NodeTransformer):
        def visit_FunctionDef(self, node):
            return node  # returns in there are ordinary

        visit_AsyncFunctionDef = visit_ClassDef = visit_Lambda = visit_FunctionDef

        def visit_Return(self, node):
            return ast.copy_location(ast.Raise(ast.Call(ast.Name("SystemExit", ast.Load()), [], [])), node)

    with _ast_lock:
        return ast.unparse(ast.fix_missing_locations(TopLevel().visit(ast.parse(source))))


@functools.lru_cache(maxsize=4096)  # a GRPO group scores the same tests many times
def _compiled_tests(setup: str, asserts: tuple[str, ...]) -> bytes:
    """The setup's and each assert's code, marshalled for the supervisor that runs them (compiled once per group)."""
    return marshal.dumps((compile(setup, "tests_setup.py", "exec"),
                          tuple(compile(text, f"test_{i}.py", "exec") for i, text in enumerate(asserts))))


@functools.lru_cache(maxsize=4096)  # a GRPO group scores the same tests many times
def _free_names(setup: str, asserts: tuple[str, ...], builtins_may_be_remote: bool) -> tuple[list, list]:
    """(stdlib modules the tests use without importing them, names the program must supply)."""
    import ast

    used, bound, attribute_bases, called = set(), set(), set(), set()
    with _ast_lock:
        trees = [ast.parse(text) for text in (setup, *asserts)]
    for node in (node for tree in trees for node in ast.walk(tree)):
        if isinstance(node, ast.Name):
            (used if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            attribute_bases.add(node.value.id)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            called.add(node.func.id)
    free = sorted(used - bound)
    modules = [n for n in free if n in sys.stdlib_module_names and n in attribute_bases and n not in called]
    others = [n for n in free if n not in modules]
    own = [n for n in others if not hasattr(builtins, n)]
    return modules, own or (others if builtins_may_be_remote else [])


def _run_many(source: str, stdins: list, limits: Limits, sandbox: Sandbox | None) -> list[RunResult | None]:
    stdins = [s.encode() if isinstance(s, str) else bytes(s) for s in stdins]
    job = {"kind": "run", "source": source, "code": _compile(source)[0], "stdins": stdins, "limits": limits._asdict()}
    budget = min(limits.total_timeout, limits.timeout * limits.wall_factor * len(stdins))
    reply = (sandbox or default_sandbox()).request(job, budget)
    return [None if r is None else RunResult(**r) for r in reply]


def _run_suite(source: str, suite: dict, n: int, limits: Limits, sandbox: Sandbox | None) -> list[Verdict]:
    if n == 0:
        return []
    code, error = _compile(source)
    if error:
        return [Verdict("syntax_error", error)] * n
    job = {"kind": "suite", "code": code, "limits": limits._asdict(), "n": n, "suite": suite}
    return [Verdict(*v) for v in (sandbox or default_sandbox()).request(job, _suite_budget(limits._asdict(), n))]


def _suite_budget(limits: dict, n: int) -> float:
    """Each test's wall-clock limit plus a second for restarting the program after a test that timed out, within
    total_timeout."""
    return min(limits["total_timeout"], (limits["timeout"] * limits["wall_factor"] + 1.0) * max(1, n))


class Sandbox:
    """Handle on one zygote, thread-safe; its runs use uids in [uid_base, uid_base + UID_RANGE). `packages`: the
    import names programs may import besides the stdlib (those installed here; see SESSION_PACKAGES).
    `default_sandbox()` is the shared one."""

    def __init__(self, uid_base: int | None = None, packages: tuple[str, ...] = (), isolation: str = "full"):
        if isolation not in ISOLATION:
            raise ValueError(f"isolation {isolation!r}: must be one of {', '.join(ISOLATION)}")
        self.uid_base = uid_base if uid_base is not None else 1 << 30 | random.randrange(1 << 14) * UID_RANGE
        self.packages = packages
        self.isolation = isolation  # the weakest level allowed
        self.level = None  # the level its programs run at (a key of ISOLATION), fixed by the first start
        self.mode = None  # the zygote's own account: namespaces or plain, +uids where each run gets its own uid
        self._lock = _thread.allocate_lock()
        self._proc = self._control = None
        self._owner_pid = -1

    def request(self, job: dict, budget: float):
        """Hand `job` to a supervisor and return its reply. A supervisor that dies fails only this job; if the zygote
        itself died (and so every job on it), the job is tried once more on a fresh one."""
        for attempt in (1, 2):
            conn, zygote = self._hand_over()
            try:
                conn.settimeout(budget + 30)
                _send(conn, job)
                reply = _recv(conn)
            except (EOFError, OSError) as e:
                if attempt == 1 and self._died(zygote):
                    continue
                raise SandboxError(f"a sandbox supervisor died during its job: {e!r}") from e
            finally:
                conn.close()
            if isinstance(reply, dict):
                raise SandboxError(f"a sandbox supervisor failed:\n{reply['sandbox_error']}")
            return reply

    def open_session(self, job: dict) -> tuple[socket.socket, socket.socket]:
        """Start a long-lived program (a "session" job): (the job's connection, whose closing ends the session and
        kills all its processes; a socket to the program itself)."""
        conn, _ = self._hand_over()
        try:
            conn.settimeout(60)
            _send(conn, job)
            _, fds, _, _ = socket.recv_fds(conn, 16, 1)
        except OSError as e:
            conn.close()
            raise SandboxError(f"the session could not start: {e!r}") from e
        if not fds:
            conn.close()
            raise SandboxError("the session could not start: its supervisor hung up")
        conn.settimeout(None)
        return conn, socket.socket(fileno=fds[0])

    def _hand_over(self) -> tuple[socket.socket, object]:
        """A connection to a supervisor of a running zygote (started or replaced as needed), and that zygote."""
        mine, theirs = socket.socketpair()
        try:
            with self._lock:
                for _ in (1, 2):
                    self._ensure_started()
                    try:
                        _tell(self._control, "job", [theirs.fileno()])
                        return mine, self._proc
                    except OSError:
                        self._stop()  # the zygote died: the next attempt starts a new one
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        mine.close()
        raise SandboxError("the sandbox zygote does not accept jobs")

    def _died(self, zygote) -> bool:
        """Whether `zygote` is gone (then replaced); a zygote's death ends its supervisors first, so wait a little."""
        import subprocess

        try:
            zygote.wait(1)
        except subprocess.TimeoutExpired:
            return False
        with self._lock:
            if self._proc is zygote:  # not one another thread has already replaced
                self._stop()
        return True

    def start(self) -> str:
        """Start the zygote now (otherwise the first job does); the isolation level reached."""
        with self._lock:
            self._ensure_started()
        return self.level

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _stop(self) -> None:
        import subprocess

        if self._control is not None:
            self._control.close()  # the zygote exits on EOF, and its PID namespace with it
            self._control = None
        if self._proc is not None:
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    def _ensure_started(self) -> None:
        import logging
        import shutil
        import subprocess

        if self._owner_pid == os.getpid() and self._proc is not None and self._proc.poll() is None:
            return
        if self._owner_pid != os.getpid():  # a forked caller must not share its parent's zygote
            self._proc = self._control = None
        self._stop()
        # Imported, not run as a script: a script is compiled from source, and that garbage would stay in the heap
        # every fork copies.
        here, name = os.path.split(os.path.abspath(__file__)[:-3])
        python = [sys.executable, "-I", "-S", "-c", f"import sys; sys.path.insert(0, {here!r}); import {name}; "
                  f"sys.path.pop(0); {name}._zygote_main(*sys.argv[1:])"]
        ns = ["--net", "--ipc", "--uts", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc",
              "--propagation", "private"]
        unshare = shutil.which("unshare")
        levels = list(ISOLATION)
        # The strongest level first, down to the weakest allowed; a restart must reach the level decided at the start.
        allowed = [self.level] if self.level else levels[:levels.index(self.isolation) + 1]
        attempts = {"full": [unshare, *ns], "userns": [unshare, "--user", "--map-root-user", *ns], "plain": []}
        packages = _package_paths(self.packages)
        missing = [] if unshare else ["`unshare` (util-linux) is not on PATH"]
        for level in allowed:
            prefix = attempts[level]
            if level != "plain" and not unshare:
                continue
            mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            proc = subprocess.Popen(prefix + python + [str(theirs.fileno()), str(self.uid_base), str(bool(prefix)),
                                                       *packages],
                                    pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                    env={"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"})
            theirs.close()
            mine.settimeout(60)
            try:
                mode = mine.recv(64).decode()
            except OSError:
                mode = ""
            reached = "full" if mode == "namespaces+uids" else "userns" if mode == "namespaces" else "plain"
            if mode and reached in allowed:
                proc.stderr.close()
                mine.settimeout(None)
                self._proc, self._control, self._owner_pid = proc, mine, os.getpid()
                if self.level is None:
                    self.level, self.mode = reached, mode
                    (logging.getLogger("kiln.sandbox").info if reached == "full" else
                     logging.getLogger("kiln.sandbox").warning)("%s", describe(reached))
                return
            mine.close()
            proc.kill()
            missing.append(_missing(level, mode, proc.communicate()[1].decode(errors="replace")))
        raise IsolationError(_refusal(allowed[-1], self.level is not None, missing))


def describe(level: str) -> str:
    """One line for the log: the level a sandbox runs at and what it protects against."""
    return f"sandbox isolation: {level} ({ISOLATION[level]})"


def _missing(level: str, mode: str, stderr: str) -> str:
    """Why the zygote's start for `level` fell short: what the machine lacks, and unshare's or Python's last words."""
    said = " ".join(stderr.strip().splitlines()[-1:])[-300:]
    if level == "full" and mode == "namespaces":
        return ("full: root here cannot give each run its own uid (a user namespace maps only part of the uids, or "
                "CAP_SETUID, CAP_SETGID or CAP_CHOWN is dropped)")
    if level == "full" and os.geteuid() != 0:
        return f"full: not root (each run gets its own uid, which needs root); unshare said: {said}"
    if level == "full" and not _capabilities() >> CAP_SYS_ADMIN & 1:
        return f"full: no CAP_SYS_ADMIN (namespaces and mounts need it); unshare said: {said}"
    if level == "userns":
        return ("userns: user namespaces are not allowed (see /proc/sys/user/max_user_namespaces, "
                f"kernel.unprivileged_userns_clone, or the container's seccomp profile); unshare said: {said}")
    return f"{level}: the zygote did not start: {said}"


def _capabilities() -> int:
    """This process's effective capabilities, a bit mask."""
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("CapEff:")).split()[1], 16)


def _refusal(weakest: str, restart: bool, missing: list[str]) -> str:
    if restart:
        return f"the sandbox's zygote died and a new one cannot reach isolation {weakest} again: " + "; ".join(missing)
    return (f"the sandbox cannot isolate programs at the level required ({weakest}) on this machine: "
            + "; ".join(missing) + ". Full isolation needs root with CAP_SYS_ADMIN, a seccomp profile that allows "
            "unshare, mount and pivot_root, and util-linux's unshare: in Docker --cap-add SYS_ADMIN --security-opt "
            "seccomp=unconfined (and apparmor=unconfined where AppArmor runs); in Kubernetes "
            "securityContext.capabilities.add: [SYS_ADMIN] with seccompProfile.type: Unconfined. Or name a weaker "
            "level (--sandbox-isolation userns or plain); docs/sandbox.md says what each gives up")


def _package_paths(names: tuple[str, ...]) -> list[str]:
    """Where the caller's interpreter finds each allow-listed package (not installed: left out, so programs cannot
    import it either), plus the `*.libs` folders of shared libraries that wheels keep beside their packages."""
    import importlib.util

    paths = []
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is None:
            continue
        path = spec.submodule_search_locations[0] if spec.submodule_search_locations else spec.origin
        folder = os.path.dirname(path)
        paths += [path] + [os.path.join(folder, e) for e in sorted(os.listdir(folder)) if e.endswith(".libs")]
    return list(dict.fromkeys(paths))


_defaults: dict[tuple[str, ...], Sandbox] = {}
_default_lock = _thread.allocate_lock()
_required = ["full"]  # the weakest isolation the shared sandboxes may run at (`require`)


def default_sandbox(packages: tuple[str, ...] = ()) -> Sandbox:
    """The shared Sandbox whose programs may import `packages` (reward programs: none)."""
    with _default_lock:
        if packages not in _defaults:
            _defaults[packages] = Sandbox(packages=packages, isolation=_required[0])
        return _defaults[packages]


def require(isolation: str, sessions: bool = False) -> str:
    """Hold the shared sandboxes to at least `isolation` (a key of ISOLATION) and start them now, before expensive
    work: the reward programs' one, and with `sessions` PythonSession's. Returns the level they run at (`describe`
    says what it protects against); raises IsolationError, naming what the machine lacks, if it allows less."""
    if isolation not in ISOLATION:
        raise ValueError(f"sandbox isolation {isolation!r}: must be one of {', '.join(ISOLATION)}")
    with _default_lock:
        if _required[0] != isolation:
            for box in _defaults.values():
                box.close()
            _defaults.clear()
            _required[0] = isolation
    for packages in [()] + [SESSION_PACKAGES] * sessions:
        default_sandbox(packages).start()
    return isolation_level()


def isolation_level() -> str | None:
    """The level the shared reward sandbox runs at, i.e. that graded every sample it ran (None before it started):
    what metrics and sample records carry."""
    box = _defaults.get(())
    return box.level if box else None


# ----------------------------------------------------------------------------------------------------------
# Messages. Streams between trusted processes: 8-byte length + pickle. Zygote channels: one pickle per
# SOCK_SEQPACKET message, with file descriptors attached.

def _send(sock: socket.socket, obj) -> None:
    data = pickle.dumps(obj, protocol=5)
    sock.sendall(struct.pack("<Q", len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise EOFError("connection closed")
        buf += chunk
    return bytes(buf)


def _recv(sock: socket.socket):
    (n,) = struct.unpack("<Q", _recv_exact(sock, 8))
    return pickle.loads(_recv_exact(sock, n))


def _tell(sock: socket.socket, obj, fds: list[int] = ()) -> None:
    socket.send_fds(sock, [pickle.dumps(obj)], list(fds))


def _hear(sock: socket.socket, exits: dict | None = None, kind: str | None = None) -> tuple[object, list[int]]:
    """The next message and its descriptors ((None, []) once the other side is gone). With `kind`, the next
    message of that kind, filing the zygote's exit reports into `exits` on the way."""
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 8)
        except OSError:
            return None, []
        message = pickle.loads(data) if data else None
        if message is not None and message[0] == "exit" and exits is not None:
            exits[message[1]] = message[2]
        if kind is None or message is None or message[0] == kind:
            return message, fds


# ----------------------------------------------------------------------------------------------------------
# Zygote

def _zygote_main(control_fd: str, uid_base: str, namespaces: str, *packages: str) -> None:
    """The zygote's loop: `sandbox._zygote_main(FD, UID_BASE, NAMESPACES, *PACKAGE_PATHS)` in a fresh `python -I -S`."""
    global _isolated, _package_dirs
    control, uid_base = socket.socket(fileno=int(control_fd)), int(uid_base)
    _isolated = namespaces == "True"
    if _isolated:
        _enter_view(packages)
        _package_dirs = [PACKAGES_DIR] if packages else []
    else:
        _package_dirs = list(dict.fromkeys(os.path.dirname(p) for p in packages))
    # Per-run uids need real root (a user namespace maps a single uid) that may change uids and chown (a container
    # can drop those capabilities).
    switch_uids = os.geteuid() == 0 and open("/proc/self/uid_map").read().split()[2] == "4294967295" and \
        _capabilities() & CAPS_TO_SWITCH_UIDS == CAPS_TO_SWITCH_UIDS
    builtins.exit = builtins.quit = sys.exit  # `-S` skips site.py, which defines them; programs call exit()
    sys.set_int_max_str_digits(0)  # contest answers can have more digits than Python 3.11's default allows
    gc.freeze()  # children never collect (hence never copy) the zygote's objects
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the poll below whenever a child or orphan exits
    control.send(("namespaces" if namespaces == "True" else "plain").encode() + b"+uids" * switch_uids)
    poller = select.poll()
    poller.register(control, select.POLLIN)
    poller.register(wake_r, select.POLLIN)
    supervisors: dict[int, list] = {}  # pid -> [channel, current run or None]
    channels: dict[int, int] = {}  # channel fd -> supervisor pid
    owners: dict[int, int] = {}  # program pid -> supervisor pid
    idle: list[int] = []
    run_index = 0
    while True:
        for fd, _ in sorted(poller.poll(1000), key=lambda event: event[0] == control.fileno()):  # jobs last
            if fd == wake_r:
                os.read(wake_r, 4096)
            elif fd == control.fileno():
                message, fds = _hear(control)
                if message is None:
                    return  # the caller closed the control socket (or died): exiting ends the PID namespace
                run_index += 1
                run = (uid_base + 2 * run_index % UID_RANGE, switch_uids, run_index, os.urandom(6).hex())
                if not idle:
                    pid, channel = _fork_supervisor()
                    supervisors[pid], channels[channel.fileno()] = [channel, None], pid
                    poller.register(channel, select.POLLIN)
                    idle.append(pid)
                supervisor = idle.pop()
                supervisors[supervisor][1] = run
                _tell(supervisors[supervisor][0], ("job", run), fds)
                os.close(fds[0])
            else:
                supervisor = channels[fd]
                message, fds = _hear(supervisors[supervisor][0])
                if message is None:
                    poller.unregister(fd)
                    del channels[fd]
                elif message[0] == "idle":
                    supervisors[supervisor][1] = None
                    idle.append(supervisor)
                else:  # ("spawn", spec)
                    pid = os.fork()
                    if pid == 0:
                        _program_main(message[1], fds)
                    for child_fd in fds:
                        os.close(child_fd)
                    owners[pid] = supervisor
                    _tell(supervisors[supervisor][0], ("pid", pid))
        while True:  # reap exited children and reparented orphans (we are PID 1)
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            supervisor = owners.pop(pid, None)
            if supervisor in supervisors:
                try:
                    _tell(supervisors[supervisor][0], ("exit", pid, status))
                except OSError:
                    pass
            elif pid in supervisors:
                channel, run = supervisors.pop(pid)
                channels.pop(channel.fileno(), None)
                idle[:] = [p for p in idle if p != pid]
                channel.close()
                if run is not None:  # it died mid-job: clean up after it
                    _kill_once(_RunIds(*run), [])


def _fork_supervisor() -> tuple[int, socket.socket]:
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        try:
            _forget_zygote_signals()
            os.dup2(theirs.fileno(), 3)
            os.closerange(4, 1 << 20)  # the zygote's control socket, wake-up pipe, other channels
            _supervisor_main(socket.socket(fileno=3))
        finally:
            os._exit(0)
    theirs.close()
    return pid, mine


def _forget_zygote_signals() -> None:
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)


_isolated = False  # the zygote's namespaces (and so every run's own) exist; inherited by its forks
_package_dirs: list[str] = []  # what programs add to sys.path for the allow-listed packages
_libc = ctypes.CDLL(None, use_errno=True)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384
MNT_DETACH = 2
CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWNET = 0x20000, 0x8000000, 0x40000000
CAP_SYS_ADMIN = 21
CAPS_TO_SWITCH_UIDS = 1 << 0 | 1 << 6 | 1 << 7  # CAP_CHOWN, CAP_SETGID, CAP_SETUID
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}  # glibc has no wrapper


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(_libc.mount(source.encode(), target.encode(), fstype and fstype.encode(), flags, data and data.encode()),
           f"mount {target}")


def _enter_view(packages: tuple[str, ...]) -> None:
    """Make the root of the zygote's mount namespace a new tmpfs holding only what programs may see (the module
    docstring lists it), then pivot_root into it and detach the host's tree, which no process here can reach again."""
    root = "/tmp"  # any mount point does: this namespace's mounts are private
    multiarch = getattr(sys.implementation, "_multiarch", "")
    stdlib = os.path.dirname(os.__file__)
    # From /usr: programs (a shell, coreutils), the shared libraries and the loader, time zones; then a system
    # Python's stdlib, or a whole pyenv/conda/local prefix (at the path the interpreter knows it by: symlinks in it
    # are resolved on the host side).
    wanted = [(path, path) for path in ("/bin", "/lib", "/lib32", "/lib64", "/sbin")
              if os.path.isdir(path) and not os.path.islink(path)]
    wanted += [(path, path) for path in ("/usr/bin", f"/usr/lib/{multiarch}", "/usr/lib64", "/usr/share/zoneinfo")
               if multiarch and os.path.isdir(path)]
    prefix = stdlib if os.path.realpath(sys.base_prefix) == "/usr" else os.path.abspath(sys.base_prefix)
    # An interpreter under the view's own /tmp, /dev or /proc (a venv's base in a temp dir) moves out of their way.
    moved = HOST_DIR + prefix if prefix.split("/")[1] in ("tmp", "dev", "proc") else prefix
    wanted += [(prefix, moved)] + [(path, f"{PACKAGES_DIR}/{os.path.basename(path)}") for path in packages]
    # Each source is opened before the view's tmpfs covers /tmp and bound through its descriptor: what lives under
    # /tmp (a checkout, a venv, the interpreter), behind symlinks or on other mounts stays reachable.
    held = [(os.open(source, os.O_PATH | os.O_CLOEXEC), os.path.isdir(source), target) for source, target in wanted]

    def bind(source: str, target: str, is_dir: bool, read_only: bool = True) -> None:
        target = root + target
        if is_dir:
            os.makedirs(target, exist_ok=True)  # the folders made on the way are 755 (a pyenv under /root, mode
        else:  # 700, stays reachable for other uids)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            open(target, "w").close()
        _mount(source, target, None, MS_BIND | MS_REC)
        if read_only:
            _mount("none", target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)

    _mount("kiln-view", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=1m")
    for path in ("/bin", "/lib", "/lib32", "/lib64", "/sbin"):
        if os.path.islink(path):  # merged /usr
            os.symlink(os.readlink(path), root + path)
    for fd, is_dir, target in held:
        bind(f"/proc/self/fd/{fd}", target, is_dir)
        os.close(fd)
    for folder in (f"{stdlib}/site-packages", f"{stdlib}/dist-packages"):  # installed packages: the allow-list only
        folder = moved + folder[len(prefix):]
        if os.path.isdir(root + folder):
            _mount("kiln-empty", root + folder, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k")
    os.mkdir(root + "/proc")
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC,  # only one's own processes
           f"hidepid=2,gid={PROC_READER_GID}")
    os.mkdir(root + "/dev")
    for name in ("null", "zero", "full", "random", "urandom"):
        bind("/dev/" + name, "/dev/" + name, False, read_only=False)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2"), ("shm", "/tmp")):  # POSIX shared memory: the run's /tmp
        os.symlink(target, f"{root}/dev/{name}")
    os.mkdir(root + "/tmp")  # each run mounts its own tmpfs here
    os.chdir(root)
    _check(_libc.syscall(SYS_PIVOT_ROOT[os.uname().machine], b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "detaching the host's root")
    os.chdir("/")
    _mount("none", "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    if moved != prefix:
        sys.path[:] = [moved + p[len(prefix):] if (p + "/").startswith(prefix + "/") else p for p in sys.path]


def _isolate_run(uid: int | None, limits: dict, joins: bool) -> None:
    """In a freshly forked program (still root): its own mount namespace with a private tmpfs /tmp that is freed
    with the last process of the run; network and IPC namespaces of its own, or with `joins` those of its
    supervisor's that fds 4 and 5 name (`_namespaces_for_runs`)."""
    if joins:
        _check(_libc.setns(4, CLONE_NEWNET), "setns")
        _check(_libc.setns(5, CLONE_NEWIPC), "setns")
        os.close(4)
        os.close(5)
    _check(_libc.unshare(CLONE_NEWNS | (0 if joins else CLONE_NEWIPC | CLONE_NEWNET)), "unshare")
    owner = "" if uid is None else f",uid={uid},gid={uid}"
    _mount("kiln-run", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
           f"mode=700,size={limits['tmp_mb']}m,nr_inodes=16384{owner}")


class _RunIds(NamedTuple):
    program_uid: int
    switch_uids: bool
    index: int
    marker: str

    @property
    def uids(self) -> tuple[int, ...]:
        return (self.program_uid, self.program_uid + 1) if self.switch_uids else ()

    def uid(self, which: int) -> int | None:
        return self.uids[which] if self.switch_uids else None


# ----------------------------------------------------------------------------------------------------------
# Supervisor: root, trusted, one job at a time

_run_namespaces: list[int] = []  # a supervisor's network and IPC namespaces that its programs join (full level)


def _namespaces_for_runs() -> list[int]:
    """Descriptors of the network and IPC namespaces that the supervisor's next program joins: the supervisor's own,
    made anew whenever a run left anything in them (`_scrub_namespaces`), so each run still starts in empty ones.
    Making both for every run cost about 3 ms of CPU (the kernel's setup and teardown of a network namespace
    above all), more than the rest of a run. Only with per-run uids: a program that is root in a user namespace
    could change a namespace's configuration, which no check here would see."""
    if not _run_namespaces:
        if os.path.ismount("/tmp"):  # the message queues of the namespaces given up
            _check(_libc.umount2(b"/tmp", MNT_DETACH), "umount /tmp")
        else:  # the supervisor's own mounts, so the zygote's stay as they are
            _check(_libc.unshare(CLONE_NEWNS), "unshare")
        _check(_libc.unshare(CLONE_NEWNET | CLONE_NEWIPC), "unshare")
        _mount("mqueue", "/tmp", "mqueue", MS_NOSUID | MS_NODEV | MS_NOEXEC)  # to see the POSIX message queues
        _run_namespaces.extend(os.open(f"/proc/self/ns/{kind}", os.O_RDONLY | os.O_CLOEXEC) for kind in ("net", "ipc"))
    return [os.dup(fd) for fd in _run_namespaces]


def _scrub_namespaces() -> None:
    """Once a run's processes are gone: give up the runs' namespaces if anything outlived the run in them. A socket
    can (a descriptor sent and never received keeps it, bound names and all, until the kernel collects it), and
    SysV IPC objects and POSIX message queues do."""
    if not _run_namespaces:
        return
    left = []
    for table in ("/proc/self/net/unix", "/proc/sysvipc/shm", "/proc/sysvipc/sem", "/proc/sysvipc/msg"):
        try:
            with open(table, "rb") as f:
                left += f.read().splitlines()[1:]  # after the header line
        except FileNotFoundError:  # a kernel without SysV IPC
            pass
    if left or os.listdir("/tmp"):
        for fd in _run_namespaces:
            os.close(fd)
        _run_namespaces.clear()


def _supervisor_main(channel: socket.socket) -> None:
    exits: dict[int, int] = {}  # program pid -> wait status, as the zygote reports them
    for jobs_done in range(1, JOBS_PER_SUPERVISOR + 1):
        message, fds = _hear(channel, exits, "job")
        if message is None:
            return
        conn, reply = socket.socket(fileno=fds[0]), None
        try:
            job, ids = _recv(conn), _RunIds(*message[1])
            if job["kind"] == "session":
                _serve_session(job, ids, channel, exits, conn)
            else:
                reply = _serve_run(job, ids, channel, exits) if job["kind"] == "run" else \
                    _serve_suite(job, ids, channel, exits)
        except BaseException:
            import traceback

            reply = {"sandbox_error": traceback.format_exc()}
        exits.clear()
        if jobs_done < JOBS_PER_SUPERVISOR:
            _tell(channel, ("idle",))  # before replying, so that the zygote knows by the caller's next job
        try:
            if reply is not None:
                _send(conn, reply)
        except OSError:
            pass
        conn.close()


def _serve_run(job: dict, ids: _RunIds, channel: socket.socket, exits: dict) -> list:
    limits = job["limits"]
    deadline, results = time.monotonic() + limits["total_timeout"], []
    for stdin in job["stdins"]:
        left = deadline - time.monotonic()
        results.append(_run_program(job["source"], job["code"], stdin, limits, ids, min(limits["timeout"], left),
                                    min(limits["timeout"] * limits["wall_factor"], left), channel, exits)
                       if left > 0 else None)
    return results


def _serve_suite(job: dict, ids: _RunIds, channel: socket.socket, exits: dict) -> list:
    """Run the tests against the program; after a test that timed out, a fresh program runs the tests after it."""
    limits, suite, n = job["limits"], job["suite"], job["n"]
    deadline = time.monotonic() + _suite_budget(limits, n)
    # A CPU-bound hang inside C code (building or comparing what the program returned) ignores the tests' alarm:
    # then this limit ends the supervisor, the job fails alone (SandboxError) and the zygote cleans up.
    used = resource.getrusage(resource.RUSAGE_SELF)
    cpu = math.ceil(used.ru_utime + used.ru_stime + _suite_budget(limits, n)) + 5
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, resource.RLIM_INFINITY))
    verdicts: list[tuple[str, str]] = []
    while len(verdicts) < n:
        if time.monotonic() >= deadline:
            return verdicts + [("timeout", "not run: the suite's total_timeout was used up")] * (n - len(verdicts))
        mine, theirs = socket.socketpair()
        null = os.open(os.devnull, os.O_RDWR)
        tmp, pid = _spawn(channel, exits, ids, limits, deadline - time.monotonic(),
                          [null, os.dup(null), os.dup(null), theirs.detach()])
        _send(mine, ("serve", job["code"], suite["kind"] == "call"))
        verdicts += _run_tests(suite, mine, pid, ids.uid(1), len(verdicts), limits, deadline)
        mine.close()
        _kill_run(ids, pid, channel, exits, tmp)
    return verdicts


def _serve_session(job: dict, ids: _RunIds, channel: socket.socket, exits: dict, conn: socket.socket) -> None:
    """Start the session's program, hand the caller a socket to it, and kill the run once the caller hangs up."""
    mine, theirs = socket.socketpair()
    null = os.open(os.devnull, os.O_RDWR)
    tmp, pid = _spawn(channel, exits, ids, job["limits"], SESSION_CPU_SECONDS,
                      [null, os.dup(null), os.dup(null), theirs.detach()])
    _send(mine, ("session", job["input_images"]))
    socket.send_fds(conn, [b"s"], [mine.fileno()])
    mine.close()
    poller = select.poll()
    poller.register(conn, select.POLLIN)
    poller.register(channel, select.POLLIN)
    while True:
        events = dict(poller.poll())
        if channel.fileno() in events and _hear(channel, exits)[0] is None:
            break  # the zygote is gone, and the run with it
        if conn.fileno() in events and not conn.recv(1):
            break
    _kill_run(ids, pid, channel, exits, tmp)


def _spawn(channel: socket.socket, exits: dict, ids: _RunIds, limits: dict, budget: float,
           fds: list[int]) -> tuple[str | None, int]:
    """Have the zygote fork the run's program with `fds` as its 0, 1, 2, 3 (4, 5: the namespaces it joins); (its
    temp dir in plain mode, pid)."""
    tmp = None
    if not _isolated:  # otherwise the program mounts its own /tmp
        tmp = f"/tmp/kiln-{ids.marker}-{os.urandom(3).hex()}"
        os.mkdir(tmp, 0o700)
        if ids.switch_uids:
            os.chown(tmp, ids.program_uid, ids.program_uid)
    if _isolated and ids.switch_uids:
        fds = fds + _namespaces_for_runs()
    _tell(channel, ("spawn", (ids.uid(0), limits, budget, tmp, ids.marker)), fds)
    for fd in fds:
        os.close(fd)
    return tmp, _hear(channel, exits, "pid")[0][1]


def _run_program(source: str, code: bytes | None, stdin: bytes, limits: dict, ids: _RunIds, budget: float, wall: float,
                 channel: socket.socket, exits: dict) -> dict:
    """One run: `budget` CPU seconds, `wall` seconds of wall clock."""
    (stdin_r, stdin_w), (out_r, out_w), (err_r, err_w) = os.pipe(), os.pipe(), os.pipe()
    mine, theirs = socket.socketpair()
    started = time.monotonic()
    tmp, pid = _spawn(channel, exits, ids, limits, budget, [stdin_r, out_w, err_w, theirs.detach()])
    _send(mine, ("run", source, code))
    mine.close()
    pumped = _pump(pid, channel, exits, {out_r: "stdout", err_r: "stderr"}, stdin, stdin_w, budget, wall,
                   limits["max_output"])
    _kill_run(ids, pid, channel, exits, tmp)
    code = None if pumped["status"] is None else os.waitstatus_to_exitcode(pumped["status"])
    stderr = pumped["stderr"].decode(errors="replace")
    return {"stdout": pumped["stdout"].decode(errors="replace"), "stderr": stderr, "returncode": code,
            "timed_out": pumped["timed_out"] or code in (-signal.SIGXCPU, -signal.SIGKILL),
            "memory_exceeded": (stderr.strip().splitlines() or [""])[-1].startswith("MemoryError"),
            "output_overflow": pumped["overflow"], "wall_time": time.monotonic() - started}


def _pump(pid: int, channel: socket.socket, exits: dict, readers: dict[int, str], stdin: bytes, stdin_fd: int,
          budget: float, wall: float, cap: int) -> dict:
    """Feed stdin and drain the readers until `pid` exits, has used `budget` CPU seconds or `wall` seconds, or an
    output passes `cap`. (Its CPU time cannot pass its wall time, so it is only read once `budget` seconds have
    passed.)"""
    started = time.monotonic()
    deadline = started + wall
    got = {name: bytearray() for name in readers.values()}
    timed_out = overflow = False
    poller = select.poll()
    poller.register(channel, select.POLLIN)
    for fd in readers:
        os.set_blocking(fd, False)
        poller.register(fd, select.POLLIN)
    os.set_blocking(stdin_fd, False)
    poller.register(stdin_fd, select.POLLOUT)
    pending, open_fds = memoryview(stdin), set(readers) | {stdin_fd}
    while pid not in exits and not overflow:
        now = time.monotonic()
        left = deadline - now
        if left <= 0 or now - started >= budget and _cpu_seconds(pid) >= budget:
            timed_out = True
            break
        for fd, _ in poller.poll(min(left, max(started + budget - now, 0.05)) * 1000):
            if fd == channel.fileno():
                _hear(channel, exits)
            elif fd == stdin_fd and fd in open_fds:
                try:
                    pending = pending[os.write(fd, pending[:65536]):]
                except BrokenPipeError:
                    pending = pending[:0]
            elif fd in open_fds and _drain(fd, got[readers[fd]], cap):
                continue
            if fd in open_fds and (fd != stdin_fd or not pending):  # EOF, or all of stdin written
                poller.unregister(fd)
                open_fds.discard(fd)
                os.close(fd)
        overflow = any(len(buf) > cap for buf in got.values())
    for fd in open_fds:
        if pid in exits and fd in readers:  # what it wrote before exiting is still in the pipe
            _drain(fd, got[readers[fd]], cap)
        os.close(fd)
    return {"status": exits.get(pid), "timed_out": timed_out, "overflow": overflow,
            **{name: bytes(buf[:cap]) for name, buf in got.items()}}


def _drain(fd: int, buf: bytearray, cap: int) -> bool:
    """Read what is available (up to just past `cap`); False at EOF."""
    while len(buf) <= cap:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return True
        if not chunk:
            return False
        buf += chunk
    return True


def _kill_run(ids: _RunIds, pid: int, channel: socket.socket, exits: dict, tmp: str | None) -> None:
    """Kill every process of the run, however far it wandered from its parent; in plain mode, remove what it left
    (with namespaces its /tmp is freed with its last process)."""
    import shutil

    _kill_once(ids, [pid], scan=False)
    while pid not in exits and _hear(channel, exits)[0] is not None:
        pass  # scanning before the zygote has reaped the program would only find it dying
    for attempt in range(3000):
        if not _kill_once(ids, [pid]):
            break
        time.sleep(0.0002 if attempt < 100 else 0.01)
    else:
        raise SandboxError(f"processes of run {ids.index} survived SIGKILL for 30s")
    _scrub_namespaces()
    if tmp is None:
        return
    leftovers = [tmp]
    for top in WORLD_WRITABLE if ids.switch_uids else ():  # what the run wrote outside its temp dir
        try:
            leftovers += [e.path for e in os.scandir(top) if e.stat(follow_symlinks=False).st_uid in ids.uids]
        except OSError:
            pass
    for path in dict.fromkeys(leftovers):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.lexists(path):
            os.unlink(path)


def _kill_once(ids: _RunIds, group_leaders: list[int], scan: bool = True) -> list[int]:
    """SIGKILL the run once; return the processes of the run still there (zombies too: the zygote reaps them as
    soon as they appear)."""
    for uid in ids.uids:
        os.setresuid(uid, uid, 0)  # kill(-1) as the run's uid reaches exactly that uid's processes
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        finally:
            os.setresuid(0, 0, 0)
    for pid in group_leaders if not ids.switch_uids else ():
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    found, needle = [], f"KILN_RUN={ids.marker}".encode()
    for entry in os.listdir("/proc") if scan else ():  # kill(-1)'s result cannot tell: it counts everyone
        try:
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            if ids.switch_uids:
                with open(f"/proc/{entry}/status", "rb") as f:
                    status = f.read()
                hit = int(status[status.index(b"\nUid:") + 5:].split()[0]) in ids.uids
            else:  # one uid for everything: the environment marker finds daemons that kept it
                with open(f"/proc/{entry}/environ", "rb") as f:
                    hit = needle in f.read().split(b"\0")
                if hit:
                    os.kill(int(entry), signal.SIGKILL)
        except (OSError, ValueError):
            continue
        if hit:
            found.append(int(entry))
    return found


# ----------------------------------------------------------------------------------------------------------
# The program (untrusted), forked by the zygote: fd 0-2 as given, fd 3 brings its job

def _program_main(spec: tuple, fds: list[int]) -> None:
    uid, limits, budget, cwd, marker = spec
    try:
        _forget_zygote_signals()
        os.setsid()
        moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, 256) for fd in fds]  # out of the way of the dup2s
        for target, fd in enumerate(moved):
            os.dup2(fd, target)
        os.closerange(len(fds), 1 << 20)
        if cwd is None:
            _isolate_run(uid, limits, joins=len(fds) == 6)
            cwd = "/tmp"
        os.chdir(cwd)
        for which, value in ((resource.RLIMIT_AS, limits["memory_mb"] << 20), (resource.RLIMIT_CORE, 0),
                             (resource.RLIMIT_NPROC, limits["nproc"]), (resource.RLIMIT_NOFILE, limits["nofile"]),
                             (resource.RLIMIT_FSIZE, limits["fsize_mb"] << 20)):
            resource.setrlimit(which, (value, value))
        cpu = math.ceil(budget) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        # Deep recursion through C frames (lru_cache, ...) needs main-thread stack; threads keep their 8 MiB.
        hard = resource.getrlimit(resource.RLIMIT_STACK)[1]
        resource.setrlimit(resource.RLIMIT_STACK, (256 << 20 if hard == resource.RLIM_INFINITY else hard, hard))
        if uid is not None:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        os.environ.update({"HOME": cwd, "TMPDIR": cwd, "KILN_RUN": marker})
        sys.argv = ["solution.py"]
        sys.path += _package_dirs
        sock = socket.socket(fileno=3)
        job = _recv(sock)
        if job[0] == "run":
            sock.close()
            _exec_program(job[1], job[2])
        elif job[0] == "session":
            _session_main(sock, job[1])
        else:
            _serve_program(sock, job[1], job[2])
    finally:
        os._exit(127)


def _program_module(leetcode: bool) -> dict:
    """A fresh `__main__` namespace; LeetCode-style code gets `typing` names and common modules, as on those
    judges."""
    module = type(sys)("__main__")
    module.__file__ = "solution.py"
    sys.modules["__main__"] = module
    if leetcode:
        module.__dict__.update({name: getattr(typing, name) for name in typing.__all__})
        module.__dict__.update({name: sys.modules[name] for name in LEETCODE_MODULES})
    return module.__dict__


def _exec_program(source: str, compiled: bytes | None) -> None:
    """Behave like `python solution.py`: exit status from SystemExit, traceback on stderr, threads joined."""
    code = 0
    try:
        with open("solution.py", "w") as f:  # for the traceback's source lines
            f.write(source)
        exec(marshal.loads(compiled) if compiled else compile(source, "solution.py", "exec", dont_inherit=True),
             _program_module(False))
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException as e:
        e.__traceback__ = e.__traceback__.tb_next  # start at the program's own frames
        sys.__excepthook__(type(e), e, e.__traceback__)
        code = 1
    threading = sys.modules.get("threading")
    for thread in threading.enumerate() if threading else ():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    os._exit(code & 0xFF)


class _Encoder(pickle.Pickler):
    """The program's side: plain values by value, anything else as a handle into `objects`."""

    def persistent_id(self, obj):
        if id(type(obj)) in self.plain or id(obj) in self.plain:  # type objects pickle by name
            return None
        self.objects[id(obj)] = obj  # kept alive: the tests may hand the handle back
        return id(obj)


class _Decoder(pickle.Unpickler):
    def persistent_load(self, pid):
        return self.objects[pid]


def _plain_type_ids() -> set[int]:
    """ids of the PLAIN types; a module the program never imported cannot have produced its types."""
    found = {id(type(None))}
    for module_name, names in PLAIN.items():
        module = builtins if module_name == "builtins" else sys.modules.get(module_name)
        found.update(id(getattr(module, name)) for name in names if isinstance(getattr(module, name, None), type))
    return found


def _serve_program(sock: socket.socket, code: bytes, leetcode: bool) -> None:
    """Run the module, then answer the tests' requests until they hang up."""
    objects: dict[int, object] = {}

    def reply(message) -> None:
        if type(message[-1]) in (int, float, str, bool, type(None)):  # nothing to turn into a handle
            data = pickle.dumps(message, protocol=5)
        else:
            buf = io.BytesIO()
            encoder = _Encoder(buf, protocol=5)
            encoder.plain, encoder.objects = _plain_type_ids(), objects
            encoder.dump(message)
            data = buf.getvalue()
        sock.sendall(struct.pack("<Q", len(data)) + data)

    def error(e: BaseException):
        return ("err", type(e).__name__, str(e)[:500])

    try:
        namespace = _program_module(leetcode)
        exec(marshal.loads(code), namespace)
        reply(("ok", None))
    except BaseException as e:
        reply(error(e))
        os._exit(1)
    while True:
        try:
            (size,) = struct.unpack("<Q", _recv_exact(sock, 8))
            decoder = _Decoder(io.BytesIO(_recv_exact(sock, size)))
            decoder.objects = objects
            op, ref, args, kwargs = decoder.load()
        except EOFError:
            os._exit(0)
        try:
            if isinstance(ref, str) and ref not in namespace:
                raise NameError(f"name {ref!r} is not defined", name=ref)
            target = namespace[ref] if isinstance(ref, str) else objects[ref]
            result = (target if op == "get" else target(*args, **kwargs) if op == "call" else
                      getattr(target, args) if op == "getattr" else setattr(target, args, kwargs)
                      if op == "setattr" else list(target))
            message = ("ok", result)
        except BaseException as e:
            message = error(e)
        try:
            reply(message)
        except BaseException as e:  # e.g. too deeply nested to encode
            reply(error(e))


# ----------------------------------------------------------------------------------------------------------
# The tests, run by the supervisor as the run's second uid, calling into the program

class ProgramError(Exception):
    """An exception from inside the program with no builtin equivalent, or the program's death."""
    from_program = True


class _Remote:
    """An object living in the program. Calls, attribute reads/writes and iteration are forwarded; equality is
    identity, so a handle never equals an expected value."""
    __slots__ = ("_ref", "_rpc")

    def __init__(self, ref, rpc):
        object.__setattr__(self, "_ref", ref)
        object.__setattr__(self, "_rpc", rpc)

    def __call__(self, *args, **kwargs):
        return self._rpc("call", self._ref, args, kwargs)

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._rpc("getattr", self._ref, name, None)

    def __setattr__(self, name: str, value) -> None:
        self._rpc("setattr", self._ref, name, value)

    def __iter__(self):
        return iter(self._rpc("list", self._ref, None, None))

    def __repr__(self) -> str:
        return "<program object>"

    def __reduce_ex__(self, protocol):
        raise TypeError("a handle is sent by reference")  # sends the caller to _TestsEncoder


class _TestsEncoder(pickle.Pickler):
    def persistent_id(self, obj):
        return obj._ref if type(obj) is _Remote else None


class _TestsDecoder(pickle.Unpickler):
    """Only PLAIN classes can be named in a reply; handles become `_Remote`s."""

    def find_class(self, module, name):
        if name not in PLAIN.get(module, ()) or name == "NoneType":
            raise pickle.UnpicklingError(f"the program sent a {module}.{name}")
        return _bounded_fraction if name == "Fraction" else getattr(__import__(module), name)

    def persistent_load(self, pid):
        return _Remote(pid, self.rpc)


def _bounded_fraction(*parts):
    """A Fraction pickles as (numerator, denominator), rebuilt with a gcd; a forged one may bring text to parse.
    Both cost more than linear time, so their size is bounded."""
    import fractions

    if not all(type(p) is int and p.bit_length() <= 4 * MAX_FRACTION_DIGITS or type(p) is str
               and len(p) <= MAX_FRACTION_DIGITS for p in parts):
        raise pickle.UnpicklingError("the program sent a Fraction too large to rebuild")
    return fractions.Fraction(*parts)


_CONTAINERS = (list, tuple, set, frozenset, dict, collections.deque, collections.OrderedDict, collections.Counter,
               collections.defaultdict)


def _too_many_items(value) -> bool:
    """Whether `value`, walked as a tree, holds more than MAX_REPLY_ITEMS items: a few bytes of pickle can share one
    list a billion times, and comparing or normalising it would take that long."""
    budget, stack = MAX_REPLY_ITEMS, [value]
    while stack:
        item = stack.pop()
        if type(item) not in _CONTAINERS:
            continue
        budget -= len(item)
        if budget < 0:
            return True
        children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
        stack += [child for child in children if type(child) in _CONTAINERS]
    return False


class _ShortRepr(reprlib.Repr):
    """reprlib's abbreviations, without turning a huge int into decimal digits (quadratic time)."""

    def repr_int(self, x, level):
        return repr(x) if x.bit_length() < 4000 else f"<int of {x.bit_length()} bits>"


_short = _ShortRepr().repr


class _TestTimeout(BaseException):
    """A test (or the program's start) ran past its time limit."""


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid: int) -> float:
    """CPU time of process `pid` (all its threads) so far; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime, stime


class _Clock:
    """The current test's limits, `timeout` CPU seconds (the program's and the tests' own, so the same on a busy
    machine) and `timeout x wall_factor` seconds of wall clock, enforced by SIGALRM without races: the handler raises
    only while a test is armed, at most once per test (it disarms first), and a connection interrupted mid-exchange
    stays expired (the program's late reply must never answer a later request)."""

    def __init__(self, program: int, wall_factor: float):
        self.program, self.wall_factor = program, wall_factor
        self.cpu_deadline = self.wall_deadline = math.inf
        self.armed = self.expired = False

    def used(self) -> float:
        return _cpu_seconds(self.program) + time.process_time()

    def on_alarm(self, *_) -> None:
        if self.armed and (time.monotonic() >= self.wall_deadline or self.used() >= self.cpu_deadline):
            self.armed, self.expired = False, True
            raise _TestTimeout

    def arm(self, seconds: float, wall_left: float) -> None:
        self.cpu_deadline = self.used() + seconds
        self.wall_deadline = time.monotonic() + min(seconds * self.wall_factor, wall_left)
        self.armed = True
        # CPU time cannot outrun the wall clock: nothing to check before `seconds`; then every 50 ms
        signal.setitimer(signal.ITIMER_REAL, max(min(seconds, wall_left), 0.001), 0.05)

    def disarm(self) -> None:
        self.armed = False
        signal.setitimer(signal.ITIMER_REAL, 0)


def _rpc_client(sock: socket.socket, clock: _Clock):
    def receive():
        if clock.expired:
            raise _TestTimeout
        try:
            (size,) = struct.unpack("<Q", _recv_exact(sock, 8))
            if size > MAX_REPLY_BYTES:
                raise ProgramError(f"a reply larger than {MAX_REPLY_BYTES >> 20} MiB")
            decoder = _TestsDecoder(io.BytesIO(_recv_exact(sock, size)))
            decoder.rpc = rpc
            message = decoder.load()
            if type(message) is not tuple or message[0] not in ("ok", "err") or len(message) != (2, 3)[
                    message[0] == "err"]:
                raise ValueError("not a reply")
            if message[0] == "ok" and _too_many_items(message[1]):
                raise ProgramError(f"a value of more than {MAX_REPLY_ITEMS} items")
        except (EOFError, OSError):
            raise ProgramError("the program exited") from None
        except (ProgramError, MemoryError):  # MemoryError: the tests' side's own limit
            raise
        except Exception as e:  # the program wrote to its end of the socket itself, or broke its own server
            raise ProgramError(f"malformed reply: {_short(e)}") from None
        if message[0] == "ok":
            return message[1]
        _, name, text = message
        cls = getattr(builtins, str(name), None)
        try:  # some builtin exceptions cannot be rebuilt from a message (UnicodeDecodeError takes five arguments)
            error = cls(str(text)) if isinstance(cls, type) and issubclass(cls, Exception) else None
        except Exception:
            error = None
        if error is None:
            error = ProgramError(f"{_short(name)}: {_short(text)}")
        error.from_program = True
        raise error

    def rpc(op, ref, args, kwargs):
        if clock.expired:
            raise _TestTimeout
        try:
            data = pickle.dumps((op, ref, args, kwargs), protocol=5)
        except TypeError:  # handles among the arguments
            buf = io.BytesIO()
            _TestsEncoder(buf, protocol=5).dump((op, ref, args, kwargs))
            data = buf.getvalue()
        sock.sendall(struct.pack("<Q", len(data)) + data)
        return receive()

    return rpc, receive


def _run_tests(suite: dict, sock: socket.socket, program: int, uid: int | None, first: int, limits: dict,
               deadline: float) -> list[tuple[str, str]]:
    """Verdicts of tests `first`, ...: until the last one or one that timed out (included; the caller starts a
    fresh program for the rest). Each test, and the program's start, gets the time limits of `_Clock`. Runs as `uid`
    (keeping root as the saved uid, to clean up after), calling the program over `sock`; the program cannot
    signal or trace us: another uid, and not dumpable after the uid change."""
    clock = _Clock(program, limits["wall_factor"])
    rpc, receive = _rpc_client(sock, clock)
    n = len(suite["asserts"]) if suite["kind"] == "assert" else len(suite["args"])
    timeout = limits["timeout"]

    def within_limits(step):
        """step() under the test's time limit; every way out disarms it."""
        clock.arm(timeout, deadline - time.monotonic())
        try:
            return step()
        finally:
            clock.disarm()

    def start():
        receive()  # the program's module has run
        return _assert_runner(suite, rpc) if suite["kind"] == "assert" else _call_runner(suite, rpc)

    signal.signal(signal.SIGALRM, clock.on_alarm)
    # The tests' side has its own memory limit: what the program returns is built here.
    memory_before = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as f:
        size = int(f.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (size + (limits["memory_mb"] << 20), memory_before[1]))
    gc.disable()
    groups_before = os.getgroups()
    if uid is not None:
        os.setgroups([PROC_READER_GID])  # the program's CPU time (_Clock) through the view's /proc
        os.setresgid(uid, uid, 0)
        os.setresuid(uid, uid, 0)
    try:
        try:
            run_test = within_limits(start)
        except _TestTimeout:
            return [("timeout", f"the program did not start within the time limit ({timeout}s)")] * (n - first)
        except BaseException as e:
            # A setup that uses the program's names (MBPP builds trees of the program's Node class) can be made to
            # fail by the program (_assert_runner marks it so); one that fails without them is the ground truth's fault.
            blamed = getattr(e, "from_program", False)
            return [(_classify(e) if blamed else "harness_error", f"before the tests: {_describe(e)}")] * (n - first)
        verdicts: list[tuple[str, str]] = []
        for i in range(first, n):
            try:
                detail = within_limits(lambda: run_test(i))
                verdicts.append(("pass", "") if detail is None else ("wrong_answer", detail))
            except _TestTimeout:
                verdicts.append(("timeout", f"no result within the time limit ({timeout}s of CPU, "
                                            f"{timeout * limits['wall_factor']:g}s of wall clock)"))
            except BaseException as e:
                verdicts.append((_classify(e), _describe(e)))
            if verdicts[-1][0] != "pass" and suite.get("stop"):
                return verdicts + [("not_run", "")] * (n - first - len(verdicts))
            if verdicts[-1][0] == "timeout":
                break
        return verdicts
    finally:
        clock.disarm()
        if uid is not None:
            os.setresuid(0, 0, 0)
            os.setresgid(0, 0, 0)
            os.setgroups(groups_before)
        resource.setrlimit(resource.RLIMIT_AS, memory_before)
        gc.enable()


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {_short(str(e))[1:-1]}"[:500]


def _classify(e: BaseException) -> str:
    if isinstance(e, MemoryError):
        return "memory"
    return "wrong_answer" if isinstance(e, AssertionError) and not getattr(e, "from_program", False) else "runtime_error"


def _assert_runner(suite: dict, rpc):
    namespace: dict = {"__name__": "__kiln_tests__"}
    setup, tests = marshal.loads(suite["code"])
    for name in suite["modules"]:  # the tests' own module, never the program's
        namespace[name] = __import__(name)

    def bind(names: list[str]) -> None:
        for name in names:
            try:
                namespace[name] = rpc("get", name, None, None)
            except NameError:
                namespace.pop(name, None)  # no stand-in from the setup (a HumanEval stub): the test must fail

    bind(suite["before"])
    try:
        exec(setup, namespace)
    except BaseException as e:
        if set(suite["before"]) & _code_names(setup):
            e.from_program = True
        raise
    bind(suite["after"])
    return lambda i: exec(tests[i], namespace)


def _code_names(code) -> set[str]:
    """The global and attribute names `code` and the functions in it refer to."""
    return set(code.co_names).union(*(_code_names(c) for c in code.co_consts if isinstance(c, type(code))))


def _call_runner(suite: dict, rpc):
    target = []

    def run_test(i: int):
        if not target:
            try:
                target.append(rpc("get", suite["fn_name"], None, None))
            except NameError:
                target.append(getattr(rpc("get", "Solution", None, None)(), suite["fn_name"]))
        args, expected = suite["args"][i], suite["expected"][i]
        got = _as_lists(target[0](*args))
        if type(got) is not _Remote and (got == expected or type(expected) is list and [got] == expected):
            return None
        return f"args {_short(args)}: expected {_short(expected)}, got {_short(got)}"

    return run_test


def _as_lists(value):
    """Tuples read as lists, as in the JSON the expected values come from."""
    if type(value) in (list, tuple):
        return [_as_lists(v) for v in value]
    return {k: _as_lists(v) for k, v in value.items()} if type(value) is dict else value


# ----------------------------------------------------------------------------------------------------------
# PythonSession: the agent's stateful Python tool, a long-lived program of the zygote (a "session" job)

class ToolOutput(NamedTuple):
    stdout: str
    stderr: str
    error: str | None  # "ExcType: message" with traceback, "timeout: ...", or None
    images: list[bytes]  # PNG bytes
    timed_out: bool


class PythonSession:
    """`with PythonSession(input_images=[png_bytes]) as s: s.run("x = 1"); s.run("print(x)")`. Variables, imports and
    files persist across calls. The code runs as a program of `sandbox` (default: the shared one whose programs may
    import SESSION_PACKAGES): the filesystem view, its own namespaces (no network), a fresh unprivileged uid, the
    Limits' rlimits and SESSION_CPU_SECONDS of CPU; its working dir (a private tmpfs) holds the first input image as
    `input_image.png`, also the PIL image `image` (several: all of them also as input_image_0.png, input_image_1.png,
    ... and the PIL images `images`). Each call has a timeout: an alarm in the interpreter interrupts that
    call only (state kept); code that will not be interrupted gets a fresh interpreter (reported). PIL images shown
    or saved and matplotlib figures come back as PNG bytes. close() kills every process the session started."""

    def __init__(self, input_images: Sequence[bytes] = (), limits: Limits = Limits(), max_images: int = 4,
                 max_image_bytes: int = 4 << 20, max_output: int = 1 << 16, sandbox: Sandbox | None = None):
        self.limits, self.max_images, self.max_image_bytes, self.max_output = limits, max_images, max_image_bytes, max_output
        self.input_images = list(input_images)
        self.sandbox = sandbox or default_sandbox(SESSION_PACKAGES)
        self._job = self._program = None
        self._start()

    def _start(self) -> None:
        job = {"kind": "session", "limits": self.limits._asdict(), "input_images": self.input_images}
        self._job, self._program = self.sandbox.open_session(job)

    def run(self, code: str, timeout: float | None = None) -> ToolOutput:
        """Run `code` in the session. Never raises for anything the code does."""
        timeout = timeout or self.limits.timeout
        if self._program is None:
            raise SandboxError("PythonSession.run after close()")
        try:
            self._program.settimeout(timeout + 5)  # grace for collecting images
            _send(self._program, (code, timeout, self.max_output))
            reply = _session_reply(self._program)
        except TimeoutError:
            return self._restart("the call ran past its timeout and could not be interrupted; it was killed and a "
                                 "fresh interpreter started (all state is lost)", timed_out=True)
        except (OSError, EOFError, ValueError, pickle.UnpicklingError):
            return self._restart("the interpreter died (memory limit or os._exit?); a fresh one was started (all "
                                 "state is lost)")
        stdout, stderr, error, timed_out, images = reply
        kept = [i for i in images if len(i) <= self.max_image_bytes][: self.max_images]
        stderr = stderr[: self.max_output]
        if len(kept) < len(images):
            stderr += f"\n[{len(images) - len(kept)} images dropped: at most {self.max_images} of " \
                      f"{self.max_image_bytes} bytes each]"
        return ToolOutput(stdout[: self.max_output], stderr, error, kept, timed_out)

    def _restart(self, why: str, timed_out: bool = False) -> ToolOutput:
        self.close()
        self._start()
        return ToolOutput("", "", why, [], timed_out)

    def close(self) -> None:
        """End the session; returns once every process it started is gone."""
        if self._job is None:
            return
        self._program.close()
        try:
            self._job.shutdown(socket.SHUT_WR)
            self._job.settimeout(60)
            self._job.recv(1)  # the supervisor hangs up once it has killed the run
        except OSError:
            pass
        self._job.close()
        self._job = self._program = None

    def __enter__(self) -> PythonSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


def _session_reply(sock: socket.socket) -> tuple:
    """The session program's reply, decoded as untrusted data: (stdout, stderr, error, timed_out, images)."""
    (size,) = struct.unpack("<Q", _recv_exact(sock, 8))
    if size > MAX_REPLY_BYTES:
        raise ValueError("reply too large")
    decoder = _TestsDecoder(io.BytesIO(_recv_exact(sock, size)))
    decoder.rpc = None
    reply = decoder.load()
    kinds = (str, str, (str, type(None)), bool, list)
    if type(reply) is not tuple or len(reply) != 5 or not all(isinstance(v, k) for v, k in zip(reply, kinds)) \
            or not all(type(i) is bytes for i in reply[4]):
        raise ValueError("not a session reply")
    return reply


def _session_main(sock: socket.socket, input_images: list[bytes]) -> None:
    """The session's program: run each call's code in one namespace and send back what it printed and drew."""
    import contextlib
    import traceback

    class CallTimeout(BaseException):
        pass

    def on_alarm(*_):
        raise CallTimeout()

    def png(image) -> bytes:
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        return buf.getvalue()

    def stamps() -> dict[str, int]:
        found = {}
        for folder, _, files in os.walk("."):
            for name in files:
                if name.lower().endswith((".png", ".jpg", ".jpeg", ".gif", ".bmp", ".webp")):
                    path = os.path.join(folder, name)[2:]
                    found[path] = os.stat(path).st_mtime_ns
        return found

    os.environ.update({"MPLBACKEND": "Agg", "MPLCONFIGDIR": os.getcwd(), "OPENBLAS_NUM_THREADS": "1"})
    signal.signal(signal.SIGALRM, on_alarm)
    namespace, shown = _program_module(False), []
    files = {"input_image.png": input_images[0]} if input_images else {}
    if len(input_images) > 1:
        files |= {f"input_image_{i}.png": data for i, data in enumerate(input_images)}
    for name, data in files.items():
        with open(name, "wb") as f:
            f.write(data)
    try:
        from PIL import Image

        Image.Image.show = lambda self, *args, **kwargs: shown.append(png(self))
        opened = [Image.open(io.BytesIO(data)) for data in input_images]
        for picture in opened:
            picture.load()
        if opened:
            namespace["image"], namespace["images"] = opened[0], opened
    except ImportError:
        Image = None
    while True:
        try:
            code, timeout, max_output = _recv(sock)
        except EOFError:
            os._exit(0)
        shown.clear()
        before, out, err, error, timed_out = stamps(), io.StringIO(), io.StringIO(), None, False
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                signal.setitimer(signal.ITIMER_REAL, timeout)
                exec(compile(code, "<tool>", "exec"), namespace)
            except CallTimeout:
                timed_out, error = True, f"timeout: the call ran past {timeout}s and was interrupted"
            except BaseException as e:
                error = "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next))
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        images = list(shown)
        try:
            for name in sorted(f for f, t in stamps().items() if before.get(f) != t):
                images.append(png(Image.open(name)))
            if "matplotlib.pyplot" in sys.modules:
                plt = sys.modules["matplotlib.pyplot"]
                for number in plt.get_fignums():
                    buf = io.BytesIO()
                    plt.figure(number).savefig(buf, format="png")
                    images.append(buf.getvalue())
                plt.close("all")
        except Exception as e:
            err.write(f"\n[images could not be collected: {type(e).__name__}: {e}]")
        _send(sock, (out.getvalue()[:max_output], err.getvalue()[:max_output], error, timed_out, images))
