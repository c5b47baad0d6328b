"""Real SWE-bench instances built offline, for the CPU recipe, tests and CI: no image registry, only Debian packages
and PyPI (debootstrap needs root: `sudo .venv/bin/python swe_instances.py ...`).

    python swe_instances.py --out DIR [--instances ID ...] [--rebuild] [--source ROWS]

The two marshmallow instances of the Lite-dev file, and a Django-shaped one (django-11099's bug on the Django 2.2
sdist, graded with swebench's Django parser). For each: the project's sdist at the instance's version becomes a git
repository with one fixed-date commit (its sha is the row's base_commit, the same on every build), installed into a
debootstrap Debian image with wheels from PyPI, built by the legacy builder without network. DIR/instances.json
holds the SWE-bench 5.x rows (image, eval_script in the official shape, log_parser, eval_type) and DIR/rows.parquet
the kiln rows `data_prep.py swebench` makes of them. Images already on the host are kept unless --rebuild.

The marshmallow rows come from the SWE-bench Lite dev split: the two are bundled in swe_instances.json (the default
--source); --source also takes a .json / .jsonl file of Lite-dev rows or the hub dataset (SWE-bench/SWE-bench_Lite,
--split dev).

The sdist of marshmallow 2.20.0 has the same src/ and tests/ as marshmallow-1343's base commit; 3.0.0 differs
from marshmallow-1359's only cosmetically in two test files (checked against the upstream history).
"""
from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import docker.errors
import tyro

import cli
import containers
import data_prep
import task_rows

log = logging.getLogger("kiln.swe_instances")

BUNDLED = Path(__file__).resolve().parent / "swe_instances.json"  # the Lite-dev rows of RECIPES' marshmallow instances
SUITE = "bullseye"  # python 3.9, the version SWE-bench's marshmallow specs use (2.20 breaks on 3.10+)
BASE_IMAGE = f"kiln-swe/base:{SUITE}"


@dataclass(frozen=True)
class Recipe:
    project: str
    """PyPI project whose sdist is the repository"""
    version: str
    """its version (the instance's)"""
    needs: tuple[str, ...]
    """wheels the tests need besides pytest, pinned so builds repeat"""
    log_parser: str
    """swebench's parser for the test log"""
    test_command: str
    """the tests the eval script runs ({tests}: the test patch's files)"""


MARSHMALLOW_NEEDS = ("pytz==2026.6", "simplejson==4.3.0", "python-dateutil==2.9.0.post0")
RECIPES = {
    "marshmallow-code__marshmallow-1343": Recipe("marshmallow", "2.20.0", MARSHMALLOW_NEEDS, "parse_log_marshmallow",
                                                 "pytest -rA {tests}"),
    "marshmallow-code__marshmallow-1359": Recipe("marshmallow", "3.0.0", MARSHMALLOW_NEEDS, "parse_log_marshmallow",
                                                 "pytest -rA {tests}"),
    "django__django-11099": Recipe("Django", "2.2", ("pytz==2026.6", "sqlparse==0.5.3"), "parse_log_django",
                                   "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1 "
                                   "auth_tests.test_validators"),
}
# Django-shaped: not a Lite-dev row. The 2.2 sdist still has the django-11099 bug (`$` also matches before a trailing
# newline); the issue text, test patch and fix below are kiln's own.
DJANGO_ISSUE = """Usernames that end with a newline pass the username validators.

ASCIIUsernameValidator and UnicodeUsernameValidator in django.contrib.auth.validators match usernames with
r'^[\\w.@+-]+$'. In a Python regex `$` also matches just before a final newline, so "joe\\n" is accepted as a
valid username. A username with a trailing newline should be rejected like any other invalid character."""
DJANGO_FIX = r"""diff --git a/django/contrib/auth/validators.py b/django/contrib/auth/validators.py
--- a/django/contrib/auth/validators.py
+++ b/django/contrib/auth/validators.py
@@ -7,7 +7,7 @@ from django.utils.translation import gettext_lazy as _
 
 @deconstructible
 class ASCIIUsernameValidator(validators.RegexValidator):
-    regex = r'^[\w.@+-]+$'
+    regex = r'^[\w.@+-]+\Z'
     message = _(
         'Enter a valid username. This value may contain only English letters, '
         'numbers, and @/./+/-/_ characters.'
@@ -17,7 +17,7 @@ class ASCIIUsernameValidator(validators.RegexValidator):
 
 @deconstructible
 class UnicodeUsernameValidator(validators.RegexValidator):
-    regex = r'^[\w.@+-]+$'
+    regex = r'^[\w.@+-]+\Z'
     message = _(
         'Enter a valid username. This value may contain only letters, '
         'numbers, and @/./+/-/_ characters.'
"""
DJANGO_TESTS = r"""diff --git a/tests/auth_tests/test_validators.py b/tests/auth_tests/test_validators.py
--- a/tests/auth_tests/test_validators.py
+++ b/tests/auth_tests/test_validators.py
@@ -237,7 +237,7 @@ class UsernameValidatorsTests(SimpleTestCase):
         invalid_usernames = [
             "o'connell", "عبد ال",
             "zerowidth\u200Bspace", "nonbreaking\u00A0space",
-            "en\u2013dash",
+            "en\u2013dash", "joe\n",
         ]
         v = validators.UnicodeUsernameValidator()
         for valid in valid_usernames:
@@ -250,7 +250,7 @@ class UsernameValidatorsTests(SimpleTestCase):
 
     def test_ascii_validator(self):
         valid_usernames = ['glenn', 'GLEnN', 'jean-marc']
-        invalid_usernames = ["o'connell", 'Éric', 'jean marc', "أحمد"]
+        invalid_usernames = ["o'connell", 'Éric', 'jean marc', "أحمد", "glenn\n"]
         v = validators.ASCIIUsernameValidator()
         for valid in valid_usernames:
             with self.subTest(valid=valid):
"""
DJANGO_ROW = {"instance_id": "django__django-11099", "repo": "django/django", "version": "2.2",
              "problem_statement": DJANGO_ISSUE, "patch": DJANGO_FIX, "test_patch": DJANGO_TESTS,
              "FAIL_TO_PASS": [f"test_{kind}_validator (auth_tests.test_validators.UsernameValidatorsTests)"
                               for kind in ("ascii", "unicode")],
              "PASS_TO_PASS": [f"{test} (auth_tests.test_validators.{case})" for case, tests in {
                  "PasswordValidationTest": [
                      "test_empty_password_validator_help_text_html", "test_get_default_password_validators",
                      "test_get_password_validators_custom", "test_password_changed",
                      "test_password_changed_with_custom_validator", "test_password_validators_help_text_html",
                      "test_password_validators_help_text_html_escaping", "test_password_validators_help_texts",
                      "test_validate_password"],
                  "CommonPasswordValidatorTest": ["test_help_text", "test_validate", "test_validate_custom_list",
                                                  "test_validate_django_supplied_file"],
                  "MinimumLengthValidatorTest": ["test_help_text", "test_validate"],
                  "NumericPasswordValidatorTest": ["test_help_text", "test_validate"],
                  "UserAttributeSimilarityValidatorTest": ["test_help_text", "test_validate",
                                                           "test_validate_property"]}.items() for test in tests]}
# pytest 8.4 is the last for python 3.9; the backports are named because pip evaluates markers on the host
TOOL_WHEELS = ["pip==26.0.1", "setuptools==80.9.0", "wheel==0.45.1", "pytest==8.4.2", "exceptiongroup==1.3.0",
               "tomli==2.2.1"]
FIXED_DATE = "2020-01-01T00:00:00+00:00"
DOCKERFILE = """FROM {base}
COPY wheels /tmp/wheels
ENV PIP_NO_INDEX=1 PIP_BREAK_SYSTEM_PACKAGES=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN ln -sf /usr/bin/python3 /usr/bin/python \\
 && pip_wheel=$(ls /tmp/wheels/pip-*.whl) \\
 && python3 "$pip_wheel/pip" install -q --no-cache-dir --find-links /tmp/wheels {packages} \\
 && rm -rf /tmp/wheels
COPY repo /testbed
WORKDIR /testbed
RUN git config --global --add safe.directory /testbed \\
 && python -m pip install -q --no-build-isolation --no-deps -e . \\
 && test -z "$(git status --porcelain)"
STOPSIGNAL SIGKILL
"""
# Build products and caches that are no part of the agent's change (the sdist carries no .gitignore)
EXCLUDE = "*.egg-info/\n__pycache__/\n*.pyc\n.pytest_cache/\nbuild/\n"


@dataclass
class Args:
    out: Path
    """where instances.json and rows.parquet go (and the downloads, under DIR/cache)"""
    instances: tuple[str, ...] = tuple(RECIPES)
    """which of the known instances to build"""
    source: str = str(BUNDLED)
    """SWE-bench Lite-dev rows (classic fields; the 5.x ones are added here): a .json / .jsonl file, or a hub dataset
    name such as SWE-bench/SWE-bench_Lite (default: the rows bundled with kiln)"""
    split: str = "dev"
    """the split of a hub dataset"""
    rebuild: bool = False
    """build images even when the tag is already on the host"""


def image_tag(instance_id: str) -> str:
    """SWE-bench's naming under kiln's own namespace, so an official image of the same instance is never shadowed."""
    return f"kiln-swe/sweb.eval.x86_64.{instance_id.lower().replace('__', '_1776_')}:offline"


def run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, check=True, **kwargs)


def build_base(client, cache: Path) -> None:
    """debootstrap minbase with python3, git and patch, imported as BASE_IMAGE (the rootfs tarball is cached)."""
    tarball = cache / f"rootfs-{SUITE}.tar"
    if not tarball.exists():
        with tempfile.TemporaryDirectory(dir=cache) as root:
            start = time.perf_counter()
            log.info("debootstrap %s into a rootfs (about a minute; once, then cached in %s)", SUITE, cache)
            run(["debootstrap", "--variant=minbase", "--include=python3,python3-distutils,git,patch,ca-certificates",
                 SUITE, root, "http://deb.debian.org/debian"], stdout=subprocess.DEVNULL)
            run(["rm", "-rf", f"{root}/var/cache/apt/archives", f"{root}/var/lib/apt/lists"])
            run(["tar", "-C", root, "-cf", f"{tarball}.part", "."])
            Path(f"{tarball}.part").rename(tarball)
            log.info("debootstrap %s: %.0fs", SUITE, time.perf_counter() - start)
    repository, tag = BASE_IMAGE.split(":")
    client.api.import_image_from_file(str(tarball), repository=repository, tag=tag, changes=['CMD ["/bin/bash"]'])


def download(cache: Path, what: list[str], sdist: bool) -> Path:
    """pip download into a cache folder named after the request (so a second build downloads nothing)."""
    folder = cache / re.sub(r"[^\w.=-]+", "_", "-".join(what))
    if not folder.exists():
        flags = (["--no-deps", "--no-binary", ":all:"] if sdist
                 else ["--only-binary", ":all:", "--python-version", "3.9"])
        run([sys.executable, "-m", "pip", "download", "-q", "-d", f"{folder}.part", *flags, *what])
        Path(f"{folder}.part").rename(folder)
    return folder


def make_repo(sdist: Path, repo: Path) -> str:
    """The sdist as a git repository with one commit at a fixed date and author; returns its sha."""
    # GNU tar, not tarfile: its safe "data" filter needs Python 3.11.4, and Debian's python3.11 is 3.11.2. tar
    # refuses members that climb out with `..`, strips leading `/`, and gives the files to whoever extracts them.
    run(["tar", "-xf", str(sdist), "-C", str(repo.parent), "--no-same-owner"])
    next(p for p in repo.parent.iterdir() if p.is_dir() and p != repo).rename(repo)
    (repo / "PKG-INFO").unlink(missing_ok=True)
    for egg_info in repo.rglob("*.egg-info"):
        run(["rm", "-rf", str(egg_info)])
    env = {"GIT_AUTHOR_NAME": "kiln", "GIT_AUTHOR_EMAIL": "kiln@localhost", "GIT_COMMITTER_NAME": "kiln",
           "GIT_COMMITTER_EMAIL": "kiln@localhost", "GIT_AUTHOR_DATE": FIXED_DATE, "GIT_COMMITTER_DATE": FIXED_DATE,
           "PATH": "/usr/bin:/bin"}
    # A commit of more loose objects than gc.auto starts a background repack, which races the docker SDK tarring the
    # build context (FileNotFoundError in .git/objects); the repository's own config keeps it off inside the image too.
    git = ["git", "-c", "safe.directory=*", "-c", "gc.auto=0", "-c", "maintenance.auto=false", "-C", str(repo)]
    run([*git, "init", "-q", "-b", "main"], env=env)  # safe.directory: the sdist's owner is not ours
    for key, value in (("gc.auto", "0"), ("maintenance.auto", "false")):
        run([*git, "config", key, value], env=env)
    for command in (["add", "-A"], ["commit", "-q", "-m", "base"]):
        run([*git, *command], env=env)
    (repo / ".git" / "info" / "exclude").write_text(EXCLUDE)
    return run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()


def patch_files(patch: str) -> list[str]:
    return list(dict.fromkeys(re.findall(r"^diff --git a/(\S+) b/", patch, re.M)))


def eval_script(row: dict, base: str, test_command: str) -> str:
    """The official 5.x shape (reset the test files, apply the test patch, run them between the markers), minus the
    conda and install lines (the environment is the image's)."""
    tests = " ".join(patch_files(row["test_patch"]))
    return "\n".join([
        "#!/bin/bash", "set -uxo pipefail", "cd /testbed", "git config --global --add safe.directory /testbed",
        "git status", "git show", f"git -c core.fileMode=false diff {base}", f"git checkout {base} {tests}",
        "git apply -v - <<'EOF_114329324912'", row["test_patch"].rstrip("\n"), "EOF_114329324912",
        ": '>>>>> Start Test Output'", test_command.format(tests=tests), ": '>>>>> End Test Output'",
        f"git checkout {base} {tests}"]) + "\n"


def build_instance(client, row: dict, cache: Path, rebuild: bool) -> dict:
    """The instance's image (unless it exists) and its 5.x row."""
    recipe = RECIPES[row["instance_id"]]
    tag = image_tag(row["instance_id"])
    with tempfile.TemporaryDirectory(dir=cache) as context:
        context = Path(context)
        sdist = next(download(cache, [f"{recipe.project}=={recipe.version}"], sdist=True).iterdir())
        (context / "src").mkdir()
        base = make_repo(sdist, context / "src" / "repo")
        (context / "src" / "repo").rename(context / "repo")
        try:
            client.images.get(tag)
            present = True
        except docker.errors.ImageNotFound:
            present = False
        if rebuild or not present:
            start = time.perf_counter()
            log.info("building %s (seconds to a minute)", tag)
            wheels = TOOL_WHEELS + list(recipe.needs)
            run(["cp", "-r", str(download(cache, wheels, sdist=False)), str(context / "wheels")])
            packages = " ".join(w.split("==")[0] for w in wheels)
            (context / "Dockerfile").write_text(DOCKERFILE.format(base=BASE_IMAGE, packages=packages))
            try:
                client.images.build(path=str(context), tag=tag, network_mode="none", rm=True, forcerm=True)
            except docker.errors.BuildError as e:
                lines = "".join(step.get("stream", "") for step in e.build_log).splitlines()
                raise RuntimeError(f"building {tag} failed: {e.msg}\n" + "\n".join(lines[-15:])) from None
            log.info("built %s: %.0fs", tag, time.perf_counter() - start)
    return {**row, "base_commit": base, "image": tag, "eval_script": eval_script(row, base, recipe.test_command),
            "log_parser": recipe.log_parser, "eval_type": "pass_and_fail"}


def source_rows(source: str, split: str, wanted: list[str]) -> dict[str, dict]:
    """The rows of `wanted` instances, by id, from a .json / .jsonl file or a hub dataset; ValueError naming the
    source when it does not exist or lacks one."""
    path = Path(source)
    if path.is_file():
        records = json.loads(path.read_text()) if path.suffix == ".json" else [r for _, r in task_rows.read_jsonl(path)]
    elif path.suffix in (".json", ".jsonl") or source.startswith(("/", ".")):
        raise ValueError(f"--source {source}: no such file")
    else:
        records = task_rows.hub_records(source, split)
    rows = {r["instance_id"]: r for r in records if r.get("instance_id") in wanted}
    missing = [i for i in wanted if i not in rows]
    if missing:
        raise ValueError(f"--source {source}: no row for {', '.join(missing)}")
    return rows


def main(args: Args) -> Path:
    unknown = sorted(set(args.instances) - set(RECIPES))
    if unknown:
        raise ValueError(f"unknown instances {unknown}; known: {sorted(RECIPES)}")
    rows = source_rows(args.source, args.split, [i for i in args.instances if i != DJANGO_ROW["instance_id"]])
    rows[DJANGO_ROW["instance_id"]] = DJANGO_ROW  # read before anything is built: a bad source fails first
    client = containers.connect()
    cache = args.out / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    try:
        client.images.get(BASE_IMAGE)
    except docker.errors.ImageNotFound:
        build_base(client, cache)
    instances = [build_instance(client, rows[i], cache, args.rebuild) for i in args.instances]
    (args.out / "instances.json").write_text(json.dumps(instances, indent=1))
    data_prep.swebench(args.out / "rows.parquet", source=str(args.out / "instances.json"))
    return args.out / "rows.parquet"


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    with cli.one_line_errors():  # unknown instances or source, no daemon, a failed build
        print(main(tyro.cli(Args)))
