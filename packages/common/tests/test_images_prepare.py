"""`images.prepare` of an image tree, called directly with Ray Data on the session's local cluster
(no worker group): every file checked once, a broken one left out and listed, the splits carved
with every class in each, and the fingerprint a checkpoint is tied to the same on a rerun."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from raytrain_common.images.dataset import inspect_dataset
from raytrain_common.images.prepare import prepare
from raytrain_common.storage import resolve_storage

CLASSES = ("cat", "dog", "fox")
PER_CLASS = 70


def write_tree(root: Path) -> Path:
    """A class-per-folder tree of small PNGs (each class its own colour and noise), with one file
    cut short, as a copy interrupted mid-file leaves it."""
    rng = np.random.default_rng(0)
    for index, name in enumerate(CLASSES):
        folder = root / name
        folder.mkdir(parents=True)
        for item in range(PER_CLASS):
            pixels = rng.integers(0, 60, (20, 24, 3), dtype=np.uint8)
            pixels[..., index] += 180
            Image.fromarray(pixels).save(folder / f"{item:03d}.png")
    broken = root / "dog" / "cut.png"
    encoded = io.BytesIO()
    Image.fromarray(np.zeros((20, 24, 3), dtype=np.uint8)).save(encoded, format="PNG")
    broken.write_bytes(encoded.getvalue()[:40])
    return broken


@pytest.mark.ray
def test_a_tree_is_prepared_with_its_broken_file_listed_and_every_class_in_each_split(
    ray_cluster: None, tmp_path: Path
) -> None:
    broken = write_tree(tmp_path / "tree")
    data_dir = resolve_storage(tmp_path / "data")
    info = prepare(str(tmp_path / "tree"), data_dir, tmp_path / "download", image_size=16)
    assert info.class_names == list(CLASSES) and info.channels == 3
    assert (info.height, info.width) == (16, 16)
    assert info.train_rows + info.val_rows + info.test_rows == len(CLASSES) * PER_CLASS
    assert info.bad_files == 1
    with open(tmp_path / "data" / "bad_files.csv", encoding="utf-8") as listed:
        rows = list(csv.DictReader(listed))
    assert len(rows) == 1 and rows[0]["file"].endswith("dog/cut.png"), rows
    assert inspect_dataset(data_dir, "prepare") == info  # what train reads back
    for split in ("train", "validation", "test"):
        labels = np.concatenate(
            [np.asarray(part["label"]) for part in _parquet_rows(tmp_path / "data" / split)]
        )
        assert set(labels.tolist()) == {0, 1, 2}, split  # stratified: every class in each split
    again = prepare(
        str(tmp_path / "tree"), data_dir, tmp_path / "download", image_size=16, force=True
    )
    assert again.fingerprint == info.fingerprint != ""
    assert broken.exists()  # the user's files are read, never moved or deleted


def _parquet_rows(folder: Path) -> list[dict[str, object]]:
    import pyarrow.parquet as pq

    files = sorted(folder.glob("*.parquet"))
    return [pq.read_table(file, columns=["label"]).to_pydict() for file in files]
