"""Image datasets as a pipeline copies them unchanged: `prepare` any image source into a folder of
small Parquet rows, check that folder before a run, and stream it to the workers with Ray Data.

A pipeline reaches it through a few calls in plain view:

    info = images.prepare.prepare(source, data_dir, download_root, named_sources={...})
    info = images.inspect_dataset(data_dir, prepare_command="my-vision prepare")
    data = images.stream.ImageData(data_dir.uri, asdict(info), run_dir.uri, seed, augment=...)
    TorchTrainer(..., datasets={"train": data.train, "train_rest_of_epoch": data.rest_of_epoch,
                                "val": data.val})

Modules (one concern each): `files` (one image: open, check, decode, EXIF, transparency; the
stratified carve), `dataset` (the prepared folder: `DatasetInfo`, `inspect_dataset`), `prepare`
(sources → the folder: array sources, IDX), `tree` (an image tree, streamed through Ray Data:
listing, checking every file, bad-file accounting, the carve by path hash, shards),
`shards` (WebDataset tars and Parquet of encoded images as a source), `decode` (the Ray Data batch
functions that fetch and decode), `stream` (the training and evaluation datasets: a fresh order
every epoch, the rest of a resumed epoch).
"""

from __future__ import annotations

from raytrain_common.images.dataset import (
    DATASET_FILE,
    DataError,
    DatasetInfo,
    Split,
    inspect_dataset,
    split_folder,
)
from raytrain_common.images.decode import SKIPPED_LABEL
from raytrain_common.images.files import IMAGE_SUFFIXES, RandomResizedCrop, load_image

__all__ = [
    "DATASET_FILE",
    "IMAGE_SUFFIXES",
    "SKIPPED_LABEL",
    "DataError",
    "DatasetInfo",
    "RandomResizedCrop",
    "Split",
    "inspect_dataset",
    "load_image",
    "split_folder",
]
