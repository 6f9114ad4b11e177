"""When the run checkpoints, what a checkpoint holds, and how a run resumes from one.

Every rank calls `ray.train.report` at every checkpoint (a barrier); rank 0 attaches the
checkpoint. Beside the weights it holds the run's record (run_state.py) and the epoch's trained
rows, which a resumed epoch's dataset reads to train only the rest (ingest.py): every image once
per epoch, on any worker count.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray.train
import torch
from torch import nn

from mnist_resnet.config import TrainConfig
from mnist_resnet.ingest import POSITION_FILE, DataShardError, EpochRows, position_file
from mnist_resnet.metrics_logger import MetricsLogger
from mnist_resnet.run_state import EpochPosition, RunState
from raytrain_common.checkpoint import (
    load_state,
    save_state,
    scratch_folder,
    unwrap,
    upload_with_retries,
    write_manifest,
)
from raytrain_common.faults import FaultLog, read_progress
from raytrain_common.hardware import workers_peak_rss_mb
from raytrain_common.loop import CheckpointPolicy, ProgressNotes
from raytrain_common.storage import StoragePath

log = logging.getLogger("mnist_resnet")

SCORE = "val_accuracy"  # checkpoints, sweeps and early stopping choose by it; never by test
# The score of a mid-epoch checkpoint, which is not evaluated: below any real accuracy, so Ray keeps
# it only as the latest (Ray's checkpoint ranking takes numbers only: NaN reaches it as None).
NOT_EVALUATED = -1.0


class Checkpointer:
    """Decides when the run checkpoints (epoch ends, every --checkpoint-every-steps, a preemption
    notice, --stop-at-step: `CheckpointPolicy`) and writes each checkpoint: the state from rank 0,
    the epoch's trained rows beside it (what a resumed epoch's dataset reads), each rank's row-id
    audit, and the `ray.train.report` every rank makes. It also restores the run's record."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loop_config: dict[str, Any],
        run_dir: StoragePath,
        steps: int,
    ) -> None:
        config = TrainConfig(**loop_config["config"])
        context = ray.train.get_context()
        self.rank, self.world = context.get_world_rank(), context.get_world_size()
        self.model, self.optimizer = model, optimizer
        self.loop_config, self.run_dir, self.steps = loop_config, run_dir, steps
        self.rows_per_epoch = steps * config.global_batch_size
        self.stop_at_step = config.stop_at_step
        self.policy = CheckpointPolicy(
            every_steps=config.checkpoint_every_steps,
            last_step=steps * config.epochs,
            epoch_steps=steps,
            stop_at_step=config.stop_at_step,
            preemption_check_steps=config.preemption_check_steps,
            every_minutes=config.checkpoint_every_minutes,
        )
        driver_id = loop_config["driver_id"]
        self.progress = ProgressNotes(
            run_dir, driver_id, self.world, config.log_every_steps, self.rank
        )
        self.upload = upload_with_retries(config.storage_path, config.storage_patience_s)
        self.audit = RowIdAudit(run_dir, self.rank, enabled=config.record_row_ids)

    def restore(self, state: dict[str, Any] | None) -> RunState:
        """The record of the checkpoint being resumed, with this restart noted and its cause; or a
        fresh record (a restart that lost its run before the first checkpoint is noted too)."""
        driver_id = self.loop_config["driver_id"]
        if state is None:
            run = RunState()
            if read_progress(self.run_dir) is not None:  # lost before its first checkpoint
                run.faults.record_restart(0, self.run_dir, driver_id, None, self.world)
            return run
        saved = {field.name for field in dataclasses.fields(RunState)} - {"position", "faults"}
        run = RunState(
            **{name: state[name] for name in saved if name in state},
            position=EpochPosition(**state["position"]) if state.get("position") else None,
            faults=FaultLog(**state.get("faults", {})),
        )
        if self.policy.already_done(run.step):
            log.info("the run is already at step %d: nothing to train", run.step)
            return run
        resumed_from = state.get("resumed_from")
        restart = run.faults.record_restart(
            run.step, self.run_dir, driver_id, resumed_from, self.world
        )
        log.info("resuming at step %d (%s)", run.step, restart["cause"])
        if restart["cause"] == "rerun":  # this command's own start-up is measured anew
            run.startup_s = run.first_batch_s = None
        return run

    def epochs_left(self, run: RunState, epochs: int) -> range:
        """From the epoch the run stopped in; none once it reached its end or --stop-at-step."""
        return (
            range(0)
            if self.policy.already_done(run.step)
            else range(run.step // self.steps + 1, epochs + 1)
        )

    def step_end(
        self,
        run: RunState,
        batch: dict[str, torch.Tensor],
        dtype: str,
        rows: EpochRows,
        logger: MetricsLogger,
        validation: dict[str, float] | None,
    ) -> bool:
        """After every step, on every rank: note the batch's rows, then checkpoint when the policy
        says so. True when the loop stops here (the run's end, --stop-at-step)."""
        self.trained(batch, rows, run, dtype)
        due = self.policy.due(
            run.step, run.faults
        )  # a collective when it asks Ray about preemption
        self.progress.note(run.step, run.faults, checkpointing=bool(due))
        epoch = (run.step - 1) // self.steps + 1
        if due.at_epoch_end:
            assert validation is not None, "the validator runs at every epoch's end"
            check_trained_once(rows, self.rows_per_epoch, logger.device)
            run.position = None
            self.save(run, logger.epoch_row(run, validation), epoch, rows, finished=True)
            logger.next_epoch(run)
        elif due:
            if due.timed and self.rank == 0:
                log.info("checkpoint at step %d: --checkpoint-every-minutes elapsed", run.step)
            with logger.paused():
                run.position = logger.totals.position((run.step - 1) % self.steps + 1, rows)
                metrics = {"epoch": run.step / self.steps, "step": run.step, SCORE: NOT_EVALUATED}
                self.save(run, metrics, epoch, rows, finished=False)
        if due.stops and self.rank == 0 and run.step == self.stop_at_step:
            log.info("stopped at step %d as asked (--stop-at-step)", run.step)
        return due.stops

    def trained(
        self, batch: dict[str, torch.Tensor], rows: EpochRows, run: RunState, dtype: str
    ) -> None:
        """Note a batch trained on: its ids, the dtype it computed in, and (rank 0) where it was
        decoded and when the run's first batch came."""
        run.compute_dtype = dtype
        ids = batch["row"].numpy()
        rows.mark(ids)
        self.audit.add(ids)
        if self.rank == 0:
            count_decode_nodes(run.decoded_on, batch["decode_node"].numpy())
        if run.first_batch_s is None:
            run.first_batch_s = time.time() - self.loop_config["launched_at"]

    def save(
        self, run: RunState, metrics: dict[str, float], epoch: int, rows: EpochRows, finished: bool
    ) -> None:
        """Every rank reports `metrics` (`ray.train.report` is a barrier: a rank that skipped it
        would hang the others); rank 0 with the checkpoint. DDP ranks hold the same weights, so one
        copy is enough. A finished epoch's next one starts with no rows trained."""
        state = self.state(run)  # on every rank: it gathers the workers' peak memory
        self.audit.write(epoch, run.step)
        if self.rank != 0:
            ray.train.report(metrics, checkpoint=None)
            return
        if finished:
            place = (epoch + 1, rows.bits[:0])
        else:  # step_end has just set the epoch's position
            trained = run.position.trained_rows  # type: ignore[union-attr]
            place = (epoch, trained.numpy())  # type: ignore[union-attr]
        with scratch_folder("checkpoint") as folder:
            save_state(folder, state)
            fingerprint = self.loop_config["dataset"].get("fingerprint", "")
            (Path(folder) / POSITION_FILE).write_bytes(position_file(*place, fingerprint))
            write_manifest(folder)  # last: a checkpoint without it is torn, and never resumed
            ray.train.report(
                metrics,
                checkpoint=ray.train.Checkpoint.from_directory(folder),
                checkpoint_upload_fn=self.upload,  # rides out a storage outage
            )

    def state(self, run: RunState) -> dict[str, Any]:
        return {
            "model": unwrap(self.model).state_dict(),
            "optimizer": self.optimizer.state_dict(),
            **dataclasses.asdict(run),
            "world_size": self.world,
            "worker_peak_rss_mb": workers_peak_rss_mb(),  # on every rank: a collective
            "config": self.loop_config["config"],
            "dataset": self.loop_config["dataset"],
        }


def read_state(checkpoint: ray.train.Checkpoint | None) -> dict[str, Any] | None:
    """The state a checkpoint holds (weights, optimiser, the run's record), noting which
    checkpoint it came from; None for no checkpoint (a fresh start)."""
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as folder:
        state = load_state(folder)
    state["resumed_from"] = checkpoint.path
    return state


def carried_rows(run: RunState, rank: int) -> np.ndarray | None:
    """The resumed epoch's rows trained before the stop: rank 0 carries them (so the merge counts
    them once)."""
    trained = run.position.trained_rows if run.position is not None else None
    return trained.numpy() if trained is not None and rank == 0 else None


def check_trained_once(rows: EpochRows, expected: int, device: torch.device) -> None:
    """At an epoch's end: every rank's rows together are `expected` distinct rows (a collective)."""
    distinct = int(np.unpackbits(rows.merged(device)).sum())
    if distinct != expected:
        raise DataShardError(f"the epoch trained {distinct} distinct rows, not {expected}")


def count_decode_nodes(counts: dict[str, int], node_tags: np.ndarray) -> None:
    """Add one batch's rows to `counts`, by the node (its id's first 15 hex digits) that decoded
    them: where the data work ran."""
    for tag, rows in zip(*np.unique(node_tags, return_counts=True), strict=True):
        key = f"{int(tag):015x}"
        counts[key] = counts.get(key, 0) + int(rows)


class RowIdAudit:
    """With --record-row-ids, each rank writes the ids of the rows it trained on with every
    checkpoint, to <run>/row_ids/epoch-E/step-S-rank-R.npy: steps lost to a failure (trained after
    the last checkpoint, then redone) are never written, so the files count each row's training
    in the run that was kept."""

    def __init__(self, run_dir: StoragePath, rank: int, enabled: bool) -> None:
        self.folder, self.rank, self.enabled = run_dir.join("row_ids"), rank, enabled
        self.ids: list[np.ndarray] = []

    def add(self, ids: np.ndarray) -> None:
        if self.enabled:
            self.ids.append(ids.copy())

    def write(self, epoch: int, step: int) -> None:
        if not self.enabled:
            return
        ids = np.concatenate(self.ids) if self.ids else np.zeros(0, dtype=np.int64)
        buffer = io.BytesIO()
        np.save(buffer, ids)
        self.folder.join(f"epoch-{epoch}", f"step-{step:07d}-rank-{self.rank}.npy").write_bytes(
            buffer.getvalue()
        )
        self.ids = []
