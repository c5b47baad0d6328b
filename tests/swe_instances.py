"""Real SWE-bench instances built offline, for tests and CI: no image registry, only Debian packages and PyPI.

    python tests/swe_instances.py --out DIR [--instances ID ...] [--rebuild]

For each instance of the Lite-dev file: the project's sdist at the instance's version becomes a git repository with
one fixed-date commit (its sha is the row's base_commit, the same on every build), installed into a debootstrap
Debian image with wheels from PyPI, built by the legacy builder without network. DIR/instances.json holds the
SWE-bench 5.x rows (image, eval_script in the official shape, log_parser, eval_type) and DIR/rows.parquet the kiln
rows `data_prep.py swebench` makes of them. Images already on the host are kept unless --rebuild.

The sdist of marshmallow 2.20.0 has the same src/ and tests/ as marshmallow-1343's base commit; 3.0.0 differs
from marshmallow-1359's only cosmetically in two test files (checked against the upstream history).
"""
from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import docker.errors
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import containers  # noqa: E402  (the repo root is not on the path when this runs as a script)
import data_prep  # noqa: E402

log = logging.getLogger("kiln.swe_instances")

LITE_DEV = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "swebench" / "swe-bench-lite-dev.json"
SUITE = "bullseye"  # python 3.9, the version SWE-bench's marshmallow specs use (2.20 breaks on 3.10+)
BASE_IMAGE = f"kiln-swe/base:{SUITE}"
# instance -> (PyPI project, sdist version, packages its tests need besides pytest), pinned so builds repeat
INSTANCES = {
    "marshmallow-code__marshmallow-1343": ("marshmallow", "2.20.0", ["pytz==2026.6", "simplejson==4.3.0",
                                                                     "python-dateutil==2.9.0.post0"]),
    "marshmallow-code__marshmallow-1359": ("marshmallow", "3.0.0", ["pytz==2026.6", "simplejson==4.3.0",
                                                                    "python-dateutil==2.9.0.post0"]),
}
# pytest 8.4 is the last for python 3.9; the backports are named because pip evaluates markers on the host
TOOL_WHEELS = ["pip==26.0.1", "setuptools==80.9.0", "wheel==0.45.1", "pytest==8.4.2", "exceptiongroup==1.3.0",
               "tomli==2.2.1"]
FIXED_DATE = "2020-01-01T00:00:00+00:00"
DOCKERFILE = """FROM {base}
COPY wheels /tmp/wheels
ENV PIP_NO_INDEX=1 PIP_BREAK_SYSTEM_PACKAGES=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN ln -sf /usr/bin/python3 /usr/bin/python \\
 && pip_wheel=$(ls /tmp/wheels/pip-*.whl) && python3 "$pip_wheel/pip" install -q --no-cache-dir --find-links /tmp/wheels {packages} \\
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
    instances: tuple[str, ...] = tuple(INSTANCES)
    """which of the known instances to build"""
    source: Path = LITE_DEV
    """the SWE-bench Lite-dev rows (classic fields; the 5.x ones are added here)"""
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
        flags = ["--no-deps", "--no-binary", ":all:"] if sdist else ["--only-binary", ":all:", "--python-version", "3.9"]
        run([sys.executable, "-m", "pip", "download", "-q", "-d", f"{folder}.part", *flags, *what])
        Path(f"{folder}.part").rename(folder)
    return folder


def make_repo(sdist: Path, repo: Path) -> str:
    """The sdist as a git repository with one commit at a fixed date and author; returns its sha."""
    with tarfile.open(sdist) as tar:
        tar.extractall(repo.parent, filter="data")
    next(p for p in repo.parent.iterdir() if p.is_dir() and p != repo).rename(repo)
    (repo / "PKG-INFO").unlink(missing_ok=True)
    for egg_info in repo.rglob("*.egg-info"):
        run(["rm", "-rf", str(egg_info)])
    env = {"GIT_AUTHOR_NAME": "kiln", "GIT_AUTHOR_EMAIL": "kiln@localhost", "GIT_COMMITTER_NAME": "kiln",
           "GIT_COMMITTER_EMAIL": "kiln@localhost", "GIT_AUTHOR_DATE": FIXED_DATE, "GIT_COMMITTER_DATE": FIXED_DATE,
           "PATH": "/usr/bin:/bin"}
    for command in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-q", "-m", "base"]):
        run(["git", "-C", str(repo), *command], env=env)
    (repo / ".git" / "info" / "exclude").write_text(EXCLUDE)
    return run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()


def patch_files(patch: str) -> list[str]:
    return list(dict.fromkeys(re.findall(r"^diff --git a/(\S+) b/", patch, re.M)))


def eval_script(row: dict, base: str) -> str:
    """The official 5.x shape (reset the test files, apply the test patch, run them between the markers), minus the
    conda and install lines (the environment is the image's)."""
    tests = " ".join(patch_files(row["test_patch"]))
    return "\n".join([
        "#!/bin/bash", "set -uxo pipefail", "cd /testbed", "git config --global --add safe.directory /testbed",
        "git status", "git show", f"git -c core.fileMode=false diff {base}", f"git checkout {base} {tests}",
        "git apply -v - <<'EOF_114329324912'", row["test_patch"].rstrip("\n"), "EOF_114329324912",
        ": '>>>>> Start Test Output'", f"pytest -rA {tests}", ": '>>>>> End Test Output'",
        f"git checkout {base} {tests}"]) + "\n"


def build_instance(client, row: dict, cache: Path, rebuild: bool) -> dict:
    """The instance's image (unless it exists) and its 5.x row."""
    project, version, needs = INSTANCES[row["instance_id"]]
    tag = image_tag(row["instance_id"])
    with tempfile.TemporaryDirectory(dir=cache) as context:
        context = Path(context)
        sdist = next(download(cache, [f"{project}=={version}"], sdist=True).iterdir())
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
            run(["cp", "-r", str(download(cache, TOOL_WHEELS + needs, sdist=False)), str(context / "wheels")])
            packages = " ".join(w.split("==")[0] for w in TOOL_WHEELS + needs)
            (context / "Dockerfile").write_text(DOCKERFILE.format(base=BASE_IMAGE, packages=packages))
            try:
                client.images.build(path=str(context), tag=tag, network_mode="none", rm=True, forcerm=True)
            except docker.errors.BuildError as e:
                lines = "".join(step.get("stream", "") for step in e.build_log).splitlines()
                raise RuntimeError(f"building {tag} failed: {e.msg}\n" + "\n".join(lines[-15:])) from None
            log.info("built %s: %.0fs", tag, time.perf_counter() - start)
    return {**row, "base_commit": base, "image": tag, "eval_script": eval_script(row, base),
            "log_parser": "parse_log_marshmallow", "eval_type": "pass_and_fail"}


def main(args: Args) -> Path:
    unknown = sorted(set(args.instances) - set(INSTANCES))
    if unknown:
        raise SystemExit(f"unknown instances {unknown}; known: {sorted(INSTANCES)}")
    client = containers.connect()
    cache = args.out / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    try:
        client.images.get(BASE_IMAGE)
    except docker.errors.ImageNotFound:
        build_base(client, cache)
    rows = {r["instance_id"]: r for r in json.loads(args.source.read_text())}
    instances = [build_instance(client, rows[i], cache, args.rebuild) for i in args.instances]
    (args.out / "instances.json").write_text(json.dumps(instances, indent=1))
    data_prep.swebench(args.out / "rows.parquet", source=str(args.out / "instances.json"))
    return args.out / "rows.parquet"


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    print(main(tyro.cli(Args)))
