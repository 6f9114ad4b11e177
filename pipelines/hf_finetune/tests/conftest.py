from __future__ import annotations

import os
import subprocess
import sys
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
    prepare(PrepareConfig(vader_sdist=str(vader_sdist)), data_dir, minilm, root / "download")
    return data_dir


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
