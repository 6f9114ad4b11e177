"""What an image tree's fresh order costs each epoch (`nox -s bench_epoch_order`): the window
mix `raytrain_common.images.stream` uses against a `random_shuffle` of the whole list (mnist-resnet 0.15), on the
same prepared rows, one after the other in this process on one local Ray cluster.

The rows are what `prepare` writes for a tree of `--rows` images (row, id, path, label; ~100 bytes
a row), ROWS_PER_FILE to a Parquet file, no images: the order's cost alone, without decoding.
Printed for each: seconds to the first batch of 256 rows (what a step waits for at an epoch's
start), seconds for the whole epoch, and how mixed the first batch is (classes among 256 of a
tree listed class by class), then the ratios. Defaults to 1.28 M rows (ImageNet's training
split).

    python -m benchmarks.mnist_resnet.bench_epoch_order [--rows 1280000] [--epochs 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

BATCH = 256


def write_rows(folder: Path, rows: int, rows_per_file: int) -> None:
    """A tree's prepared list: paths of 1,000 classes in a seeded random order, as prepare writes
    it (its label column: the class), numbered."""
    rng = np.random.default_rng(0)
    labels = rng.permutation(np.arange(rows) % 1000)
    for part, start in enumerate(range(0, rows, rows_per_file)):
        chunk = labels[start : start + rows_per_file]
        table = pa.table(
            {
                "row": np.arange(start, start + len(chunk)),
                "id": rng.integers(0, 2**62, len(chunk)),
                "path": [
                    f"class{label:04d}/image-{start + i:09d}.JPEG" for i, label in enumerate(chunk)
                ],
                "label": chunk,
            }
        )
        pq.write_table(table, folder / f"part-{part:03d}.parquet")


def timed_epochs(make: Callable[[], object], epochs: int) -> list[tuple[float, float, int]]:
    """(seconds to the first batch, seconds for the epoch, classes in the first batch) of each
    epoch of one dataset, executed once per epoch as Ray Train executes it."""
    dataset = make()
    results = []
    for _ in range(epochs):
        start = time.perf_counter()
        first, classes, count = None, 0, 0
        for batch in dataset.iter_batches(batch_size=BATCH, batch_format="numpy"):  # type: ignore[attr-defined]
            if first is None:
                first = time.perf_counter() - start
                classes = len(np.unique(batch["label"]))
            count += len(batch["row"])
        results.append((first or 0.0, time.perf_counter() - start, classes))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_280_000)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args(argv)

    import ray.data
    from ray.data import FileShuffleConfig, RandomSeedConfig
    from ray.data.expressions import random as random_column

    from raytrain_common.images.prepare import ROWS_PER_FILE
    from raytrain_common.images.stream import MIX_KEY, MIX_ROWS
    from raytrain_common.ingest.order import epoch_seed, mix_window
    from raytrain_common.ray_start import init_ray

    init_ray(train_cpus=1)
    context = ray.data.DataContext.get_current()
    context.use_datasource_v2 = False  # as ImageData reads
    context.enable_progress_bars = False
    seed = epoch_seed(0, 1)
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        write_rows(folder, args.rows, ROWS_PER_FILE)
        files = sorted(str(path) for path in folder.glob("*.parquet"))

        def windows() -> object:
            rows = ray.data.read_parquet(
                files, shuffle=FileShuffleConfig(seed, reseed_after_execution=True)
            )
            keyed = rows.with_column(MIX_KEY, random_column(seed=seed, reseed_after_execution=True))
            return keyed.map_batches(mix_window, batch_size=MIX_ROWS, fn_kwargs={"key": MIX_KEY})

        def whole_shuffle() -> object:
            rows = ray.data.read_parquet(files)
            return rows.random_shuffle(seed=RandomSeedConfig(seed, reseed_after_execution=True))

        measured = {
            "windows of 80,000 rows (0.16)": timed_epochs(windows, args.epochs),
            "random_shuffle of the list (0.15)": timed_epochs(whole_shuffle, args.epochs),
        }
    print(
        f"\n{args.rows:,} rows in {len(files)} files, {args.epochs} epochs each, batches of {BATCH}"
    )
    print(f"{'order':36} {'first batch s':>14} {'epoch s':>9} {'classes in it':>14}")
    for name, epochs in measured.items():
        for first, whole, classes in epochs:
            print(f"{name:36} {first:14.2f} {whole:9.2f} {classes:14d}")
    new, old = (np.array(epochs)[:, :2].mean(axis=0) for epochs in measured.values())
    print(
        f"random_shuffle ÷ windows: first batch {old[0] / new[0]:.1f}×, epoch {old[1] / new[1]:.1f}×"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
