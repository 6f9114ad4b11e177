"""A prepared image dataset: the folder `prepare` writes (from an array source such as MNIST or an
IDX folder, an image tree or shards; local, NFS, S3, GCS) of small Parquet rows, and the checks a
run makes of it before any worker starts. Ray Data reads it in training (`images.stream`).

Layout of a prepared dataset folder:
    train/part-000.parquet …       columns id (0..N-1), label (int64), and either image (binary:
                                   raw H×W or H×W×3 uint8 pixels, for MNIST and IDX sources) or
                                   path (an image tree's file, relative to the tree, not copied)
    validation/part-000.parquet …  carved from the training data (stratified, seeded): picks
                                   checkpoints
    test/part-000.parquet …        reported once, for the chosen checkpoint
    dataset.json                   classes, shape, mean/std, row counts, the tree's location;
                                   written last, so it marks a complete dataset

Every split is written in a seeded random order with ids in that order, so its first N ids
(`--limit-*-rows`) are a fair sample even when the source was sorted by class; training reshuffles
every epoch (`images.stream`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raytrain_common.storage import OutputMarker, StoragePath, files_of

log = logging.getLogger(__name__)

DATASET_FILE = "dataset.json"
SPLITS = ("train", "val", "test")
FORMAT = 3  # 3: rows carry a position (`row`) and a stable `id`; 2 had one dense `id`


# The folder each split is written to: `validation/` for the validation split, as in the text
# pipelines and Hugging Face datasets (folders written with `val/` before are still read).
SPLIT_FOLDERS = {"train": "train", "val": "validation", "test": "test"}
FORMER_VAL_FOLDER = "val"


def split_folder(data_dir: StoragePath, split: str, files_in: str = "") -> StoragePath:
    """Where a prepared split's files are: `validation/` for "val" (under the generation
    dataset.json names, `files_in`, on an object store), or the `val/` of a folder an earlier
    version prepared (read as it is; `prepare --force` writes `validation/`)."""
    root = files_of(data_dir, files_in)
    folder = root.join(SPLIT_FOLDERS[split])
    if split == "val" and not folder.exists():
        former = root.join(FORMER_VAL_FOLDER)
        if former.exists():
            return former
    return folder


class DataError(ValueError):
    """Data a run cannot train on; the message names the file, the problem and the fix."""


@dataclass(frozen=True)
class DatasetInfo:
    source: str
    num_classes: int
    height: int
    width: int
    mean: float | list[float]  # one per channel for RGB
    std: float | list[float]
    train_rows: int
    test_rows: int
    val_rows: int = 0  # 0: prepared by a version without a validation split (refused by train)
    channels: int = 1
    class_names: list[str] | None = None  # an image tree's folder names; None: the labels' digits
    notes: dict[str, Any] = field(default_factory=dict)  # how an image tree was read and split
    image_root: str | None = None  # an image tree's location; its splits list files under it
    format: int = 1  # FORMAT since rows carry stable ids; 1 and 2: earlier versions
    fingerprint: str = ""  # of every split's (id, label) rows: what a checkpoint was trained on
    bad_files: int = 0  # files of an image tree left out by prepare's check (bad_files.csv)
    shards: bool = False  # rows hold each image's file, encoded as it was (prepare --shards)
    files_in: str = ""  # the splits' folder under the data folder ("": beside dataset.json)

    @property
    def content(self) -> str:
        """What a row holds of its image: `path` (an image tree's file, read where it is),
        `encoded` (that file's bytes, in a shard) or `image` (raw pixels: MNIST, IDX)."""
        return "encoded" if self.shards else "path" if self.image_root else "image"

    @property
    def decodes_files(self) -> bool:
        """Training decodes each image from its original file every epoch (a tree or its
        shards), so any --image-size needs no new prepare."""
        return self.content != "image"

    def class_name(self, label: int) -> str:
        return self.class_names[label] if self.class_names else str(label)


MARKER = OutputMarker.of(DATASET_FILE, DatasetInfo)  # written last by prepare


@dataclass(frozen=True)
class Split:
    images: np.ndarray  # (N, H, W) or (N, H, W, 3) uint8
    labels: np.ndarray  # (N,) int64
    ids: np.ndarray | None = None  # (N,) int64 stable ids; None: the source's own row numbers

    def __post_init__(self) -> None:
        if self.ids is None:
            object.__setattr__(self, "ids", np.arange(len(self.labels), dtype=np.int64))

    def take(self, rows: np.ndarray) -> Split:
        return Split(self.images[rows], self.labels[rows], self.ids[rows])  # type: ignore[index]


def inspect_dataset(data_dir: StoragePath, prepare_command: str = "prepare") -> DatasetInfo:
    """Check a prepared dataset before any worker starts from its marker and its Parquet footers
    alone (schema, row counts, column statistics), never its rows: a train start costs the same
    at 100 M images as at 10 k (one footer per 10,000 rows). Errors name `prepare_command`, the
    pipeline's own command that writes the folder, as the fix."""
    marker = data_dir.join(DATASET_FILE)
    if not marker.exists():
        raise DataError(
            f"no prepared dataset at {data_dir} ({DATASET_FILE} is missing): run "
            f"`{prepare_command} --data-dir {data_dir}` first"
        )
    info = DatasetInfo(**json.loads(marker.read_text()))
    if info.format != FORMAT or not info.val_rows:
        raise DataError(
            f"{data_dir} was prepared by an earlier version (rows without stable ids): rerun "
            f"`{prepare_command} --force --data-dir {data_dir}`"
        )
    expected_rows = {"train": info.train_rows, "val": info.val_rows, "test": info.test_rows}
    for split in SPLITS:
        folder = split_folder(data_dir, split, info.files_in)
        files = folder.list_files(".parquet")
        if not files:
            raise DataError(f"no Parquet files in {folder}: rerun `{prepare_command} --force`")
        rows = sum(check_parquet_file(file, info, prepare_command) for file in files)
        if rows != expected_rows[split]:
            raise DataError(
                f"{folder} holds {rows} rows in {len(files)} Parquet file(s), but {DATASET_FILE} "
                f"says {expected_rows[split]}: a file is missing, added or cut short; rerun "
                f"`{prepare_command} --force --data-dir {data_dir}`"
            )
    return info


def check_parquet_file(file: StoragePath, info: DatasetInfo, prepare_command: str) -> int:
    """A prepared file's footer checked against dataset.json; its number of rows."""
    try:
        with file.filesystem.open_input_file(file.path) as stream:
            metadata = pq.ParquetFile(stream).metadata
    except (pa.ArrowInvalid, OSError) as error:
        raise DataError(
            f"{file} cannot be read as Parquet ({str(error).splitlines()[0]}): rerun "
            f"`{prepare_command} --force`"
        ) from error
    check_columns(file, metadata.schema.to_arrow_schema(), info, prepare_command)
    labels = column_range(file, metadata, "label", prepare_command)
    if labels is not None and (labels[0] < 0 or labels[1] >= info.num_classes):
        raise DataError(
            f"{file} has labels {labels[0]}..{labels[1]}, outside 0..{info.num_classes - 1} "
            f"(num_classes={info.num_classes} in {DATASET_FILE})"
        )
    if info.content == "image":
        check_pixel_lengths(file, metadata, info, prepare_command)
    return int(metadata.num_rows)


def check_columns(
    file: StoragePath, schema: pa.Schema, info: DatasetInfo, prepare_command: str
) -> None:
    content = info.content
    expected = {"row": pa.types.is_integer, "id": pa.types.is_integer, "label": pa.types.is_integer}
    expected[content] = pa.types.is_string if content == "path" else pa.types.is_binary
    kind = "string" if content == "path" else "binary"
    missing = set(expected) - set(schema.names)
    if missing:
        raise DataError(
            f"{file} lacks column(s) {sorted(missing)} (it has {schema.names}); expected "
            f"row and id (integers), {content} and label (integer class id): rerun "
            f"`{prepare_command} --force`"
        )
    wrong = [name for name, test in expected.items() if not test(schema.field(name).type)]
    if wrong:
        raise DataError(
            f"{file}: column(s) {wrong} have type(s) "
            f"{[str(schema.field(name).type) for name in wrong]}; expected integer row, id "
            f"and label, and {kind} {content}"
        )


def column_range(
    file: StoragePath, metadata: Any, name: str, prepare_command: str
) -> tuple[Any, Any] | None:
    """(least, greatest) value of a column over the file's row groups, from the statistics its
    writer stored (pyarrow, Spark and Ray Data store them by default); None for an empty file."""
    index = metadata.schema.to_arrow_schema().get_field_index(name)
    lows, highs = [], []
    for group in range(metadata.num_row_groups):
        row_group = metadata.row_group(group)
        if row_group.num_rows == 0:
            continue
        statistics = row_group.column(index).statistics
        if statistics is None or not statistics.has_min_max:
            raise DataError(
                f"{file} has no statistics for its {name!r} column (written without them), "
                "which the check before training reads instead of the rows: rerun "
                f"`{prepare_command} --force`"
            )
        lows.append(statistics.min)
        highs.append(statistics.max)
    return (min(lows), max(highs)) if lows else None


def check_pixel_lengths(
    file: StoragePath, metadata: Any, info: DatasetInfo, prepare_command: str
) -> None:
    """Pixel rows hold height × width × channels bytes each: checked on the column's least and
    greatest values (its statistics); `pixels_from_bytes` checks every row as it decodes."""
    extremes = column_range(file, metadata, "image", prepare_command)
    expected = info.height * info.width * info.channels
    lengths = sorted({len(value) for value in extremes or ()})
    if lengths and lengths != [expected]:
        raise DataError(
            f"{file} holds images of {lengths[0]}..{lengths[-1]} bytes; "
            f"expected {info.height}×{info.width}×{info.channels} = "
            f"{expected} bytes each (uint8 pixels, row-major)"
        )
