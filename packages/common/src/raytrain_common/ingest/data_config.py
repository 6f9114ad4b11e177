"""The run's datasets' names and Ray Train's `DataConfig` for them.

Kept apart from `ingest.epochs` and free of torch: Ray Train's DatasetManager actor unpickles
this config at every worker group's start, and importing torch there cost
(~2.5 CPU-seconds in that actor, on the start's critical path on a 2-core box).
"""

from __future__ import annotations

import copy
from typing import Any

import ray.data
from ray.data import ExecutionOptions
from ray.train import DataConfig

TRAIN = "train"
REST_OF_EPOCH = "train_rest_of_epoch"  # the rows of a resumed epoch not trained before the stop
VAL = "val"


class EvenTrainingEveryValidationRow(DataConfig):
    """Ray Train's DataConfig with every dataset's tasks on the nodes `ingest_labels` selects
    (Ray 2.60's `ExecutionOptions(label_selector=...)`: CPU-only ingest nodes, so the training
    nodes' CPUs feed their GPUs), and the validation split split unevenly.

    Training needs the equal split (every rank the same batches, or DDP waits for ever); an equal
    split of the validation rows would drop up to world − 1 of them, so the score that picks
    checkpoints would change with the worker count. Evaluation has no per-batch collective, so
    ranks may hold different numbers of rows there. The options are given whole (not Ray's
    defaults, which still set the deprecated `exclude_resources` and warn in every run).

    `ordered` (--reproducible): Ray Data's `preserve_order`. Without it the equal split hands each
    decoded block to a rank as soon as Ray knows the block is on that rank's node, so which rows
    a rank gets, and in what order, depends on timing: one epoch in 50 split differently on a
    loaded 2-core box. With it the split ignores locality and deals the blocks in the dataset's
    order."""

    def __init__(self, ingest_labels: dict[str, str] | None = None, ordered: bool = False) -> None:
        self.options = ExecutionOptions(label_selector=ingest_labels, preserve_order=ordered)
        super().__init__(execution_options=self.options)

    def configure(  # type: ignore[override]
        self,
        datasets: dict[str, ray.data.Dataset],
        world_size: int,
        worker_handles: Any,
        worker_node_ids: Any,
        **kwargs: Any,
    ) -> list[dict[str, Any]]:
        if set(datasets) != {VAL}:
            return super().configure(
                datasets, world_size, worker_handles, worker_node_ids, **kwargs
            )
        dataset = datasets[VAL].copy(datasets[VAL])
        dataset.context.execution_options = copy.deepcopy(self.options)
        shards = dataset.streaming_split(world_size, equal=False, locality_hints=worker_node_ids)
        return [{VAL: shard} for shard in shards]
