"""Every training row exactly once per epoch, on any worker count and across resumes: what Ray
Data's open-source streaming split lacks (a resumable iterator), built on row positions.

Exactly once per epoch: the epoch trains floor(N / global batch) full global batches; the equal
split (`streaming_split(equal=True)`, DataConfig's default) gives every worker the same number of
rows and `drop_last` the same number of batches, so all ranks step together on any worker count, and
the N mod (global batch) rows left over are a different few each epoch. Every batch carries its
rows' positions (`row`); each rank marks them in a bitmap of the split (N/8 bytes, `EpochRows`),
which every checkpoint saves merged over the ranks. A resumed epoch (a killed worker, a preempted
node, a rerun, on any worker count) reads the `REST_OF_EPOCH` dataset: the split without the rows
marked, so every row is trained once in the epoch. Ray Data has no resumable iterator in open
source; this bitmap is the smallest state that gives that property.

The pieces: `EpochRows` (a rank's bitmap), `TrainingRows` (the dataset an epoch reads, each batch
marked as it is handed out, the epoch's end checked), `SavedPosition` (a checkpoint's record of the
epoch and its bitmap, with the prepared data's fingerprint and the settings a resume must match;
read by the driver and by the workers alike, `saved_position`) and `check_resumable` (the driver's
refusal to resume on changed data or settings). `RowIdAudit` writes each rank's rows with every
checkpoint when asked (--record-row-ids), for tests and audits.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray.train.torch
import torch
import torch.distributed as dist

from raytrain_common.checkpoint import newest_complete_checkpoint
from raytrain_common.configs import ConfigError
from raytrain_common.ingest.data_config import REST_OF_EPOCH, TRAIN
from raytrain_common.ingest.order import bits_set
from raytrain_common.storage import StoragePath, resolve_storage

POSITION_FILE = "epoch_rows.npz"  # beside the weights in every checkpoint: the epoch, its bitmap


class DataShardError(RuntimeError):
    """A worker's shard did not hold the rows its epoch needs."""


class DataChangedError(ValueError):
    """A run asked to resume on prepared data other than the data it was trained on."""


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
    (`EpochRows`, which every checkpoint saves merged over the ranks: `trained`), keeps the
    --record-row-ids audit and where rank 0's rows were decoded, and checks at the epoch's end
    that the rank's shard held exactly its steps and the ranks together every row once."""

    def __init__(
        self,
        run_dir: StoragePath,
        rank: int,
        train_rows: int,
        steps_per_epoch: int,
        global_batch_size: int,
        record_row_ids: bool = False,
    ) -> None:
        self.rank, self.train_rows = rank, train_rows
        self.steps_per_epoch, self.global_batch_size = steps_per_epoch, global_batch_size
        self.audit = RowIdAudit(run_dir, rank, record_row_ids)
        self.marked = EpochRows(train_rows)
        self.carried: np.ndarray | None = None  # the resumed epoch's rows trained before the stop
        self.decoded_on: dict[str, int] = {}  # rank 0's rows by the node that decoded them

    @property
    def rows_per_epoch(self) -> int:
        """Rows an epoch trains: its full global batches (the rest wait for another epoch)."""
        return self.steps_per_epoch * self.global_batch_size

    def state_dict(self, step: int) -> dict[str, Any]:
        """Where the run is in its epochs after its `step`, for a checkpoint (a collective: every
        rank calls it): the epoch in progress and the bitmap of its rows trained by every rank, or,
        at an epoch's end, the epoch checked complete and the next one with none trained; and
        where rank 0's rows were decoded."""
        epoch = (step - 1) // self.steps_per_epoch + 1
        if step % self.steps_per_epoch == 0:
            self.check_epoch_complete()
            epoch, trained = epoch + 1, np.zeros(0, dtype=np.uint8)
        else:
            trained = self.trained()
        return {"epoch": epoch, "trained": trained, "decoded_on": dict(self.decoded_on)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """What the checkpoint resumed holds of the epoch: `trained`, the bitmap of its rows
        trained before the stop (None or empty: a fresh epoch), and `decoded_on`; a resumed epoch
        reads and counts only the rest."""
        trained = state.get("trained")
        self.carried = trained if trained is not None and len(trained) else None
        self.decoded_on = dict(state.get("decoded_on") or {})

    def write_audit(self, step: int) -> None:
        """With --record-row-ids: the ids of the rows this rank trained since the last checkpoint,
        written with the checkpoint after the run's `step`."""
        self.audit.write((step - 1) // self.steps_per_epoch + 1, step)

    def dataset(self) -> str:
        """The dataset an epoch reads: the whole split in a fresh order, or the rows a resumed
        epoch has not trained yet."""
        return REST_OF_EPOCH if self.carried is not None else TRAIN

    def counted(
        self, batches: Iterable[dict[str, Any]], epoch: int, step: int
    ) -> Iterator[dict[str, Any]]:
        """This rank's batches of `epoch`, from the run's `step` (steps done over all epochs),
        each marked as it is handed out: a checkpoint after step s holds exactly the rows of
        steps 1..s. The rows carried from a resumed epoch are spent by its first call."""
        carried = self.carried if self.rank == 0 else None  # rank 0 carries: counted once
        self.marked, self.carried = EpochRows(self.train_rows, carried), None
        steps_left, taken = epoch * self.steps_per_epoch - step, 0
        for batch in batches:
            rows = batch["row"].numpy()
            self.marked.mark(rows)
            self.audit.add(rows)
            if self.rank == 0 and "decode_node" in batch:
                count_decode_nodes(self.decoded_on, batch["decode_node"].numpy())
            taken += 1
            yield batch
        if taken != steps_left:
            raise DataShardError(
                f"rank {self.rank}'s shard of epoch {epoch} held {taken} steps, not "
                f"{steps_left}: the dataset changed under the run?"
            )

    def trained(self) -> np.ndarray:
        """The epoch's rows trained by every rank, a bitmap (a collective: every rank calls)."""
        return self.marked.merged(ray.train.torch.get_device())

    def check_epoch_complete(self) -> None:
        """At an epoch's end: the ranks together trained every row of its full batches once (a
        collective)."""
        distinct = int(np.unpackbits(self.trained()).sum())
        if distinct != self.rows_per_epoch:
            raise DataShardError(
                f"epoch trained {distinct} distinct rows, not {self.rows_per_epoch}"
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
    data those rows belong to ("" in checkpoints written before fingerprints) and the settings the
    checkpoint's weights need (a pipeline's, e.g. its model's width: integers, each an entry of
    the file beside `epoch`). Small, so the driver reads it without the checkpoint's weights."""

    epoch: int
    trained: np.ndarray
    fingerprint: str = ""
    settings: dict[str, int] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        stream = io.BytesIO()
        settings = {name: np.array(value) for name, value in self.settings.items()}
        np.savez(
            stream,
            epoch=np.array(self.epoch),
            trained=self.trained,
            fingerprint=np.array(self.fingerprint),
            **settings,
        )
        return stream.getvalue()


RECORD_KEYS = ("epoch", "trained", "fingerprint")  # a POSITION_FILE's entries that are no setting


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
            {name: int(arrays[name]) for name in arrays.files if name not in RECORD_KEYS},
        )


def check_resumable(
    run_dir: StoragePath,
    fingerprint: str,
    train_rows: int,
    settings: dict[str, tuple[int, int]] | None = None,
) -> None:
    """Refuse, before any worker starts, to resume a run on other prepared data or other settings
    than its newest checkpoint's.

    Other data (a tree edited and prepared again): the epoch's trained-rows bitmap, its step count
    and the schedule are all counted in that data's rows, so a resume would silently train some
    rows twice and skip others. The same tree prepared again gives the same fingerprint and
    resumes. `settings`: flag → (this run's value, the value a checkpoint written before the
    setting was saved holds), e.g. {"--model-width": (16, 64)}: another value means the saved
    weights do not fit, and every worker would fail loading them, restart and fail again."""
    saved = saved_position(run_dir)
    if saved is None:
        return
    for flag, (value, before) in (settings or {}).items():
        held = saved.settings.get(flag.removeprefix("--").replace("-", "_"), before)
        if held != value:
            raise ConfigError(
                f"{run_dir.uri} was trained with {flag} {held}, not {value}: its checkpoints hold "
                f"weights of that setting. Continue it with {flag} {held}, or train with {flag} "
                f"{value} as a new run (another --run-name)"
            )
    if saved.fingerprint and fingerprint and saved.fingerprint != fingerprint:
        raise DataChangedError(
            f"{run_dir.uri} was trained on prepared data {saved.fingerprint}, but its --data-dir "
            f"now holds {fingerprint} ({train_rows} training rows): the data changed since (a "
            "tree edited and prepared again), and resuming would count the epoch's rows wrong. "
            "Train the changed data as a new run (another --run-name), or prepare the data as it "
            "was to continue this one"
        )
