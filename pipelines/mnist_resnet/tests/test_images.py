"""A user's own images: a class-per-folder tree of PNG / JPEG / WebP files of two sizes and two
modes, prepared with Ray Data, trained on 2 workers, and new files classified with `predict
--input`."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from mnist_resnet.cli import main
from mnist_resnet.data import DatasetInfo
from mnist_resnet.train import run
from raytrain_common.storage import resolve_storage

pytestmark = pytest.mark.ray

CLASSES = ("disc", "horizontal", "vertical")


def shape_image(kind: str, size: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """A noisy RGB picture of one class: a disc, or stripes across or down, at a random phase."""
    width, height = size
    y, x = np.mgrid[0:height, 0:width]
    period, phase = rng.uniform(6, 10), rng.uniform(0, 6)
    if kind == "disc":
        cy, cx = height / 2 + rng.uniform(-3, 3), width / 2 + rng.uniform(-3, 3)
        mask = (y - cy) ** 2 + (x - cx) ** 2 < (min(size) * rng.uniform(0.25, 0.4)) ** 2
    elif kind == "horizontal":
        mask = np.sin(2 * np.pi * (y + phase) / period) > 0
    else:
        mask = np.sin(2 * np.pi * (x + phase) / period) > 0
    base = rng.uniform(0, 80, 3)
    colour = rng.uniform(150, 255, 3)
    pixels = np.where(mask[..., None], colour, base) + rng.normal(0, 20, (height, width, 3))
    return np.clip(pixels, 0, 255).astype(np.uint8)


def write_tree(root: Path, per_class: int, seed: int, nested: bool = True) -> None:
    """Two sizes (48×40, 32×32), grey and RGB, saved as PNG, JPEG and WebP, in nested folders."""
    rng = np.random.default_rng(seed)
    for kind in CLASSES:
        for index in range(per_class):
            size = (48, 40) if index % 2 else (32, 32)
            image = Image.fromarray(shape_image(kind, size, rng))
            if index % 3 == 0:
                image = image.convert("L")
            suffix = (".png", ".jpg", ".webp")[index % 3]
            folder = root / kind / (f"batch{index % 2}" if nested else "")
            folder.mkdir(parents=True, exist_ok=True)
            image.save(folder / f"{kind}_{index}{suffix}")
    (root / "disc" / "README.txt").write_text("not an image: skipped")


def test_an_image_tree_prepares_trains_on_two_workers_and_predicts_new_files(
    small_config: Callable[..., Any],
    ray_cluster: None,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    tree, data_dir = tmp_path / "shapes", tmp_path / "data"
    write_tree(tree, per_class=100, seed=0)
    assert main(["prepare", "--source", str(tree), "--data-dir", str(data_dir)]) == 0
    info = DatasetInfo(**json.loads((data_dir / "dataset.json").read_text()))
    assert info.class_names == list(CLASSES)
    assert (info.height, info.width, info.channels) == (36, 36, 3)  # median of 40 and 32; some RGB
    assert info.test_rows == 60  # 10 % of 300 is 30, under a batch of 64: 20 % of a small tree
    assert info.val_rows == 48  # then 10 % of the 240 left is 24, under a batch: 20 % of them
    assert info.train_rows + info.val_rows + info.test_rows == 300
    assert info.notes["skipped_files"] == {".txt": 1}
    assert len(info.mean) == 3 and all(s > 0 for s in info.std)

    config = small_config(
        tmp_path,
        resolve_storage(data_dir),
        run_name="shapes",
        epochs=6,
        global_batch_size=32,
        lr=0.05,
        limit_train_rows=None,
        limit_val_rows=None,
        limit_test_rows=None,
    )
    summary = run(config)
    assert summary["test"]["test_accuracy"] >= 0.8  # chance is 1/3

    new_images = tmp_path / "new"
    write_tree(new_images, per_class=10, seed=1, nested=False)
    # A folder: Ray Data batch inference into Parquet, one row per file.
    assert (
        main(
            [
                "predict",
                "--storage-path",
                str(tmp_path),
                "--run-name",
                "shapes",
                "--input",
                str(new_images),
                "--predictions",
                str(tmp_path / "predicted"),
            ]
        )
        == 0
    )
    rows = pq.read_table(tmp_path / "predicted").to_pylist()
    images = sorted(str(f) for f in new_images.rglob("*") if f.suffix in {".png", ".jpg", ".webp"})
    assert sorted(row["path"] for row in rows) == images  # README.txt skipped
    assert not any(row["error"] for row in rows)
    right = sum(Path(row["path"]).parent.name == row["label"] for row in rows)
    assert right >= 0.8 * len(rows)
    assert all(0 < row["probability"] <= 1 for row in rows)
    # One file: answered at once, in this process.
    capsys.readouterr()
    one = images[0]
    assert (
        main(
            [
                "predict",
                "--storage-path",
                str(tmp_path),
                "--run-name",
                "shapes",
                "--input",
                str(one),
            ]
        )
        == 0
    )
    [line] = capsys.readouterr().out.strip().splitlines()
    label, probability, file = line.split("\t")
    assert file == one and label in CLASSES and 0 < float(probability) <= 1

    assert main(["predict", "--storage-path", str(tmp_path), "--run-name", "shapes"]) == 0
    assert (tmp_path / "shapes" / "predictions.png").read_bytes()[:4] == b"\x89PNG"
