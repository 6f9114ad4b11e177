"""The run's record that every checkpoint holds beside the Trainer's own state (which has the steps,
weights, optimiser, schedule and data order), and what every worker knows (`WorkerContext`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray.train

from hf_finetune.config import TrainConfig
from raytrain_common.labelled.prepare import DatasetInfo
from raytrain_common.loop import RunRecord
from raytrain_common.storage import StoragePath, resolve_storage


@dataclass
class RunState(RunRecord):
    """The run's record, saved in every checkpoint (run_record.json): the library's (faults,
    start-up), the dtype the forward pass computed in, the model's parameter counts (all, and
    those that train: fewer under LoRA), and the DeepSpeed engine the shards depend on."""

    compute_dtype: str | None = None
    parameters: int | None = None
    trainable_parameters: int | None = None
    deepspeed: dict[str, Any] | None = None  # raytrain_common.zero.engine_record; None: DDP


@dataclass(frozen=True)
class WorkerContext:
    """What every worker knows of the run, parsed once from `train_loop_config` for the components:
    the typed config and dataset, the model, where the run lives, the worker's place."""

    config: TrainConfig
    info: DatasetInfo
    model: str  # the Hugging Face folder or hub id the driver resolved
    run_dir: StoragePath
    rank: int
    world: int
    loop_config: dict[str, Any]  # as Ray handed it: read by the tracker

    @classmethod
    def parse(cls, loop_config: dict[str, Any]) -> WorkerContext:
        config = TrainConfig(**loop_config["config"])
        context = ray.train.get_context()
        return cls(
            config=config,
            info=DatasetInfo(**loop_config["dataset"]),
            model=loop_config["model"],
            run_dir=resolve_storage(config.storage_path).join(config.run_name),
            rank=context.get_world_rank(),
            world=context.get_world_size(),
            loop_config=loop_config,
        )
