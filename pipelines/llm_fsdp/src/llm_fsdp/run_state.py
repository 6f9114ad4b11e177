"""The run's record that every checkpoint holds besides the weights (steps done, metrics rows,
faults survived, start-up), and what every worker knows of the run (`WorkerContext`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import ray.train

from llm_fsdp.config import TrainConfig
from llm_fsdp.model import ModelSpec
from raytrain_common.configs import per_worker_batch_size
from raytrain_common.loop import RunRecord
from raytrain_common.storage import StoragePath, resolve_storage
from raytrain_common.tokens.corpus import DatasetInfo


@dataclass
class RunState(RunRecord):
    """The run's record, saved in every checkpoint: the library's (faults, start-up), steps done
    and metrics rows. The data position is the step: its rows are a function of (seed, step)."""

    step: int = 0
    history: list[dict[str, float]] = dataclasses.field(default_factory=list)

    def latest_val(self) -> dict[str, float]:
        return next((row for row in reversed(self.history) if "val_loss" in row), {})


@dataclass(frozen=True)
class WorkerContext:
    """What every worker knows of the run, parsed once from `train_loop_config` for the components:
    the typed config, dataset and model, the run's folder and last step, the worker's place."""

    config: TrainConfig
    info: DatasetInfo
    spec: ModelSpec
    run_dir: StoragePath
    rank: int
    world: int
    micro: int  # sequences per micro-batch on this worker
    last_step: int  # max_steps, or --stop-at-step when it comes first
    loop_config: dict[str, Any]  # as Ray handed it: saved in checkpoints, read by the tracker

    @classmethod
    def parse(cls, loop_config: dict[str, Any]) -> WorkerContext:
        """Raises, naming the fix, if the global batch does not split over this worker count."""
        config = TrainConfig(**loop_config["config"])
        context = ray.train.get_context()
        world = context.get_world_size()
        return cls(
            config=config,
            info=DatasetInfo(**loop_config["dataset"]),
            spec=ModelSpec(**loop_config["model"]),
            run_dir=resolve_storage(config.storage_path).join(config.run_name),
            rank=context.get_world_rank(),
            world=world,
            micro=per_worker_batch_size(config.global_batch_size, world, config.grad_accum_steps),
            last_step=min(config.max_steps, config.stop_at_step or config.max_steps),
            loop_config=loop_config,
        )
