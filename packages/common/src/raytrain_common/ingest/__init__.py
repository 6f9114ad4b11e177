"""The training ingest a pipeline copies unchanged: every row once per epoch on any worker count
and across resumes (`epochs`), the order functions Ray Data runs (`order`), the datasets' names and
Ray Train's `DataConfig` for them with placement on labelled CPU-only nodes (`data_config`), and
the driver's watch over those nodes (`watch`).

    rows = TrainingRows(run_dir, rank, train_rows, steps_per_epoch, global_batch_size)
    rows.load_state_dict(saved)                      # a resumed epoch reads only the rest
    shard = ray.train.get_dataset_shard(rows.dataset())
    for batch in rows.counted(shard.iter_torch_batches(...), epoch, step): ...
    bitmap = rows.trained()                          # with every checkpoint (a collective)
"""

from __future__ import annotations

import importlib
from typing import Any

# Imported on first use, not with the package: Ray Data's tasks import `ingest.order` and Ray
# Train's dataset manager `ingest.data_config`, and neither should pay for torch (`epochs`).
PUBLIC = {
    "REST_OF_EPOCH": "data_config",
    "TRAIN": "data_config",
    "VAL": "data_config",
    "EvenTrainingEveryValidationRow": "data_config",
    "POSITION_FILE": "epochs",
    "DataChangedError": "epochs",
    "DataShardError": "epochs",
    "SavedPosition": "epochs",
    "TrainingRows": "epochs",
    "check_resumable": "epochs",
    "saved_position": "epochs",
    "epoch_seed": "order",
    "IngestLostError": "watch",
    "IngestNodeWatch": "watch",
    "check_cpus_for_ingest": "watch",
}
__all__ = sorted(PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{PUBLIC[name]}"), name)
