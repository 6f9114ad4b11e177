"""When and how the run scores the model on the validation split: inline, every rank its shard at
each epoch's end while training waits (the default); or, with `--validation async`, in a Ray task
on each epoch's checkpoint while training goes on (Ray Train's `ValidationConfig`)."""

from __future__ import annotations

import json
import time
from typing import Any

import ray.train
import ray.train.torch
from ray.train import ValidationConfig, ValidationTaskConfig
from torch import nn

from mnist_resnet.config import TrainConfig
from mnist_resnet.predict import checkpoint_split_metrics
from mnist_resnet.run_state import WorkerContext
from mnist_resnet.task import evaluate, on_device
from raytrain_common.ingest.data_config import VAL
from raytrain_common.loop import ValidationPolicy
from raytrain_common.storage import StoragePath, resolve_storage

SCORE = "val_accuracy"  # checkpoints, sweeps and early stopping choose by it; never by test
VAL_BATCH_ROWS = 512
VALIDATIONS_FOLDER = "validations"  # async: one JSON per validated checkpoint, for the history


class Validator:
    """Scores the model on the validation split at every epoch's end, each rank its shard (split
    unevenly, see EvenTrainingEveryValidationRow), reduced over all ranks; under `--validation
    async` it scores nothing here: the epoch's checkpoint carries the request (Checkpointer)."""

    def __init__(self, model: nn.Module, context: WorkerContext) -> None:
        self.model, self.info, self.bf16 = model, context.info, context.config.bf16
        self.device = ray.train.torch.get_device()
        self.policy = ValidationPolicy(every_steps=context.steps, last_step=context.last_step)
        self.inline = context.config.validation == "inline"

    def maybe_validate(self, step: int) -> dict[str, float] | None:
        """The validation metrics when `step` ends an epoch (inline), else None."""
        if not self.inline or not self.policy.due(step):
            return None
        started = time.perf_counter()
        shard = ray.train.get_dataset_shard(VAL)
        batches = (
            on_device(batch, self.info, self.device)
            for batch in shard.iter_torch_batches(batch_size=VAL_BATCH_ROWS, device="cpu")
        )
        metrics = evaluate(self.model, batches, self.device, self.bf16, split="val")
        return {**metrics, "val_s": time.perf_counter() - started}


def async_validation(config: TrainConfig, run_dir: StoragePath) -> ValidationConfig | None:
    """Ray Train's validation of each reported epoch checkpoint in a task of its own resources
    (--validation-cpus / --validation-gpus), or None for inline validation. Ray merges the task's
    metrics into the checkpoint's, so checkpoint ranking by val_accuracy works as inline."""
    if config.validation == "inline":
        return None
    return ValidationConfig(
        fn=validate_checkpoint,
        task_config=ValidationTaskConfig(
            fn_kwargs={"run_dir": run_dir.uri, "limit": config.limit_val_rows}
        ),
        ray_remote_kwargs={"num_cpus": config.validation_cpus, "num_gpus": config.validation_gpus},
    )


def validate_checkpoint(
    checkpoint: ray.train.Checkpoint, *, run_dir: str, limit: int | None
) -> dict[str, float]:
    """The validation split's loss and accuracy of one epoch's checkpoint (a Ray task, on its GPU
    when it has one), also written to <run>/validations/ for metrics.csv and summary.json's
    history, which the checkpoint itself, written before, cannot hold."""
    started = time.time()
    # Ray's checkpoint carries a filesystem and a path, not the user's URI: the path names it.
    place = StoragePath(checkpoint.filesystem, checkpoint.path, checkpoint.path)
    result = checkpoint_split_metrics(place, VAL, limit)
    metrics = {
        "val_loss": result["val_loss"],
        "val_accuracy": result["val_accuracy"],
        "val_s": time.time() - started,
    }
    record = {"epoch": result["epoch"], "step": result["step"], **metrics, "started_at": started}
    folder = resolve_storage(run_dir).join(VALIDATIONS_FOLDER)
    folder.mkdir()
    folder.join(f"step-{result['step']:09d}.json").write_text(json.dumps(record))
    return metrics


def read_async_validations(run_dir: StoragePath) -> dict[int, dict[str, Any]]:
    """The async validations' records by step ({} for an inline run)."""
    folder = run_dir.join(VALIDATIONS_FOLDER)
    records = (json.loads(file.read_text()) for file in folder.list_files(".json"))
    return {record["step"]: record for record in records}
