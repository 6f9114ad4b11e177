"""How images reach the training workers: Ray Data datasets over the prepared folder, handed to
`TorchTrainer(datasets=...)` and read in a pipeline's loop with
`get_dataset_shard(...).iter_torch_batches`; which rows an epoch reads, so that each is trained
once, is `raytrain_common.ingest.epochs`'.

A prepared split is Parquet of small rows, `row` (0..N-1, the position), `id` (stable: a file's path
hash), `label`, and either `image` (raw pixels: MNIST and the IDX sources), `path` (an image
tree's file, relative to the tree, which stays where it is: a local disk, NFS, S3 or GCS) or
`encoded` (that file's bytes as they are, with `prepare --shards`). Each
epoch, Ray Data tasks read those rows in a fresh order, read and decode the files (resize, crop),
augment, and stream the pixels to the workers; no node holds a copy of the split. On a cluster with
CPU-only nodes those tasks run there: the nodes --ingest-node-labels selects (Ray's node labels,
`raytrain_common.ingest.data_config`).

Data order, a fresh one every epoch, whatever order the source was written in (an image tree
read class by class, a CSV sorted by date). `prepare` wrote every split's rows in a seeded uniform
permutation, `prepare.ROWS_PER_FILE` to a Parquet file, so each file is a uniform sample of the split; an
epoch needs only a fresh order of files and a fresh order within what streams, never a pass over
the whole split before the first batch:
- The files are read in a fresh order every epoch (`read_parquet(shuffle=FileShuffleConfig(...))`,
  reseeded every execution; `randomize_block_order` would first read every block).
- An image tree's rows (row, id, path, label), ~100 bytes each, are then permuted in windows of
  MIX_ROWS (8 files' worth, ~8 MB) before any image is read: Ray Data draws a random key per row
  (`expressions.random`, reseeded every execution) and one task sorts each window by it
  (`mix_window`). The first batch waits for one window, not for the split: the image pipeline's
  `bench_epoch_order` measured 0.3-1.8 s at 1.28 M and 12.8 M rows, where the shuffle took 1.3-9.6 s,
  growing with the list. Per epoch each row is read once (~130 MB of rows at 1.28 M images, ~10 GB
  at 100 M, streamed) and sorted within its window. How close to a uniform permutation: a split of
  up to MIX_ROWS rows is one window, a uniform permutation; past that, a row's position is uniform
  over the epoch (its file's place is) and each batch is a uniform draw from its window, whose
  files are each a uniform sample of the split, so a batch's class mix is a uniform permutation's
  (the bench: 223-230 classes among a first batch of 256 from 1,000, the shuffle 227-232). What
  differs: rows of one file (10,000) always train within the same window of an epoch, beside 7
  other files drawn afresh each epoch (of 128 files at 1.28 M images, of 10,000 at 100 M). An
  all-to-all `random_shuffle` of the list (what this replaced) was exact, but held the
  whole list in the object store before the first image was read: ~10 GB at 100 M images, over
  the RayJob's ingest pods.
- Shard rows (`prepare --shards`: each image's file, encoded, in the Parquet) are mixed the same
  way in windows of SHARD_MIX_ROWS (4 shards of 1,000 images: ~400 MB of ImageNet's JPEGs), then
  decoded (`pixels_from_shards`): a shard is read whole once an epoch, one request on S3.
- Pixel rows (MNIST and the IDX sources: the images are in the Parquet) are large, so they are
  mixed after decoding, in a local shuffle buffer of LOCAL_SHUFFLE_ROWS in each worker
  (`iter_torch_batches(local_shuffle_buffer_size=...)`, seeded by the epoch): memory of a few
  blocks whatever the split's size.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import ray.data
import torch
from ray.data import FileShuffleConfig
from ray.data.collate_fn import NumpyBatchCollateFn
from ray.data.expressions import random as random_column

from raytrain_common.images.dataset import DATASET_FILE, DatasetInfo, Split, split_folder
from raytrain_common.images.decode import pixels_from_bytes, pixels_from_files, pixels_from_shards
from raytrain_common.ingest.data_config import TRAIN, VAL
from raytrain_common.ingest.epochs import saved_position
from raytrain_common.ingest.order import drop_trained, epoch_seed, mix_window
from raytrain_common.storage import StoragePath, resolve_storage

LOCAL_SHUFFLE_ROWS = 4096  # pixel rows mixed in each worker's buffer (3 MiB of MNIST)
DECODE_BATCH = 256  # rows per Ray Data decode task batch: a few MB of pixels at the largest side
MIX_ROWS = 80_000  # an image tree's rows permuted together: 8 of prepare's files, ~8 MB
DECODE_TASK_ROWS = 1024  # rows of a mixed window one decode task takes: 4 decode batches
SHARD_MIX_ROWS = 4_000  # shard rows (an encoded image each) permuted together: 4 shards
MIX_KEY = "_mix"  # the random column a window is sorted by, dropped by mix_window


@dataclass(frozen=True)
class ImageData:
    """Everything that builds the run's datasets; its methods are the dataset factories given to
    `TorchTrainer(datasets=...)`. Ray calls them each time it starts a worker group (the first
    start, and after a failure), so the dataset of a resumed epoch reads the newest checkpoint of
    that moment, the one the workers resume from."""

    data_dir: str
    info: dict[str, Any]  # DatasetInfo as a dict (kept plain: this object is pickled to Ray)
    run_dir: str
    seed: int
    # The training rows' augmentation: `crop_scale`, a random resized crop of the picture while it
    # is decoded (down to that share of its area; None: the centre crop every split gets), then
    # `augment(batch, **augment_kwargs)` on the decoded batches, a pipeline's own recipe (a Ray
    # Data batch function, pickled by reference: keep it in a module free of torch).
    crop_scale: float | None = None
    augment: Callable[..., dict[str, np.ndarray]] | None = None
    augment_kwargs: dict[str, Any] = field(default_factory=dict)
    limit_train_rows: int | None = None
    limit_val_rows: int | None = None
    progress_bars: bool = False  # Ray Data's bars on the console (--verbose)
    mix_rows: int = MIX_ROWS  # an image tree's rows permuted together each epoch

    def rows(
        self, split: str, limit: int | None, file_order: FileShuffleConfig | None = None
    ) -> ray.data.Dataset:
        """The prepared split's rows, the first `limit` ids only when given; its files in a
        random order when `file_order` is given."""
        context = ray.data.DataContext.get_current()  # the factories run in Ray's controller
        context.enable_progress_bars = self.progress_bars
        # Ray 2.60's default Parquet reader (DataSourceV2: ListFiles → ReadFiles) spends 5–7 s
        # planning every execution of a one-file split on this 2-core box; the V1 reader reads it
        # in 0.24–0.44 s (measured: 6,000 rows, warm cluster). Every epoch and every validation
        # executes the dataset anew, so V1 it is, until V2 catches up.
        context.use_datasource_v2 = False
        folder = split_folder(resolve_storage(self.data_dir), split, self.info.get("files_in", ""))
        files = [file.path for file in folder.list_files(".parquet")]
        rows = ray.data.read_parquet(files, filesystem=folder.filesystem, shuffle=file_order)
        return rows if limit is None else rows.filter(expr=f"row < {int(limit)}")

    def decoded(self, rows: ray.data.Dataset, training: bool = False) -> ray.data.Dataset:
        """Rows → {row, label, image: uint8 (C, H, W), decode_node}, decoded in Ray Data tasks;
        an image tree's or its shards' training rows also carry `error`, why a file was skipped
        (TrainingBatch), and are cropped at random when the run asks (`crop_scale`)."""
        info = DatasetInfo(**self.info)
        if info.content == "image":
            pixels = {"height": info.height, "width": info.width, "channels": info.channels}
            return rows.map_batches(pixels_from_bytes, batch_size=DECODE_BATCH, fn_kwargs=pixels)
        options: dict[str, Any] = {
            "side": info.height,
            "channels": info.channels,
            "error_column": training,
            "crop_scale": self.crop_scale if training else None,
        }
        if info.content == "encoded":
            return rows.map_batches(pixels_from_shards, batch_size=DECODE_BATCH, fn_kwargs=options)
        options["root_uri"] = info.image_root
        return rows.map_batches(pixels_from_files, batch_size=DECODE_BATCH, fn_kwargs=options)

    def position(self) -> tuple[int, np.ndarray | None]:
        """(epoch in progress, bitmap of its rows trained) of the run's newest checkpoint;
        (1, None) before the first."""
        saved = saved_position(resolve_storage(self.run_dir))
        if saved is None:
            return 1, None
        return saved.epoch, saved.trained if saved.trained.any() else None

    def shuffled(self, epoch: int, trained: np.ndarray | None = None) -> ray.data.Dataset:
        """The training rows (less those in the bitmap `trained`) in a fresh order every execution
        (every epoch: files, then an image tree's rows in windows; see the module's docstring),
        seeded by the run's seed and the epoch it starts at, so a rerun does not replay the first
        run's orders; then decoded and augmented."""
        seed = epoch_seed(self.seed, epoch)
        file_order = FileShuffleConfig(seed, reseed_after_execution=True)
        rows = self.rows(TRAIN, self.limit_train_rows, file_order)
        if trained is not None:
            rows = rows.map_batches(drop_trained, fn_kwargs={"trained": trained})
        content = DatasetInfo(**self.info).content
        if content != "image":  # path or encoded rows: mixed before decoding
            window = self.mix_rows if content == "path" else SHARD_MIX_ROWS
            keyed = rows.with_column(MIX_KEY, random_column(seed=seed, reseed_after_execution=True))
            mixed = keyed.map_batches(mix_window, batch_size=window, fn_kwargs={"key": MIX_KEY})
            # A window leaves its task as one block, which would be one decode task, decoded
            # whole before its first image came out (the first step 49 s after `train` started
            # at 1.28 M files, against 21 s from shards): Ray Data's streaming repartition (no
            # barrier) hands it on in blocks of DECODE_TASK_ROWS, decoded by tasks side by side.
            rows = mixed.repartition(target_num_rows_per_block=DECODE_TASK_ROWS)
        decoded = self.decoded(rows, training=True)
        if self.augment is not None:
            decoded = decoded.map_batches(
                self.augment, batch_size=DECODE_BATCH, fn_kwargs=self.augment_kwargs
            )
        return decoded

    @property
    def local_shuffle_rows(self) -> int | None:
        """The local shuffle buffer a worker reads pixel rows through (None for an image tree and
        its shards, whose rows were mixed before decoding, and whose decoded images are large)."""
        return None if DatasetInfo(**self.info).decodes_files else LOCAL_SHUFFLE_ROWS

    def train(self) -> ray.data.Dataset:
        """The training split, in a fresh order every epoch."""
        epoch, _ = self.position()
        return self.shuffled(epoch)

    def rest_of_epoch(self) -> ray.data.Dataset:
        """The training rows the newest checkpoint's epoch has not trained yet (read only by a
        run resumed mid-epoch; the whole split otherwise)."""
        epoch, trained = self.position()
        return self.shuffled(epoch + 1_000_000, trained)  # not the order a full epoch draws

    def val(self) -> ray.data.Dataset:
        return self.decoded(self.rows(VAL, self.limit_val_rows))

    def split(self, split: str, limit: int | None = None) -> ray.data.Dataset:
        """Any split decoded, unshuffled: the test split, and the single-process tools."""
        return self.decoded(self.rows(split, limit))


class TrainingBatch(NumpyBatchCollateFn):
    """A training batch as torch tensors (on the CPU: uint8 crosses to the device in `on_device`),
    with `skipped`, the files of the batch that could not be decoded (their rows carry
    SKIPPED_LABEL), as a list of strings: a string column has no tensor form."""

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        errors = batch.pop("error", np.zeros(0, dtype=object))
        tensors: dict[str, Any] = {
            name: torch.from_numpy(np.require(column, requirements=["C", "W"]))
            for name, column in batch.items()
        }
        tensors["skipped"] = [str(error) for error in errors if error]
        return tensors


def read_arrays(data: ImageData, split: str, limit: int | None = None) -> dict[str, np.ndarray]:
    """A whole decoded split in this process's memory, in row order: for the single-process tools
    (a plain-PyTorch baseline, predict's picture), never for training."""
    parts = list(data.split(split, limit).iter_batches(batch_size=4096, batch_format="numpy"))
    positions = np.concatenate([part["row"] for part in parts])
    order = np.argsort(positions)
    return {
        name: np.concatenate([part[name] for part in parts])[order] for name in ("image", "label")
    }


def read_split_arrays(data_dir: StoragePath, split: str, limit: int | None = None) -> Split:
    """A whole split decoded into this process's memory as (N, H, W) or (N, H, W, C) images, in
    row order, read through Ray Data: for the single-process tools (a plain-PyTorch baseline, a
    test's reference), never for training."""
    from raytrain_common.ray_start import init_ray

    init_ray(train_cpus=1)
    info = DatasetInfo(**json.loads(data_dir.join(DATASET_FILE).read_text()))
    data = ImageData(data_dir.uri, asdict(info), run_dir="", seed=0)
    arrays = read_arrays(data, split, limit)
    images = arrays["image"]
    images = images[:, 0] if info.channels == 1 else images.transpose(0, 2, 3, 1)
    return Split(np.ascontiguousarray(images), arrays["label"])
