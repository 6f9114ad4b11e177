"""Fixtures of the tests of deploy/'s image (tests/test_image.py, tests/test_container_cluster.py:
two files, so `nox -s manifests` runs the pod test and the cluster of containers in its two
pytest processes side by side)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from build_image import IMAGE  # noqa: E402  (tools/ is not a package)


@pytest.fixture(scope="session")  # once per pytest process: the build checks every layer
def image() -> str:
    """The project's image, built (or found up to date) by tools/build_image.py."""
    if shutil.which("podman") is None:
        pytest.fail(
            "podman is missing: `apt-get install podman buildah runc debootstrap` (.ci/run does)"
        )
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "build_image.py")], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return IMAGE
