"""When the run checkpoints, what a checkpoint holds, and how a run resumes from one.

Sharded checkpoints (DCP): every rank writes its shards and a manifest of them, every rank calls
`ray.train.report` with its folder, and Ray merges the folders; a resume loads the shards into the
current sharding (DCP reshards for another worker count). `export` reads the same files.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import ray.train
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ray.train import Checkpoint, CheckpointUploadMode
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from llm_fsdp.loss import NextTokenLoss
from llm_fsdp.model import parameter_count, trainable_parameter_count
from llm_fsdp.run_state import RunState, WorkerContext
from raytrain_common.checkpoint import (
    UploadFn,
    new_scratch_folder,
    upload_with_retries,
    write_manifest,
)
from raytrain_common.faults import read_progress
from raytrain_common.hardware import workers_peak_rss_mb
from raytrain_common.loop import CheckpointPolicy, ProgressNotes

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
    # The LM's state alone, so the keys are a plain Hugging Face model's (export loads them); what
    # trains only: under LoRA the adapters, the frozen base being the pretrained folder's.
    model_state, optimizer_state = get_state_dict(model.lm, optimizer)
    model_state = trained_state(model.lm, model_state)
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
    """Load shards into the current sharding (DCP reshards for another worker count): every
    parameter that trains; the frozen ones (LoRA's base) are the pretrained weights already."""
    model_state, optimizer_state = get_state_dict(model.lm, optimizer)
    loaded = {"model": trained_state(model.lm, model_state), "optimizer": optimizer_state}
    dcp.load(loaded, checkpoint_id=folder)
    keys = set_state_dict(
        model.lm,
        optimizer,
        model_state_dict=loaded["model"],
        optim_state_dict=loaded["optimizer"],
        options=StateDictOptions(strict=False),  # the frozen base is not in it: checked below
    )
    frozen = frozen_names(model.lm) | {name for name, _ in model.lm.named_buffers()}
    if keys.unexpected_keys or set(keys.missing_keys) - frozen:
        raise RuntimeError(
            f"{folder} does not fit the model: missing {sorted(set(keys.missing_keys) - frozen)[:5]}"
            f", unexpected {sorted(keys.unexpected_keys)[:5]}"
        )
    return json.loads((Path(folder) / STATE_FILE).read_text())


def frozen_names(lm: torch.nn.Module) -> set[str]:
    """The names of the parameters that do not train (LoRA's base), a tied one under each name."""
    return {n for n, p in lm.named_parameters(remove_duplicate=False) if not p.requires_grad}


def trained_state(lm: torch.nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """`state` without the frozen parameters, each name of a tied one included (the output layer
    sharing the embeddings' weight), which `StateDictOptions(ignore_frozen_params=True)` keeps."""
    frozen = frozen_names(lm)
    return {name: value for name, value in state.items() if name not in frozen}


def read_train_state(checkpoint: Checkpoint) -> dict[str, Any]:
    with checkpoint.as_directory() as folder:
        return json.loads((Path(folder) / STATE_FILE).read_text())


class Checkpointer:
    """Decides when the run checkpoints (every --checkpoint-every-steps, a preemption notice,
    --stop-at-step, the end: `CheckpointPolicy`) and writes sharded checkpoints from every rank
    (`save_checkpoint` below, which calls `ray.train.report`); restores the run from the newest
    complete one, resharded to this worker count."""

    def __init__(
        self,
        context: WorkerContext,
        *,
        model: NextTokenLoss,
        optimizer: torch.optim.Optimizer,
        run: RunState,
    ) -> None:
        self.context, self.config = context, context.config
        self.model, self.optimizer, self.run = model, optimizer, run
        self.run_dir, self.driver_id = context.run_dir, context.loop_config["driver_id"]
        self.rank, self.world = context.rank, context.world
        config = context.config
        self.policy = CheckpointPolicy(
            every_steps=config.checkpoint_every_steps,
            last_step=context.last_step,
            stop_at_step=config.stop_at_step,
            preemption_check_steps=config.preemption_check_steps,
            every_minutes=config.checkpoint_every_minutes,
        )
        self.progress = ProgressNotes(
            self.run_dir, self.driver_id, self.world, config.log_every_steps, self.rank
        )
        self.upload = upload_with_retries(config.storage_path, config.storage_patience_s)
        # Counted once (DTensors count their global size): every checkpoint records them.
        self.parameters = {
            "parameters": parameter_count(model.lm),
            "trainable_parameters": trainable_parameter_count(model.lm),
        }

    def restore(self, checkpoint: Checkpoint | None) -> None:
        """Load the checkpoint into the model and optimiser (resharded to this worker count) and
        the run's record, or start fresh; either way the restart, if this is one, recorded with its
        cause."""
        run = self.run
        if checkpoint is None:
            if read_progress(self.run_dir) is not None:  # lost before its first checkpoint
                run.faults.record_restart(0, self.run_dir, self.driver_id, None, self.world)
            return
        with checkpoint.as_directory() as folder:
            state = load_checkpoint(self.model, self.optimizer, folder)
        run.load_state_dict(state)
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

    def report_again_if_lost(self) -> None:
        """This driver's worker group restarted (an elastic grow) after its last checkpoint was
        written but before Ray registered it: report that checkpoint again, or the run ends on an
        older one (the step's state is the weights and the step: a restarted group holds both)."""
        progress = read_progress(self.run_dir) or {}
        if self.policy.already_done(self.run.step) and progress.get("driver_id") == self.driver_id:
            self.save(self.run.latest_val())

    def step_end(self, validation: dict[str, float] | None) -> bool:
        """After every step, on every rank, with the step's validation scores (None when it did
        not validate): checkpoint when the policy says so (a collective when it asks Ray about a
        preemption, and at a checkpoint). True when the loop stops here."""
        run = self.run
        due = self.policy.due(run.step, run.faults)
        self.progress.note(run.step, run.faults, checkpointing=bool(due))
        if due:
            self.save(validation or run.latest_val())
        return due.stops

    def save(self, validation: dict[str, float]) -> None:
        """A sharded checkpoint of every rank, reported with the latest validation loss (Ray ranks
        checkpoints by it), and how long training waited for it (a metrics.csv row)."""
        run = self.run
        saved = {
            **run.state_dict(),
            "sequences_seen": run.step * self.config.global_batch_size,
            "world_size": self.world,
            "compute_dtype": str(self.model.compute_dtype).removeprefix("torch."),
            **self.parameters,
            "worker_peak_rss_mb": workers_peak_rss_mb(),  # on every rank: a collective
            "loop_config": self.context.loop_config,
        }
        stalled = time.perf_counter()
        validate = self.config.validation == "async"
        # Async: ranked last until the validation task's loss replaces this one.
        latest = {"val_loss": NOT_EVALUATED} if validate else validation
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
