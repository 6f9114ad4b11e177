"""The run's record that every checkpoint holds besides the weights (steps done, one row per epoch,
faults survived, timing), and what every worker knows of the run (`WorkerContext`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import ray.train

from mnist_resnet.config import TrainConfig
from raytrain_common.configs import per_worker_batch_size
from raytrain_common.images.dataset import DatasetInfo
from raytrain_common.loop import RunRecord
from raytrain_common.storage import StoragePath, resolve_storage


@dataclass
class RunState(RunRecord):
    """The run's record, saved in every checkpoint: the library's (faults, start-up), steps done,
    one row per epoch, the interval losses (curves), the compute dtype, the first batch's wait.
    Where the run is inside an epoch is the epoch's own state: its sums (the logger's
    `EpochTotals`) and its trained rows (`TrainingRows`)."""

    step: int = 0
    history: list[dict[str, float]] = dataclasses.field(default_factory=list)
    step_log: list[dict[str, float]] = dataclasses.field(default_factory=list)
    compute_dtype: str | None = None
    first_batch_s: float | None = None


def training_rows(info: DatasetInfo, config: TrainConfig) -> int:
    """The training split's rows a run trains on: all, or the first --limit-train-rows."""
    return min(info.train_rows, config.limit_train_rows or info.train_rows)


def steps_per_epoch(train_rows: int, global_batch_size: int) -> int:
    """Optimiser steps per epoch, the same on any worker count: the rows past the last full global
    batch are left for another epoch (each epoch's order leaves out other ones)."""
    return train_rows // global_batch_size


@dataclass(frozen=True)
class WorkerContext:
    """What every worker knows of the run, parsed once from `train_loop_config` and handed to the
    components: the typed config and dataset, where the run lives, the worker's place in the
    group, and the epoch's size in steps and rows."""

    config: TrainConfig
    info: DatasetInfo
    run_dir: StoragePath
    rank: int
    world: int
    steps: int  # optimiser steps per epoch, the same on any worker count
    rows_per_step: int  # rows one rank takes per optimiser step (micro-batches together)
    train_rows: int  # the training split's rows (--limit-train-rows applied)
    loop_config: dict[str, Any]  # as Ray handed it: saved in checkpoints, read by the tracker

    @classmethod
    def parse(cls, loop_config: dict[str, Any]) -> WorkerContext:
        """Raises, naming the fix, if the global batch does not split over this worker count
        (an elastic run's new size)."""
        config = TrainConfig(**loop_config["config"])
        info = DatasetInfo(**loop_config["dataset"])
        context = ray.train.get_context()
        world = context.get_world_size()
        train_rows = training_rows(info, config)
        micro = per_worker_batch_size(config.global_batch_size, world, config.grad_accum_steps)
        return cls(
            config=config,
            info=info,
            run_dir=resolve_storage(config.storage_path).join(config.run_name),
            rank=context.get_world_rank(),
            world=world,
            steps=steps_per_epoch(train_rows, config.global_batch_size),
            rows_per_step=config.grad_accum_steps * micro,
            train_rows=train_rows,
            loop_config=loop_config,
        )

    @property
    def last_step(self) -> int:
        return self.steps * self.config.epochs

    @property
    def rows_per_epoch(self) -> int:
        """Rows an epoch trains: its full global batches (the rest wait for another epoch)."""
        return self.steps * self.config.global_batch_size
