"""`prepare` reads a corpus as a stream: a file and a chunk at a time into numbered document shards.
These tests read real files through the pipeline's own readers, without a Ray cluster."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytrain_common.storage import resolve_storage
from raytrain_common.text import TextEncodingError
from raytrain_common.tokens.corpus import (
    MAX_DOCUMENT_CHARS,
    held_out_documents,
    iter_documents,
    split_documents,
    write_document_shards,
)


def shards_of(tmp_path: Path, source: Path, shard_chars: int = 1 << 16, **options: str):
    documents, report = iter_documents(str(source), "text", tmp_path / "download", **options)
    return write_document_shards(
        documents, resolve_storage(tmp_path / "shards"), shard_chars
    ), report


def test_every_kind_of_file_becomes_numbered_documents_in_shards(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    (corpus / "a").mkdir(parents=True)
    (corpus / "a" / "one.txt").write_text("first document\n")
    (corpus / "a" / "blank.md").write_text("  \n")
    (corpus / "b.jsonl").write_text('{"text": "row one"}\n\n{"text": "row two"}\n{"text": 3}\n')
    pq.write_table(pa.table({"text": ["p1", None, "p2"]}), corpus / "c.parquet")
    (corpus / "d.txt").write_text("é in cp1252", encoding="cp1252")
    (corpus / "picture.png").write_bytes(b"\x89PNG")
    with pytest.raises(TextEncodingError, match=r"d\.txt is not valid utf-8 text: byte 0 \(line 1"):
        shards_of(tmp_path, corpus)
    (corpus / "d.txt").unlink()
    shards, report = shards_of(tmp_path / "again", corpus)
    texts = list(shards.texts())
    assert texts == ["first document\n", "row one", "row two", "p1", "p2"]
    assert shards.lengths.tolist() == [len(t) for t in texts]
    assert report.files() == {
        "read": {".jsonl": 1, ".parquet": 1, ".txt": 1},
        "skipped": {"(empty)": 1, ".png": 1},
    }


def test_a_text_file_larger_than_a_document_is_cut_at_line_ends_and_nothing_is_lost(
    tmp_path: Path,
) -> None:
    line = "To be, or not to be, that is the question — ünïcode\n"
    text = line * (2 * MAX_DOCUMENT_CHARS // len(line) + 10)
    corpus = tmp_path / "big.txt"
    corpus.write_text(text, encoding="utf-16")  # 2 bytes a character, chunks split characters
    shards, _ = shards_of(tmp_path, corpus, shard_chars=MAX_DOCUMENT_CHARS, encoding="utf-16")
    documents = list(shards.texts())
    assert len(documents) == 3 and "".join(documents) == text
    assert all(d.endswith("\n") for d in documents)
    assert max(shards.lengths) <= MAX_DOCUMENT_CHARS


def test_the_document_split_is_the_seeded_permutation_of_the_document_count() -> None:
    lengths = np.full(200, 5_000)
    held_out = held_out_documents(lengths, 0.05, seed=3, min_validation_chars=1_000)
    assert held_out is not None
    split = split_documents(200, 0.05, seed=3)
    assert {name: ids.tolist() for name, ids in held_out.items()} == {
        name: split[name].tolist() for name in ("validation", "test")
    }
    every = np.concatenate([split["train"], split["validation"], split["test"]])
    assert sorted(every.tolist()) == list(range(200))  # each document in exactly one split
    assert (len(split["validation"]), len(split["test"])) == (10, 10)
    # Short documents: more are held out until each fills a block, training keeps the larger part.
    grown = held_out_documents(np.full(200, 10), 0.05, seed=3, min_validation_chars=300)
    assert grown is not None and [len(ids) for ids in grown.values()] == [30, 30]
    assert not set(grown["validation"].tolist()) & set(grown["test"].tolist())
    assert held_out_documents(np.array([10_000]), 0.05, 0, 100) is None  # one document
    # Three long documents and two short: held out whole, the rest would be under half: None.
    assert held_out_documents(np.array([10, 10, 10]), 0.05, 0, 10) is None


def plays(count: int = 42, lines: int = 6000) -> list[str]:
    """`count` documents of seeded words in lines, ~5 MB together: a corpus the size of
    Shakespeare's complete works, made here (the library's tests need no pipeline's data)."""
    words = np.array(
        [
            "the",
            "and",
            "to",
            "of",
            "a",
            "I",
            "you",
            "my",
            "in",
            "that",
            "is",
            "not",
            "with",
            "me",
            "it",
            "for",
            "be",
            "his",
        ]
    )
    picks = np.random.default_rng(0).integers(0, len(words), size=(count, lines, 6))
    return ["\n".join(map(" ".join, words[document].tolist())) for document in picks]


def test_reading_a_corpus_holds_one_shard_not_the_corpus(tmp_path: Path) -> None:
    """~42 MB of text (8 copies of a 5 MB corpus) read and sharded by a fresh process: its peak
    memory is within 20 MB of reading one copy (holding the documents would add over 40 MB)."""
    works = plays()

    def peak_mb(copies: int) -> float:
        corpus = tmp_path / f"corpus-{copies}"
        for copy in range(copies):
            (corpus / f"c{copy}").mkdir(parents=True)
            for index, work in enumerate(works):
                (corpus / f"c{copy}" / f"w{index}.txt").write_text(work)
        script = (
            "import json, resource, sys\n"
            "from pathlib import Path\n"
            "from raytrain_common.tokens.corpus import iter_documents, write_document_shards\n"
            "from raytrain_common.storage import resolve_storage\n"
            "documents, _ = iter_documents(sys.argv[1], 'text', Path(sys.argv[2]))\n"
            "shards = write_document_shards(documents, resolve_storage(sys.argv[2]), 4 << 20)\n"
            "print(json.dumps([len(shards), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss]))\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", script, str(corpus), str(tmp_path / f"shards-{copies}")],
            capture_output=True,
            text=True,
            check=True,
        )
        count, peak_kib = json.loads(done.stdout)
        assert count == copies * len(works)
        return peak_kib / 1024

    small, large = peak_mb(1), peak_mb(8)
    corpus_mb = 8 * sum(len(w) for w in works) / 2**20
    print(f"peak {small:.0f} MB reading 1×, {large:.0f} MB reading 8× ({corpus_mb:.0f} MB of text)")
    assert large - small < 20


@pytest.mark.ray
def test_ray_tasks_read_a_corpus_into_the_documents_one_process_reads(
    tmp_path: Path, ray_cluster: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Groups of files read by Ray tasks (a group a file or two here) give the same documents, in
    the same order and with the same ids, and the same report; a bad file's error is the one a
    single process gives, naming the file."""
    from raytrain_common.tokens import corpus as data

    corpus = tmp_path / "corpus"
    for index in range(7):
        (corpus / f"part{index}").mkdir(parents=True)
        (corpus / f"part{index}" / "notes.txt").write_text(f"document {index}\n" * (index + 1))
        rows = "".join(f'{{"text": "row {index}.{row}"}}\n' for row in range(index))
        (corpus / f"part{index}" / "rows.jsonl").write_text(rows)
    (corpus / "part3" / "blank.md").write_text("\n")
    (corpus / "cover.png").write_bytes(b"\x89PNG")
    serial, serial_report = shards_of(tmp_path / "serial", corpus)
    monkeypatch.setattr(data, "READ_GROUP_BYTES", 40)
    report = data.CorpusReport(str(corpus))
    chosen = data.chosen_files(str(corpus), None, report)
    sizes = [(tmp_path / "corpus" / relative).stat().st_size for relative, _ in chosen]
    parallel = data.read_documents_in_tasks(
        chosen, sizes, "text", "utf-8", resolve_storage(tmp_path / "tasks"), 1 << 16, report
    )
    assert len(parallel.files) > 5  # several groups, each its own shards
    assert list(parallel.texts()) == list(serial.texts())
    assert parallel.lengths.tolist() == serial.lengths.tolist()
    wanted = np.array([1, 4, 9, 20])
    assert list(parallel.texts(wanted)) == list(serial.texts(wanted))
    assert report.files() == serial_report.files()

    (corpus / "part5" / "rows.jsonl").write_text('{"text": "fine"}\nnot json\n')
    report = data.CorpusReport(str(corpus))
    chosen = data.chosen_files(str(corpus), None, report)
    with pytest.raises(data.DataError, match=r"part5/rows\.jsonl as JSON lines: line 2"):
        data.read_documents_in_tasks(
            chosen,
            [1] * len(chosen),
            "text",
            "utf-8",
            resolve_storage(tmp_path / "bad"),
            1 << 16,
            report,
        )
