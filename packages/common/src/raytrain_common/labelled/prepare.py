"""Labelled text (users' CSV / TSV / JSON Lines / Parquet files in any encoding on any storage, a
hub dataset, or a pipeline's own `named_sources`) → the label vocabulary, a stratified split, and
pre-tokenised Parquet (`raytrain_common.pretokenize`) that `labelled.tokenized` reads in training.

Layout of a prepared dataset folder:
    train/ validation/ test/   Parquet from `raytrain_common.pretokenize` (input_ids, length, label,
                               text) and its stats.json
    dataset.json               label names, row counts, tokenizer, split seed; written last, so it
                               marks a complete dataset
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv
import pyarrow.json
import pyarrow.parquet as pq

from raytrain_common.pretokenize import TokenStats, read_stats
from raytrain_common.storage import (
    OutputMarker,
    StoragePath,
    check_output_folder,
    files_of,
    resolve_storage,
    staged_output,
)
from raytrain_common.text import UTF8, TextEncodingError, iter_decoded

log = logging.getLogger(__name__)

DATASET_FILE = "dataset.json"
SPLITS = ("train", "validation", "test")
TEXT_SUFFIXES = (".csv", ".tsv", ".jsonl", ".json", ".parquet")
READ_BYTES = 4 << 20  # a source file is read, transcoded and parsed this much at a time
READ_ROWS = 16_384  # rows of a table source (or a Parquet file) handled at a time
RAW_ROWS_PER_FILE = 2048  # at least, per split file to tokenise: both tokenizer actors get work
SMALL_SPLIT_BYTES = 64 << 20  # a split's rows read into prepare's process, not by Ray Data
MIN_VOCABULARY = 100  # fewer tokens: a tokenizer folder without its vocabulary files


class DataError(ValueError):
    """Data a run cannot train on; the message names the file or column and the fix."""


class PrepareOptions(Protocol):
    """What `prepare` reads of a pipeline's options (its config dataclass has these fields)."""

    @property
    def dataset(self) -> str: ...
    @property
    def dataset_config(self) -> str | None: ...
    @property
    def text_column(self) -> str: ...
    @property
    def label_column(self) -> str: ...
    @property
    def stratify_column(self) -> str | None: ...
    @property
    def encoding(self) -> str: ...
    @property
    def validation_fraction(self) -> float: ...
    @property
    def test_fraction(self) -> float: ...
    @property
    def max_length(self) -> int: ...
    @property
    def seed(self) -> int: ...


@dataclass(frozen=True)
class NamedSource:
    """A pipeline's own dataset, by name (e.g. its default, from a package): `load(download_dir)`
    gives a table with `text` and `label` columns and a description beginning with `prefix`
    (what dataset.json's `source` records: a folder prepared from it is recognised by it). Its
    split is stratified by the column `stratify_by` (e.g. the sources its rows come from) unless
    the user gives --stratify-column; by the label otherwise."""

    prefix: str
    load: Callable[[Path], tuple[pa.Table, str]]
    stratify_by: str | None = None


NamedSources = Mapping[str, NamedSource]


@dataclass(frozen=True)
class DatasetInfo:
    source: str
    labels: list[str]
    rows: dict[str, int]
    tokenizer: str
    tokenizer_sha256: str
    max_length: int
    stratified_by: str | None
    seed: int
    token_stats: dict[str, dict[str, float]] = field(default_factory=dict)
    files_in: str = ""  # the splits' folder under the data folder ("": beside dataset.json)

    @property
    def num_labels(self) -> int:
        return len(self.labels)


MARKER = OutputMarker.of(DATASET_FILE, DatasetInfo)  # written last by prepare


# ---------------------------------------------------------------------------------------------
# Sources: each returns Arrow tables with a `text` (string) and a raw `label` column
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RawPart:
    """One named part of a source ("all", or a hub split) that can be read again, a table of rows
    at a time: prepare reads it twice (the labels, then the rows into their splits), never whole."""

    name: str
    where: str  # for messages: the file, or the source and split
    tables: Callable[[], Iterator[tuple[pa.Table, str, int]]]  # (rows, where, first row's index)


def data_files(locations: Sequence[str]) -> list[StoragePath]:
    """CSV / TSV / JSONL / Parquet files (local or object storage) in the order given, folders at
    any depth; an error naming a location that holds none."""
    files = []
    for location in locations:
        storage = resolve_storage(location)
        if not storage.exists():
            raise DataError(f"no data files at {location!r}: the path does not exist")
        found = [f for _, f in storage.walk_files()] if storage.is_dir() else [storage]
        found = [f for f in found if f.path.lower().endswith(TEXT_SUFFIXES)]
        if not found:
            raise DataError(
                f"no data files at {location!r}: give CSV, TSV, JSONL or Parquet files "
                f"({', '.join(TEXT_SUFFIXES)})"
            )
        files += found
    return files


def files_part(files: list[StoragePath], encoding: str) -> RawPart:
    def tables() -> Iterator[tuple[pa.Table, str, int]]:
        for file in files:
            first_row = 0
            for table in file_tables(file, encoding):
                yield table, file.uri, first_row
                first_row += table.num_rows

    where = files[0].uri if len(files) == 1 else f"{len(files)} files ({files[0].uri}, …)"
    return RawPart("all", where, tables)


def table_part(name: str, where: str, table: pa.Table) -> RawPart:
    """A table already at hand (a named source's, or a hub split, which `datasets` memory-maps)."""

    def tables() -> Iterator[tuple[pa.Table, str, int]]:
        for start in range(0, table.num_rows, READ_ROWS):
            yield table.slice(start, READ_ROWS), where, start

    return RawPart(name, where, tables)


class Utf8Stream(io.RawIOBase):
    """A text file in any encoding, read a chunk at a time and handed on as UTF-8 (what Arrow's
    readers take); a byte that is not `encoding` fails with its place and the fix."""

    def __init__(self, file: StoragePath, encoding: str) -> None:
        self.file = file
        self.pending = memoryview(b"")  # UTF-8 bytes decoded but not yet read
        self.decoded = iter_decoded(self._chunks(), encoding, file.uri)

    def _chunks(self) -> Iterator[bytes]:
        with self.file.filesystem.open_input_stream(self.file.path) as stream:
            while chunk := stream.read(READ_BYTES):
                yield chunk

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self.pending:
            text = next(self.decoded, None)
            if text is None:
                return 0
            self.pending = memoryview(text[0].encode(UTF8))
        count = min(len(buffer), len(self.pending))
        buffer[:count] = self.pending[:count]
        self.pending = self.pending[count:]
        return count


def file_tables(file: StoragePath, encoding: str) -> Iterator[pa.Table]:
    """One file's rows a few MiB at a time: Parquet by row group batches, CSV / TSV / JSONL
    transcoded to UTF-8 on the way (Arrow's readers take UTF-8 alone)."""
    suffix = Path(file.path).suffix.lower()
    with file.filesystem.open_input_stream(file.path) as stream:
        head = stream.read(4096)
    if not head.strip():
        raise DataError(f"{file.uri} is empty: give a file with a header and rows")
    if suffix != ".parquet" and b"\x00" in head and not head.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise DataError(
            f"{file.uri} holds NUL bytes, so it is no {suffix[1:].upper()} text (a binary file "
            "named like one?); if it is UTF-16 or UTF-32 text, pass --encoding utf-16 / utf-32"
        )
    try:
        if suffix == ".parquet":
            with file.filesystem.open_input_file(file.path) as source:
                for batch in pq.ParquetFile(source).iter_batches(batch_size=READ_ROWS):
                    yield pa.Table.from_batches([batch])
            return
        text = Utf8Stream(file, encoding)
        if suffix in (".jsonl", ".json"):
            reader: Any = pa.json.open_json(
                text, read_options=pa.json.ReadOptions(block_size=READ_BYTES)
            )
        else:
            # Quoted fields may span lines (a review with paragraphs), as spreadsheets write them.
            reader = pa.csv.open_csv(
                text,
                read_options=pa.csv.ReadOptions(block_size=READ_BYTES),
                parse_options=pa.csv.ParseOptions(
                    delimiter="\t" if suffix == ".tsv" else ",", newlines_in_values=True
                ),
            )
        for batch in reader:
            yield pa.Table.from_batches([batch])
    except (pa.ArrowInvalid, OSError) as error:
        if isinstance(error.__context__, TextEncodingError):  # raised inside Arrow's read
            raise error.__context__ from None
        first_line = (
            str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        )
        raise DataError(f"cannot read {file.uri} as {suffix[1:]}: {first_line}") from error


def read_hub(name: str, config_name: str | None) -> list[RawPart]:
    """A Hugging Face hub dataset's splits (needs the hub; HF_HUB_OFFLINE=1 turns it off), read
    from the memory-mapped Arrow files `datasets` keeps."""
    import datasets

    try:
        loaded = datasets.load_dataset(name, config_name)
    except Exception as error:  # the hub raises many types; the message is what matters
        raise DataError(
            f"cannot load dataset {name!r} from the Hugging Face hub ({type(error).__name__}: "
            f"{str(error)[:300]}); without the hub, give local CSV / JSONL / Parquet files"
        ) from error
    return [
        table_part(split, f"{name} ({split})", part.data.table) for split, part in loaded.items()
    ]


# ---------------------------------------------------------------------------------------------
# Checks, labels and the split
# ---------------------------------------------------------------------------------------------


def select_columns(
    table: pa.Table, text_column: str, label_column: str, where: str, first_row: int = 0
) -> tuple[pa.Array, pa.Array]:
    """The text and label columns of rows `first_row`… of `where`, checked: text must be strings,
    neither may have gaps. Integral float labels (1.0, 2.0) become integers."""
    missing = [c for c in (text_column, label_column) if c not in table.column_names]
    if missing:
        raise DataError(
            f"{where} has no column {missing[0]!r} (it has {table.column_names}): "
            "set --text-column and --label-column to the data's names"
        )
    if table.num_rows == 0:
        raise DataError(f"{where} has no rows")
    text = table.column(text_column).combine_chunks()
    if not (pa.types.is_string(text.type) or pa.types.is_large_string(text.type)):
        example = next((v for v in text.to_pylist() if v is not None), None)
        if pa.types.is_binary(text.type) or pa.types.is_large_binary(text.type):
            raise DataError(
                f"column {text_column!r} of {where} holds raw bytes, not strings (e.g. "
                f"{example!r}): if they are text, store them as a string column (UTF-8); otherwise "
                "set --text-column to the column with the sentences"
            )
        raise DataError(
            f"column {text_column!r} of {where} holds {text.type} values (e.g. {example!r}), not "
            "text: set --text-column to the column with the sentences"
        )
    labels = table.column(label_column).combine_chunks()
    if pa.types.is_floating(labels.type):
        nan = pc.fill_null(pc.is_nan(labels), False)
        count = pc.sum(nan).as_py() or 0
        if count:
            row = first_row + int(pc.index(nan, True).as_py())
            raise DataError(
                f"column {label_column!r} of {where} is NaN at row {row} ({count} such rows in "
                f"rows {first_row}–{first_row + table.num_rows - 1}): fill or drop those rows"
            )
        values = labels.drop_null()
        if len(values) and pc.all(pc.equal(pc.floor(values), values)).as_py():
            labels = pc.cast(
                labels, pa.int64()
            )  # 1.0, 2.0: class ids a spreadsheet wrote as floats
    blank_text = pc.or_kleene(pc.is_null(text), pc.equal(pc.utf8_trim_whitespace(text), ""))
    for name, blank in ((text_column, blank_text), (label_column, pc.is_null(labels))):
        count = pc.sum(pc.fill_null(blank, True)).as_py() or 0
        if count:
            row = first_row + int(pc.index(pc.fill_null(blank, True), True).as_py())
            raise DataError(
                f"column {name!r} of {where} has no value (blank, NA or NaN) at row {row} "
                f"({count} such rows in rows {first_row}–{first_row + table.num_rows - 1}): "
                "fill or drop those rows"
            )
    return text.cast(pa.string()), labels


class Codes:
    """A column's distinct values as seen batch by batch, and every row as the code of its value
    (first-seen order, 4 bytes a row): what prepare keeps of the labels and strata, not the rows."""

    def __init__(self) -> None:
        self.values: dict[str, int] = {}
        self.chunks: list[np.ndarray] = []

    def add(self, column: pa.Array) -> None:
        as_text = pc.fill_null(pc.cast(column, pa.string()), "")  # a stratum may be missing
        encoded = as_text.dictionary_encode()  # this batch's values, and each row's index in them
        codes = np.array(
            [self.values.setdefault(v, len(self.values)) for v in encoded.dictionary.to_pylist()],
            dtype=np.int32,
        )
        self.chunks.append(codes[encoded.indices.to_numpy(zero_copy_only=False)])

    def ids(self, names: Sequence[str]) -> np.ndarray:
        """Each row's position in `names` (which holds every value seen)."""
        position = {name: index for index, name in enumerate(names)}
        remap = np.array([position[value] for value in self.values], dtype=np.int64)
        return remap[np.concatenate(self.chunks)] if self.chunks else np.zeros(0, np.int64)


@dataclass
class PartLabels:
    """What the first pass keeps of one part: its rows' class codes and strata, and the labels'
    kind (numeric order for integer labels, "2" before "10")."""

    labels: Codes = field(default_factory=Codes)
    strata: Codes = field(default_factory=Codes)
    rows: int = 0
    kinds: set[str] = field(default_factory=set)


def read_labels_of(part: RawPart, options: PrepareOptions, stratify: str) -> PartLabels:
    """First pass: every table of the part checked (columns, text, gaps); its labels and strata
    kept as codes."""
    seen = PartLabels()
    for table, where, first_row in part.tables():
        _, labels = select_columns(
            table, options.text_column, options.label_column, where, first_row
        )
        if pa.types.is_floating(labels.type):
            raise DataError(
                f"label column {options.label_column!r} holds floats (e.g. {labels[0].as_py()}): "
                "a classifier needs class labels; map the scores to classes first"
            )
        if stratify not in table.column_names:
            raise DataError(
                f"no column {stratify!r} to stratify the split by ({where} has "
                f"{table.column_names}): set --stratify-column"
            )
        seen.kinds.add("integer" if pa.types.is_integer(labels.type) else "text")
        seen.labels.add(labels)
        seen.strata.add(table.column(stratify).combine_chunks())
        seen.rows += table.num_rows
    if seen.rows == 0:
        raise DataError(f"{part.where} has no rows")
    return seen


def label_names(parts: Sequence[PartLabels], label_column: str) -> list[str]:
    """The sorted class names over every part (numeric order when every label is an integer); at
    least two, or an error."""
    values = sorted({value for part in parts for value in part.labels.values})
    if all(part.kinds == {"integer"} for part in parts):
        values.sort(key=int)
    if len(values) < 2:
        rows = sum(part.rows for part in parts)
        raise DataError(
            f"label column {label_column!r} has one class ({values[0]!r}) in {rows} rows: "
            "a classifier needs at least two; check --label-column"
        )
    return values


MIN_HELD_OUT_ROWS = 32  # one global batch of the default presets
MAX_HELD_OUT_SHARE = 0.2  # the minimum yields to this share of a small dataset


def held_out_rows(rows: int, fraction: float) -> int:
    """A carved split's size: `fraction` of the rows, but at least one batch while the dataset is
    large enough (so a tiny CSV still gets a validation split worth measuring)."""
    if fraction == 0:
        return 0
    return max(round(rows * fraction), min(MIN_HELD_OUT_ROWS, int(rows * MAX_HELD_OUT_SHARE)), 1)


def split_indices(
    rows: int, strata: np.ndarray, fractions: tuple[float, float], seed: int
) -> dict[str, np.ndarray]:
    """Train / validation / test row indices: each held-out split `held_out_rows` long, shared out
    over the strata in proportion (largest remainders), each stratum keeping a training row."""
    rng = np.random.default_rng(seed)
    groups = [rng.permutation(np.flatnonzero(strata == s)) for s in np.unique(strata)]
    sizes = np.array([len(g) for g in groups])
    taken = np.zeros(len(groups), dtype=np.int64)
    parts: dict[str, list[np.ndarray]] = {split: [] for split in SPLITS}
    for split, fraction in zip(("validation", "test"), fractions, strict=True):
        room = sizes - taken - 1  # every stratum keeps one row for training
        share = held_out_rows(rows, fraction) * sizes / rows
        quota = np.minimum(np.floor(share).astype(np.int64), room)
        missing = held_out_rows(rows, fraction) - int(quota.sum())
        for index in np.argsort(-(share - np.floor(share)), kind="stable"):
            if missing <= 0:
                break
            if quota[index] < room[index]:
                quota[index] += 1
                missing -= 1
        for group, start, count in zip(groups, taken, quota, strict=True):
            parts[split].append(group[start : start + count])
        taken += quota
    for group, start in zip(groups, taken, strict=True):
        parts["train"].append(group[start:])
    splits = {name: rng.permutation(np.concatenate(chunks)) for name, chunks in parts.items()}
    assert sum(len(v) for v in splits.values()) == rows
    return splits


def tokenizer_fingerprint(tokenizer_path: str) -> str:
    """A hash of the tokenizer's full definition: data tokenised by one is only fit for the same
    one."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    except (OSError, ValueError, TypeError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise DataError(
            f"cannot load a tokenizer from {tokenizer_path}: {first[:200]}. A model folder needs "
            "its tokenizer files (tokenizer.json, or vocab.txt / vocab.json + merges.txt)"
        ) from error
    if len(tokenizer) < MIN_VOCABULARY:
        # transformers builds a tokenizer of special tokens alone from a folder that lacks the
        # files.
        raise DataError(
            f"the tokenizer in {tokenizer_path} has {len(tokenizer)} "
            "tokens: its files (tokenizer.json, or vocab.txt / vocab.json "
            "+ merges.txt) are missing; copy the whole model folder"
        )
    return hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()


def inspect_dataset(data_dir: StoragePath, prepare_command: str = "prepare") -> DatasetInfo:
    """The prepared dataset's description; an error naming the command to run (`prepare_command`,
    the pipeline's own) if it is incomplete."""
    marker = data_dir.join(DATASET_FILE)
    if not marker.exists():
        raise DataError(
            f"no prepared dataset at {data_dir.uri!r} (no {DATASET_FILE}): run "
            f"`{prepare_command}` first, or point --data-dir at a prepared folder"
        )
    info = DatasetInfo(**json.loads(marker.read_text()))
    for split in SPLITS:
        folder = split_dir(data_dir, split, info)
        try:
            stats: TokenStats = read_stats(folder)
        except FileNotFoundError as error:  # a split deleted or cut off behind the marker's back
            raise DataError(f"{error}: rerun `{prepare_command} --force`") from error
        if stats.rows != info.rows[split]:
            raise DataError(
                f"{folder.uri} has {stats.rows} rows, {DATASET_FILE} says "
                f"{info.rows[split]}: rerun `{prepare_command} --force`"
            )
    return info


def split_dir(data_dir: StoragePath, split: str, info: DatasetInfo | None = None) -> StoragePath:
    """A prepared split's folder: under the generation dataset.json names (an object store's
    output: `storage.staged_output`); `info` when the caller has read it."""
    if info is None:
        info = DatasetInfo(**json.loads(data_dir.join(DATASET_FILE).read_text()))
    return files_of(data_dir, info.files_in).join(split)


def read_labels(data_dir: StoragePath, split: str, prepare_command: str = "prepare") -> np.ndarray:
    """One split's class ids, read from the label column alone, a file at a time."""
    labels = []
    folder = split_dir(data_dir, split)
    for file in folder.list_files(".parquet"):
        with file.filesystem.open_input_file(file.path) as stream:
            labels.append(pq.read_table(stream, columns=["label"]).column("label").to_numpy())
    if not labels:
        raise DataError(f"no Parquet files in {folder.uri}: rerun `{prepare_command} --force`")
    return np.concatenate(labels)


# ---------------------------------------------------------------------------------------------
# prepare: source → checked, split, pre-tokenised Parquet
# ---------------------------------------------------------------------------------------------


def load_source(
    options: PrepareOptions, download_dir: Path, named: NamedSources
) -> tuple[list[RawPart], str]:
    """The source's parts (one, or the hub's named splits) and a description of where they came
    from; nothing is read yet but a named source's table (a small dataset shipped whole)."""
    if options.dataset in named:
        table, where = named[options.dataset].load(download_dir)
        return [table_part("all", where, table)], where
    looks_like_files = (
        any(options.dataset.lower().endswith(s) for s in TEXT_SUFFIXES)
        or resolve_storage(options.dataset).exists()
    )
    if looks_like_files or "://" in options.dataset:
        files = data_files(options.dataset.split(","))
        return [files_part(files, options.encoding)], options.dataset
    return read_hub(options.dataset, options.dataset_config), options.dataset


SPLIT_NAMES = {
    "train": "train",
    "validation": "validation",
    "valid": "validation",
    "dev": "validation",
    "test": "test",
}


@dataclass(frozen=True)
class Placement:
    """Where each row of a part goes: its split (an index into SPLITS; -1: nowhere) and its row id
    in that split (its place in the split's seeded order)."""

    split: np.ndarray  # (rows,) int8
    row: np.ndarray  # (rows,) int64


def place_rows(
    parts: Sequence[RawPart], seen: Sequence[PartLabels], options: PrepareOptions
) -> list[Placement]:
    """Use a source's own train/validation/test splits; carve any missing one out of its train rows,
    stratified by the `stratum` codes so each split keeps the source's mix."""
    named = {SPLIT_NAMES[p.name]: i for i, p in enumerate(parts) if p.name in SPLIT_NAMES}
    placements = [
        Placement(np.full(part.rows, -1, np.int8), np.zeros(part.rows, np.int64)) for part in seen
    ]

    def whole(index: int, split: str) -> None:
        placements[index].split[:] = SPLITS.index(split)
        placements[index].row[:] = np.arange(seen[index].rows)

    if named.keys() >= set(SPLITS):
        for split in SPLITS:
            whole(named[split], split)
        return placements
    pool = named.get("train", 0)
    rows = seen[pool].rows
    fractions = (
        0.0 if "validation" in named else options.validation_fraction,
        0.0 if "test" in named else options.test_fraction,
    )
    if rows < 10:
        raise DataError(
            f"{rows} rows cannot make a train, a validation and a test split worth the name: "
            "give at least 10 labelled rows (a few hundred to learn anything)"
        )
    for split, fraction in zip(("validation", "test"), fractions, strict=True):
        size = held_out_rows(rows, fraction)
        if fraction and size > round(rows * fraction):
            log.warning(
                "%s: %d rows, not the %d that --%s-fraction %.2f gives, so it holds one batch of "
                "%d (or %.0f %% of a small dataset)",
                split,
                size,
                round(rows * fraction),
                split,
                fraction,
                MIN_HELD_OUT_ROWS,
                100 * MAX_HELD_OUT_SHARE,
            )
    strata = seen[pool].strata.ids(sorted(seen[pool].strata.values))
    for split, chosen in split_indices(rows, strata, fractions, options.seed).items():
        placements[pool].split[chosen] = SPLITS.index(split)
        placements[pool].row[chosen] = np.arange(len(chosen))
    for split in ("validation", "test"):
        if split in named:
            whole(named[split], split)
    return placements


def write_raw_splits(
    parts: Sequence[RawPart],
    codes: Sequence[np.ndarray],
    placements: Sequence[Placement],
    options: PrepareOptions,
    counts: dict[str, int],
    folder: StoragePath,
) -> None:
    """Second pass: every part read again and each row (row id, text, class id) appended to its
    split's Parquet files under `folder`, a table at a time."""
    writers = {
        split: PartWriter(folder.join(split), max(RAW_ROWS_PER_FILE, counts[split] // 64))
        for split in SPLITS
    }
    for part, labels, place in zip(parts, codes, placements, strict=True):
        offset = 0
        for table, _, _ in part.tables():
            end = offset + table.num_rows
            text = table.column(options.text_column).combine_chunks().cast(pa.string())
            for index, split in enumerate(SPLITS):
                mask = place.split[offset:end] == index
                if mask.any():
                    writers[split].write(
                        pa.table(
                            {
                                "row": place.row[offset:end][mask],
                                "text": text.filter(pa.array(mask)),
                                "label": labels[offset:end][mask],
                            }
                        )
                    )
            offset = end
    for writer in writers.values():
        writer.close()


class PartWriter:
    """Tables appended to part-NNNNN.parquet files of at most `rows_per_file` rows each."""

    def __init__(self, folder: StoragePath, rows_per_file: int) -> None:
        self.folder, self.rows_per_file = folder, rows_per_file
        self.writer: pq.ParquetWriter | None = None
        self.files = self.rows = 0

    def write(self, table: pa.Table) -> None:
        while table.num_rows:
            if self.writer is None:
                target = self.folder.join(f"part-{self.files:05d}.parquet")
                self.folder.mkdir()
                self.writer = pq.ParquetWriter(
                    target.path, table.schema, filesystem=target.filesystem
                )
                self.files, self.rows = self.files + 1, 0
            taken = table.slice(0, self.rows_per_file - self.rows)
            self.writer.write_table(taken)
            self.rows += taken.num_rows
            table = table.slice(taken.num_rows)
            if self.rows == self.rows_per_file:
                self.close()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def raw_rows(folder: StoragePath) -> Any:
    """A split's rows to tokenise as a Ray Dataset: read here when small (Ray Data's Parquet reader
    costs seconds of start-up per split, most of a small dataset's prepare), else read by Ray Data
    across the cluster."""
    import ray.data

    files = folder.list_files(".parquet")
    if sum(file.filesystem.get_file_info(file.path).size for file in files) > SMALL_SPLIT_BYTES:
        return ray.data.read_parquet(folder.path, filesystem=folder.filesystem)
    table = pa.concat_tables(
        [pq.read_table(file.path, filesystem=file.filesystem) for file in files]
    )
    step = RAW_ROWS_PER_FILE
    return ray.data.from_arrow(
        [table.slice(start, step) for start in range(0, table.num_rows, step)]
    )


def prepare(
    options: PrepareOptions,
    data_dir: StoragePath,
    model: str,
    download_dir: Path,
    force: bool = False,
    named_sources: NamedSources | None = None,
    prepare_command: str = "prepare",
) -> DatasetInfo:
    """Read, check, split and pre-tokenise a labelled text dataset; idempotent unless `force`.

    The source is read twice, a table at a time, never whole: first its labels (kept as 4-byte
    codes a row, for the stratified split), then its rows, each appended to its split's Parquet
    in a staging folder, which Ray Data then tokenises across the cluster. Memory grows with the
    row count by ~25 bytes a row (codes, placements, class ids), not with the text.
    """
    from raytrain_common.ray_start import init_ray

    check_prepare_options(options)
    fingerprint = tokenizer_fingerprint(model)
    named = named_sources or {}
    existing = prepared_already(data_dir, options, fingerprint, force, named, prepare_command)
    if existing is not None:
        return existing
    check_output_folder(data_dir, MARKER)  # the user's own files: refused before any work
    parts, source = load_source(options, download_dir, named)
    own = named[options.dataset].stratify_by if options.dataset in named else None
    stratify = options.stratify_column or own or options.label_column
    seen = [read_labels_of(part, options, stratify) for part in parts]
    names = label_names(seen, options.label_column)
    placements = place_rows(parts, seen, options)
    counts = split_counts(placements, source)
    init_ray(train_cpus=1)  # only now: every check above runs without a cluster
    with staged_output(data_dir, MARKER) as staged:
        staging = staged.folder
        raw = staging.join(".raw")
        class_ids = [part.labels.ids(names) for part in seen]
        write_raw_splits(parts, class_ids, placements, options, counts, raw)
        token_stats = {
            split: tokenise_split(raw, staging, split, model, options) for split in SPLITS
        }
        raw.filesystem.delete_dir(raw.path)
        info = DatasetInfo(
            source=source,
            labels=names,
            rows=counts,
            tokenizer=model,
            tokenizer_sha256=fingerprint,
            max_length=options.max_length,
            stratified_by=stratify,
            seed=options.seed,
            token_stats=token_stats,
            files_in=staged.files_in,
        )
        staged.write_marker(asdict(info))
    return info


def check_prepare_options(options: PrepareOptions) -> None:
    for name, fraction in (
        ("validation", options.validation_fraction),
        ("test", options.test_fraction),
    ):
        if not 0 < fraction < 0.5:
            raise DataError(f"--{name}-fraction={fraction}: it must lie between 0 and 0.5")
    if options.max_length < 8:
        raise DataError(f"--max-length={options.max_length}: give at least 8 tokens")


def prepared_already(
    data_dir: StoragePath,
    options: PrepareOptions,
    fingerprint: str,
    force: bool,
    named: NamedSources,
    prepare_command: str = "prepare",
) -> DatasetInfo | None:
    """The dataset in `data_dir` when it was prepared with these settings (and no --force); a
    refusal when it holds another preparation; None when there is none, or --force rewrites it
    (a damaged one too, when its dataset.json is ours: `storage.staged_output` checks)."""
    marker = data_dir.join(DATASET_FILE)
    if force or not marker.exists() or not MARKER.is_ours(marker):
        return None  # (someone else's dataset.json: check_output_folder refuses it)
    existing = inspect_dataset(data_dir, prepare_command)
    same = (existing.tokenizer_sha256, existing.max_length, existing.seed) == (
        fingerprint,
        options.max_length,
        options.seed,
    )
    if same and existing.source.startswith(_source_prefix(options, named)):
        log.info("dataset at %s is prepared already; --force rewrites it", data_dir.uri)
        return existing
    raise DataError(
        f"{data_dir.uri} holds data prepared from {existing.source} with {existing.tokenizer} "
        "and other settings: pass --force to rewrite it, or choose another --data-dir"
    )
    existing = inspect_dataset(data_dir, prepare_command)
    same = (existing.tokenizer_sha256, existing.max_length, existing.seed) == (
        fingerprint,
        options.max_length,
        options.seed,
    )
    if not force and same and existing.source.startswith(_source_prefix(options, named)):
        log.info("dataset at %s is prepared already; --force rewrites it", data_dir.uri)
        return existing
    if not force:
        raise DataError(
            f"{data_dir.uri} holds data prepared from {existing.source} with {existing.tokenizer} "
            "and other settings: pass --force to rewrite it, or choose another --data-dir"
        )
    return None


def split_counts(placements: list[Placement], source: str) -> dict[str, int]:
    """Rows per split; a split without rows is refused."""
    counts = {
        split: int(sum((p.split == i).sum() for p in placements)) for i, split in enumerate(SPLITS)
    }
    for split, count in counts.items():
        if count == 0:
            raise DataError(
                f"the {split} split of {source} has no rows ({sum(counts.values())} rows in all): "
                "give more data, or a larger --validation-fraction / --test-fraction"
            )
    return counts


def tokenise_split(
    raw: StoragePath, staging: StoragePath, split: str, model: str, options: PrepareOptions
) -> dict[str, Any]:
    """One split's raw rows pre-tokenised with Ray Data into the staging folder; its stats."""
    from raytrain_common.pretokenize import pretokenize

    stats = pretokenize(
        raw_rows(raw.join(split)),
        staging.join(split),
        tokenizer_path=model,
        text_column="text",
        max_length=options.max_length,
        keep_columns=["row", "label", "text"],
    )
    log.info(
        "%s: %d rows, token length p50 %d / p99 %d, %.2f%% truncated at %d",
        *(split, stats.rows, stats.length_p50, stats.length_p99),
        *(100 * stats.truncated_share, options.max_length),
    )
    return asdict(stats)


def _source_prefix(options: PrepareOptions, named: NamedSources) -> str:
    return named[options.dataset].prefix if options.dataset in named else options.dataset
