"""Fixtures for the tests that need Docker: the daemon, and the offline SWE-bench instances built once per session.

Without a daemon those tests skip, except under CI=true, where a missing daemon fails them: CI must run them.
KILN_SWE_DIR keeps the instances' downloads (and rows) between sessions; images already on the host are reused.
"""
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import containers  # noqa: E402
import data_prep  # noqa: E402
import swe_instances  # noqa: E402


@pytest.fixture(scope="session")
def docker_client():
    try:
        client = containers.connect()
    except containers.DockerUnavailable as e:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true and no Docker daemon: {e}")
        pytest.skip(str(e))
    containers.sweep(client)
    return client


@pytest.fixture(scope="session")
def swe_rows(docker_client, tmp_path_factory) -> dict[str, dict]:
    """The kiln rows of the offline instances, by instance id."""
    out = Path(os.environ["KILN_SWE_DIR"]) if os.environ.get("KILN_SWE_DIR") else tmp_path_factory.mktemp("swe")
    rows = data_prep.load_rows(swe_instances.main(swe_instances.Args(out=out)))
    return {row["extra_info"]["index"]: row for row in rows}
