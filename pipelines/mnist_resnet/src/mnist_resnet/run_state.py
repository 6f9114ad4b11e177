"""The run's record that every checkpoint holds besides the weights: steps done, one row per epoch,
the position inside an epoch (its sums and its trained rows), faults survived, timing."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from raytrain_common.faults import FaultLog


@dataclass
class EpochPosition:
    """Where a run is inside an epoch, saved with every mid-epoch checkpoint so a resume continues
    exactly there: the steps taken in the epoch, and the epoch's sums over all ranks so far (its
    training loss and accuracy then equal an uninterrupted epoch's)."""

    step: int = 0
    loss_sum: float = 0.0
    correct: float = 0.0
    seen: float = 0.0
    train_s: float = 0.0
    skipped: float = 0.0  # rows whose file could not be decoded (counted as trained)
    trained_rows: torch.Tensor | None = None  # the epoch's rows trained, a bitmap (EpochRows)


@dataclass
class RunState:
    """The run's record, saved in every checkpoint: steps done, one row per epoch, the interval
    losses (curves), the position inside an epoch, faults survived, and timing."""

    step: int = 0
    history: list[dict[str, float]] = dataclasses.field(default_factory=list)
    step_log: list[dict[str, float]] = dataclasses.field(default_factory=list)
    position: EpochPosition | None = None
    faults: FaultLog = dataclasses.field(default_factory=FaultLog)
    decoded_on: dict[str, int] = dataclasses.field(default_factory=dict)  # rank 0's batches by node
    compute_dtype: str | None = None
    startup_s: float | None = None
    first_batch_s: float | None = None

    @property
    def resumes_mid_epoch(self) -> bool:
        """The checkpoint resumed was written inside an epoch: the rest of it is still to train."""
        return self.position is not None and self.position.trained_rows is not None
