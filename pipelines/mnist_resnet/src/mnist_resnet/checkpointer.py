"""When the run checkpoints, what a checkpoint holds, and how a run resumes from one.

Every rank calls `ray.train.report` at every checkpoint (a barrier); rank 0 attaches the
checkpoint. Beside the weights it holds the run's record (run_state.py) and the epoch's trained
rows with the prepared data's fingerprint (`TrainingRows`, `raytrain_common.ingest`), which a
resumed epoch's dataset reads to train only the rest: every image once per epoch, on any worker
count.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import ray.train
import torch
from torch import nn

from mnist_resnet.metrics_logger import EpochTotals, MetricsLogger
from mnist_resnet.run_state import RunState, WorkerContext
from mnist_resnet.validator import SCORE
from raytrain_common.checkpoint import (
    load_model_weights,
    load_state,
    save_state,
    scratch_folder,
    unwrap,
    upload_with_retries,
    write_manifest,
)
from raytrain_common.faults import read_progress
from raytrain_common.hardware import workers_peak_rss_mb
from raytrain_common.ingest.epochs import POSITION_FILE, SavedPosition, TrainingRows
from raytrain_common.loop import CheckpointDue, CheckpointPolicy, ProgressNotes

log = logging.getLogger("mnist_resnet")

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
    """Decides when the run checkpoints (`checkpoint_policy`), writes each checkpoint and restores
    the run from one. It is handed the run's state once: the model, the optimiser, the run's record
    (`RunState`), the epoch's trained rows (`TrainingRows`) and its metric sums (`EpochTotals`),
    each with `state_dict()` / `load_state_dict()`; the step hands it what only the step knows
    (its validation scores). Its `step_end` is every step's one place for the collectives a
    checkpoint needs (the preemption check, the epoch's sums and rows, the workers' memory)."""

    def __init__(
        self,
        context: WorkerContext,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        run: RunState,
        rows: TrainingRows,
        epoch_sums: EpochTotals,
        logger: MetricsLogger,
    ) -> None:
        self.context, self.model, self.optimizer, self.run = context, model, optimizer, run
        self.rows, self.epoch_sums, self.logger = rows, epoch_sums, logger
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

    def restore(self, checkpoint: ray.train.Checkpoint | None) -> None:
        """Load the checkpoint into every piece of state (the run's newest complete one: a
        restarted worker group, a rerun), noting the restart and its cause; or, with none, note a
        restart that lost its run before the first checkpoint."""
        run, context = self.run, self.context
        driver_id, run_dir = context.loop_config["driver_id"], context.run_dir
        if checkpoint is None:
            if read_progress(run_dir) is not None:  # lost before its first checkpoint
                run.faults.record_restart(0, run_dir, driver_id, None, context.world)
            return
        with checkpoint.as_directory() as folder:
            state = load_state(folder)
            position = read_position(Path(folder))
        load_model_weights(self.model, state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        run.load_state_dict(state)
        self.epoch_sums.load_state_dict(state.get("position"))
        self.rows.load_state_dict({**position, "decoded_on": state.get("decoded_on") or {}})
        if self.policy.already_done(run.step):
            log.info("the run is already at step %d: nothing to train", run.step)
            return
        restart = run.faults.record_restart(
            run.step, run_dir, driver_id, checkpoint.path, context.world
        )
        log.info("resuming at step %d (%s)", run.step, restart["cause"])
        if restart["cause"] == "rerun":  # this command's own start-up is measured anew
            run.startup_s = run.first_batch_s = run.startup_phases = None

    # No `report_again_if_lost` (llm-fsdp's): this run's last checkpoint holds its epoch's trained
    # rows, which a worker group restarted after it no longer has to write again.

    def epochs_left(self) -> range:
        """From the epoch the run stopped in; none once it reached its end or --stop-at-step."""
        if self.policy.already_done(self.run.step):
            return range(0)
        return range(self.run.step // self.context.steps + 1, self.context.config.epochs + 1)

    def step_end(self, validation: dict[str, float] | None) -> bool:
        """After every step, on every rank, with the step's validation scores (None when it did
        not validate): checkpoint when the policy says so. True when the loop stops here."""
        run = self.run
        due = self.policy.due(run.step, run.faults)  # a collective every --preemption-check-steps
        self.progress.note(run.step, run.faults, checkpointing=bool(due))
        if not due:
            return False
        if due.at_epoch_end and validation is None and not self.validate_async:
            raise RuntimeError(f"step {run.step} ends an epoch: pass its validation scores")
        with self.logger.paused():  # the checkpoint's time is left out of the throughput
            sums = self.epoch_sums.state_dict(run.step)  # collectives, on every rank
            trained = self.rows.state_dict(run.step)
            metrics = self.report_metrics(due, sums, validation)
            # What was logged up to this checkpoint reaches MLflow before it is reported: a
            # restart resumes after it and never logs those steps again, and a sweep may stop the
            # trial on the report's epoch row.
            self.logger.flush()
            self.rows.write_audit(run.step)
            state = self.state_dict(trained, None if due.at_epoch_end else sums)  # a collective
            with self.checkpoint_folder(state, trained) as checkpoint:
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

    def report_metrics(
        self, due: CheckpointDue, sums: dict[str, float], validation: dict[str, float] | None
    ) -> dict[str, float]:
        """What the report carries: the ended epoch's row (its validation score ranks it), or a
        mid-epoch step's."""
        if due.at_epoch_end:
            row = self.logger.epoch_row(self.run, sums, validation)
            # Async: ranked last until the validation task's score replaces this one.
            return row if SCORE in row else {**row, SCORE: NOT_EVALUATED}
        if due.timed and self.context.rank == 0:
            log.info("checkpoint at step %d: --checkpoint-every-minutes elapsed", self.run.step)
        return {
            "epoch": self.run.step / self.context.steps,
            "step": self.run.step,
            SCORE: NOT_EVALUATED,
        }

    def state_dict(
        self, trained: dict[str, Any], epoch_sums: dict[str, float] | None
    ) -> dict[str, Any]:
        """state.pt: the weights, the optimiser, the run's record and the epoch's sums (a
        mid-epoch checkpoint's), with what read it back needs (a collective: the workers' memory)."""
        return {
            "model": unwrap(self.model).state_dict(),
            "optimizer": self.optimizer.state_dict(),
            **self.run.state_dict(),
            "position": epoch_sums,
            "decoded_on": trained["decoded_on"],  # rank 0's rows by the node that decoded them
            "world_size": self.context.world,
            "worker_peak_rss_mb": workers_peak_rss_mb(),  # on every rank: a collective
            "config": self.context.loop_config["config"],
            "dataset": self.context.loop_config["dataset"],
        }

    @contextlib.contextmanager
    def checkpoint_folder(
        self, state: dict[str, Any], trained: dict[str, Any]
    ) -> Iterator[ray.train.Checkpoint | None]:
        """Rank 0's checkpoint (state.pt; the epoch's rows, the one record of the data position
        that workers and the driver read; the manifest written last: a folder without it is torn
        and never resumed); None on the other ranks (DDP ranks hold the same weights)."""
        if self.context.rank != 0:
            yield None
            return
        with scratch_folder("checkpoint") as folder:
            save_state(folder, state)
            # What a resume must match: the prepared data, and the model's width (check_resumable).
            width = {"model_width": self.context.config.model_width}
            saved = SavedPosition(
                trained["epoch"], trained["trained"], self.context.info.fingerprint, width
            )
            (Path(folder) / POSITION_FILE).write_bytes(saved.to_bytes())
            write_manifest(folder)
            yield ray.train.Checkpoint.from_directory(folder)


def read_position(folder: Path) -> dict[str, Any]:
    """The epoch a checkpoint is in and the rows of it trained (None at an epoch's end)."""
    with np.load(folder / POSITION_FILE, allow_pickle=False) as arrays:
        trained = arrays["trained"]
        return {"epoch": int(arrays["epoch"]), "trained": trained if len(trained) else None}
