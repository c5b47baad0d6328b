"""Tests the code under test cannot tell apart: the rewrite of an instance's test files that swe_grading runs inside
the grading container, right before the tests start (the eval script feeds this file to the container's Python).

Every FAIL_TO_PASS test function is renamed to a fresh random name and placed, in random order, beside copies of
itself in its own class and file: copies that must agree with it (they fail or pass as it does) and variants that
must fail (its own code, then a check that fails). Each of them, the renamed test included, ends with a check of the
same shape (`if sorted([...]) != [...]: raise AssertionError(...)`), true for the test and its copies, false for the
variants. Before a fix they all fail at the same statement with the same error. The names are drawn here, from the
container's own randomness, and leave only in one `kiln-renamed` line on standard error (the log, which only the grader
reads): the eval script never holds them, so code under test reading it learns nothing. swe_grading maps the names
back outside the container and distrusts a report where a variant passed or the test and its copies disagree.

Runs on the instance's Python (3.5 and up: SWE-bench's oldest images), standard library only, as
`python -I -S - PLAN_JSON`: isolated, so a patched module in the working tree can shadow nothing it imports.
PLAN_JSON: {"targets": [{"candidates": [file, ...], "scope": [class, ...], "name": function}, ...], "copies": n,
"fails": n}. Exit status 3 and a `kiln-canaries-failed` line when a target cannot be found or rewritten.
"""
import ast
import json
import random
import re
import sys

RENAMED = "kiln-renamed "
FAILED = "kiln-canaries-failed "
RNG = random.SystemRandom()


class RewriteError(Exception):
    pass


def fresh_name(name):
    """A random name the runner still collects: the original's prefix up to its first underscore ("test_")."""
    prefix = name.split("_")[0] + "_" if "_" in name else "test_"
    return prefix + "%012x" % RNG.getrandbits(48)


def check_line(indent, passes):
    """The closing check: sorted() of four random numbers against their sorted order (passes) or a wrong order."""
    values = RNG.sample(range(100, 1000), 4)
    expected = sorted(values)
    if not passes:
        expected = expected[:2] + expected[2:][::-1]
    return "%sif sorted(%r) != %r: raise AssertionError(%r)\n" % (indent, values, expected, values)


def start_of(node):
    """The first line of a statement, its decorators included (Python < 3.8 puts lineno there already)."""
    return min([d.lineno for d in getattr(node, "decorator_list", [])] + [node.lineno])


def end_of(node, following, lines):
    """The last line of a statement: end_lineno where Python has it (3.8+), else the line before the next statement,
    less trailing blank and comment lines."""
    if getattr(node, "end_lineno", None):
        return node.end_lineno
    end = following - 1
    while end > node.lineno and (not lines[end - 1].strip() or lines[end - 1].strip().startswith("#")):
        end -= 1
    return end


def find(tree, scope, name, lines):
    """The function `name` in the class chain `scope`, with the line where the statement after it starts."""
    body, following = tree.body, len(lines) + 1
    for part in list(scope) + [name]:
        found = None
        for i, node in enumerate(body):
            if getattr(node, "name", None) == part and isinstance(node, (ast.ClassDef, ast.FunctionDef,
                                                                         getattr(ast, "AsyncFunctionDef", ast.FunctionDef))):
                found = node
                following = start_of(body[i + 1]) if i + 1 < len(body) else following
        if found is None:
            raise RewriteError("no %s in %s" % (part, ".".join(scope) or "the module"))
        body = found.body
    if isinstance(found, ast.ClassDef):
        raise RewriteError("%s is a class, not a test function" % name)
    return found, following


def is_docstring(node):
    if sys.version_info < (3, 8):
        return isinstance(node, ast.Expr) and isinstance(node.value, ast.Str)
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def leaves_early(function):
    """Whether the function's own code (not nested functions) returns or yields: a check after its last line could
    then be skipped, so it goes first instead."""
    todo = list(function.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Return, ast.Yield, getattr(ast, "YieldFrom", ast.Yield))):
            return True
        if not isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Lambda,
                                 getattr(ast, "AsyncFunctionDef", ast.FunctionDef))):
            todo.extend(ast.iter_child_nodes(node))
    return False


def group(function, following, lines, copies, fails):
    """The renamed function and its copies and variants, in random order: (text, {name: role})."""
    start, end = start_of(function), end_of(function, following, lines)
    block, first = lines[start - 1:end], function.body[0]
    if lines[first.lineno - 1][:first.col_offset].strip():
        raise RewriteError("%s has its body on its def line" % function.name)
    indent = lines[first.lineno - 1][:first.col_offset]
    def_line = next(i for i in range(len(block)) if re.match(r"\s*(async\s+)?def\s+%s\b" % function.name, block[i]))
    if leaves_early(function):  # the check goes after the docstring, before anything that can return
        after = (end_of(first, start_of(function.body[1]), lines) if is_docstring(first) and len(function.body) > 1
                 else start_of(first) - 1) - start + 1
    else:
        after = len(block)
    roles = ["target"] + ["copy"] * copies + ["fail"] * fails
    RNG.shuffle(roles)
    text, names = [], {}
    for role in roles:
        name = fresh_name(function.name)
        names[name] = role
        member = list(block)
        member[def_line] = re.sub(r"(def\s+)%s\b" % function.name, r"\g<1>" + name, member[def_line], count=1)
        member.insert(after, check_line(indent, role != "fail"))
        text.append("".join(member))
    return "\n".join(text), names


def rewrite(path, targets, copies, fails):
    """The file with each target's group in its place (bottom up, so line numbers stay right); one record each."""
    with open(path, "rb") as f:
        source = f.read()
    lines = source.decode("utf-8").splitlines(True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    tree = ast.parse(source, path)
    found = []
    for target in targets:
        function, following = find(tree, target["scope"], target["name"], lines)
        found.append((start_of(function), function, following, target))
    records = []
    for start, function, following, target in sorted(found, key=lambda f: -f[0]):
        end = end_of(function, following, lines)
        text, names = group(function, following, lines, copies, fails)
        lines[start - 1:end] = [text]
        records.append({"file": path, "scope": target["scope"], "name": target["name"], "tests": names})
    with open(path, "wb") as f:
        f.write("".join(lines).encode("utf-8"))
    return records


def main(plan):
    by_file = {}
    for target in plan["targets"]:
        path = next((c for c in target["candidates"] if _exists(c)), None)
        if path is None:
            raise RewriteError("no file for %s among %s" % (target["name"], " ".join(target["candidates"])))
        by_file.setdefault(path, []).append(target)
    records = []
    for path, targets in sorted(by_file.items()):
        records.extend(rewrite(path, targets, plan["copies"], plan["fails"]))
    sys.stderr.write(RENAMED + json.dumps(records, sort_keys=True) + "\n")  # in order with the eval script's trace


def _exists(path):
    try:
        open(path, "rb").close()
        return True
    except (IOError, OSError):
        return False


if __name__ == "__main__":
    try:
        main(json.loads(sys.argv[1]))
    except (RewriteError, SyntaxError, UnicodeDecodeError) as e:
        sys.stderr.write(FAILED + str(e) + "\n")
        sys.exit(3)
