"""A text corpus → documents → tokens → packed blocks of `seq_len + 1` tokens in one token file,
for a causal language model: `prepare`, then `inspect_dataset` and `split_blocks` in training.

Sources: a file or folder of text, JSON Lines or Parquet (local, NFS, S3, GCS; any encoding), a
Hugging Face hub dataset, or one of the pipeline's own corpora (`named_corpora`). Tokenizers: a
Hugging Face folder or hub id, byte-level BPE trained on the corpus (`bpe:<vocab size>`), or one of
the pipeline's own (`named_tokenizers`).

Layout of a prepared dataset folder:
    tokenizer/                 the tokenizer the blocks were made with (a Hugging Face folder)
    train/ validation/ test/   tokens.bin (the packed blocks, `tokens.file`) and stats.json
    dataset.json               seq_len, tokenizer, document split, packing stats; written last
"""

from __future__ import annotations

import array
import codecs
import fnmatch
import functools
import json
import logging
import os
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute
import pyarrow.json
import pyarrow.parquet as pq

from raytrain_common.pretokenize import STATS_FILE
from raytrain_common.storage import OutputMarker, StoragePath, resolve_storage, staged_output
from raytrain_common.text import UTF8, check_encoding, iter_decoded
from raytrain_common.tokens.file import (
    TOKEN_FILE,
    TokenBlocks,
    TokenFileWriter,
    open_token_file,
    token_dtype,
)
from raytrain_common.tokens.packing import PackStats, read_pack_stats

log = logging.getLogger(__name__)

DATASET_FILE = "dataset.json"
SPLITS = ("train", "validation", "test")
HELD_OUT = ("validation", "test")  # each --validation-fraction of the corpus, apart from training
BPE_PREFIX = "bpe:"
EOS_TOKEN = "<|endoftext|>"
PLAIN_SUFFIXES = (
    ".txt",
    ".text",
    ".md",
    ".markdown",
    ".rst",
    ".adoc",
    ".tex",
    ".py",
)  # a document each
ROW_SUFFIXES = (".jsonl", ".json", ".parquet")  # one document per row of --text-column
READ_CHUNK_BYTES = 1 << 20  # files are read a MiB at a time
MAX_DOCUMENT_CHARS = 4 << 20  # a longer text file becomes documents of about this size
MIN_SHARD_CHARS, MAX_SHARD_CHARS = 64 << 10, 1 << 20  # document shards, see shard_size
PARALLEL_READ_BYTES = 64 << 20  # a corpus of files this large is read by Ray tasks (read_corpus)
READ_GROUP_BYTES = 16 << 20  # files read by one of those tasks: ~16 shards of work each
TOKENIZER_SAMPLE_CHARS = 256 << 20  # a trained tokenizer learns from this much training text
UTF16_BOMS = (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)


class DataError(ValueError):
    """A corpus a run cannot train on; the message names the input and the fix."""


# A pipeline's own corpora by name (e.g. its default, from a package): each gives (documents, a
# description for the report) given a folder it may download into.
NamedCorpora = Mapping[str, Callable[[Path], tuple[list[str], str]]]
# A pipeline's own tokenizers by name (e.g. one whose files ship in a package): each writes a
# Hugging Face tokenizer folder at the path it is given.
NamedTokenizers = Mapping[str, Callable[[Path], None]]


@dataclass(frozen=True)
class DatasetInfo:
    source: str
    seq_len: int
    tokenizer: str  # the folder under the dataset, or a hub id / local folder given by the user
    tokenizer_name: str
    vocab_size: int
    eos_id: int
    documents: dict[str, int]
    packing: dict[str, dict[str, int]]
    seed: int
    split_by: str = "documents"  # or "characters": each document's tail held out (small corpora)
    files: dict[str, dict[str, int]] = field(default_factory=dict)  # read / skipped, by suffix
    files_in: str = ""  # always beside dataset.json: prepare writes local or mounted folders

    def blocks(self, split: str) -> int:
        return self.packing[split]["blocks"]


MARKER = OutputMarker.of(DATASET_FILE, DatasetInfo)  # written last by prepare


# ---------------------------------------------------------------------------------------------
# Sources: each gives a list of documents
# ---------------------------------------------------------------------------------------------


@dataclass
class CorpusReport:
    """Where the documents came from, and which files were read or skipped (filled while read)."""

    source: str
    expected_bytes: int | None = None  # the corpus's size (bytes or characters) before reading
    read: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)

    def files(self) -> dict[str, dict[str, int]]:
        if not self.read and not self.skipped:
            return {}
        return {
            "read": dict(sorted(self.read.items())),
            "skipped": dict(sorted(self.skipped.items())),
        }


def wanted(relative: str, patterns: list[str] | None) -> bool:
    if patterns:
        return any(
            fnmatch.fnmatch(relative, p) or fnmatch.fnmatch(Path(relative).name, p)
            for p in patterns
        )
    return Path(relative).suffix.lower() in PLAIN_SUFFIXES + ROW_SUFFIXES


def chosen_files(
    location: str, glob: str | None, report: CorpusReport
) -> list[tuple[str, StoragePath]]:
    """The files of a file or folder (at any depth) that hold documents; the rest are counted."""
    storage = resolve_storage(location)
    if not storage.exists():
        raise DataError(f"no corpus at {location!r}: the path does not exist")
    listed = storage.walk_files() if storage.is_dir() else [(Path(storage.path).name, storage)]
    patterns = [p.strip() for p in glob.split(",") if p.strip()] if glob else None
    chosen = [(relative, file) for relative, file in listed if wanted(relative, patterns)]
    report.skipped.update(
        Path(r).suffix.lower() or "(none)" for r, _ in listed if not wanted(r, patterns)
    )
    if not chosen:
        seen = ", ".join(f"{n} {s}" for s, n in report.skipped.most_common(5)) or "nothing"
        raise DataError(
            f"no text files at {location!r} ({len(listed)} files: {seen}): give "
            f"{', '.join(PLAIN_SUFFIXES)}, .jsonl or .parquet files, or choose files with --glob"
        )
    infos = storage.filesystem.get_file_info([file.path for _, file in chosen])
    report.expected_bytes = sum(max(0, info.size or 0) for info in infos)
    return chosen


def read_chunks(file: StoragePath, size: int = READ_CHUNK_BYTES) -> Iterator[bytes]:
    with file.filesystem.open_input_stream(file.path) as stream:
        while chunk := stream.read(size):
            yield chunk


def plain_documents(file: StoragePath, encoding: str) -> Iterator[str]:
    """A text file as one document; a file longer than MAX_DOCUMENT_CHARS as documents of about
    that size, cut at line ends, so no document (and no process) holds a huge file whole."""
    pending = ""
    for number, (text, chunk) in enumerate(iter_decoded(read_chunks(file), encoding, file.uri)):
        if number == 0 and b"\x00" in chunk[:4096] and not chunk.startswith(UTF16_BOMS):
            raise DataError(
                f"{file.uri} holds NUL bytes, so it is no text file (an image or archive?): "
                "leave it out with --glob, or pass --encoding utf-16 if it is UTF-16 text"
            )
        pending += text
        while len(pending) > MAX_DOCUMENT_CHARS:
            cut = pending.rfind("\n", 0, MAX_DOCUMENT_CHARS) + 1 or MAX_DOCUMENT_CHARS
            yield pending[:cut]
            pending = pending[cut:]
    yield pending


def jsonl_documents(file: StoragePath, encoding: str, text_column: str) -> Iterator[str]:
    """One document per line's `text_column`, read a chunk at a time."""
    pending, line_number = "", 0
    for text, _ in iter_decoded(read_chunks(file), encoding, file.uri):
        lines = (pending + text).split("\n")
        pending = lines.pop()
        for line in lines:
            line_number += 1
            yield from json_line_text(line, line_number, file, text_column)
    yield from json_line_text(pending, line_number + 1, file, text_column)


def json_line_text(line: str, number: int, file: StoragePath, text_column: str) -> Iterator[str]:
    if not line.strip():
        return
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise DataError(f"cannot read {file.uri} as JSON lines: line {number}: {error}") from None
    if not isinstance(row, dict):
        raise DataError(f"cannot read {file.uri} as JSON lines: line {number} is no JSON object")
    if text_column not in row:
        raise DataError(
            f"{file.uri} has no column {text_column!r} (it has {list(row)}): set --text-column"
        )
    if isinstance(row[text_column], str):
        yield row[text_column]


def parquet_documents(file: StoragePath, text_column: str) -> Iterator[str]:
    """One document per row's `text_column`, a record batch at a time."""
    with file.filesystem.open_input_file(file.path) as stream:
        try:
            reader = pq.ParquetFile(stream)
        except (pa.ArrowInvalid, OSError) as error:
            raise DataError(
                f"{file.uri} cannot be read as Parquet ({str(error).splitlines()[0]}): is it "
                "whole? Copy it again, or leave it out with --glob"
            ) from error
        if text_column not in reader.schema_arrow.names:
            raise DataError(
                f"{file.uri} has no column {text_column!r} (it has "
                f"{reader.schema_arrow.names}): set --text-column"
            )
        for batch in reader.iter_batches(batch_size=1024, columns=[text_column]):
            yield from (t for t in batch.column(0).to_pylist() if isinstance(t, str))


def file_documents(
    relative: str, file: StoragePath, text_column: str, encoding: str, report: CorpusReport
) -> Iterator[str]:
    """One file's documents: a plain text file is one (or several, past MAX_DOCUMENT_CHARS), JSONL
    and Parquet one per row of `text_column`; the file is counted as read or empty in `report`."""
    suffix = Path(relative).suffix.lower()
    if suffix == ".parquet":
        documents = parquet_documents(file, text_column)
    elif suffix in (".jsonl", ".json"):
        documents = jsonl_documents(file, encoding, text_column)
    else:
        documents = plain_documents(file, encoding)
    any_text = False
    for document in documents:
        any_text = any_text or bool(document.strip())
        yield document
    if any_text:
        report.read[suffix or "(none)"] += 1
    else:
        report.skipped["(empty)"] += 1


def local_documents(
    location: str, text_column: str, encoding: str, glob: str | None, report: CorpusReport
) -> Iterator[str]:
    """Documents from a file or a folder at any depth: plain text files (.txt, .md, .rst, …; one
    document each, in `encoding`), JSONL or Parquet (one document per row of `text_column`). Read a
    file at a time and a chunk at a time: memory does not grow with the corpus."""
    check_encoding(encoding)
    for relative, file in chosen_files(location, glob, report):
        yield from file_documents(relative, file, text_column, encoding, report)
    log_files_read(report)


def log_files_read(report: CorpusReport) -> None:
    log.info(
        "read %d files (%s); skipped %d (%s)",
        sum(report.read.values()),
        ", ".join(f"{n} {s}" for s, n in sorted(report.read.items())) or "none",
        sum(report.skipped.values()),
        ", ".join(f"{n} {s}" for s, n in sorted(report.skipped.items())) or "none",
    )


def hub_documents(name: str, config_name: str | None, text_column: str) -> Iterator[str]:
    import datasets

    try:
        loaded = datasets.load_dataset(name, config_name, split="train")
    except Exception as error:  # the hub raises many types; the message is what matters
        raise DataError(
            f"cannot load dataset {name!r} from the Hugging Face hub ({type(error).__name__}: "
            f"{str(error)[:300]}); without the hub, give local .txt / .jsonl / .parquet files"
        ) from error
    if text_column not in loaded.column_names:
        raise DataError(
            f"{name} has no column {text_column!r} ({loaded.column_names}): set --text-column"
        )
    # The hub's Arrow files are memory-mapped: read a batch at a time, not as one list.
    for batch in loaded.select_columns([text_column]).iter(batch_size=1024):
        yield from (t for t in batch[text_column] if isinstance(t, str))


def iter_documents(
    dataset: str,
    text_column: str,
    download_dir: Path,
    encoding: str = UTF8,
    glob: str | None = None,
    named: NamedCorpora | None = None,
) -> tuple[Iterator[str], CorpusReport]:
    """The corpus's documents, one at a time, and the report filled while they are read."""
    if named and dataset in named:
        documents, description = named[dataset](download_dir)  # a small corpus, read whole
        return iter(documents), CorpusReport(description, sum(len(d) for d in documents))
    if is_file_corpus(dataset, named):
        report = CorpusReport(dataset)
        return local_documents(dataset, text_column, encoding, glob, report), report
    return hub_documents(dataset, None, text_column), CorpusReport(dataset)


def is_file_corpus(dataset: str, named: NamedCorpora | None = None) -> bool:
    """A file or folder (local, NFS, S3, GCS), not a pipeline's named corpus or a hub dataset."""
    if named and dataset in named:
        return False
    return "://" in dataset or resolve_storage(dataset).exists() or bool(Path(dataset).suffix)


def read_corpus(
    dataset: str,
    text_column: str,
    download_dir: Path,
    encoding: str,
    glob: str | None,
    folder: StoragePath,
    named: NamedCorpora | None = None,
) -> tuple[DocumentShards, CorpusReport]:
    """The corpus in numbered document shards under `folder`. A corpus of several files holding
    PARALLEL_READ_BYTES or more is read by Ray tasks across the cluster; a smaller one, an archive
    or a hub dataset by this process, a file and a chunk at a time."""
    if is_file_corpus(dataset, named):
        from raytrain_common.ray_start import init_ray

        check_encoding(encoding)
        report = CorpusReport(dataset)
        chosen = chosen_files(dataset, glob, report)
        if len(chosen) > 1 and (report.expected_bytes or 0) >= PARALLEL_READ_BYTES:
            infos = chosen[0][1].filesystem.get_file_info([file.path for _, file in chosen])
            sizes = [max(0, info.size or 0) for info in infos]
            init_ray(train_cpus=1)
            shard_chars = shard_size(report.expected_bytes)
            shards = read_documents_in_tasks(
                chosen, sizes, text_column, encoding, folder, shard_chars, report
            )
            return shards, report
    documents, report = iter_documents(dataset, text_column, download_dir, encoding, glob, named)
    return write_document_shards(documents, folder, shard_size(report.expected_bytes)), report


@dataclass
class DocumentShards:
    """The corpus's documents (column text) in Parquet shards, `firsts[i]` the id of the first
    document of `files[i]`, with every document's length: what the split, the tokenizer and the
    tokenising tasks read, in bounded pieces."""

    files: list[StoragePath]
    firsts: np.ndarray  # id of the first document of each shard file
    lengths: np.ndarray  # characters of document i

    def __len__(self) -> int:
        return len(self.lengths)

    def texts(
        self,
        wanted_ids: np.ndarray | None = None,
        max_chars: int | None = None,
        per_document: int | None = None,
    ) -> Iterator[str]:
        """Documents in id order (only `wanted_ids`, sorted, if given), each cut to
        `per_document` characters, until `max_chars` characters are out."""
        keep = None
        if wanted_ids is not None:
            keep = np.zeros(len(self.lengths), dtype=bool)
            keep[wanted_ids] = True
        total = 0
        for file, first in zip(self.files, self.firsts, strict=True):
            doc = int(first)
            with file.filesystem.open_input_file(file.path) as stream:
                for batch in pq.ParquetFile(stream).iter_batches(batch_size=256):
                    for text in batch.column(0).to_pylist():
                        doc += 1
                        if keep is not None and not keep[doc - 1]:
                            continue
                        text = text[:per_document] if per_document else text
                        yield text
                        total += len(text)
                        if max_chars is not None and total >= max_chars:
                            return


def write_document_shards(
    documents: Iterable[str], folder: StoragePath, shard_chars: int, name: str = "part-000000000"
) -> DocumentShards:
    """Number the non-blank documents from 0 and write them in shards of about `shard_chars`
    characters, `<name>-<k>.parquet`."""
    folder.mkdir()
    lengths: array.array[int] = array.array("q")
    files: list[StoragePath] = []
    firsts: list[int] = []
    pending: list[str] = []
    pending_chars = 0

    def flush() -> None:
        nonlocal pending_chars
        firsts.append(len(lengths) - len(pending))
        files.append(folder.join(f"{name}-{len(files):06d}.parquet"))
        with files[-1].filesystem.open_output_stream(files[-1].path) as stream:
            pq.write_table(pa.table({"text": pending}), stream, row_group_size=256)
        pending.clear()
        pending_chars = 0

    for document in documents:
        if not document.strip():
            continue
        lengths.append(len(document))
        pending.append(document)
        pending_chars += len(document)
        if pending_chars >= shard_chars:
            flush()
    if pending:
        flush()
    return DocumentShards(
        files, np.array(firsts, dtype=np.int64), np.frombuffer(lengths, dtype=np.int64).copy()
    )


def read_file_group(
    group: int,
    files: list[tuple[str, StoragePath]],
    text_column: str,
    encoding: str,
    folder: StoragePath,
    shard_chars: int,
) -> tuple[DocumentShards, CorpusReport]:
    """A Ray task: consecutive files of the corpus → document shards `part-<group>-<k>`, their
    documents numbered from 0 (the driver adds the group's offset)."""
    report = CorpusReport("")
    documents = (
        document
        for relative, file in files
        for document in file_documents(relative, file, text_column, encoding, report)
    )
    return write_document_shards(documents, folder, shard_chars, f"part-{group:09d}"), report


def read_documents_in_tasks(
    chosen: list[tuple[str, StoragePath]],
    sizes: list[int],
    text_column: str,
    encoding: str,
    folder: StoragePath,
    shard_chars: int,
    report: CorpusReport,
) -> DocumentShards:
    """The corpus's files read into document shards by Ray tasks, a group of consecutive files
    (~READ_GROUP_BYTES) each: as many at once as the cluster has CPUs. Document ids, shards'
    contents and the report are the ones one process reading file after file makes."""
    import ray

    folder.mkdir()
    groups: list[list[tuple[str, StoragePath]]] = [[]]
    group_bytes = 0
    for entry, size in zip(chosen, sizes, strict=True):
        if groups[-1] and group_bytes >= READ_GROUP_BYTES:
            groups.append([])
            group_bytes = 0
        groups[-1].append(entry)
        group_bytes += size
    task = ray.remote(read_file_group).options(num_cpus=1, scheduling_strategy="SPREAD")
    pending = [
        task.remote(index, group, text_column, encoding, folder, shard_chars)
        for index, group in enumerate(groups)
    ]
    try:
        results = ray.get(pending)
    except ray.exceptions.RayTaskError as error:
        if isinstance(error.cause, DataError):
            raise error.cause from None  # the file and the fix, as one process would say them
        raise
    files, firsts, lengths = [], [], []
    offset = 0
    for shards, group_report in results:
        files += shards.files
        firsts.append(shards.firsts + offset)
        lengths.append(shards.lengths)
        offset += len(shards)
        report.read.update(group_report.read)
        report.skipped.update(group_report.skipped)
    log_files_read(report)
    return DocumentShards(files, np.concatenate(firsts), np.concatenate(lengths))


def shard_size(expected_bytes: int | None) -> int:
    """Characters per document shard: at least ~16 shards (work for every tokenising actor), and
    at most 1 Mi characters whatever the corpus (measured: 2.8 Mi-character shards of a 90 MB
    corpus raised the peak memory of `prepare` by ~500 MiB; 1 Mi kept it flat)."""
    if not expected_bytes:
        return MAX_SHARD_CHARS
    return int(min(MAX_SHARD_CHARS, max(MIN_SHARD_CHARS, expected_bytes // 16)))


# ---------------------------------------------------------------------------------------------
# Tokenizers: a pretrained one, GPT-2's (offline), or byte-level BPE trained on the corpus
# ---------------------------------------------------------------------------------------------


def build_tokenizer(
    name: str,
    train_documents: Iterable[str],
    target: Path,
    named: NamedTokenizers | None = None,
) -> Path:
    """A Hugging Face tokenizer folder at `target` with an EOS token; returns the folder."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if target.exists():
        shutil.rmtree(target)
    if named and name in named:
        named[name](target)
    elif name.startswith(BPE_PREFIX):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        vocab_size = int(name.removeprefix(BPE_PREFIX))
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOS_TOKEN],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tokenizer.train_from_iterator(train_documents, trainer=trainer)
        PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS_TOKEN).save_pretrained(
            str(target)
        )
    else:
        try:
            AutoTokenizer.from_pretrained(name).save_pretrained(str(target))
        except (OSError, ValueError) as error:
            raise DataError(
                f"unknown tokenizer {name!r}: give "
                + "".join(f"{known}, " for known in named or {})
                + f"{BPE_PREFIX}<vocab size>, a local Hugging Face folder or a hub id"
            ) from error
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    if len(tokenizer) < 100:
        # transformers builds a tokenizer of special tokens alone from a folder that lacks the
        # files.
        raise DataError(
            f"the tokenizer {name!r} has {len(tokenizer)} tokens: its files (tokenizer.json, or "
            "vocab.json + merges.txt) are missing; copy the whole tokenizer folder"
        )
    if tokenizer.eos_token_id is None:
        raise DataError(f"tokenizer {name!r} has no EOS token to separate documents")
    return target


# ---------------------------------------------------------------------------------------------
# prepare
# ---------------------------------------------------------------------------------------------


def split_documents(count: int, validation_fraction: float, seed: int) -> dict[str, np.ndarray]:
    """Whole documents to train, validation or test, by a seeded permutation: validation first,
    test next, each `validation_fraction` of the documents (at least one each), train the rest."""
    order = np.random.default_rng(seed).permutation(count)
    held_out = min((count - 1) // 2, max(1, round(count * validation_fraction)))
    return {
        "train": np.sort(order[2 * held_out :]),
        "validation": np.sort(order[:held_out]),
        "test": np.sort(order[held_out : 2 * held_out]),
    }


def held_out_documents(
    lengths: np.ndarray, validation_fraction: float, seed: int, min_validation_chars: int
) -> dict[str, np.ndarray] | None:
    """The documents held out for validation, then for test (sorted ids), in the order of
    `split_documents`' permutation: each starts at `validation_fraction` of the documents and adds
    documents while it holds less than one block; None when whole documents cannot fill both
    while training keeps the larger part of the corpus (the caller splits by characters then)."""
    count = len(lengths)
    if count < 3:
        return None
    order = np.random.default_rng(seed).permutation(count)
    wanted = max(1, round(count * validation_fraction))
    chars = np.concatenate([[0], np.cumsum(lengths[order])])  # chars[k]: the first k documents'
    held: dict[str, np.ndarray] = {}
    start = 0
    for split in HELD_OUT:
        # The fewest documents from `start` on, at least `wanted`, that fill a block.
        filled = int(np.searchsorted(chars, chars[start] + min_validation_chars))
        end = min(count - 1, max(start + wanted, filled))
        if end <= start or chars[end] - chars[start] < min_validation_chars:
            return None
        held[split], start = np.sort(order[start:end]), end
    if chars[count] - chars[start] <= chars[count] / 2:  # training keeps the larger part
        return None
    return held


def split_by_characters(
    documents: list[str], validation_fraction: float, min_validation_chars: int
) -> dict[str, list[str]]:
    """For a corpus whose documents cannot fill a validation and a test block (one document, a
    few short ones: small by construction, so in memory): the end of every document, cut at line
    ends, as large a share each as a block needs: validation, then test at the very end."""
    total = sum(len(d) for d in documents)
    share = max(validation_fraction, min_validation_chars / max(total, 1))
    if share > 1 / 3:
        raise DataError(
            f"the corpus holds {total:,} characters in {len(documents)} document(s): too little "
            f"for a training, a validation and a test block (~{min_validation_chars:,} characters "
            "each at this --seq-len); give more text or a smaller --seq-len"
        )
    parts: dict[str, list[str]] = {split: [] for split in SPLITS}
    for document in documents:
        held = max(1, round(len(document) * share))
        test_cut = line_cut(document, len(document) - held)
        validation_cut = line_cut(document, test_cut - held)
        parts["train"].append(document[:validation_cut])
        parts["validation"].append(document[validation_cut:test_cut])
        parts["test"].append(document[test_cut:])
    log.warning(
        "%d document(s) cannot fill a validation and a test block of --seq-len tokens: holding "
        "out the last 2 × %.1f %% of every document instead",
        len(documents),
        100 * share,
    )
    return {name: [d for d in part if d.strip()] for name, part in parts.items()}


def line_cut(document: str, cut: int) -> int:
    """`cut` moved back to the line end before it, when one lies within the last tenth."""
    cut = max(0, cut)
    line_end = document.rfind("\n", 0, cut + 1)
    return line_end + 1 if line_end > cut * 0.9 else cut


def chars_per_token(tokenizer: Any, documents: Iterable[str]) -> float:
    """Characters per token of this tokenizer on a sample of the corpus (≤ ~1 MB)."""
    sample = list(documents)
    size = sum(len(text) for text in sample)
    tokens = sum(len(ids) for ids in tokenizer(sample)["input_ids"])
    return size / max(tokens, 1)


@dataclass(frozen=True)
class ShardTokens:
    """What one tokenising task reports: its shard's counts, its part file and the node that did
    the work."""

    documents: int
    tokens: int
    part: str
    node: str


def tokenise_shard(
    shard: str,
    first_doc: int,
    filesystem: Any,
    member: np.ndarray | None,
    tokenizer_json: str,
    eos_id: int,
    vocab_size: int,
    part: str,
) -> ShardTokens:
    """One document shard's documents (ids `first_doc` on; only those `member` marks, if given),
    in document order, each ended with EOS → their token ids, end to end, in the token file's type
    at `part`.

    A Ray task of its own per shard: the cluster's CPUs set how many run at once, on every node.
    The tokenizer is rebuilt from its JSON with the small `tokenizers` library (importing
    transformers would cost each worker seconds)."""
    import ray

    with filesystem.open_input_file(shard) as stream:
        table = pq.read_table(stream)
    if member is not None:
        table = table.filter(pa.array(member[first_doc : first_doc + len(table)]))
    encoded = fast_tokenizer(tokenizer_json).encode_batch_fast(table.column("text").to_pylist())
    ids = np.empty(sum(len(encoding.ids) + 1 for encoding in encoded), dtype=np.int64)
    end = 0
    for encoding in encoded:
        start, end = end, end + len(encoding.ids) + 1
        ids[start : end - 1] = encoding.ids
        ids[end - 1] = eos_id
    if len(ids) and ids.max() >= vocab_size:
        raise DataError(
            f"the tokenizer produced id {ids.max()} for a vocabulary of {vocab_size}: its files "
            "and its recorded size disagree; rebuild it with prepare --force"
        )
    partial = f"{part}.{os.getpid()}.partial"  # a retried task rewrites its part whole
    ids.astype(token_dtype(vocab_size)).tofile(partial)
    os.replace(partial, part)
    node = ray.get_runtime_context().get_node_id()
    return ShardTokens(documents=len(encoded), tokens=len(ids), part=part, node=node)


@functools.lru_cache(maxsize=2)
def fast_tokenizer(tokenizer_json: str) -> Any:
    """The Rust tokenizer, built once per worker process (Ray reuses them across tasks; building
    GPT-2's takes a fraction of a second), one thread: the tasks are the parallelism."""
    from tokenizers import Tokenizer

    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # read by the library at each call
    tokenizer = Tokenizer.from_str(tokenizer_json)
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def tokenise_documents(
    shards: DocumentShards,
    ids: np.ndarray | None,
    parts: Path,
    tokenizer_json: str,
    eos_id: int,
    vocab_size: int,
) -> list[ShardTokens]:
    """Every shard tokenised by a Ray task of its own (1 CPU each: as many at once as the cluster
    has CPUs), each into a part file under `parts` (a folder every node writes: prepare's data
    folder), in shard order; this process holds the tasks' counts, never tokens."""
    import ray

    parts.mkdir(parents=True, exist_ok=True)
    member = None
    if ids is not None:
        member = np.zeros(len(shards), dtype=bool)
        member[ids] = True
    # SPREAD: the shards go round the nodes instead of filling the driver's node first.
    task = ray.remote(tokenise_shard).options(
        num_cpus=1, max_retries=2, scheduling_strategy="SPREAD"
    )
    shared_member, shared_tokenizer = ray.put(member), ray.put(tokenizer_json)
    pending = [
        task.remote(
            file.path,
            int(first),
            file.filesystem,
            shared_member,
            shared_tokenizer,
            eos_id,
            vocab_size,
            str(parts / f"part-{index:09d}.bin"),
        )
        for index, (file, first) in enumerate(zip(shards.files, shards.firsts, strict=True))
    ]
    return list(ray.get(pending))


def pack_token_file(
    shards: list[ShardTokens], target: Path, block_len: int, vocab_size: int
) -> PackStats:
    """The shards' token parts, in document order, appended byte for byte to one token file of
    blocks of `block_len` (`tokens.file`); the tail after the last whole block is dropped. A
    copy of files: this process holds a copy buffer, and the disk sets the pace."""
    target.parent.mkdir(parents=True, exist_ok=True)
    writer = TokenFileWriter(target, block_len, vocab_size)
    try:
        for shard in shards:
            writer.append_file(Path(shard.part), shard.tokens)
        blocks, dropped = writer.close()
    except BaseException:
        writer.abort()
        raise
    return PackStats(
        documents=sum(shard.documents for shard in shards),
        tokens=writer.tokens,
        block_size=block_len,
        blocks=blocks,
        tokens_dropped=dropped,
    )


def prepare(
    dataset: str,
    data_dir: StoragePath,
    *,
    tokenizer: str,
    seq_len: int,
    download_dir: Path,
    text_column: str = "text",
    validation_fraction: float = 0.05,
    seed: int = 0,
    force: bool = False,
    encoding: str = UTF8,
    glob: str | None = None,
    named_corpora: NamedCorpora | None = None,
    named_tokenizers: NamedTokenizers | None = None,
    prepare_command: str = "prepare",
) -> DatasetInfo:
    """Read, split by document, tokenise (Ray tasks) and pack a corpus; idempotent unless `force`.
    A stream: documents are read a chunk at a time into Parquet shards (this process holds one),
    split by their lengths (`split_corpus`), tokenised and packed a split at a time."""
    from raytrain_common.ray_start import init_ray

    check_prepare_options(data_dir, seq_len, validation_fraction)
    existing = prepared_already(data_dir, tokenizer, seq_len, seed, force, prepare_command)
    if existing is not None:
        return existing
    with staged_output(data_dir, MARKER) as staged:
        staging = staged.folder
        texts = staging.join("texts")
        shards, report = read_corpus(
            dataset, text_column, download_dir, encoding, glob, texts.join("all"), named_corpora
        )
        if not len(shards):
            raise DataError(f"the corpus {dataset!r} is empty: it holds no text")
        hf_tokenizer = corpus_tokenizer(
            tokenizer, shards, staging, validation_fraction, seed, named_tokenizers
        )
        split_by, sources = split_corpus(
            shards, hf_tokenizer, texts, seq_len, validation_fraction, seed
        )
        init_ray(train_cpus=1)  # only now: every check above runs without a cluster
        packing = {
            name: asdict(tokenise_and_pack(name, source, ids, staging, hf_tokenizer, seq_len))
            for name, (source, ids) in sources.items()
        }
        for scratch in (texts.path, Path(staging.path) / "parts"):
            shutil.rmtree(scratch)  # copies of the corpus and its tokens: training reads the files
        info = DatasetInfo(
            source=report.source,
            seq_len=seq_len,
            tokenizer=str(Path(data_dir.path) / "tokenizer"),
            tokenizer_name=tokenizer,
            vocab_size=len(hf_tokenizer),
            eos_id=hf_tokenizer.eos_token_id,
            documents={
                name: len(ids if ids is not None else src) for name, (src, ids) in sources.items()
            },
            packing=packing,
            seed=seed,
            split_by=split_by,
            files=report.files(),
            files_in=staged.files_in,
        )
        staged.write_marker(asdict(info))
    return info


def corpus_tokenizer(
    tokenizer: str,
    shards: DocumentShards,
    staging: StoragePath,
    validation_fraction: float,
    seed: int,
    named: NamedTokenizers | None = None,
) -> Any:
    """The tokenizer, saved in the staging folder. A trained one sees training documents of the
    document split; a split by characters (a corpus too small for that) is decided after, with
    its characters per token."""
    from transformers import AutoTokenizer

    first = split_documents(len(shards), validation_fraction, seed) if len(shards) > 1 else None
    folder = build_tokenizer(
        tokenizer,
        shards.texts(None if first is None else first["train"], TOKENIZER_SAMPLE_CHARS),
        Path(staging.path) / "tokenizer",
        named,
    )
    return AutoTokenizer.from_pretrained(str(folder))


def check_prepare_options(data_dir: StoragePath, seq_len: int, validation_fraction: float) -> None:
    if seq_len < 8:
        raise DataError(f"--seq-len={seq_len}: give at least 8 tokens")
    if not 0 < validation_fraction <= 0.25:
        raise DataError(
            f"--validation-fraction={validation_fraction}: it must lie in (0, 0.25] (validation "
            "and test each hold out this share, training keeps the rest)"
        )
    if not data_dir.is_local:
        raise DataError(
            "prepare writes the tokenizer folder locally: give a local or NFS --data-dir"
        )


def prepared_already(
    data_dir: StoragePath,
    tokenizer: str,
    seq_len: int,
    seed: int,
    force: bool,
    prepare_command: str = "prepare",
) -> DatasetInfo | None:
    """The dataset in `data_dir` when it was prepared with these settings (and no --force); a
    refusal when it was prepared with others; None when there is none, or --force rewrites it."""
    marker = data_dir.join(DATASET_FILE)
    if force or not marker.exists() or not MARKER.is_ours(marker):
        return None  # (someone else's dataset.json, the user's own files: staged_output refuses)
    existing = inspect_dataset(data_dir, prepare_command)
    if (existing.seq_len, existing.tokenizer_name, existing.seed) == (seq_len, tokenizer, seed):
        log.info("dataset at %s is prepared already; --force rewrites it", data_dir.uri)
        return existing
    raise DataError(
        f"{data_dir.uri} holds data prepared from {existing.source} with seq_len "
        f"{existing.seq_len} and tokenizer {existing.tokenizer_name}: pass --force to rewrite "
        "it, or choose another --data-dir"
    )


Sources = dict[str, tuple[DocumentShards, np.ndarray | None]]


def split_corpus(
    shards: DocumentShards,
    hf_tokenizer: Any,
    texts: StoragePath,
    seq_len: int,
    validation_fraction: float,
    seed: int,
) -> tuple[str, Sources]:
    """The splits' documents: whole documents held out for validation and test while each fills a
    block ("documents"), else the end of every document ("characters", shards of their own)."""
    per_token = chars_per_token(
        hf_tokenizer, shards.texts(max_chars=1_000_000, per_document=100_000)
    )
    # 1.3 blocks: the estimate of characters per token is a sample's.
    min_chars = round(1.3 * (seq_len + 1) * per_token)
    held_out = held_out_documents(shards.lengths, validation_fraction, seed, min_chars)
    if held_out is not None:
        train_ids = np.setdiff1d(
            np.arange(len(shards)), np.concatenate(list(held_out.values())), assume_unique=True
        )
        return "documents", {
            "train": (shards, train_ids),
            **{name: (shards, ids) for name, ids in held_out.items()},
        }
    parts = split_by_characters(list(shards.texts()), validation_fraction, min_chars)
    return "characters", {
        name: (write_document_shards(part, texts.join(name), MIN_SHARD_CHARS), None)
        for name, part in parts.items()
    }


def tokenise_and_pack(
    name: str,
    source: DocumentShards,
    ids: np.ndarray | None,
    staging: StoragePath,
    hf_tokenizer: Any,
    seq_len: int,
) -> PackStats:
    """One split: a Ray task per document shard tokenises it, then the parts are appended in
    document order to the split's token file; its stats.json beside it."""
    started = time.perf_counter()
    shard_tokens = tokenise_documents(
        source,
        ids,
        Path(staging.path) / "parts" / name,
        hf_tokenizer.backend_tokenizer.to_str(),
        hf_tokenizer.eos_token_id,
        len(hf_tokenizer),
    )
    stats = pack_token_file(
        shard_tokens,
        Path(staging.join(name).path) / TOKEN_FILE,
        block_len=seq_len + 1,
        vocab_size=len(hf_tokenizer),
    )
    staging.join(name, STATS_FILE).write_text(json.dumps(asdict(stats), indent=2) + "\n")
    seconds = time.perf_counter() - started
    log.info(
        "%s: %d documents, %d tokens → %d blocks of %d (%d tokens dropped); tokenised by "
        "%d tasks on %d node(s) and packed in %.1f s (%.0f tokens/s)",
        *(name, stats.documents, stats.tokens, stats.blocks, seq_len + 1, stats.tokens_dropped),
        *(len(shard_tokens), len({c.node for c in shard_tokens}), seconds),
        stats.tokens / max(seconds, 1e-9),
    )
    if stats.blocks == 0:
        documents = len(source) if ids is None else len(ids)
        raise DataError(
            f"the {name} split holds {stats.tokens:,} tokens ({documents} document(s)), less "
            f"than one block of {seq_len + 1}: give more text, a smaller --seq-len or a larger "
            "--validation-fraction"
        )
    return stats


def inspect_dataset(data_dir: StoragePath, prepare_command: str = "prepare") -> DatasetInfo:
    """The prepared dataset's description; an error naming the command to run (`prepare_command`,
    the pipeline's own) if it is incomplete."""
    marker = data_dir.join(DATASET_FILE)
    if not marker.exists():
        raise DataError(
            f"no prepared dataset at {data_dir.uri!r} (no {DATASET_FILE}): run `{prepare_command}` "
            "first, or point --data-dir at a prepared folder"
        )
    info = DatasetInfo(**json.loads(marker.read_text()))
    if "test" not in info.packing:
        raise DataError(
            f"{data_dir.uri} has no test split (prepared by an earlier version, which held out "
            f"validation documents only): rerun `{prepare_command} --force`"
        )
    for split in SPLITS:
        stats: PackStats = read_pack_stats(data_dir.join(split))
        if stats.blocks != info.blocks(split):
            raise DataError(
                f"{data_dir.uri}/{split} does not match {DATASET_FILE}: rerun "
                f"`{prepare_command} --force`"
            )
        if not data_dir.join(split, TOKEN_FILE).exists():
            raise DataError(
                f"{data_dir.uri}/{split} has no {TOKEN_FILE} (prepared by an earlier version, or "
                f"copied without it): rerun `{prepare_command} --force`"
            )
    return info


def split_blocks(data_dir: StoragePath, split: str, info: DatasetInfo) -> TokenBlocks:
    """The split's packed blocks of seq_len + 1 tokens, read by index from its token file, in place
    (a local or shared folder) or by ranged reads (object storage): `tokens.file`."""
    return open_token_file(data_dir.join(split), info.seq_len + 1, info.vocab_size)
