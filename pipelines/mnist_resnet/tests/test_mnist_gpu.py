"""The `gpu` preset where CUDA is (skipped elsewhere): bf16 autocast in effect, the loss falls, an
epoch's checkpoint resumes into the next, and full MNIST reaches the accuracy the preset claims."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from mnist_resnet.config import gpu_preset
from mnist_resnet.train import run
from raytrain_common.metrics import read_metrics_csv
from raytrain_common.storage import StoragePath, resolve_storage

pytestmark = [pytest.mark.gpu, pytest.mark.ray]


def test_gpu_preset_trains_in_bf16_and_resumes(
    ray_cluster: None, mnist_dir: StoragePath, tmp_path: Path
) -> None:
    config = dataclasses.replace(
        gpu_preset(),
        storage_path=str(tmp_path),
        data_dir=mnist_dir.uri,
        run_name="gpu",
        epochs=1,
        limit_test_rows=2000,
    )
    first = run(config)
    assert first["epochs_done"] == 1
    resumed = run(dataclasses.replace(config, epochs=2))  # continues after epoch 1
    assert resumed["epochs_done"] == 2

    rows = read_metrics_csv(resolve_storage(tmp_path / "gpu" / "metrics.csv"))
    assert [int(row["epoch"]) for row in rows] == [1, 2]
    assert all(math.isfinite(row["train_loss"]) for row in rows)
    assert rows[1]["train_loss"] < rows[0]["train_loss"]
    assert resumed["compute_dtype"] == "bfloat16"  # autocast really in effect
    assert resumed["test"]["test_accuracy"] >= 0.98  # two epochs of 60k images; chance is 0.10
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    assert 0 < resumed["peak_memory_gb"] < total
