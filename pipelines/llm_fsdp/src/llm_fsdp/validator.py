"""How and when the validation split is scored: the mean next-token loss (and perplexity) over the
same first blocks every time, each rank its share, every --eval-every-steps and at the last step."""

from __future__ import annotations

import logging
import math

import numpy as np
import ray.train.torch
import torch
import torch.distributed as dist

from llm_fsdp.config import TrainConfig
from llm_fsdp.loss import NextTokenLoss
from llm_fsdp.task import val_metrics
from llm_fsdp.tokens import TokenBlocks
from raytrain_common.loop import ValidationPolicy

log = logging.getLogger("llm_fsdp")


class Validator:
    """Scores the validation split every --eval-every-steps and at the last step."""

    def __init__(
        self,
        model: NextTokenLoss,
        blocks: TokenBlocks,
        micro: int,
        config: TrainConfig,
        last_step: int,
    ) -> None:
        self.model, self.blocks, self.micro, self.config = model, blocks, micro, config
        self.device = ray.train.torch.get_device()
        self.policy = ValidationPolicy(every_steps=config.eval_every_steps, last_step=last_step)

    def maybe_validate(self, step: int) -> dict[str, float] | None:
        return self.validate(step) if self.policy.due(step) else None

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
