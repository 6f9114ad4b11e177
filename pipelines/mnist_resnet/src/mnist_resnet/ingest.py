"""How images reach the training workers: Ray Data datasets over the prepared folder, handed to
`TorchTrainer(datasets=...)` and read in `train.py` with
`get_dataset_shard(...).iter_torch_batches`.

A prepared split is Parquet of small rows, `row` (0..N-1, the position), `id` (stable: a file's path
hash), `label`, and either `image` (raw pixels: MNIST and the IDX sources), `path` (an image
tree's file, relative to the tree, which stays where it is: a local disk, NFS, S3 or GCS) or
`encoded` (that file's bytes as they are, with `prepare --shards`). Each
epoch, Ray Data tasks read those rows in a fresh order, read and decode the files (resize, crop),
augment, and stream the pixels to the workers; no node holds a copy of the split. On a cluster with
CPU-only nodes those tasks run there: the nodes --ingest-node-labels selects (Ray's node labels; see
deploy/rayjob/mnist_resnet.yaml).

Data order, a fresh one every epoch, whatever order the source was written in (an image tree
read class by class, a CSV sorted by date). `prepare` wrote every split's rows in a seeded uniform
permutation, ROWS_PER_FILE to a Parquet file, so each file is a uniform sample of the split; an
epoch needs only a fresh order of files and a fresh order within what streams, never a pass over
the whole split before the first batch:
- The files are read in a fresh order every epoch (`read_parquet(shuffle=FileShuffleConfig(...))`,
  reseeded every execution; `randomize_block_order` would first read every block).
- An image tree's rows (row, id, path, label), ~100 bytes each, are then permuted in windows of
  MIX_ROWS (8 files' worth, ~8 MB) before any image is read: Ray Data draws a random key per row
  (`expressions.random`, reseeded every execution) and one task sorts each window by it
  (`mix_window`). The first batch waits for one window, not for the split: `nox -s
  bench_mnist_order` measured 0.3-1.8 s at 1.28 M and 12.8 M rows, where the shuffle took 1.3-9.6 s,
  growing with the list. Per epoch each row is read once (~130 MB of rows at 1.28 M images, ~10 GB
  at 100 M, streamed) and sorted within its window. How close to a uniform permutation: a split of
  up to MIX_ROWS rows is one window, a uniform permutation; past that, a row's position is uniform
  over the epoch (its file's place is) and each batch is a uniform draw from its window, whose
  files are each a uniform sample of the split, so a batch's class mix is a uniform permutation's
  (the bench: 223-230 classes among a first batch of 256 from 1,000, the shuffle 227-232). What
  differs: rows of one file (10,000) always train within the same window of an epoch, beside 7
  other files drawn afresh each epoch (of 128 files at 1.28 M images, of 10,000 at 100 M). An
  all-to-all `random_shuffle` of the list (mnist-resnet 0.15 and before) was exact, but held the
  whole list in the object store before the first image was read: ~10 GB at 100 M images, over
  the RayJob's ingest pods.
- Shard rows (`prepare --shards`: each image's file, encoded, in the Parquet) are mixed the same
  way in windows of SHARD_MIX_ROWS (4 shards of 1,000 images: ~400 MB of ImageNet's JPEGs), then
  decoded (`pixels_from_shards`): a shard is read whole once an epoch, one request on S3.
- Pixel rows (MNIST and the IDX sources: the images are in the Parquet) are large, so they are
  mixed after decoding, in a local shuffle buffer of LOCAL_SHUFFLE_ROWS in each worker
  (`iter_torch_batches(local_shuffle_buffer_size=...)`, seeded by the epoch): memory of a few
  blocks whatever the split's size.

Exactly once per epoch: the epoch trains floor(N / global batch) full global batches; the equal
split (`streaming_split(equal=True)`, DataConfig's default) gives every worker the same number of
rows and `drop_last` the same number of batches, so all ranks step together on any worker count, and
the N mod (global batch) rows left over are a different few each epoch. Every batch carries its
rows' positions (`row`); each rank marks them in a bitmap of the split (N/8 bytes, `EpochRows`),
which every checkpoint saves merged over the ranks. A resumed epoch (a killed worker, a preempted
node, a rerun, on any worker count) reads the `REST_OF_EPOCH` dataset: the split without the rows
marked, so every row is trained once in the epoch. Ray Data has no resumable iterator in open
source; this bitmap is the smallest state that gives that property.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import ray
import ray.data
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from ray.data import FileShuffleConfig
from ray.data.collate_fn import NumpyBatchCollateFn
from ray.data.expressions import random as random_column

from mnist_resnet.data import DATASET_FILE, DatasetInfo, Split, split_folder
from mnist_resnet.data_config import REST_OF_EPOCH, TRAIN, VAL
from mnist_resnet.transforms import (
    augment,
    bits_set,
    drop_trained,
    mix_window,
    pixels_from_bytes,
    pixels_from_files,
    pixels_from_shards,
)
from raytrain_common.checkpoint import newest_complete_checkpoint
from raytrain_common.configs import ConfigError
from raytrain_common.storage import StoragePath, resolve_storage

if TYPE_CHECKING:  # the run's record and context import the dataset, which imports this module
    from mnist_resnet.run_state import RunState, WorkerContext

POSITION_FILE = "epoch_rows.npz"  # beside state.pt in every checkpoint: the epoch and its bitmap
LOCAL_SHUFFLE_ROWS = 4096  # pixel rows mixed in each worker's buffer (3 MiB of MNIST)
DECODE_BATCH = 256  # rows per Ray Data decode task batch: a few MB of pixels at the largest side
MIX_ROWS = 80_000  # an image tree's rows permuted together: 8 of prepare's files, ~8 MB
DECODE_TASK_ROWS = 1024  # rows of a mixed window one decode task takes: 4 decode batches
SHARD_MIX_ROWS = 4_000  # shard rows (an encoded image each) permuted together: 4 shards
MIX_KEY = "_mix"  # the random column a window is sorted by, dropped by mix_window


class DataShardError(RuntimeError):
    """A worker's shard did not hold the rows its epoch needs."""


class DataChangedError(ValueError):
    """A run asked to resume on prepared data other than the data it was trained on."""


# ---------------------------------------------------------------------------------------------
# The datasets
# ---------------------------------------------------------------------------------------------


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
    augment: str = "none"
    crop_scale: float = 0.08  # the photo recipe's smallest crop, as a share of the area
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
        folder = split_folder(resolve_storage(self.data_dir), split)
        files = [file.path for file in folder.list_files(".parquet")]
        rows = ray.data.read_parquet(files, filesystem=folder.filesystem, shuffle=file_order)
        return rows if limit is None else rows.filter(expr=f"row < {int(limit)}")

    def decoded(self, rows: ray.data.Dataset, training: bool = False) -> ray.data.Dataset:
        """Rows → {row, label, image: uint8 (C, H, W), decode_node}, decoded in Ray Data tasks;
        an image tree's or its shards' training rows also carry `error`, why a file was skipped
        (TrainingBatch), and are cropped by the photo recipe when it is the run's augmentation."""
        info = DatasetInfo(**self.info)
        if info.content == "image":
            pixels = {"height": info.height, "width": info.width, "channels": info.channels}
            return rows.map_batches(pixels_from_bytes, batch_size=DECODE_BATCH, fn_kwargs=pixels)
        photo = training and self.augment == "photo"
        options: dict[str, Any] = {
            "side": info.height,
            "channels": info.channels,
            "error_column": training,
            "crop_scale": self.crop_scale if photo else None,
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
        if self.augment in ("crop", "crop-flip"):  # "photo" crops while decoding
            pad = max(1, self.info["height"] // 8)
            flip = self.augment == "crop-flip"
            decoded = decoded.map_batches(
                augment, batch_size=DECODE_BATCH, fn_kwargs={"pad": pad, "flip": flip}
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


def epoch_seed(seed: int, epoch: int) -> int:
    """One 32-bit seed per (run seed, epoch)."""
    return int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0])


def read_arrays(data: ImageData, split: str, limit: int | None = None) -> dict[str, np.ndarray]:
    """A whole decoded split in this process's memory, in row order: for the single-process tools
    (the baseline, bench, predict's picture), never for training."""
    parts = list(data.split(split, limit).iter_batches(batch_size=4096, batch_format="numpy"))
    positions = np.concatenate([part["row"] for part in parts])
    order = np.argsort(positions)
    return {
        name: np.concatenate([part[name] for part in parts])[order] for name in ("image", "label")
    }


def read_split_arrays(data_dir: StoragePath, split: str, limit: int | None = None) -> Split:
    """A whole split decoded into this process's memory as (N, H, W) or (N, H, W, C) images, in
    row order, read through Ray Data: for the single-process tools (baseline, bench, predict's
    picture), never for training."""
    from raytrain_common.ray_start import init_ray

    init_ray(train_cpus=1)
    info = DatasetInfo(**json.loads(data_dir.join(DATASET_FILE).read_text()))
    data = ImageData(data_dir.uri, asdict(info), run_dir="", seed=0)
    arrays = read_arrays(data, split, limit)
    images = arrays["image"]
    images = images[:, 0] if info.channels == 1 else images.transpose(0, 2, 3, 1)
    return Split(np.ascontiguousarray(images), arrays["label"])


# ---------------------------------------------------------------------------------------------
# Which rows an epoch has trained
# ---------------------------------------------------------------------------------------------


class EpochRows:
    """The rows of the epoch in progress that this rank trained on, as a bitmap of the split's ids
    (N/8 bytes: 160 KB at 1.28 M images). Rank 0 also holds the rows trained before a resume."""

    def __init__(self, num_rows: int, carried: np.ndarray | None = None) -> None:
        self.bits = np.zeros((num_rows + 7) // 8, dtype=np.uint8)
        if carried is not None:
            self.bits |= carried
        self.marked = self.count()

    def count(self) -> int:
        return int(np.unpackbits(self.bits).sum())

    def mark(self, ids: np.ndarray) -> None:
        if bits_set(self.bits, ids).any():
            raise DataShardError(f"rows {ids[bits_set(self.bits, ids)][:5]} came twice")
        np.bitwise_or.at(self.bits, ids >> 3, np.left_shift(1, ids & 7).astype(np.uint8))
        self.marked += len(ids)

    def merged(self, device: torch.device) -> np.ndarray:
        """Every rank's bitmap in one (a collective: every rank calls it). Ranks train disjoint
        rows, so a sum of the bitmaps is their union; the counts check that it is."""
        if not dist.is_initialized():
            return self.bits.copy()
        bits = torch.from_numpy(self.bits.copy()).to(device)  # all_reduce writes in place
        marked = torch.tensor([self.marked], device=device, dtype=torch.int64)
        dist.all_reduce(bits)
        dist.all_reduce(marked)
        union = bits.cpu().numpy()
        if int(np.unpackbits(union).sum()) != int(marked.item()):
            raise DataShardError(
                f"the ranks' shards overlapped: {int(marked.item())} rows marked, "
                f"{int(np.unpackbits(union).sum())} distinct"
            )
        return union


class TrainingRows:
    """Every training row once per epoch, on any worker count and across resumes, behind one object.
    It names the dataset an epoch reads (the whole split in a fresh order, or only the rows a
    resumed epoch has not trained: REST_OF_EPOCH), marks each batch's rows in this rank's bitmap
    (`EpochRows`, which every checkpoint saves merged over the ranks), keeps the --record-row-ids
    audit and where rank 0's rows were decoded, and checks at the epoch's end that the rank's shard
    held exactly its steps and the ranks together every row once."""

    def __init__(self, context: WorkerContext) -> None:
        self.context = context
        self.audit = RowIdAudit(context.run_dir, context.rank, context.config.record_row_ids)
        self.marked = EpochRows(context.train_rows)

    @staticmethod
    def dataset(run: RunState) -> str:
        """The dataset an epoch reads: the whole split in a fresh order, or the rows a resumed
        epoch has not trained yet."""
        return REST_OF_EPOCH if run.resumes_mid_epoch else TRAIN

    def counted(
        self, batches: Iterable[dict[str, Any]], run: RunState, epoch: int
    ) -> Iterator[dict[str, Any]]:
        """This rank's batches of `epoch` (from the run's position in it), each marked as it is
        handed out: a checkpoint after step s holds exactly the rows of steps 1..s."""
        context = self.context
        position = run.position if run.resumes_mid_epoch else None
        carried = position.trained_rows if position is not None else None
        on_rank_zero = carried.numpy() if carried is not None and context.rank == 0 else None
        self.marked = EpochRows(context.train_rows, on_rank_zero)  # rank 0 carries: counted once
        steps_left, taken = epoch * context.steps - run.step, 0
        for batch in batches:
            rows = batch["row"].numpy()
            self.marked.mark(rows)
            self.audit.add(rows)
            if context.rank == 0:
                count_decode_nodes(run.decoded_on, batch["decode_node"].numpy())
            taken += 1
            yield batch
        if taken != steps_left:
            raise DataShardError(
                f"rank {context.rank}'s shard of epoch {epoch} held {taken} steps, not "
                f"{steps_left}: the dataset changed under the run?"
            )

    def trained(self) -> np.ndarray:
        """The epoch's rows trained by every rank, a bitmap (a collective: every rank calls)."""
        return self.marked.merged(ray.train.torch.get_device())

    def check_epoch_complete(self) -> None:
        """At an epoch's end: the ranks together trained every row of its full batches once (a
        collective)."""
        distinct = int(np.unpackbits(self.trained()).sum())
        if distinct != self.context.rows_per_epoch:
            raise DataShardError(
                f"epoch trained {distinct} distinct rows, not {self.context.rows_per_epoch}"
            )


def count_decode_nodes(counts: dict[str, int], node_tags: np.ndarray) -> None:
    """Add one batch's rows to `counts`, by the node (its id's first 15 hex digits) that decoded
    them: where the data work ran."""
    for tag, rows in zip(*np.unique(node_tags, return_counts=True), strict=True):
        key = f"{int(tag):015x}"
        counts[key] = counts.get(key, 0) + int(rows)


class RowIdAudit:
    """With --record-row-ids, each rank writes the rows it trained on with every checkpoint, to
    <run>/row_ids/epoch-E/step-S-rank-R.npy: steps lost to a failure (trained after the last
    checkpoint, then redone) are never written, so the files count each row's training in the run
    that was kept."""

    def __init__(self, run_dir: StoragePath, rank: int, enabled: bool) -> None:
        self.folder, self.rank, self.enabled = run_dir.join("row_ids"), rank, enabled
        self.rows: list[np.ndarray] = []

    def add(self, rows: np.ndarray) -> None:
        if self.enabled:
            self.rows.append(rows.copy())

    def write(self, epoch: int, step: int) -> None:
        if not self.enabled:
            return
        rows = np.concatenate(self.rows) if self.rows else np.zeros(0, dtype=np.int64)
        buffer = io.BytesIO()
        np.save(buffer, rows)
        self.folder.join(f"epoch-{epoch}", f"step-{step:07d}-rank-{self.rank}.npy").write_bytes(
            buffer.getvalue()
        )
        self.rows = []


@dataclass(frozen=True)
class SavedPosition:
    """A checkpoint's POSITION_FILE: the epoch in progress and the bitmap of its rows trained, with
    what the driver checks before a resume (`check_resumable`): the fingerprint of the prepared
    data those rows belong to ("" before mnist-resnet 0.14) and the model's --model-width (64
    before it existed). Small, so the driver reads it without the checkpoint's weights."""

    epoch: int
    trained: np.ndarray
    fingerprint: str = ""
    model_width: int = 64

    def to_bytes(self) -> bytes:
        stream = io.BytesIO()
        np.savez(
            stream,
            epoch=np.array(self.epoch),
            trained=self.trained,
            fingerprint=np.array(self.fingerprint),
            model_width=np.array(self.model_width),
        )
        return stream.getvalue()


def saved_position(run_dir: StoragePath) -> SavedPosition | None:
    """The POSITION_FILE of the run's newest complete checkpoint; None before the first."""
    checkpoint = newest_complete_checkpoint(run_dir)
    if checkpoint is None:
        return None
    saved = resolve_storage(run_dir.uri_for(checkpoint.path)).join(POSITION_FILE)
    if not saved.exists():
        return None
    with np.load(io.BytesIO(saved.read_bytes()), allow_pickle=False) as arrays:
        return SavedPosition(
            int(arrays["epoch"]),
            arrays["trained"],
            str(arrays["fingerprint"]) if "fingerprint" in arrays else "",
            int(arrays["model_width"]) if "model_width" in arrays else 64,
        )


def check_resumable(run_dir: StoragePath, info: dict[str, Any], model_width: int) -> None:
    """Refuse, before any worker starts, to resume a run on other prepared data or another model
    than its newest checkpoint's.

    Other data (a tree edited and prepared again): the epoch's trained-rows bitmap, its step count
    and the schedule are all counted in that data's rows, so a resume would silently train some
    rows twice and skip others. The same tree prepared again gives the same fingerprint (ids come
    from paths, the carve from their hashes) and resumes. Another --model-width: the saved weights
    do not fit the model, and every worker would fail loading them, restart and fail again."""
    saved = saved_position(run_dir)
    if saved is not None and saved.model_width != model_width:
        raise ConfigError(
            f"{run_dir.uri} was trained with --model-width {saved.model_width}, not "
            f"{model_width}: its checkpoints hold weights of that width. Continue it with "
            f"--model-width {saved.model_width}, or train this width as a new run (another "
            "--run-name)"
        )
    trained_on = saved.fingerprint if saved is not None else ""
    if trained_on and info.get("fingerprint") and trained_on != info["fingerprint"]:
        raise DataChangedError(
            f"{run_dir.uri} was trained on prepared data {trained_on}, but its --data-dir now "
            f"holds {info['fingerprint']} ({info['train_rows']} training rows): the data changed "
            "since (a tree edited and prepared again), and resuming would count the epoch's rows "
            "wrong. Train the changed data as a new run (another --run-name), or prepare the "
            "data as it was to continue this one"
        )
