"""Benchmark: steady-state training images/s of the 2-worker Ray Train pipeline ÷ the plain baseline.

All run here, one after the other, on the same cores and the same rows, so the ratio is what Ray
Train, Ray Data and DDP cost (or gain) over a single PyTorch process. A third run, plain DDP in
processes started by torch.multiprocessing on data held in memory, splits that cost into what DDP's
gradient all-reduce takes and what Ray adds. Start-up is reported apart.

    python -m mnist_resnet.bench [--rows 15360] [--storage-path ./runs]
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F  # noqa: N812

from mnist_resnet.baseline import run_baseline
from mnist_resnet.config import TrainConfig, cpu_preset
from mnist_resnet.data import inspect_dataset, normalise, read_split_arrays
from mnist_resnet.model import build_model
from mnist_resnet.train import (
    THROUGHPUT_SKIP_STEPS,
    build_optimizer,
    run,
    steps_per_epoch,
    warmup_cosine,
)
from raytrain_common.configs import per_worker_batch_size
from raytrain_common.metrics import write_metrics_csv
from raytrain_common.storage import resolve_storage

RUN_NAME = "bench_mnist"


def plain_ddp_worker(rank: int, world: int, port: int, config: TrainConfig, results: dict) -> None:
    """One rank of DDP without Ray: gloo, one thread, this rank's slice of the rows in memory."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    data_dir = resolve_storage(config.resolved_data_dir())
    info = inspect_dataset(data_dir)
    train = read_split_arrays(data_dir, "train", config.limit_train_rows)
    images = torch.from_numpy(train.images[rank::world]).unsqueeze(1)
    labels = torch.from_numpy(train.labels[rank::world])
    micro = per_worker_batch_size(config.global_batch_size, world)
    steps = steps_per_epoch(len(train.labels), world, micro, 1)
    torch.manual_seed(config.seed)
    model = torch.nn.parallel.DistributedDataParallel(build_model(info.num_classes))
    optimizer = build_optimizer(model, config)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(steps, config.warmup_fraction)
    )
    order = torch.randperm(len(labels))
    for step in range(1, steps + 1):
        if step == THROUGHPUT_SKIP_STEPS + 1:
            steady_start = time.perf_counter()
        index = order[(step - 1) * micro : step * micro]
        loss = F.cross_entropy(model(normalise(images[index], info.mean, info.std)), labels[index])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
    if rank == 0:
        elapsed = time.perf_counter() - steady_start
        results["images_per_s"] = (
            config.global_batch_size * (steps - THROUGHPUT_SKIP_STEPS) / elapsed
        )
    dist.destroy_process_group()


def run_plain_ddp(config: TrainConfig) -> float:
    """Steady-state images/s of DDP over `num_workers` processes without Ray."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(
            plain_ddp_worker,
            args=(config.num_workers, port, config, results),
            nprocs=config.num_workers,
        )
        return float(results["images_per_s"])


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
        run_dir.filesystem.delete_dir(run_dir.path)

    baseline = run_baseline(config)["history"][0]
    plain_ddp = run_plain_ddp(config)
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
            "pipeline": f"plain DDP ({args.num_workers} procs)",
            "threads": 1,
            "images_per_s": plain_ddp,
            "epoch_train_s": float("nan"),
            "startup_s": float("nan"),
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
    print(
        f"of which DDP's all-reduce on these cores: plain DDP ÷ baseline = "
        f"{plain_ddp / baseline['train_images_per_s']:.3f}; Ray Train + Ray Data ÷ plain DDP = "
        f"{ray_epoch['train_images_per_s'] / plain_ddp:.3f}"
    )
    print(f"rows: {args.rows}, global batch {config.global_batch_size}; written to {csv_file}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
