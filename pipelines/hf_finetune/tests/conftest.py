from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_finetune.data import VADER_SDIST, PrepareOptions, prepare
from hf_finetune.model import default_model
from raytrain_common.storage import StoragePath, resolve_storage


@pytest.fixture(scope="session")
def minilm() -> str:
    return default_model()


@pytest.fixture(scope="session")
def vader_sdist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The VADER source distribution: $RAYTRAIN_VADER_SDIST if set (machines without PyPI, such as
    the GPU kit's), else fetched from PyPI once per test session."""
    local = os.environ.get("RAYTRAIN_VADER_SDIST")
    if local:
        return Path(local)
    folder = tmp_path_factory.mktemp("vader-sdist")
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
    done = subprocess.run(
        [*command, "--no-binary", ":all:", VADER_SDIST, "-d", str(folder)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode:
        pytest.skip(
            f"{VADER_SDIST} could not be downloaded ({done.stderr.strip()[-200:]}): set "
            "RAYTRAIN_VADER_SDIST to a local vaderSentiment-3.3.2.tar.gz"
        )
    return next(folder.glob("*.tar.gz"))


@pytest.fixture(scope="session")
def vader_dir(
    ray_cluster: None, tmp_path_factory: pytest.TempPathFactory, vader_sdist: Path, minilm: str
) -> StoragePath:
    """VADER split and pre-tokenised with MiniLM's tokenizer, once per test session."""
    root = tmp_path_factory.mktemp("vader")
    data_dir = resolve_storage(root / "data")
    prepare(PrepareOptions(vader_sdist=str(vader_sdist)), data_dir, minilm, root / "download")
    return data_dir
