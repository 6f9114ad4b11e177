"""When and how the run scores the model on the validation split."""

from __future__ import annotations

import time

import ray.train
import ray.train.torch
from torch import nn

from mnist_resnet.data import on_device
from mnist_resnet.ingest import VAL
from mnist_resnet.run_state import WorkerContext
from mnist_resnet.task import evaluate
from raytrain_common.loop import ValidationPolicy

VAL_BATCH_ROWS = 512


class Validator:
    """Scores the model on the validation split at every epoch's end, each rank its shard (split
    unevenly, see EvenTrainingEveryValidationRow), reduced over all ranks."""

    def __init__(self, model: nn.Module, context: WorkerContext) -> None:
        self.model, self.info, self.bf16 = model, context.info, context.config.bf16
        self.device = ray.train.torch.get_device()
        self.policy = ValidationPolicy(every_steps=context.steps, last_step=context.last_step)

    def maybe_validate(self, step: int) -> dict[str, float] | None:
        """The validation metrics when `step` ends an epoch, else None."""
        if not self.policy.due(step):
            return None
        started = time.perf_counter()
        shard = ray.train.get_dataset_shard(VAL)
        batches = (
            on_device(batch, self.info, self.device)
            for batch in shard.iter_torch_batches(batch_size=VAL_BATCH_ROWS, device="cpu")
        )
        metrics = evaluate(self.model, batches, self.device, self.bf16, split="val")
        return {**metrics, "val_s": time.perf_counter() - started}
