"""The `gpu` preset where CUDA is (skipped elsewhere): MiniLM on VADER learns in bf16 (checked by
the dtype its forward pass computes in) and an epoch's checkpoint resumes into the next.

Offline GPU machines: set RAYTRAIN_VADER_SDIST to a local vaderSentiment-3.3.2.tar.gz (the kit
carries one); without it and without PyPI the test is skipped, with the reason.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from hf_finetune.config import PrepareConfig, gpu_preset
from hf_finetune.data import prepare
from hf_finetune.model import ModelError, default_model
from hf_finetune.train import run
from raytrain_common.metrics import read_metrics_csv
from raytrain_common.storage import resolve_storage

pytestmark = [pytest.mark.gpu, pytest.mark.ray]


def test_gpu_preset_learns_in_bf16_and_resumes(
    ray_cluster: None, tmp_path: Path, vader_sdist: Path
) -> None:
    try:
        minilm = default_model()
    except ModelError as error:
        pytest.skip(str(error))
    data_dir = resolve_storage(tmp_path / "data")
    prepare(PrepareConfig(vader_sdist=str(vader_sdist)), data_dir, minilm, tmp_path / "download")
    config = dataclasses.replace(
        gpu_preset(),
        storage_path=str(tmp_path),
        data_dir=data_dir.uri,
        run_name="gpu",
        epochs=1,
        limit_train_rows=4096,
        limit_val_rows=1024,
        limit_test_rows=1024,
        log_every_steps=10,
    )
    assert config.bf16
    first = run(config)
    assert first["epochs_done"] == 1
    resumed = run(dataclasses.replace(config, epochs=2))  # continues after epoch 1
    assert resumed["epochs_done"] == 2

    rows = read_metrics_csv(resolve_storage(tmp_path / "gpu" / "metrics.csv"))
    assert [int(row["epoch"]) for row in rows] == [1, 2]
    assert all(math.isfinite(row["val_loss"]) for row in rows)
    assert resumed["best"]["val_accuracy"] >= 0.70  # the majority class is 0.54
    assert resumed["compute_dtype"] == "bfloat16"  # the Trainer's bf16 autocast really in effect
    # The chosen checkpoint scored on the test split once, in a Ray task holding a GPU.
    assert resumed["test"]["test_rows"] == 1024 and resumed["test"]["test_accuracy"] >= 0.70
