"""How and when the validation split is scored: the mean next-token loss (and perplexity) over the
same first blocks every time, each rank its share, every --eval-every-steps and at the last step;
or, with `--validation async`, by a Ray task on each checkpoint while training goes on (Ray
Train's `ValidationConfig`), over the same blocks."""

from __future__ import annotations

import json
import logging
import math
import time
from typing import Any

import numpy as np
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from ray.train import ValidationConfig, ValidationTaskConfig

from llm_fsdp.config import TrainConfig
from llm_fsdp.evaluate import score_checkpoint
from llm_fsdp.loss import NextTokenLoss
from llm_fsdp.run_state import WorkerContext
from llm_fsdp.task import val_metrics
from raytrain_common.configs import per_worker_batch_size
from raytrain_common.loop import ValidationPolicy
from raytrain_common.storage import StoragePath, resolve_storage
from raytrain_common.tokens.file import TokenBlocks

SCORE = "val_loss"  # Ray keeps the best checkpoints by it (lowest first); a sweep ranks by it
VALIDATIONS_FOLDER = "validations"  # async: one JSON per validated checkpoint, for the history

log = logging.getLogger("llm_fsdp")


class Validator:
    """Scores the validation split every --eval-every-steps and at the last step."""

    def __init__(self, model: NextTokenLoss, blocks: TokenBlocks, context: WorkerContext) -> None:
        self.model, self.blocks = model, blocks
        self.micro, self.config = context.micro, context.config
        self.device = ray.train.torch.get_device()
        every = context.config.eval_every_steps
        self.policy = ValidationPolicy(every_steps=every, last_step=context.last_step)
        self.inline = context.config.validation == "inline"

    def maybe_validate(self, step: int) -> dict[str, float] | None:
        """The validation metrics when due (inline); under async, each checkpoint carries the
        request instead (Checkpointer)."""
        return self.validate(step) if self.inline and self.policy.due(step) else None

    def validate(self, step: int) -> dict[str, float]:
        losses = evaluate(self.model, self.blocks, self.micro, self.config, self.device)
        if dist.get_rank() == 0:
            dtype = f"  (compute in {self.model.compute_dtype})" if step == 0 else ""
            log.info(
                "step %d  val loss %.4f  perplexity %.1f%s",
                *(step, losses["val_loss"], losses["val_perplexity"], dtype),
            )
        return losses


@torch.no_grad()
def evaluate(
    model: NextTokenLoss,
    blocks: TokenBlocks,
    micro: int,
    config: TrainConfig,
    device: torch.device,
) -> dict[str, float]:
    """Mean validation loss over the same first blocks every time (each rank its share),
    all-reduced.

    Eager even when the blocks are compiled: its batches' shapes vary, and compiling for them
    would recompile the training graphs with dynamic shapes.
    """
    with torch.compiler.set_stance("force_eager"):
        model.eval()
        rank, world = dist.get_rank(), dist.get_world_size()
        wanted = min(len(blocks), config.eval_batches * micro * world)
        mine = np.array_split(np.arange(wanted), world)[rank]
        totals = torch.zeros(2, device=device)
        # Every rank runs the same number of forward passes: FSDP's all-gathers need all ranks.
        for chunk in np.array_split(mine, max(1, math.ceil(wanted / world / micro))):
            if len(chunk):
                batch = torch.from_numpy(blocks.take(chunk)).to(device).long()
                totals[0] += model(batch)
                totals[1] += batch.shape[0] * (batch.shape[1] - 1)
            else:
                model(torch.from_numpy(blocks.take(np.arange(1))).to(device).long())
        dist.all_reduce(totals)
        model.train()
        loss_sum, tokens = totals.tolist()
        return val_metrics(loss_sum, tokens)


def async_validation(config: TrainConfig, run_dir: StoragePath) -> ValidationConfig | None:
    """Ray Train's validation of each reported checkpoint in a task of its own resources
    (--validation-cpus / --validation-gpus), over the blocks inline validation scores; None for
    inline. Ray merges the task's val_loss into the checkpoint's metrics, which rank it."""
    if config.validation == "inline":
        return None
    micro = per_worker_batch_size(
        config.global_batch_size, config.num_workers, config.grad_accum_steps
    )
    return ValidationConfig(
        fn=validate_checkpoint,
        task_config=ValidationTaskConfig(
            fn_kwargs={
                "run_dir": run_dir.uri,
                "data_dir": config.resolved_data_dir(),
                "blocks": config.eval_batches * micro * config.num_workers,
            }
        ),
        ray_remote_kwargs={"num_cpus": config.validation_cpus, "num_gpus": config.validation_gpus},
    )


def validate_checkpoint(
    checkpoint: ray.train.Checkpoint, *, run_dir: str, data_dir: str, blocks: int
) -> dict[str, float]:
    """The validation loss and perplexity of one checkpoint (a Ray task, on its GPU when it has
    one), also written to <run>/validations/ for metrics.csv and summary.json's history, which the
    checkpoint itself, written before, cannot hold."""
    started = time.time()
    with checkpoint.as_directory() as folder:
        result = score_checkpoint(folder, data_dir, "validation", blocks)
    metrics = {"val_loss": result["val_loss"], "val_perplexity": result["val_perplexity"]}
    record = {"step": result["step"], **metrics, "started_at": started}
    target = resolve_storage(run_dir).join(VALIDATIONS_FOLDER)
    target.mkdir()
    target.join(f"step-{result['step']:09d}.json").write_text(json.dumps(record))
    return metrics


def read_async_validations(run_dir: StoragePath) -> list[dict[str, Any]]:
    """The async validations' records, by step ([] for an inline run)."""
    folder = run_dir.join(VALIDATIONS_FOLDER)
    return sorted(
        (json.loads(file.read_text()) for file in folder.list_files(".json")),
        key=lambda record: record["step"],
    )
