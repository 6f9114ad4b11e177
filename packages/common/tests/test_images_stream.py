"""The image stream (`raytrain_common.images.stream.ImageData`) on data as users have it: written
in class order. Every epoch is a fresh global order of the whole split, mixed from its first batch,
and a resumed epoch reads exactly the rows it had not trained (the record a checkpoint holds,
`raytrain_common.ingest.epochs.SavedPosition`). Ray Data on a local cluster, no worker group."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray.data
from PIL import Image

from raytrain_common.checkpoint import save_state, write_manifest
from raytrain_common.images.dataset import DATASET_FILE, FORMAT, DatasetInfo, Split
from raytrain_common.images.stream import ImageData
from raytrain_common.images.tree import path_id
from raytrain_common.ingest.epochs import POSITION_FILE, SavedPosition

# Largest gap allowed between the class shares of an epoch's first half and the split's. Half an
# epoch of 6,000 rows gives a standard error of ~0.0055 per class share; 0.03 is over 5 of them,
# while the first half of a class-sorted split holds only half the classes (a gap of 0.1).
MAX_SHARE_GAP = 0.03
ROWS = 6000
MIX_ROWS_HERE = 1000


def digits(rows: int) -> Split:
    """`rows` 28×28 grey images of 10 classes (a bright bar whose place is the class, on seeded
    noise), the classes in a seeded order: pixels that differ image to image, so a crop shows."""
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 10, rows)
    images = rng.integers(0, 96, (rows, 28, 28), dtype=np.uint8)
    for index, label in enumerate(labels):
        images[index, 2 + 2 * label : 4 + 2 * label, 4:24] = 255
    return Split(images, labels.astype(np.int64))


def class_sorted_dataset(folder: Path, rows_per_file: int = 500) -> ImageData:
    """`ROWS` 28×28 grey images of 10 classes as a PNG tree listed in class order (as a
    folder-by-folder read of a sorted tree gives it), its list written as prepare writes it (a
    seeded random order, numbered), in files of `rows_per_file` rows; windows of MIX_ROWS_HERE rows
    (2 files), so an epoch mixes 12 files in 6 windows, as 1.28 M images mix 128 files in 16."""
    train = digits(ROWS)
    order = np.argsort(train.labels[:ROWS], kind="stable")
    paths = []
    for index in order:
        path = f"{int(train.labels[index])}/{index:05d}.png"
        (folder / "tree" / path).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(train.images[index]).save(folder / "tree" / path)
        paths.append(path)
    shuffled = np.random.default_rng(0).permutation(ROWS)
    rows = pa.table(
        {
            "row": np.arange(ROWS),
            "id": [path_id(paths[index]) for index in shuffled],
            "path": [paths[index] for index in shuffled],
            "label": train.labels[:ROWS][order][shuffled],
        }
    )
    # `val/`, as earlier versions wrote it: still read (`validation/` now).
    for name in ("train", "val", "test"):
        (folder / name).mkdir(parents=True)
        for part, start in enumerate(range(0, ROWS, rows_per_file)):
            table = rows.slice(start, rows_per_file)
            pq.write_table(table, folder / name / f"part-{part:03d}.parquet")
    info = DatasetInfo(
        "sorted",
        10,
        28,
        28,
        0.1307,
        0.3081,
        ROWS,
        ROWS,
        ROWS,
        format=FORMAT,
        image_root=str(folder / "tree"),
    )
    (folder / DATASET_FILE).write_text(json.dumps(dataclasses.asdict(info)))
    run_dir = str(folder / "run")
    return ImageData(str(folder), dataclasses.asdict(info), run_dir, seed=0, mix_rows=MIX_ROWS_HERE)


def files_in_order(rows: np.ndarray) -> list[int]:
    """The files (of 500 rows) an epoch read, in the order their first row came."""
    files = rows // 500
    _, first = np.unique(files, return_index=True)
    return [int(files[index]) for index in np.sort(first)]


def read_epoch(dataset: ray.data.Dataset) -> tuple[np.ndarray, np.ndarray]:
    """(rows, labels) of one execution of the dataset (one epoch), in the order they stream out."""
    batches = list(dataset.iter_batches(batch_size=64, batch_format="numpy"))
    columns = (np.concatenate([b[name] for b in batches]) for name in ("row", "label"))
    return tuple(columns)  # type: ignore[return-value]


def checkpoint_with_trained_rows(run_dir: Path, epoch: int, trained_ids: np.ndarray) -> None:
    """A checkpoint folder as the loop writes one mid-epoch: state.pt, the position file,
    manifest."""
    folder = run_dir / "checkpoint_2026-01-01_00-00-00.000000"
    bits = np.zeros((ROWS + 7) // 8, np.uint8)
    np.bitwise_or.at(bits, trained_ids >> 3, np.left_shift(1, trained_ids & 7).astype(np.uint8))
    save_state(folder, {"step": 0})
    (folder / POSITION_FILE).write_bytes(SavedPosition(epoch, bits).to_bytes())
    write_manifest(folder)


@pytest.mark.ray
def test_every_epoch_is_a_fresh_order_of_the_whole_split_and_a_resume_reads_only_the_rest(
    ray_cluster: None, tmp_path: Path
) -> None:
    """An image tree listed in class order: every epoch reads prepare's files in a fresh order and
    permutes its rows in windows before any image is read (no pass over the split first), so
    classes are mixed from the first batch on, every row comes once, and each epoch's order is
    new. Were the rows taken as prepare wrote them (no mixing), every file's rows would come in
    ascending order and each epoch's order would repeat; were the files' order fixed, both
    epochs would start with the same files."""
    data = class_sorted_dataset(tmp_path / "sorted")
    train = data.train()  # Ray Train executes this one dataset once per epoch
    ids, labels = read_epoch(train)
    split_share = np.bincount(np.sort(labels), minlength=10) / ROWS
    # Every row once, mixed from the first batch on, not by the end of the epoch.
    assert np.array_equal(np.sort(ids), np.arange(ROWS))
    assert len(np.unique(labels[:64])) >= 9
    first_half = np.bincount(labels[: ROWS // 2], minlength=10) / (ROWS // 2)
    assert np.abs(first_half - split_share).max() < MAX_SHARE_GAP, first_half
    # Windows mix files: the first window's rows come from more than one file (rows // 500),
    # in no file's own order.
    first_window = ids[:MIX_ROWS_HERE]
    assert len(np.unique(first_window // 500)) >= 2
    assert not np.all(np.diff(first_window[first_window // 500 == first_window[0] // 500]) > 0)
    # The next execution (the next epoch) draws another order, starting with other files.
    again, _ = read_epoch(train)
    assert np.array_equal(np.sort(again), np.arange(ROWS))
    assert (again != ids).mean() > 0.9
    assert files_in_order(again) != files_in_order(ids)

    # The photo recipe crops while Ray Data decodes: every row still once, at the tree's side,
    # and other pixels than the centre crop (the rows' order differs too: compare by row).
    photo = dataclasses.replace(data, crop_scale=0.08).train()  # the photo recipe's crop
    batches = list(photo.iter_batches(batch_size=512, batch_format="numpy"))
    rows = np.concatenate([batch["row"] for batch in batches])
    assert np.array_equal(np.sort(rows), np.arange(ROWS))
    cropped = np.concatenate([batch["image"] for batch in batches])[np.argsort(rows)]
    centred = list(data.split("train").iter_batches(batch_size=512, batch_format="numpy"))
    order = np.argsort(np.concatenate([batch["row"] for batch in centred]))
    plain = np.concatenate([batch["image"] for batch in centred])[order]
    assert cropped.shape == plain.shape == (ROWS, 1, 28, 28)
    assert (cropped != plain).any(axis=(1, 2, 3)).mean() > 0.9

    # A run stopped a third into its epoch 3: the rest of that epoch is exactly the other rows.
    trained = ids[: ROWS // 3]
    checkpoint_with_trained_rows(tmp_path / "sorted" / "run", 3, trained)
    rest, _ = read_epoch(data.rest_of_epoch())
    assert np.array_equal(np.sort(np.concatenate([trained, rest])), np.arange(ROWS))
