"""Labelled text (VADER, a hub dataset or the user's files) → split, pre-tokenised Parquet.

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
import subprocess
import sys
import tarfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv
import pyarrow.json
import pyarrow.parquet as pq

from hf_finetune.config import VADER_SOURCE, PrepareConfig
from raytrain_common.pretokenize import TokenStats, read_stats
from raytrain_common.storage import StoragePath, resolve_storage, staged_folder
from raytrain_common.text import UTF8, decode_text

log = logging.getLogger(__name__)

DATASET_FILE = "dataset.json"
SPLITS = ("train", "validation", "test")
VADER_SDIST = "vadersentiment==3.3.2"
VADER_FILES = {  # file in the sdist's inner archive → source name
    "tweets_GroundTruth.txt": "tweets",
    "movieReviewSnippets_GroundTruth.txt": "movie_reviews",
    "amazonReviewSnippets_GroundTruth.txt": "amazon_reviews",
    "nytEditorialSnippets_GroundTruth.txt": "nyt_editorials",
}
TEXT_SUFFIXES = (".csv", ".tsv", ".jsonl", ".json", ".parquet")
MIN_VOCABULARY = 100  # fewer tokens: a tokenizer folder without its vocabulary files


class DataError(ValueError):
    """Data this pipeline cannot train on; the message names the file or column and the fix."""


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

    @property
    def num_labels(self) -> int:
        return len(self.labels)


# ---------------------------------------------------------------------------------------------
# Sources: each returns Arrow tables with a `text` (string) and a raw `label` column
# ---------------------------------------------------------------------------------------------


def download_vader(into: Path) -> Path:
    """The vaderSentiment source distribution from PyPI: its wheel lacks the rated sentences."""
    into.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
    command += ["--no-binary", ":all:", VADER_SDIST, "-d", str(into)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    archives = sorted(into.glob("vader*-3.3.2.tar.gz"), key=lambda p: p.name.lower())
    if done.returncode or not archives:
        raise DataError(
            f"could not download {VADER_SDIST} from PyPI ({done.stderr.strip()[-300:]}); "
            "download it elsewhere with `pip download --no-deps --no-binary :all: "
            f"{VADER_SDIST}` and pass the .tar.gz with --vader-sdist"
        )
    return archives[0]


def read_vader(sdist: Path) -> pa.Table:
    """VADER's 23,703 human-rated sentences: text, label (positive if the mean rating is > 0), source."""
    texts: list[str] = []
    labels: list[str] = []
    sources: list[str] = []
    with tarfile.open(sdist) as outer:
        inner_member = next(
            (m for m in outer.getmembers() if m.name.endswith("hutto_ICWSM_2014.tar.gz")), None
        )
        if inner_member is None:
            raise DataError(f"{sdist} holds no hutto_ICWSM_2014.tar.gz: is it {VADER_SDIST}?")
        inner_bytes = outer.extractfile(inner_member).read()  # type: ignore[union-attr]
    with tarfile.open(fileobj=io.BytesIO(inner_bytes)) as inner:
        for member in sorted(inner.getmembers(), key=lambda m: m.name):
            source = VADER_FILES.get(Path(member.name).name)
            if source is None:
                continue
            lines = inner.extractfile(member).read().decode("utf-8").splitlines()  # type: ignore[union-attr]
            for line in lines:
                parts = line.split("\t")
                if len(parts) < 3:
                    continue
                texts.append("\t".join(parts[2:]).strip())
                labels.append("positive" if float(parts[1]) > 0 else "negative")
                sources.append(source)
    if len(set(sources)) != len(VADER_FILES):
        raise DataError(f"{sdist} lacks some of {sorted(VADER_FILES)}: is it {VADER_SDIST}?")
    return pa.table({"text": texts, "label": labels, "source": sources})


def read_files(locations: Sequence[str], encoding: str = UTF8) -> pa.Table:
    """CSV / TSV / JSONL / Parquet files (local or object storage), concatenated in the order given;
    text files in `encoding`, folders at any depth."""
    tables = []
    for location in locations:
        storage = resolve_storage(location)
        if not storage.exists():
            raise DataError(f"no data files at {location!r}: the path does not exist")
        files = [f for _, f in storage.walk_files()] if storage.is_dir() else [storage]
        files = [f for f in files if f.path.lower().endswith(TEXT_SUFFIXES)]
        if not files:
            raise DataError(
                f"no data files at {location!r}: give CSV, TSV, JSONL or Parquet files "
                f"({', '.join(TEXT_SUFFIXES)})"
            )
        tables += [_read_one(file, encoding) for file in files]
    try:
        return pa.concat_tables(tables, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as error:
        raise DataError(
            f"the files' columns do not agree ({error}): give files of one layout"
        ) from error


def _read_one(file: StoragePath, encoding: str) -> pa.Table:
    suffix = Path(file.path).suffix.lower()
    data = file.read_bytes()
    if not data.strip():
        raise DataError(f"{file.uri} is empty: give a file with a header and rows")
    if suffix != ".parquet":
        if b"\x00" in data[:4096] and not data.startswith((b"\xff\xfe", b"\xfe\xff")):
            raise DataError(
                f"{file.uri} holds NUL bytes, so it is no {suffix[1:].upper()} text (a binary file "
                "named like one?); if it is UTF-16 or UTF-32 text, pass --encoding utf-16 / utf-32"
            )
        # Arrow's readers take UTF-8 alone: decode in the user's encoding first, so bytes in
        # another one are refused with their place and the fix, never read as 'binary' columns.
        data = decode_text(data, encoding, file.uri).encode(UTF8)
    try:
        if suffix == ".parquet":
            return pq.read_table(io.BytesIO(data))
        if suffix in (".jsonl", ".json"):
            return pa.json.read_json(io.BytesIO(data))
        delimiter = "\t" if suffix == ".tsv" else ","
        # Quoted fields may span lines (a review with paragraphs), as spreadsheets write them.
        options = pa.csv.ParseOptions(delimiter=delimiter, newlines_in_values=True)
        return pa.csv.read_csv(io.BytesIO(data), parse_options=options)
    except (pa.ArrowInvalid, OSError) as error:
        first_line = (
            str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        )
        raise DataError(f"cannot read {file.uri} as {suffix[1:]}: {first_line}") from error


def read_hub(name: str, config_name: str | None) -> dict[str, pa.Table]:
    """A Hugging Face hub dataset's splits (needs the hub; HF_HUB_OFFLINE=1 turns it off)."""
    import datasets

    try:
        loaded = datasets.load_dataset(name, config_name)
    except Exception as error:  # the hub raises many types; the message is what matters
        raise DataError(
            f"cannot load dataset {name!r} from the Hugging Face hub ({type(error).__name__}: "
            f"{str(error)[:300]}); without the hub, give local CSV / JSONL / Parquet files"
        ) from error
    return {split: part.data.table for split, part in loaded.items()}


# ---------------------------------------------------------------------------------------------
# Checks, labels and the split
# ---------------------------------------------------------------------------------------------


def select_columns(
    table: pa.Table, text_column: str, label_column: str, where: str
) -> tuple[pa.Table, pa.Array]:
    """The text and label columns, checked: text must be strings, neither may have gaps."""
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
                f"column {text_column!r} of {where} holds raw bytes, not strings (e.g. {example!r}): "
                "if they are text, store them as a string column (UTF-8); otherwise set "
                "--text-column to the column with the sentences"
            )
        raise DataError(
            f"column {text_column!r} of {where} holds {text.type} values (e.g. {example!r}), not text: "
            "set --text-column to the column with the sentences"
        )
    labels = table.column(label_column).combine_chunks()
    if pa.types.is_floating(labels.type):
        nan = pc.fill_null(pc.is_nan(labels), False)
        count = pc.sum(nan).as_py() or 0
        if count:
            row = int(pc.index(nan, True).as_py())
            raise DataError(
                f"column {label_column!r} of {where} is NaN at row {row} ({count} such rows): "
                "fill or drop those rows"
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
            row = int(pc.index(pc.fill_null(blank, True), True).as_py())
            raise DataError(
                f"column {name!r} of {where} has no value (blank, NA or NaN) at row {row} "
                f"({count} such rows in all): fill or drop those rows"
            )
    return text.cast(pa.string()), labels


def label_names(labels: pa.Array | pa.ChunkedArray, label_column: str) -> list[str]:
    """The sorted class names (numeric order for integer labels); at least two, or an error."""
    if pa.types.is_floating(labels.type):
        raise DataError(
            f"label column {label_column!r} holds floats (e.g. {labels[0].as_py()}): "
            "a classifier needs class labels; map the scores to classes first"
        )
    values = pc.unique(labels).to_pylist()
    if pa.types.is_integer(labels.type):
        names = [str(v) for v in sorted(values)]  # numeric order: "2" before "10"
    else:
        names = sorted(pc.unique(pc.cast(labels, pa.string())).to_pylist())
    if len(names) < 2:
        raise DataError(
            f"label column {label_column!r} has one class ({names[0]!r}) in {len(labels)} rows: "
            "a classifier needs at least two; check --label-column"
        )
    return names


def label_ids(labels: pa.Array, names: Sequence[str]) -> np.ndarray:
    as_text = pc.cast(labels, pa.string()) if not pa.types.is_string(labels.type) else labels
    ids = pc.index_in(as_text, value_set=pa.array(list(names))).to_numpy(zero_copy_only=False)
    if np.isnan(ids.astype(float)).any():
        raise DataError(f"labels outside the label set {list(names)}")
    return ids.astype(np.int64)


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
    """A hash of the tokenizer's full definition: data tokenised by one is only fit for the same one."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    except (OSError, ValueError, TypeError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise DataError(
            f"cannot load a tokenizer from {tokenizer_path}: {first[:200]}. A model folder needs its "
            "tokenizer files (tokenizer.json, or vocab.txt / vocab.json + merges.txt)"
        ) from error
    if len(tokenizer) < MIN_VOCABULARY:
        # transformers builds a tokenizer of special tokens alone from a folder that lacks the files.
        raise DataError(
            f"the tokenizer in {tokenizer_path} has {len(tokenizer)} tokens: its files (tokenizer.json, "
            "or vocab.txt / vocab.json + merges.txt) are missing; copy the whole model folder"
        )
    return hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()


def write_info(data_dir: StoragePath, info: DatasetInfo) -> None:
    data_dir.join(DATASET_FILE).write_text(json.dumps(asdict(info), indent=2) + "\n")


def inspect_dataset(data_dir: StoragePath) -> DatasetInfo:
    """The prepared dataset's description; an error naming the command to run if it is incomplete."""
    marker = data_dir.join(DATASET_FILE)
    if not marker.exists():
        raise DataError(
            f"no prepared dataset at {data_dir.uri!r} (no {DATASET_FILE}): run `hf-finetune "
            "prepare` first, or point --data-dir at a prepared folder"
        )
    info = DatasetInfo(**json.loads(marker.read_text()))
    for split in SPLITS:
        stats: TokenStats = read_stats(data_dir.join(split))
        if stats.rows != info.rows[split]:
            raise DataError(
                f"{data_dir.uri}/{split} has {stats.rows} rows, {DATASET_FILE} says {info.rows[split]}:"
                " rerun `hf-finetune prepare --force`"
            )
    return info


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


def read_labels(data_dir: StoragePath, split: str) -> np.ndarray:
    """One split's class ids, read from the label column alone, a file at a time."""
    labels = []
    for file in data_dir.join(split).list_files(".parquet"):
        with file.filesystem.open_input_file(file.path) as stream:
            labels.append(pq.read_table(stream, columns=["label"]).column("label").to_numpy())
    if not labels:
        raise DataError(f"no Parquet files in {data_dir.uri}/{split}: rerun `hf-finetune prepare`")
    return np.concatenate(labels)


# ---------------------------------------------------------------------------------------------
# prepare: source → checked, split, pre-tokenised Parquet
# ---------------------------------------------------------------------------------------------


def load_source(options: PrepareConfig, download_dir: Path) -> tuple[dict[str, pa.Table], str]:
    """The raw tables (one, or the hub's named splits) and a description of where they came from."""
    if options.dataset == VADER_SOURCE:
        sdist = Path(options.vader_sdist) if options.vader_sdist else download_vader(download_dir)
        return {"all": read_vader(sdist)}, f"VADER human-rated sentences ({sdist.name})"
    looks_like_files = (
        any(options.dataset.lower().endswith(s) for s in TEXT_SUFFIXES)
        or resolve_storage(options.dataset).exists()
    )
    if looks_like_files or "://" in options.dataset:
        locations = options.dataset.split(",")
        return {"all": read_files(locations, options.encoding)}, options.dataset
    return read_hub(options.dataset, options.dataset_config), options.dataset


def assign_splits(raw: dict[str, pa.Table], options: PrepareConfig) -> dict[str, pa.Table]:
    """Use a source's own train/validation/test splits; carve any missing one out of its train rows.

    Carving is stratified by the `stratum` column, so each split keeps the source's mix.
    """
    aliases = {"train": "train", "validation": "validation", "valid": "validation", "dev": "validation", "test": "test"}  # fmt: skip
    named = {aliases[k]: v for k, v in raw.items() if k in aliases}
    if named.keys() >= set(SPLITS):
        return {split: named[split] for split in SPLITS}
    pool = named.get("train", next(iter(raw.values())))
    fractions = (
        0.0 if "validation" in named else options.validation_fraction,
        0.0 if "test" in named else options.test_fraction,
    )
    strata = np.asarray(pool.column("stratum").to_pylist(), dtype=str)
    if pool.num_rows < 10:
        raise DataError(
            f"{pool.num_rows} rows cannot make a train, a validation and a test split worth the name: "
            "give at least 10 labelled rows (a few hundred to learn anything)"
        )
    for split, fraction in zip(("validation", "test"), fractions, strict=True):
        size = held_out_rows(pool.num_rows, fraction)
        if fraction and size > round(pool.num_rows * fraction):
            log.warning(
                "%s: %d rows, not the %d that --%s-fraction %.2f gives, so it holds one batch of "
                "%d (or %.0f %% of a small dataset)",
                split, size, round(pool.num_rows * fraction), split, fraction,
                MIN_HELD_OUT_ROWS, 100 * MAX_HELD_OUT_SHARE,
            )  # fmt: skip
    carved = {
        split: pool.take(pa.array(rows))
        for split, rows in split_indices(pool.num_rows, strata, fractions, options.seed).items()
    }
    return {
        split: carved[split] if split == "train" else named.get(split, carved[split])
        for split in SPLITS
    }


def normalise(
    raw: dict[str, pa.Table], options: PrepareConfig, stratify: str, where: str
) -> tuple[dict[str, pa.Table], list[str]]:
    """Every raw table as columns text, label (class id) and stratum; and the class names."""
    checked = {
        name: select_columns(table, options.text_column, options.label_column, f"{where} ({name})")
        for name, table in raw.items()
    }
    names = label_names(
        pa.chunked_array([labels for _, labels in checked.values()]), options.label_column
    )
    normalised = {}
    for name, (text, labels) in checked.items():
        if stratify not in raw[name].column_names:
            raise DataError(
                f"no column {stratify!r} to stratify the split by (the data has "
                f"{raw[name].column_names}): set --stratify-column"
            )
        stratum = pc.cast(raw[name].column(stratify), pa.string())
        normalised[name] = pa.table(
            {"text": text, "label": pa.array(label_ids(labels, names)), "stratum": stratum}
        )
    return normalised, names


def prepare(
    options: PrepareConfig,
    data_dir: StoragePath,
    model: str,
    download_dir: Path,
    force: bool = False,
) -> DatasetInfo:
    """Read, check, split and pre-tokenise a labelled text dataset; idempotent unless `force`."""
    import ray.data

    from raytrain_common.pretokenize import pretokenize
    from raytrain_common.ray_start import init_ray

    for name, fraction in (
        ("validation", options.validation_fraction),
        ("test", options.test_fraction),
    ):
        if not 0 < fraction < 0.5:
            raise DataError(f"--{name}-fraction={fraction}: it must lie between 0 and 0.5")
    if options.max_length < 8:
        raise DataError(f"--max-length={options.max_length}: give at least 8 tokens")
    fingerprint = tokenizer_fingerprint(model)
    marker = data_dir.join(DATASET_FILE)
    if marker.exists():
        existing = inspect_dataset(data_dir)
        same = (existing.tokenizer_sha256, existing.max_length, existing.seed) == (
            fingerprint, options.max_length, options.seed,
        )  # fmt: skip
        if not force and same and existing.source.startswith(_source_prefix(options)):
            log.info("dataset at %s is prepared already; --force rewrites it", data_dir.uri)
            return existing
        if not force:
            raise DataError(
                f"{data_dir.uri} holds data prepared from {existing.source} with {existing.tokenizer} "
                "and other settings: pass --force to rewrite it, or choose another --data-dir"
            )
        if not data_dir.is_local:  # rewritten in place: unmarked until complete
            marker.filesystem.delete_file(marker.path)

    raw, source = load_source(options, download_dir)
    is_vader = options.dataset == VADER_SOURCE
    stratify = options.stratify_column or ("source" if is_vader else options.label_column)
    normalised, names = normalise(raw, options, stratify, source)
    splits = assign_splits(normalised, options)
    for split, table in splits.items():
        if table.num_rows == 0:
            raise DataError(
                f"the {split} split of {source} has no rows ({sum(t.num_rows for t in splits.values())} "
                "rows in all): give more data, or a larger --validation-fraction / --test-fraction"
            )

    init_ray(train_cpus=1)  # only now: every check above runs without a cluster
    token_stats = {}
    with staged_folder(data_dir, DATASET_FILE) as staging:
        for split, table in splits.items():
            table = pa.table(
                {
                    "row": pa.array(np.arange(table.num_rows)),
                    "text": table["text"],
                    "label": table["label"],
                }
            )
            stats = pretokenize(
                # Blocks of a few thousand rows, so that both tokenizer actors get work.
                ray.data.from_arrow(
                    [table.slice(start, 2048) for start in range(0, table.num_rows, 2048)]
                ),
                staging.join(split),
                tokenizer_path=model,
                text_column="text",
                max_length=options.max_length,
                keep_columns=["row", "label", "text"],
            )
            token_stats[split] = asdict(stats)
            log.info(
                "%s: %d rows, token length p50 %d / p99 %d, %.2f%% truncated at %d",
                split, stats.rows, stats.length_p50, stats.length_p99,
                100 * stats.truncated_share, options.max_length,
            )  # fmt: skip
        info = DatasetInfo(
            source=source,
            labels=names,
            rows={split: table.num_rows for split, table in splits.items()},
            tokenizer=model,
            tokenizer_sha256=fingerprint,
            max_length=options.max_length,
            stratified_by=stratify,
            seed=options.seed,
            token_stats=token_stats,
        )
        write_info(staging, info)
    return info


def _source_prefix(options: PrepareConfig) -> str:
    return "VADER" if options.dataset == VADER_SOURCE else options.dataset
