"""How the validation split is scored: by the Trainer's own `evaluate`, at every epoch's end
(`eval_strategy="epoch"`) and before every checkpoint the Checkpointer asks for, so each checkpoint
Ray receives carries its own score and `CheckpointConfig` keeps the best by it."""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers import Trainer

# The prefix of the validation metrics (the Trainer's own is "eval"): `val_*` names the split that
# chooses checkpoints in every pipeline, `test_*` the one reported once.
VAL_PREFIX = "val"
SCORE = "val_f1"  # Ray keeps the best checkpoints by this (and a sweep ranks trials by it)


class ValidatingTrainer(Trainer):
    """The Trainer, with one correction to `evaluate` (public API; tests/test_hf_trainer.py fails
    without it): transformers' evaluation DataLoader draws its seed from the global RNG, and the
    Trainer saves that RNG right after, so a checkpoint evaluated where an uninterrupted run was
    not (a stop, a preemption) would resume with another dropout stream."""

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        cpu_state = torch.get_rng_state()
        cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        kwargs.setdefault("metric_key_prefix", VAL_PREFIX)
        try:
            return super().evaluate(*args, **kwargs)
        finally:
            torch.set_rng_state(cpu_state)
            if cuda_states is not None:
                torch.cuda.set_rng_state_all(cuda_states)


def eval_batch_per_worker(rows: int, workers: int, most: int) -> int:
    """Each worker's evaluation batch: at most `most` rows, and as few filler rows as the split
    allows. Accelerate fills every worker's last evaluation batch to full size with rows from the
    split's start (and leaves them out of the scores), so a split smaller than workers × batch was
    evaluated many times over: 64 rows on 2 workers at 128 a batch made 256 rows of work, 4×. The
    same number of batches, evened out, makes 64 (2,370 rows: 2,380 instead of 2,560)."""
    batches = max(1, math.ceil(rows / (workers * most)))
    return max(1, math.ceil(rows / (workers * batches)))
