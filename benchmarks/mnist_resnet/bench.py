"""Benchmark: steady-state training images/s of the Ray Train pipeline ÷ the plain baseline.

All run here, one after the other, on the same device and the same rows, so the ratio is what Ray
Train, Ray Data and DDP cost (or gain) over a single PyTorch process. On a CPU box: the `cpu` preset
with 2 workers, plus plain DDP in processes started by torch.multiprocessing on data held in memory
(what DDP's gradient all-reduce takes, apart from what Ray adds), plus the previous version of this
pipeline (`--previous`, a git commit: its row-file reader, run from a git worktree of that commit).
On a GPU machine: the `gpu` preset (bf16, batch 512), one worker per GPU, all 60k rows, with MFU,
peak memory and the share of each step spent waiting for data. Start-up and time to the first
batch are reported apart, and first, start-up as a user meets it: `mnist-resnet train` in a fresh
process (its own local Ray cluster), seconds to its first optimiser step, phase by phase
(summary.json's `startup_phases`).

    python -m benchmarks.mnist_resnet.bench [--preset cpu|gpu] [--rows N] [--epochs N] [--storage-path ./runs]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.mnist_resnet.baseline import run_baseline
from mnist_resnet.cli import USER_ERRORS
from mnist_resnet.config import PRESETS, TrainConfig
from mnist_resnet.run_state import steps_per_epoch
from mnist_resnet.task import build_model, loss_fn, normalise
from mnist_resnet.train import (
    THROUGHPUT_SKIP_STEPS,
    build_optimizer,
    learning_rate,
    run,
    set_learning_rate,
)
from raytrain_common.configs import per_worker_batch_size
from raytrain_common.hardware import mfu
from raytrain_common.images.dataset import inspect_dataset
from raytrain_common.images.stream import read_split_arrays
from raytrain_common.metrics import write_metrics_csv
from raytrain_common.storage import resolve_storage

RUN_NAME = "bench_mnist"
# The last version that read rows from node-local row files instead of Ray Data (mnist-resnet
# 0.10.0).
PREVIOUS = "caf810e"
REPOSITORY = Path(__file__).resolve().parents[2]


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
    steps = steps_per_epoch(len(train.labels), config.global_batch_size)
    torch.manual_seed(config.seed)
    model = torch.nn.parallel.DistributedDataParallel(build_model(info.num_classes))
    optimizer = build_optimizer(model, config)
    order = torch.randperm(len(labels))
    for step in range(1, steps + 1):
        if step == THROUGHPUT_SKIP_STEPS + 1:
            steady_start = time.perf_counter()
        index = order[(step - 1) * micro : step * micro]
        loss = loss_fn(model(normalise(images[index], info.mean, info.std)), labels[index])
        loss.backward()
        set_learning_rate(optimizer, learning_rate(step - 1, steps, config))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
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


def run_previous_version(commit: str, config: TrainConfig, storage: Path) -> float | None:
    """Steady-state images/s of the pipeline at `commit`, trained on the same rows: its code from
    a git worktree (ahead of the installed packages on PYTHONPATH), its own prepared folder (its
    format), its own local Ray cluster. None when this is no git checkout."""
    if not (REPOSITORY / ".git").exists():
        return None
    with tempfile.TemporaryDirectory(prefix="bench-previous-") as folder:
        tree = Path(folder) / "tree"
        subprocess.run(
            ["git", "-C", str(REPOSITORY), "worktree", "add", "--detach", str(tree), commit],
            check=True,
            capture_output=True,
        )
        try:
            sources = [*sorted(tree.glob("pipelines/*/src")), tree / "packages" / "common" / "src"]
            env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
            env["PYTHONPATH"] = os.pathsep.join(map(str, sources))
            data = Path(folder) / "data"
            command = [sys.executable, "-m", "mnist_resnet"]
            subprocess.run([*command, "prepare", "--data-dir", str(data)], env=env, check=True)
            subprocess.run(
                [
                    *command,
                    "train",
                    "--preset",
                    "cpu",
                    "--data-dir",
                    str(data),
                    "--storage-path",
                    str(storage),
                    "--run-name",
                    f"{RUN_NAME}_previous",
                    "--epochs",
                    str(config.epochs),
                    "--limit-train-rows",
                    str(config.limit_train_rows),
                    "--limit-val-rows",
                    "1000",
                    "--limit-test-rows",
                    "1000",
                    "--tracking",
                    "none",
                    "--num-workers",
                    str(config.num_workers),
                ],
                env=env,
                check=True,
            )
        finally:
            subprocess.run(
                ["git", "-C", str(REPOSITORY), "worktree", "remove", "--force", str(tree)],
                check=False,
                capture_output=True,
            )
    summary = json.loads((storage / f"{RUN_NAME}_previous" / "summary.json").read_text())
    return float(summary["final"]["train_images_per_s"])


def training_flops_per_image(num_classes: int, height: int, width: int) -> float:
    """Forward + backward FLOPs of one image through the model, as torch's FLOP counter sees
    them."""
    from torch.utils.flop_counter import FlopCounterMode

    model = build_model(num_classes)
    counter = FlopCounterMode(display=False)
    with counter:
        loss_fn(model(torch.randn(2, 1, height, width)), torch.tensor([0, 1])).backward()
    return counter.get_total_flops() / 2


def main(argv: list[str] | None = None) -> int:
    on_gpu = torch.cuda.is_available()
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.mnist_resnet.bench", description=__doc__
    )
    preset_default = "gpu" if on_gpu else "cpu"
    parser.add_argument(
        "--preset",
        choices=list(PRESETS),
        default=preset_default,
        help=f"(default here: {preset_default})",
    )
    parser.add_argument(
        "--rows",
        type=int,
        default=None if on_gpu else 15_360,
        help="training rows (default: 15360 on CPU, all 60k on GPU)",
    )
    parser.add_argument(
        "--epochs",
        type=int,
        default=2 if on_gpu else 1,
        help="the last one is measured (default: 1 on CPU, 2 on GPU)",
    )
    parser.add_argument("--storage-path", default="./runs", help="(default: ./runs)")
    parser.add_argument(
        "--num-workers", type=int, default=None, help="Ray workers (default: 2 on CPU, 1 per GPU)"
    )
    parser.add_argument(
        "--previous",
        default=PREVIOUS,
        help=f"git commit of the version to compare with on a CPU box (default: {PREVIOUS}, the "
        "row-file reader); 'none' skips it",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        return measure(args)
    except USER_ERRORS as error:
        print(f"python -m benchmarks.mnist_resnet.bench: error: {error}", file=sys.stderr)
        return 2


def fresh_bench_config(args: argparse.Namespace) -> TrainConfig:
    """The measured run's config; its run folders from an earlier bench removed (a benchmark
    measures a fresh run, never a resumed one)."""
    preset = PRESETS[args.preset]
    config = dataclasses.replace(
        preset,
        storage_path=args.storage_path,
        run_name=RUN_NAME,
        num_workers=args.num_workers or (torch.cuda.device_count() if preset.use_gpu else 2),
        epochs=args.epochs,
        limit_train_rows=args.rows,
        limit_val_rows=1000,
        limit_test_rows=1000,
        log_every_steps=20,
    )
    for name in (RUN_NAME, f"{RUN_NAME}_previous"):
        run_dir = resolve_storage(args.storage_path).join(name)
        if run_dir.is_dir():  # a benchmark measures a fresh run, never a resumed one
            run_dir.filesystem.delete_dir(run_dir.path)
    return config


def measure_startup(args: argparse.Namespace) -> dict[str, Any]:
    """`mnist-resnet train` in a fresh process to its second step: its summary.json (startup_s,
    startup_phases). Run before anything here starts Ray, so the box is as a user's would be."""
    name = f"{RUN_NAME}_startup"
    run_dir = resolve_storage(args.storage_path).join(name)
    if run_dir.is_dir():  # a fresh run, never a resumed one
        run_dir.filesystem.delete_dir(run_dir.path)
    command = [sys.executable, "-m", "mnist_resnet", "train", "--preset", args.preset]
    command += ["--run-name", name, "--storage-path", args.storage_path, "--stop-at-step", "2"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} ended with {done.returncode}:\n{done.stderr}")
    return json.loads(run_dir.join("summary.json").read_text())


def measure(args: argparse.Namespace) -> int:
    startup = measure_startup(args)
    config = fresh_bench_config(args)
    info = inspect_dataset(resolve_storage(config.resolved_data_dir()))
    per_image = training_flops_per_image(info.num_classes, info.height, info.width)
    device = torch.device("cuda" if config.use_gpu else "cpu")

    baseline = run_baseline(config)["history"][-1]
    # Plain DDP runs gloo processes on the CPU cores: a comparison for CPU boxes only.
    plain_ddp = None if config.use_gpu else run_plain_ddp(config)
    previous = (
        None
        if config.use_gpu or args.previous == "none"
        else run_previous_version(args.previous, config, Path(args.storage_path).resolve())
    )
    started = time.perf_counter()
    summary = run(config)
    ray_wall = time.perf_counter() - started
    ray_epoch = summary["final"]
    ratio = ray_epoch["train_images_per_s"] / baseline["train_images_per_s"]
    rows = [
        {
            "pipeline": "baseline (1 process)",
            "images_per_s": baseline["train_images_per_s"],
            "train_s": baseline["train_s"],
            "startup_s": 0.0,
            "peak_memory_gb": baseline.get("peak_memory_gb"),
        },
        {
            "pipeline": f"ray train ({config.num_workers} workers)",
            "images_per_s": ray_epoch["train_images_per_s"],
            "train_s": ray_epoch["train_s"],
            # Everything the Ray run spent outside its training and evaluation loops.
            "startup_s": ray_wall - summary["train_time_s"],
            "peak_memory_gb": ray_epoch.get("peak_memory_gb"),
        },
    ]
    if plain_ddp is not None:
        rows.insert(
            1, {"pipeline": f"plain DDP ({config.num_workers} procs)", "images_per_s": plain_ddp}
        )
    if previous is not None:
        rows.insert(-1, {"pipeline": f"row files ({args.previous})", "images_per_s": previous})
    rows[-1]["first_batch_s"] = summary.get("first_batch_s")
    rows[-1]["data_wait_share"] = summary["final"].get("data_wait_share")
    for row in rows:
        row["mfu"] = mfu(row["images_per_s"] * per_image, device, config.num_workers)
    csv_file = resolve_storage(args.storage_path).join("bench", "bench_mnist.csv")
    write_metrics_csv(csv_file, [*rows, {"pipeline": "ratio", "images_per_s": ratio}])
    print_table(rows, args, config, per_image)
    print_ratios(ratio, ray_epoch, summary, baseline, plain_ddp, previous, args)
    phases = " + ".join(f"{name} {s:.1f}" for name, s in startup["startup_phases"].items())
    print(
        f"start-up of `mnist-resnet train` in a fresh process: {startup['startup_s']:.1f} s to "
        f"the first optimiser step = {phases}"
    )
    print(f"rows: {args.rows or 'all'}, epoch {args.epochs} measured; written to {csv_file.uri}")
    return 0


def print_table(
    rows: list[dict[str, Any]], args: argparse.Namespace, config: TrainConfig, per_image: float
) -> None:
    where = (
        torch.cuda.get_device_name(0) if config.use_gpu else f"{torch.get_num_threads()} threads"
    )
    print(
        f"\n{args.preset} preset, batch {config.global_batch_size}, "
        f"{where}, {per_image / 1e9:.2f} GFLOP per image"
    )
    print(
        f"{'pipeline':<24}{'images/s':>10}{'epoch s':>9}{'start-up s':>12}{'MFU':>8}"
        f"{'peak GiB':>10}"
    )
    for row in rows:
        train_s, startup_s = _cell(row.get("train_s"), ".1f"), _cell(row.get("startup_s"), ".1f")
        mfu, peak = _cell(row["mfu"], ".1%"), _cell(row.get("peak_memory_gb"), ".2f")
        print(
            f"{row['pipeline']:<24}{row['images_per_s']:>10.1f}{train_s:>9}{startup_s:>12}"
            f"{mfu:>8}{peak:>10}"
        )


def print_ratios(
    ratio: float,
    ray_epoch: dict[str, Any],
    summary: dict[str, Any],
    baseline: dict[str, Any],
    plain_ddp: float | None,
    previous: float | None,
    args: argparse.Namespace,
) -> None:
    print(f"\nratio (ray train ÷ baseline, steady-state images/s): {ratio:.3f}   target ≥ 0.97")
    ray_rate = ray_epoch["train_images_per_s"]
    if plain_ddp is not None:
        print(
            f"of which DDP's all-reduce on these cores: plain DDP ÷ baseline = "
            f"{plain_ddp / baseline['train_images_per_s']:.3f}; Ray Train + Ray Data ÷ plain DDP = "
            f"{ray_rate / plain_ddp:.3f}   goal ≥ 0.9"
        )
    if previous is not None:
        print(f"Ray Data ingest ÷ the row-file reader ({args.previous}): {ray_rate / previous:.3f}")
    print(
        f"time to the first batch: {_cell(summary.get('first_batch_s'), '.1f')} s; share of the "
        "last epoch's steps spent waiting for data: "
        f"{_cell(ray_epoch.get('data_wait_share'), '.1%')}"
    )


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


if __name__ == "__main__":
    raise SystemExit(main())
