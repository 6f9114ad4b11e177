from __future__ import annotations

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
    """The VADER source distribution, fetched from PyPI once per test session."""
    folder = tmp_path_factory.mktemp("vader-sdist")
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
    subprocess.run([*command, "--no-binary", ":all:", VADER_SDIST, "-d", str(folder)], check=True)
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
