"""When the run checkpoints, what a checkpoint holds, and how a run resumes from one.

Sharded checkpoints (DCP): every rank writes its shards and a manifest of them, every rank calls
`ray.train.report` with its folder, and Ray merges the folders; a resume loads the shards into the
current sharding (DCP reshards for another worker count). `export` reads the same files.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray.train
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ray.train import Checkpoint, CheckpointUploadMode
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from llm_fsdp.config import TrainConfig
from llm_fsdp.loss import NextTokenLoss
from raytrain_common.checkpoint import (
    UploadFn,
    new_scratch_folder,
    upload_with_retries,
    write_manifest,
)
from raytrain_common.faults import FaultLog, read_progress
from raytrain_common.hardware import workers_peak_rss_mb
from raytrain_common.loop import CheckpointPolicy, ProgressNotes
from raytrain_common.storage import StoragePath

log = logging.getLogger("llm_fsdp")

STATE_FILE = "train_state.json"  # step, data position, history: beside the DCP shards
# The validation loss of a checkpoint an async validation has not scored yet: above any real loss,
# so Ray ranks it last (its ranking takes numbers only: NaN and infinity do not sort).
NOT_EVALUATED = 1e9


def save_checkpoint(
    model: NextTokenLoss,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    metrics: dict[str, float],
    async_upload: bool = False,
    upload: UploadFn | None = None,
    validate: bool = False,
) -> None:
    # The LM's state alone, so the keys are a plain Hugging Face model's (export loads them).
    model_state, optimizer_state = get_state_dict(model.lm, optimizer)
    folder = new_scratch_folder("llm-fsdp-ckpt")
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=folder)
    if dist.get_rank() == 0:
        (Path(folder) / STATE_FILE).write_text(json.dumps(state))
    # Each rank describes its own shards, last: a shard cut off is found before a resume.
    write_manifest(folder, rank=dist.get_rank(), world_size=dist.get_world_size())
    # Ray deletes the local folder once it is in storage: at once (sync), or after the background
    # upload (async), which is why the folder is not a context-managed temporary one.
    mode = CheckpointUploadMode.ASYNC if async_upload else CheckpointUploadMode.SYNC
    ray.train.report(
        metrics,
        checkpoint=Checkpoint.from_directory(folder),
        checkpoint_upload_mode=mode,
        delete_local_checkpoint_after_upload=True,
        checkpoint_upload_fn=upload,
        validation=validate,  # --validation async: Ray Train scores it in a task of its own
    )


def load_checkpoint(
    model: NextTokenLoss, optimizer: torch.optim.Optimizer, folder: str
) -> dict[str, Any]:
    """Load shards into the current sharding (DCP reshards for another worker count)."""
    model_state, optimizer_state = get_state_dict(model.lm, optimizer)
    loaded = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(loaded, checkpoint_id=folder)
    set_state_dict(
        model.lm, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"]
    )
    return json.loads((Path(folder) / STATE_FILE).read_text())


def read_train_state(checkpoint: Checkpoint) -> dict[str, Any]:
    with checkpoint.as_directory() as folder:
        return json.loads((Path(folder) / STATE_FILE).read_text())


@dataclass
class RunState:
    """The run's record, saved in every checkpoint: steps done, metrics rows, faults survived, and
    the start-up time of the command that began this attempt."""

    step: int = 0
    history: list[dict[str, float]] = dataclasses.field(default_factory=list)
    faults: FaultLog = dataclasses.field(default_factory=FaultLog)
    startup_s: float | None = None  # from the command's start to the first optimiser step
    startup_phases: dict[str, float] | None = None  # those seconds, phase by phase (StartupClock)

    def latest_val(self) -> dict[str, float]:
        return next((row for row in reversed(self.history) if "val_loss" in row), {})


class Checkpointer:
    """Decides when the run checkpoints (every --checkpoint-every-steps, a preemption notice,
    --stop-at-step, the end: `CheckpointPolicy`) and writes sharded checkpoints from every rank
    (`save_checkpoint` below, which calls `ray.train.report`); restores the run from the newest
    complete one, resharded to this worker count."""

    def __init__(
        self,
        model: NextTokenLoss,
        optimizer: torch.optim.Optimizer,
        loop_config: dict[str, Any],
        run_dir: StoragePath,
        last_step: int,
    ) -> None:
        self.config = config = TrainConfig(**loop_config["config"])
        self.model, self.optimizer, self.loop_config = model, optimizer, loop_config
        self.run_dir, self.driver_id = run_dir, loop_config["driver_id"]
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.policy = CheckpointPolicy(
            every_steps=config.checkpoint_every_steps,
            last_step=last_step,
            stop_at_step=config.stop_at_step,
            preemption_check_steps=config.preemption_check_steps,
            every_minutes=config.checkpoint_every_minutes,
        )
        self.progress = ProgressNotes(
            run_dir, self.driver_id, self.world, config.log_every_steps, self.rank
        )
        self.upload = upload_with_retries(config.storage_path, config.storage_patience_s)

    def restore(self, checkpoint: Checkpoint | None) -> RunState:
        """The checkpoint's state loaded into the model (resharded to this worker count), or a
        fresh start; either way the restart, if this is one, recorded with its cause."""
        if checkpoint is None:
            run = RunState()
            if read_progress(self.run_dir) is not None:  # lost before its first checkpoint
                run.faults.record_restart(0, self.run_dir, self.driver_id, None, self.world)
            return run
        with checkpoint.as_directory() as folder:
            state = load_checkpoint(self.model, self.optimizer, folder)
        run = RunState(
            step=state["step"],
            history=state["history"],
            faults=FaultLog(**state.get("faults", {})),
            startup_s=state.get("startup_s"),
            startup_phases=state.get("startup_phases"),
        )
        if not self.policy.already_done(run.step):
            restart = run.faults.record_restart(
                run.step, self.run_dir, self.driver_id, checkpoint.path, self.world
            )
            if restart["cause"] == "rerun":  # this command's own start-up is measured anew
                run.startup_s = run.startup_phases = None
        if self.rank == 0:
            log.info(
                "resumed at step %d (written by %d worker(s)) on %d worker(s)",
                *(run.step, state["world_size"], self.world),
            )
        return run

    def report_again_if_lost(self, run: RunState) -> None:
        """This driver's worker group restarted (an elastic grow) after its last checkpoint was
        written but before Ray registered it: report that checkpoint again, or the run ends on an
        older one."""
        progress = read_progress(self.run_dir) or {}
        if self.policy.already_done(run.step) and progress.get("driver_id") == self.driver_id:
            self.save(run)

    def step_end(self, run: RunState) -> bool:
        """After every step, on every rank (a collective when it asks Ray about a preemption):
        checkpoint when the policy says so. True when the loop stops here."""
        due = self.policy.due(run.step, run.faults)
        self.progress.note(run.step, run.faults, checkpointing=bool(due))
        if due:
            self.save(run)
        return due.stops

    def save(self, run: RunState) -> None:
        """A sharded checkpoint of every rank, reported with the latest validation loss (Ray ranks
        checkpoints by it), and how long training waited for it (a metrics.csv row)."""
        saved = {
            **dataclasses.asdict(run),
            "sequences_seen": run.step * self.config.global_batch_size,
            "world_size": self.world,
            "compute_dtype": str(self.model.compute_dtype).removeprefix("torch."),
            "worker_peak_rss_mb": workers_peak_rss_mb(),  # on every rank: a collective
            "loop_config": self.loop_config,
        }
        stalled = time.perf_counter()
        validate = self.config.validation == "async"
        # Async: ranked last until the validation task's loss replaces this one.
        latest = {"val_loss": NOT_EVALUATED} if validate else run.latest_val()
        metrics = {"step": run.step, **latest}
        save_checkpoint(
            self.model,
            self.optimizer,
            saved,
            metrics,
            self.config.async_upload,
            self.upload,
            validate,
        )
        # In metrics.csv (this run's rows; a resumed run's history comes from its checkpoint,
        # which cannot hold its own stall).
        run.history.append({"step": run.step, "checkpoint_stall_s": time.perf_counter() - stalled})
