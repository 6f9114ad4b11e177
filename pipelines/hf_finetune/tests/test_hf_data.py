"""Reading, checking, splitting and pre-tokenising labelled text: VADER, users' files, bad input."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hf_finetune.cli import main
from hf_finetune.config import PrepareConfig
from hf_finetune.data import prepare, read_vader
from hf_finetune.model import ModelError, resolve_model
from raytrain_common.labelled.prepare import (
    DataError,
    PartLabels,
    inspect_dataset,
    label_names,
    read_labels_of,
    split_indices,
    table_part,
)
from raytrain_common.storage import StoragePath, resolve_storage


def read_split(data_dir: StoragePath, split: str, limit: int | None = None) -> pa.Table:
    """One pre-tokenised split as an Arrow table (input_ids, length, label, text)."""
    tables = []
    for file in data_dir.join(split).list_files(".parquet"):
        with file.filesystem.open_input_file(file.path) as stream:
            tables.append(pq.read_table(stream))
    if not tables:
        raise DataError(f"no Parquet files in {data_dir.uri}/{split}: rerun `hf-finetune prepare`")
    table = pa.concat_tables(tables)
    # Ray Data writes blocks in completion order: sort by the row id so every worker sees one order.
    table = table.sort_by("row")
    return table.slice(0, limit) if limit is not None else table


def test_vader_is_the_published_corpus(vader_sdist: Path) -> None:
    table = read_vader(vader_sdist)
    assert table.num_rows == 23_703
    assert Counter(table["label"].to_pylist()) == {"positive": 12_471, "negative": 11_232}
    assert Counter(table["source"].to_pylist()) == {
        "tweets": 4_200,
        "movie_reviews": 10_605,
        "amazon_reviews": 3_708,
        "nyt_editorials": 5_190,
    }


def test_split_is_stratified_disjoint_complete_and_seeded() -> None:
    strata = np.array(["a"] * 900 + ["b"] * 100)
    split = split_indices(len(strata), strata, (0.1, 0.2), seed=3)
    joined = np.concatenate(list(split.values()))
    assert sorted(joined.tolist()) == list(range(1000))  # every row once
    assert Counter(strata[split["validation"]]) == {"a": 90, "b": 10}
    assert Counter(strata[split["test"]]) == {"a": 180, "b": 20}
    again = split_indices(len(strata), strata, (0.1, 0.2), seed=3)
    assert all(np.array_equal(split[k], again[k]) for k in split)


def labels_of(values: pa.Array) -> PartLabels:
    table = pa.table({"text": [f"row {i}" for i in range(len(values))], "y": values})
    options = PrepareConfig(text_column="text", label_column="y")
    return read_labels_of(table_part("all", "a table", table), options, stratify="y")


def test_label_names_and_ids() -> None:
    numbers = labels_of(pa.array([10, 2, 2, 10, 7]))
    assert label_names([numbers], "y") == ["2", "7", "10"]  # numeric order, not text order
    assert numbers.labels.ids(["2", "7", "10"]).tolist() == [2, 0, 0, 2, 1]
    words = labels_of(pa.array(["pos", "neg", "neutral"]))
    assert label_names([words], "y") == ["neg", "neutral", "pos"]
    assert label_names([numbers, words], "y")[:3] == ["10", "2", "7"]  # mixed: text order
    with pytest.raises(DataError, match=r"label column 'y' has one class \('pos'\) in 2 rows"):
        label_names([labels_of(pa.array(["pos", "pos"]))], "y")
    with pytest.raises(DataError, match=r"holds floats .*map the scores to classes first"):
        labels_of(pa.array([0.5, -1.2]))
    assert label_names([labels_of(pa.array([1.0, 2.0]))], "y") == ["1", "2"]  # a spreadsheet's


@pytest.mark.ray
def test_vader_tokens_round_trip_and_stats(vader_dir: StoragePath, minilm: str) -> None:
    from transformers import AutoTokenizer

    info = inspect_dataset(vader_dir)
    assert info.labels == ["negative", "positive"]
    assert sum(info.rows.values()) == 23_703
    assert info.rows["test"] == info.rows["validation"] == 2_370
    tokenizer = AutoTokenizer.from_pretrained(minilm)
    test = read_split(vader_dir, "test")
    assert test["row"].to_pylist() == list(range(test.num_rows))  # one order on every worker
    for row in test.slice(0, 50).to_pylist():
        decoded = tokenizer.decode(row["input_ids"], skip_special_tokens=True)
        assert decoded.replace(" ", "") == tokenizer.decode(
            tokenizer(row["text"])["input_ids"], skip_special_tokens=True
        ).replace(" ", "")
        assert row["input_ids"][0] == tokenizer.cls_token_id
        assert row["input_ids"][-1] == tokenizer.sep_token_id
    stats = info.token_stats["train"]
    assert stats["rows"] == info.rows["train"]
    assert 10 < stats["length_p50"] < stats["length_p99"] <= stats["length_max"]


@pytest.mark.ray
def test_a_users_csv_with_three_classes_and_truncation(
    ray_cluster: None, tmp_path: Path, minilm: str, write_reviews: Callable[..., Path]
) -> None:
    from transformers import AutoTokenizer

    csv = write_reviews(tmp_path / "reviews.csv", encoding="utf-8-sig")
    options = PrepareConfig(
        dataset=str(csv), text_column="comment", label_column="rating", max_length=8
    )
    data_dir = resolve_storage(tmp_path / "data")
    info = prepare(options, data_dir, minilm, tmp_path / "download")
    assert info.labels == ["bad", "great", "okay"]
    # 10 % would be 9 rows: each held-out split takes one batch (32) or 20 % of a small file.
    assert info.rows == {"train": 54, "validation": 18, "test": 18}
    assert info.stratified_by == "rating"
    tokenizer = AutoTokenizer.from_pretrained(minilm)
    for split in ("train", "validation", "test"):
        table = read_split(data_dir, split)
        assert Counter(table["label"].to_pylist()) == {i: info.rows[split] // 3 for i in range(3)}
        for row in table.to_pylist():
            assert len(row["input_ids"]) == 8  # every review is longer than 8 tokens: cut
            assert row["input_ids"][-1] == tokenizer.sep_token_id  # with [SEP] kept at the end
            first_word = row["text"].split()[0]
            assert (
                info.labels[row["label"]]
                == {"the": "bad", "an": "okay", "wonderful": "great"}[first_word]
            )
    assert info.token_stats["train"]["truncated_share"] == 1.0
    # Preparing again with the same settings is a no-op; other settings need --force.
    assert prepare(options, data_dir, minilm, tmp_path / "download") == info
    with pytest.raises(DataError, match="pass --force to rewrite it"):
        prepare(
            PrepareConfig(dataset=str(csv), text_column="comment", label_column="rating"),
            data_dir,
            minilm,
            tmp_path / "download",
        )


@pytest.mark.parametrize(
    ("content", "columns", "message"),
    [
        (
            "comment,rating\nhi,good\n",
            ("text", "rating"),
            r"has no column 'text' \(it has \['comment', 'rating'\]\): set --text-column",
        ),
        ("", ("comment", "rating"), r"reviews.csv is empty: give a file with a header and rows"),
        (
            "comment,rating\nhi,good\nho,good\n",
            ("comment", "rating"),
            r"label column 'rating' has one class \('good'\) in 2 rows",
        ),
        (
            "comment,rating\n12,good\n13,bad\n",
            ("comment", "rating"),
            r"column 'comment' .* holds int64 values \(e.g. 12\), not text: set --text-column",
        ),
        (
            "comment,rating\nhi,good\n  ,bad\nho,bad\n",
            ("comment", "rating"),
            r"column 'comment' .* has no value \(blank, NA "
            r"or NaN\) at row 1 \(1 such rows in rows 0–2\)",
        ),
        (
            "comment,rating\nhi,good\nho,bad\n",
            ("comment", "rating"),
            r"2 rows cannot make a train, a validation and a test split .* at least 10",
        ),
    ],
    ids=[
        "missing column",
        "empty file",
        "one class",
        "text not text",
        "blank text",
        "too few rows",
    ],
)
def test_bad_data_is_refused_with_its_reason(
    tmp_path: Path, minilm: str, content: str, columns: tuple[str, str], message: str
) -> None:
    csv = tmp_path / "reviews.csv"
    csv.write_text(content)
    options = PrepareConfig(dataset=str(csv), text_column=columns[0], label_column=columns[1])
    with pytest.raises(DataError, match=message):
        prepare(options, resolve_storage(tmp_path / "data"), minilm, tmp_path / "download")
    assert not (tmp_path / "data" / "dataset.json").exists()


def test_unknown_model_is_refused(tmp_path: Path) -> None:
    with pytest.raises(
        ModelError, match=r"unknown model 'no-such-org/no-such-model': give a local"
    ):
        resolve_model("no-such-org/no-such-model")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match=r"is a folder without config\.json"):
        resolve_model(str(tmp_path / "empty"))


def test_cli_reports_bad_input_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(
        ["prepare", "--dataset", str(tmp_path / "none.csv"), "--storage-path", str(tmp_path)]
    )
    assert status == 2
    # The command's own lines (Ray may still stream an earlier run's worker logs, prefixed).
    own = [
        line for line in capsys.readouterr().err.splitlines() if not line.startswith(("\x1b[", "("))
    ]
    assert len(own) == 1 and own[0].startswith("hf-finetune prepare: error: no data files at")
