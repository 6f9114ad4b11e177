"""When the run checkpoints, what a checkpoint holds, and how a run resumes from one.

Every rank calls `ray.train.report` at every checkpoint (a barrier); rank 0 attaches the
checkpoint. Beside the weights it holds the run's record (run_state.py) and the epoch's trained
rows with the prepared data's fingerprint (`TrainingRows`, `raytrain_common.ingest`), which a
resumed epoch's dataset reads to train only the rest: every image once per epoch, on any worker
count.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import ray.train
import torch
from torch import nn

from mnist_resnet.metrics_logger import MetricsLogger
from mnist_resnet.run_state import EpochPosition, RunState, WorkerContext
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
from raytrain_common.ingest.epochs import POSITION_FILE, SavedPosition, TrainingRows
from raytrain_common.loop import CheckpointDue, CheckpointPolicy, ProgressNotes

log = logging.getLogger("mnist_resnet")

SCORE = "val_accuracy"  # checkpoints, sweeps and early stopping choose by it; never by test
# The score of a mid-epoch checkpoint, which is not evaluated: below any real accuracy, so Ray keeps
# it only as the latest (Ray's checkpoint ranking takes numbers only: NaN reaches it as None).
NOT_EVALUATED = -1.0


def checkpoint_policy(context: WorkerContext) -> CheckpointPolicy:
    """Epoch ends, every --checkpoint-every-steps and --checkpoint-every-minutes, a preemption
    notice, --stop-at-step, the run's end."""
    config = context.config
    return CheckpointPolicy(
        every_steps=config.checkpoint_every_steps,
        last_step=context.last_step,
        epoch_steps=context.steps,
        stop_at_step=config.stop_at_step,
        preemption_check_steps=config.preemption_check_steps,
        every_minutes=config.checkpoint_every_minutes,
    )


class Checkpointer:
    """Decides when the run checkpoints (`checkpoint_policy`) and writes each checkpoint: the
    state from rank 0, the epoch's trained rows beside it, each rank's row audit, and the
    `ray.train.report` every rank makes, with the metrics of the epoch that ended (the logger's)
    or of the step inside it."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        context: WorkerContext,
        rows: TrainingRows,
        logger: MetricsLogger,
    ) -> None:
        self.model, self.optimizer, self.context = model, optimizer, context
        self.rows, self.logger = rows, logger
        self.policy = checkpoint_policy(context)
        config = context.config
        self.progress = ProgressNotes(
            context.run_dir,
            context.loop_config["driver_id"],
            context.world,
            config.log_every_steps,
            context.rank,
        )
        self.upload = upload_with_retries(config.storage_path, config.storage_patience_s)
        self.validate_async = config.validation == "async"

    def epochs_left(self, run: RunState) -> range:
        """From the epoch the run stopped in; none once it reached its end or --stop-at-step."""
        if self.policy.already_done(run.step):
            return range(0)
        return range(run.step // self.context.steps + 1, self.context.config.epochs + 1)

    def step_end(self, run: RunState) -> bool:
        """After every step, on every rank (a collective when it asks Ray about a preemption or
        the clock): checkpoint when the policy says so. True when the loop stops here."""
        due = self.policy.due(run.step, run.faults)
        self.progress.note(run.step, run.faults, checkpointing=bool(due))
        if not due:
            return False
        epoch = (run.step - 1) // self.context.steps + 1
        with self.logger.paused():  # the checkpoint's time is left out of the throughput
            metrics = self.metrics(run, due)
            # What was logged up to this checkpoint reaches MLflow before it is reported: a
            # restart resumes after it and never logs those steps again, and a sweep may stop the
            # trial on the report's epoch row.
            self.logger.flush()
            self.rows.audit.write(epoch, run.step)
            with self.checkpoint_folder(run, epoch, due) as checkpoint:
                # --validation async: Ray Train scores an epoch's checkpoint in a task of its own.
                validate = self.validate_async and due.at_epoch_end and checkpoint is not None
                ray.train.report(
                    metrics,
                    checkpoint=checkpoint,
                    checkpoint_upload_fn=self.upload,
                    validation=validate,
                )
        if due.at_epoch_end:
            self.logger.next_epoch(run)  # after the report: metrics.csv never runs ahead
        if due.stops and self.context.rank == 0 and run.step == self.context.config.stop_at_step:
            log.info("stopped at step %d as asked (--stop-at-step)", run.step)
        return due.stops

    def metrics(self, run: RunState, due: CheckpointDue) -> dict[str, float]:
        """What the report carries: the ended epoch's row (its validation score ranks it), or a
        mid-epoch step's, with the epoch's position saved in the run's record (collectives)."""
        if due.at_epoch_end:
            self.rows.check_epoch_complete()
            run.position = None
            row = self.logger.epoch_row(run)
            # Async: ranked last until the validation task's score replaces this one.
            return row if SCORE in row else {**row, SCORE: NOT_EVALUATED}
        if due.timed and self.context.rank == 0:
            log.info("checkpoint at step %d: --checkpoint-every-minutes elapsed", run.step)
        step_in_epoch = (run.step - 1) % self.context.steps + 1
        run.position = self.logger.totals.position(step_in_epoch, self.rows.trained())
        return {"epoch": run.step / self.context.steps, "step": run.step, SCORE: NOT_EVALUATED}

    @contextlib.contextmanager
    def checkpoint_folder(
        self, run: RunState, epoch: int, due: CheckpointDue
    ) -> Iterator[ray.train.Checkpoint | None]:
        """Rank 0's checkpoint (state.pt, the epoch's rows, the manifest written last: a folder
        without it is torn and never resumed); None on the other ranks (DDP ranks hold the same
        weights)."""
        state = self.state(run)  # on every rank: it gathers the workers' peak memory
        if self.context.rank != 0:
            yield None
            return
        if due.at_epoch_end:  # the next epoch starts with no rows trained
            place = (epoch + 1, np.zeros(0, dtype=np.uint8))
        else:
            place = (epoch, run.position.trained_rows.numpy())  # type: ignore[union-attr]
        with scratch_folder("checkpoint") as folder:
            save_state(folder, state)
            # What a resume must match: the prepared data, and the model's width (check_resumable).
            width = {"model_width": self.context.config.model_width}
            saved = SavedPosition(*place, self.context.info.fingerprint, width)
            (Path(folder) / POSITION_FILE).write_bytes(saved.to_bytes())
            write_manifest(folder)
            yield ray.train.Checkpoint.from_directory(folder)

    def state(self, run: RunState) -> dict[str, Any]:
        return {
            "model": unwrap(self.model).state_dict(),
            "optimizer": self.optimizer.state_dict(),
            **dataclasses.asdict(run),
            "decoded_on": self.rows.decoded_on,  # rank 0's rows by the node that decoded them
            "world_size": self.context.world,
            "worker_peak_rss_mb": workers_peak_rss_mb(),  # on every rank: a collective
            "config": self.context.loop_config["config"],
            "dataset": self.context.loop_config["dataset"],
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


def resumed_rows(state: dict[str, Any] | None, run: RunState) -> dict[str, Any]:
    """What `TrainingRows.load_state_dict` takes from the checkpoint resumed: the bitmap of a
    mid-epoch checkpoint's rows trained, and where rank 0's rows were decoded so far."""
    trained = run.position.trained_rows if run.position is not None else None
    return {
        "trained": trained.numpy() if trained is not None else None,
        "decoded_on": (state or {}).get("decoded_on") or {},
    }


def restore_run(state: dict[str, Any] | None, context: WorkerContext) -> RunState:
    """The record of the checkpoint being resumed, with this restart noted and its cause; or a
    fresh record (a restart that lost its run before the first checkpoint is noted too)."""
    driver_id, run_dir = context.loop_config["driver_id"], context.run_dir
    if state is None:
        run = RunState()
        if read_progress(run_dir) is not None:  # lost before its first checkpoint
            run.faults.record_restart(0, run_dir, driver_id, None, context.world)
        return run
    saved = {field.name for field in dataclasses.fields(RunState)} - {"position", "faults"}
    run = RunState(
        **{name: state[name] for name in saved if name in state},
        position=EpochPosition(**state["position"]) if state.get("position") else None,
        faults=FaultLog(**state.get("faults", {})),
    )
    if checkpoint_policy(context).already_done(run.step):
        log.info("the run is already at step %d: nothing to train", run.step)
        return run
    restart = run.faults.record_restart(
        run.step, run_dir, driver_id, state.get("resumed_from"), context.world
    )
    log.info("resuming at step %d (%s)", run.step, restart["cause"])
    if restart["cause"] == "rerun":  # this command's own start-up is measured anew
        run.startup_s = run.first_batch_s = run.startup_phases = None
    return run
