"""Data-parallel training of ResNet18 on MNIST with Ray Train.

Read top to bottom: the optimiser and schedule, one epoch, evaluation, the per-worker loop, then the
driver that checks the inputs and launches `TorchTrainer`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from ray.train import DataConfig
from ray.train.torch import TorchTrainer
from torch import nn

from mnist_resnet import __version__
from mnist_resnet.config import TrainConfig
from mnist_resnet.data import DatasetInfo, ImageBatchCollate, inspect_dataset
from mnist_resnet.model import build_model
from raytrain_common.checkpoint import (
    latest_state,
    load_model_weights,
    load_state,
    report_checkpoint,
    unwrap,
)
from raytrain_common.configs import (
    ConfigError,
    build_run_config,
    build_scaling_config,
    build_torch_config,
    per_worker_batch_size,
)
from raytrain_common.data import device_batches, read_parquet
from raytrain_common.hardware import peak_memory_gb
from raytrain_common.metrics import (
    SUMMARY_FILE,
    package_versions,
    plot_curves,
    write_metrics_csv,
    write_summary,
)
from raytrain_common.ray_start import start_ray_for_run
from raytrain_common.storage import (
    StoragePath,
    check_writable,
    resolve_storage,
)

log = logging.getLogger("mnist_resnet")

METRICS_FILE = "metrics.csv"
CURVES_FILE = "curves.png"
SCORE = "test_accuracy"
# The first steps of an epoch include Ray Data's pipeline start; throughput skips them.
THROUGHPUT_SKIP_STEPS = 5


# ---------------------------------------------------------------------------------------------
# Optimiser and schedule (shared with baseline.py, so both train the same way)
# ---------------------------------------------------------------------------------------------


def build_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """SGD with Nesterov momentum; no weight decay on BatchNorm and bias parameters."""
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    return torch.optim.SGD(
        [
            {"params": decay, "weight_decay": config.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=config.lr,
        momentum=config.momentum,
        nesterov=True,
    )


def warmup_cosine(total_steps: int, warmup_fraction: float) -> Callable[[int], float]:
    """Learning-rate multiplier: linear warm-up, then cosine decay to zero at `total_steps`.

    A pure function of the step, so a resumed run that asks for more epochs simply stretches the
    curve instead of tripping a scheduler that had already finished (OneCycleLR would raise).
    """
    warmup = max(1, round(total_steps * warmup_fraction))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def steps_per_epoch(train_rows: int, workers: int, micro_batch: int, grad_accum_steps: int) -> int:
    """Optimiser steps each rank takes per epoch: the shard is split equally, partial batches dropped."""
    return (train_rows // workers) // micro_batch // grad_accum_steps


def autocast(device: torch.device, enabled: bool) -> contextlib.AbstractContextManager[Any]:
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=enabled)


# ---------------------------------------------------------------------------------------------
# One epoch, evaluation
# ---------------------------------------------------------------------------------------------


def train_one_epoch(
    model: nn.Module,
    batches: Iterable[dict[str, torch.Tensor]],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    config: TrainConfig,
    *,
    epoch: int,
    steps: int,
    device: torch.device,
    step_log: list[dict[str, float]],
) -> tuple[dict[str, float], str]:
    """Train one epoch of exactly `steps` optimiser steps; return loss, accuracy and images/s, and
    the dtype the forward pass computed in (bfloat16 when autocast is in effect).

    Rank 0 appends the mean loss of every `log_every_steps` interval to `step_log` (for the curves).
    """
    model.train()
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    accum = config.grad_accum_steps
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), device=device, dtype=torch.long)
    interval_loss = torch.zeros((), device=device)
    interval_batches = 0
    seen = 0
    step = 0
    started = steady_start = time.perf_counter()
    compute_dtype = torch.float32
    for micro_step, batch in enumerate(batches):
        if step >= steps:
            continue  # drain the iterator so every rank ends its epoch together
        images, labels = batch["image"], batch["label"]
        is_last_micro = (micro_step + 1) % accum == 0
        # Between micro-batches, gradients stay local; DDP all-reduces once per optimiser step.
        no_sync = getattr(model, "no_sync", None)
        sync = contextlib.nullcontext() if is_last_micro or no_sync is None else no_sync()
        with sync:
            with autocast(device, config.bf16):
                logits = model(images)
                loss = F.cross_entropy(logits, labels)
            (loss / accum).backward()
        compute_dtype = logits.dtype  # bf16 when autocast is really in effect
        loss_sum += loss.detach() * len(labels)
        interval_loss += loss.detach()
        interval_batches += 1
        correct += (logits.argmax(dim=1) == labels).sum()
        seen += len(labels)
        if not is_last_micro:
            continue
        if config.grad_clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        step += 1
        if step == THROUGHPUT_SKIP_STEPS:
            steady_start = time.perf_counter()
        if rank == 0 and (step % config.log_every_steps == 0 or step == steps):
            loss_value = interval_loss.item() / interval_batches
            interval_loss.zero_()
            interval_batches = 0
            if not math.isfinite(loss_value):
                raise FloatingPointError(
                    f"rank {rank}: loss is {loss_value} at epoch {epoch} step {step}; lower --lr, "
                    "or set --grad-clip-norm"
                )
            step_log.append({"epoch": epoch - 1 + step / steps, "train_loss_interval": loss_value})
            rate = len(labels) * accum * world * step / (time.perf_counter() - started)
            log.info(
                "epoch %d step %d/%d  loss %.4f  lr %.4g  %.0f img/s",
                epoch,
                step,
                steps,
                loss_value,
                scheduler.get_last_lr()[0],
                rate,
            )
    elapsed = time.perf_counter() - started
    if step < steps:
        raise RuntimeError(
            f"rank {rank}: epoch {epoch} ended after {step} of {steps} steps: the data shard was "
            "shorter than expected"
        )
    totals = torch.stack([loss_sum, correct.float(), torch.tensor(float(seen), device=device)])
    if dist.is_initialized():
        dist.all_reduce(totals)
    train_loss = (totals[0] / totals[2]).item()
    if not math.isfinite(train_loss):  # every rank sees the same reduced value and stops alike
        raise FloatingPointError(
            f"rank {rank}: mean training loss of epoch {epoch} is {train_loss}; lower --lr, "
            "or set --grad-clip-norm"
        )
    if steps > THROUGHPUT_SKIP_STEPS:
        images_per_s = (
            config.global_batch_size
            * (steps - THROUGHPUT_SKIP_STEPS)
            / (time.perf_counter() - steady_start)
        )
    else:
        images_per_s = config.global_batch_size * steps / elapsed
    row = {
        "train_loss": train_loss,
        "train_accuracy": (totals[1] / totals[2]).item(),
        "train_images_per_s": images_per_s,
        "epoch_train_s": elapsed,
    }
    if device.type == "cuda":
        row["peak_memory_gb"] = peak_memory_gb(device)
    return row, str(compute_dtype).removeprefix("torch.")


@torch.no_grad()
def evaluate(
    model: nn.Module, batches: Iterable[dict[str, torch.Tensor]], device: torch.device, bf16: bool
) -> dict[str, float]:
    """Loss and accuracy over every rank's test shard (summed across ranks, shards may differ)."""
    plain = unwrap(model)  # the DDP wrapper's forward would issue collectives; shards may be uneven
    plain.eval()
    totals = torch.zeros(3, device=device)
    for batch in batches:
        with autocast(device, bf16):
            logits = plain(batch["image"])
        totals[0] += F.cross_entropy(logits.float(), batch["label"], reduction="sum")
        totals[1] += (logits.argmax(dim=1) == batch["label"]).sum()
        totals[2] += len(batch["label"])
    if dist.is_initialized():
        dist.all_reduce(totals)
    return {
        "test_loss": (totals[0] / totals[2]).item(),
        "test_accuracy": (totals[1] / totals[2]).item(),
    }


# ---------------------------------------------------------------------------------------------
# The per-worker loop
# ---------------------------------------------------------------------------------------------


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """Runs on every worker: build, restore if the run has a checkpoint, train, evaluate, report."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    config = TrainConfig(**loop_config["config"])
    info = DatasetInfo(**loop_config["dataset"])
    train_rows: int = loop_config["train_rows"]
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    device = ray.train.torch.get_device()
    torch.manual_seed(config.seed)

    micro_batch = per_worker_batch_size(config.global_batch_size, world, config.grad_accum_steps)
    steps = steps_per_epoch(train_rows, world, micro_batch, config.grad_accum_steps)
    if steps < 1:
        raise ValueError(
            f"rank {rank}: {train_rows} training rows over {world} workers make no full batch of "
            f"{micro_batch}; use more rows or a smaller --global-batch-size"
        )

    model = build_model(info.num_classes)
    state = latest_state()
    if state is not None:
        load_model_weights(model, state["model"])
    model = ray.train.torch.prepare_model(model)  # moves to the device, wraps in DDP if world > 1
    optimizer = build_optimizer(model, config)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(steps * config.epochs, config.warmup_fraction)
    )
    history: list[dict[str, float]] = []
    step_log: list[dict[str, float]] = []
    epochs_done = 0
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        history, step_log, epochs_done = state["history"], state["step_log"], state["epochs_done"]
        if rank == 0 and epochs_done >= config.epochs:
            log.info("the run already has its %d epochs: nothing to train", epochs_done)
        elif rank == 0:
            log.info("resuming after epoch %d of %d", epochs_done, config.epochs)

    run_dir = resolve_storage(config.storage_path).join(config.run_name)
    collate = ImageBatchCollate(info)
    train_shard = ray.train.get_dataset_shard("train")
    test_shard = ray.train.get_dataset_shard("test")
    for epoch in range(epochs_done + 1, config.epochs + 1):
        batches = device_batches(
            train_shard,
            batch_size=micro_batch,
            collate_fn=collate,
            drop_last=True,
            shuffle_buffer_rows=config.shuffle_buffer_rows or None,
            seed=config.seed * 10_000 + epoch * 100 + rank,
        )
        row: dict[str, float] = {"epoch": epoch}
        trained, compute_dtype = train_one_epoch(
            model,
            batches,
            optimizer,
            scheduler,
            config,
            epoch=epoch,
            steps=steps,
            device=device,
            step_log=step_log,
        )
        row |= trained
        eval_started = time.perf_counter()
        test_batches = device_batches(
            test_shard, batch_size=512, collate_fn=collate, drop_last=False
        )
        row |= evaluate(model, test_batches, device, config.bf16)
        row |= {
            "epoch_eval_s": time.perf_counter() - eval_started,
            "lr": scheduler.get_last_lr()[0],
        }
        history.append(row)
        if rank == 0:
            log.info(
                "epoch %d/%d  train loss %.4f  test loss %.4f  test accuracy %.4f  %.0f img/s",
                epoch,
                config.epochs,
                row["train_loss"],
                row["test_loss"],
                row["test_accuracy"],
                row["train_images_per_s"],
            )
        report_checkpoint(
            row,
            {
                "model": unwrap(model).state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "epochs_done": epoch,
                "compute_dtype": compute_dtype,
                "history": history,
                "step_log": step_log,
                "config": dataclasses.asdict(config),
                "dataset": dataclasses.asdict(info),
            },
        )
        if rank == 0:  # after the report: the CSV never lists an epoch without its checkpoint
            write_metrics_csv(run_dir.join(METRICS_FILE), history)


# ---------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------


def run(config: TrainConfig) -> dict[str, Any]:
    """Check everything that can be checked, train, then write curves and summary.json."""
    started = time.perf_counter()
    config.validate()
    storage = resolve_storage(config.storage_path)
    check_writable(storage)
    data_dir = resolve_storage(config.resolved_data_dir())
    info = inspect_dataset(data_dir)
    train_rows = min(info.train_rows, config.limit_train_rows or info.train_rows)
    workers = config.num_workers
    micro_batch = per_worker_batch_size(config.global_batch_size, workers, config.grad_accum_steps)
    if steps_per_epoch(train_rows, workers, micro_batch, config.grad_accum_steps) < 1:
        raise ConfigError(
            f"{train_rows} training rows over {workers} workers make no full batch of {micro_batch}: "
            "use more rows or a smaller --global-batch-size"
        )
    config = dataclasses.replace(config, storage_path=storage.uri, data_dir=data_dir.uri)

    start_ray_for_run(config, storage, data_dir)

    train_data = read_parquet(data_dir.join("train"))
    test_data = read_parquet(data_dir.join("test"))
    if config.limit_train_rows is not None:
        train_data = train_data.limit(config.limit_train_rows)
    if config.limit_test_rows is not None:
        test_data = test_data.limit(config.limit_test_rows)
    # MNIST is ~50 MB: read it once into Ray's object store instead of re-reading Parquet every
    # epoch (that costs ~10 s per epoch here). For data larger than the cluster's memory, drop this.
    train_data, test_data = train_data.materialize(), test_data.materialize()
    # Blocks in a new random order each epoch; rows are mixed further by each worker's shuffle buffer.
    train_data = train_data.randomize_block_order()

    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "config": dataclasses.asdict(config),
            "dataset": dataclasses.asdict(info),
            "train_rows": train_rows,
        },
        scaling_config=build_scaling_config(config),
        run_config=build_run_config(config, score_attribute=SCORE, score_order="max"),
        torch_config=build_torch_config(config),
        datasets={"train": train_data, "test": test_data},
        dataset_config=DataConfig(datasets_to_split="all"),
    )
    log.info(
        "training %s on %d worker(s) for %d epoch(s); run folder %s",
        config.run_name,
        config.num_workers,
        config.epochs,
        storage.join(config.run_name),
    )
    result = trainer.fit()
    return write_run_outputs(storage.join(config.run_name), result, config, info, started)


def write_run_outputs(
    run_dir: StoragePath,
    result: ray.train.Result,
    config: TrainConfig,
    info: DatasetInfo,
    started: float,
) -> dict[str, Any]:
    """Curves PNG and summary.json from the checkpointed history (covers resumed runs too)."""
    best = result.get_best_checkpoint(SCORE, "max") if result.best_checkpoints else None
    if result.checkpoint is None:
        raise RuntimeError(f"run {config.run_name} finished without a checkpoint under {run_dir}")
    with result.checkpoint.as_directory() as folder:
        state = load_state(folder)
    history = state["history"]
    write_metrics_csv(run_dir.join(METRICS_FILE), history)
    # Interval losses (x: fractional epoch) and per-epoch metrics share the plot's epoch axis.
    plot_curves(
        run_dir.join(CURVES_FILE),
        sorted(state["step_log"] + history, key=lambda row: row["epoch"]),
        [
            ("loss", ["train_loss_interval", "test_loss"]),
            ("accuracy", ["train_accuracy", "test_accuracy"]),
        ],
        title=f"{config.run_name}: ResNet18 on {info.source}",
        log_y=["loss"],
    )
    best_row = max(history, key=lambda row: row[SCORE])
    summary = {
        "pipeline": "mnist_resnet",
        "pipeline_version": __version__,
        "run_name": config.run_name,
        "run_dir": run_dir.uri,
        "epochs_done": len(history),
        "final": history[-1],
        "best": best_row,
        "best_checkpoint": _uri(run_dir, best.path) if best else None,
        "latest_checkpoint": _uri(run_dir, result.checkpoint.path),
        "metrics_csv": run_dir.join(METRICS_FILE).uri,
        "curves_png": run_dir.join(CURVES_FILE).uri,
        "train_time_s": sum(row["epoch_train_s"] + row["epoch_eval_s"] for row in history),
        "compute_dtype": state.get("compute_dtype"),
        "peak_memory_gb": max(
            (r["peak_memory_gb"] for r in history if "peak_memory_gb" in r), default=None
        ),
        "wall_time_s": time.perf_counter() - started,
        "config": dataclasses.asdict(config),
        "dataset": dataclasses.asdict(info),
        "versions": package_versions("torchvision"),
    }
    write_summary(run_dir.join(SUMMARY_FILE), summary)
    return summary


def _uri(run_dir: StoragePath, path: str) -> str:
    """A checkpoint's path as a URI users can pass back (scheme kept for object stores)."""
    if run_dir.is_local:
        return path
    return f"{run_dir.uri.split('://', 1)[0]}://{path}"
