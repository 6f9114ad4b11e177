"""Benchmark: steady-state training images/s of the 2-worker Ray Train pipeline ÷ the plain baseline.

Both run here, one after the other, on the same cores and the same rows, so the ratio is what Ray
Train, Ray Data and DDP cost (or gain) over a single PyTorch process. Start-up is reported apart.

    python -m mnist_resnet.bench [--rows 15360] [--storage-path ./runs]
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import shutil
import time

import torch

from mnist_resnet.baseline import run_baseline
from mnist_resnet.config import cpu_preset
from mnist_resnet.train import run
from raytrain_common.metrics import write_metrics_csv
from raytrain_common.storage import resolve_storage

RUN_NAME = "bench_mnist"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mnist_resnet.bench", description=__doc__)
    parser.add_argument("--rows", type=int, default=15_360, help="training rows (default: 15360)")
    parser.add_argument("--storage-path", default="./runs", help="(default: ./runs)")
    parser.add_argument("--num-workers", type=int, default=2, help="Ray workers (default: 2)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    config = dataclasses.replace(
        cpu_preset(),
        storage_path=args.storage_path,
        run_name=RUN_NAME,
        num_workers=args.num_workers,
        epochs=1,
        limit_train_rows=args.rows,
        limit_test_rows=1000,
        log_every_steps=20,
    )
    run_dir = resolve_storage(args.storage_path).join(RUN_NAME)
    if run_dir.is_dir():  # a benchmark measures a fresh run, never a resumed one
        shutil.rmtree(run_dir.path) if run_dir.is_local else run_dir.filesystem.delete_dir(
            run_dir.path
        )

    baseline = run_baseline(config)["history"][0]
    started = time.perf_counter()
    summary = run(config)
    ray_wall = time.perf_counter() - started
    ray_epoch = summary["final"]
    ratio = ray_epoch["train_images_per_s"] / baseline["train_images_per_s"]
    rows = [
        {
            "pipeline": "baseline (1 process)",
            "threads": torch.get_num_threads(),
            "images_per_s": baseline["train_images_per_s"],
            "epoch_train_s": baseline["epoch_train_s"],
            "startup_s": 0.0,
        },
        {
            "pipeline": f"ray train ({args.num_workers} workers)",
            "threads": 1,
            "images_per_s": ray_epoch["train_images_per_s"],
            "epoch_train_s": ray_epoch["epoch_train_s"],
            # Everything the Ray run spent outside its training and evaluation loops.
            "startup_s": ray_wall - ray_epoch["epoch_train_s"] - ray_epoch["epoch_eval_s"],
        },
    ]
    csv_file = resolve_storage(args.storage_path).join("bench", "bench_mnist.csv")
    write_metrics_csv(csv_file, [*rows, {"pipeline": "ratio", "images_per_s": ratio}])
    print(f"\n{'pipeline':<24}{'threads/proc':>13}{'images/s':>10}{'epoch s':>9}{'start-up s':>12}")
    for row in rows:
        print(
            f"{row['pipeline']:<24}{row['threads']:>13}{row['images_per_s']:>10.1f}"
            f"{row['epoch_train_s']:>9.1f}{row['startup_s']:>12.1f}"
        )
    print(f"\nratio (ray train ÷ baseline, steady-state images/s): {ratio:.3f}   target ≥ 0.97")
    print(f"rows: {args.rows}, global batch {config.global_batch_size}; written to {csv_file}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
