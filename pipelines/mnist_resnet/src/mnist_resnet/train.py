"""Data-parallel training of ResNet18 on MNIST with Ray Train.

Read top to bottom: the optimiser and schedule, one epoch, evaluation, the per-worker loop, then the
driver that checks the inputs, launches `TorchTrainer`, and reports the chosen checkpoint's test
accuracy.

Data order: every epoch reads the training rows in a fresh permutation drawn from (seed, epoch), cut
into global batches, each split over the workers (raytrain_common.order). Over an epoch every worker
trains on a uniform sample of the whole split whatever order it was written in, and the order does
not depend on the worker count, so a resume mid-epoch (same or another worker count) is exact.
Checkpoints are ranked by validation accuracy; the test split is evaluated once, on the chosen one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from ray.train import UserCallback
from ray.train.torch import TorchTrainer
from torch import nn

from mnist_resnet import __version__
from mnist_resnet.config import TrainConfig
from mnist_resnet.data import DatasetInfo, ImageRows, inspect_dataset
from mnist_resnet.model import build_model
from mnist_resnet.predict import checkpoint_test_metrics
from raytrain_common.checkpoint import (
    best_complete_checkpoint,
    latest_state,
    load_model_weights,
    load_state,
    report_checkpoint,
    unwrap,
    upload_with_retries,
)
from raytrain_common.configs import (
    ConfigError,
    build_run_config,
    build_scaling_config,
    build_torch_config,
    per_worker_batch_size,
)
from raytrain_common.faults import FaultLog, read_progress, write_progress
from raytrain_common.hardware import peak_memory_gb
from raytrain_common.metrics import (
    CURVES_FILE,
    METRICS_FILE,
    SUMMARY_FILE,
    eta,
    package_versions,
    plot_curves,
    write_metrics_csv,
    write_summary,
)
from raytrain_common.order import epoch_batch_indices, micro_batches, pass_permutation
from raytrain_common.ray_start import quiet_ray_output, start_ray_for_run
from raytrain_common.runs import fit, locate_run, summary_header
from raytrain_common.storage import (
    StoragePath,
    resolve_storage,
)
from raytrain_common.tracking import (
    failed_on_error,
    finish_for_summary,
    open_for_config,
    rank_zero_sink,
)

log = logging.getLogger("mnist_resnet")

SCORE = "val_accuracy"  # checkpoints, sweeps and early stopping choose by it; never by test
# The score of a mid-epoch checkpoint, which is not evaluated: below any real accuracy, so Ray keeps
# it only as the latest (Ray's checkpoint ranking takes numbers only: NaN reaches it as None).
NOT_EVALUATED = -1.0
# The first steps of an epoch include warm-up (allocator, kernels); throughput skips them.
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


def steps_per_epoch(train_rows: int, global_batch_size: int) -> int:
    """Optimiser steps per epoch, the same on any worker count: the rows past the last full global
    batch are left for another epoch (each epoch's order leaves out other ones)."""
    return train_rows // global_batch_size


def autocast(device: torch.device, enabled: bool) -> contextlib.AbstractContextManager[Any]:
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=enabled)


# ---------------------------------------------------------------------------------------------
# One epoch, evaluation
# ---------------------------------------------------------------------------------------------


@dataclass
class EpochPosition:
    """Where a run is inside an epoch, saved with every checkpoint so a resume continues exactly there.

    The data order is a pure function of (seed, epoch) (see the module's docstring), so the position
    is just the optimiser steps already taken; the sums (over all ranks) make the epoch's training
    loss and accuracy the same as an uninterrupted epoch's.
    """

    step: int = 0
    loss_sum: float = 0.0
    correct: float = 0.0
    seen: float = 0.0
    train_s: float = 0.0


# Called after every optimiser step on every rank, with the step within the epoch and a function
# that returns the epoch's position so far (a collective: call it on every rank or on none).
AfterStep = Callable[[int, Callable[[], EpochPosition]], None]


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
    start: EpochPosition | None = None,
    after_step: AfterStep | None = None,
) -> tuple[dict[str, float], str]:
    """Train the epoch's steps from `start` (a resumed epoch) up to `steps`; return loss, accuracy
    and images/s, and the dtype the forward pass computed in (bfloat16 when autocast is in effect).

    `batches` are this rank's micro-batches from that step on (`epoch_batches`). Rank 0 appends the
    mean loss of every `log_every_steps` interval to `step_log` (for the curves).
    """
    model.train()
    start = start or EpochPosition()
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    accum = config.grad_accum_steps
    # Sums carried over from before a resume live on rank 0 only, so the all-reduce counts them once.
    carried = rank == 0
    loss_sum = torch.tensor(start.loss_sum if carried else 0.0, device=device)
    correct = torch.tensor(start.correct if carried else 0.0, device=device)
    seen = torch.tensor(start.seen if carried else 0.0, device=device)
    interval_loss = torch.zeros((), device=device)
    interval_batches = 0
    step = start.step
    started = steady_start = time.perf_counter()
    compute_dtype = torch.float32

    def position() -> EpochPosition:
        totals = torch.stack([loss_sum, correct, seen])
        if dist.is_initialized():
            dist.all_reduce(totals)
        elapsed = start.train_s + time.perf_counter() - started
        loss_total, correct_total, seen_total = (float(value) for value in totals.tolist())
        return EpochPosition(step, loss_total, correct_total, seen_total, elapsed)

    for micro_step, batch in enumerate(batches):
        labels = batch["label"]
        is_last_micro = (micro_step + 1) % accum == 0
        logits, loss = forward_backward(model, batch, config, device, sync=is_last_micro)
        compute_dtype = logits.dtype  # bf16 when autocast is really in effect
        loss_sum += loss.detach() * len(labels)
        interval_loss += loss.detach()
        interval_batches += 1
        correct += (logits.argmax(dim=1) == labels).sum()
        seen += len(labels)
        if not is_last_micro:
            continue
        optimizer_step(model, optimizer, scheduler, config)
        step += 1
        if step - start.step == THROUGHPUT_SKIP_STEPS:
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
            trained = step - start.step
            rate = len(labels) * accum * world * trained / (time.perf_counter() - started)
            seconds_per_step = (time.perf_counter() - started) / trained
            log.info(
                "epoch %d step %d/%d  loss %.4f  lr %.4g  %.0f img/s  %s",
                epoch,
                step,
                steps,
                loss_value,
                scheduler.get_last_lr()[0],
                rate,
                eta((config.epochs - epoch) * steps + steps - step, seconds_per_step),
            )
        if after_step is not None:
            after_step(step, position)
    trained = steps - start.step
    if trained > THROUGHPUT_SKIP_STEPS:
        images_per_s = (
            config.global_batch_size
            * (trained - THROUGHPUT_SKIP_STEPS)
            / (time.perf_counter() - steady_start)
        )
    else:
        images_per_s = config.global_batch_size * trained / (time.perf_counter() - started)
    row = epoch_row(position(), images_per_s, device, epoch)
    return row, str(compute_dtype).removeprefix("torch.")


def forward_backward(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    config: TrainConfig,
    device: torch.device,
    *,
    sync: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch's logits and loss, its gradient accumulated (scaled by the accumulation)."""
    # Between micro-batches, gradients stay local; DDP all-reduces once per optimiser step.
    no_sync = getattr(model, "no_sync", None)
    context = contextlib.nullcontext() if sync or no_sync is None else no_sync()
    with context:
        with autocast(device, config.bf16):
            logits = model(batch["image"])
            loss = F.cross_entropy(logits, batch["label"])
        (loss / config.grad_accum_steps).backward()
    return logits, loss


def optimizer_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    config: TrainConfig,
) -> None:
    if config.grad_clip_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()


def epoch_row(
    final: EpochPosition, images_per_s: float, device: torch.device, epoch: int
) -> dict[str, float]:
    """The epoch's training metrics from the sums over every rank (the same on each)."""
    train_loss = final.loss_sum / final.seen
    if not math.isfinite(train_loss):  # every rank sees the same reduced value and stops alike
        raise FloatingPointError(
            f"rank {dist.get_rank() if dist.is_initialized() else 0}: mean training loss of epoch "
            f"{epoch} is {train_loss}; lower --lr, or set --grad-clip-norm"
        )
    row = {
        "train_loss": train_loss,
        "train_accuracy": final.correct / final.seen,
        "train_images_per_s": images_per_s,
        "epoch_train_s": final.train_s,
    }
    if (memory := peak_memory_gb(device)) is not None:  # on a GPU
        row["peak_memory_gb"] = memory
    return row


def epoch_batches(
    rows: ImageRows,
    epoch: int,
    steps: range,
    config: TrainConfig,
    rank: int,
    world: int,
    device: torch.device,
) -> Iterator[dict[str, torch.Tensor]]:
    """Rank `rank`'s micro-batches of the epoch's `steps` (0-based), in the epoch's order."""
    order = pass_permutation(len(rows), config.seed, epoch - 1)
    for step in steps:
        indices = epoch_batch_indices(order, step, config.global_batch_size)
        for part in micro_batches(indices, rank, world, config.grad_accum_steps):
            yield rows.batch(part, device)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[dict[str, torch.Tensor]],
    device: torch.device,
    bf16: bool,
    split: str = "val",
) -> dict[str, float]:
    """`<split>_loss` and `<split>_accuracy` over every rank's rows (summed across ranks)."""
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
        f"{split}_loss": (totals[0] / totals[2]).item(),
        f"{split}_accuracy": (totals[1] / totals[2]).item(),
    }


# ---------------------------------------------------------------------------------------------
# The per-worker loop
# ---------------------------------------------------------------------------------------------


class StopAtStepReached(Exception):  # noqa: N818 (a signal, not an error)
    """`--stop-at-step` reached: the checkpoint is written, every rank leaves the loop together."""


def val_metrics(
    model: nn.Module, val: ImageRows, device: torch.device, bf16: bool
) -> dict[str, float]:
    """Validation loss and accuracy: each rank its rows rank, rank + world, …, reduced over all."""
    started = time.perf_counter()
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    mine = np.arange(rank, len(val), world)
    batches = (val.batch(mine[i : i + 512], device) for i in range(0, len(mine), 512))
    return {**evaluate(model, batches, device, bf16), "epoch_eval_s": time.perf_counter() - started}


def restore_progress(
    state: dict[str, Any] | None,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    run_dir: StoragePath,
    driver_id: str,
    steps: int,
    epochs: int,
) -> tuple[list[dict[str, float]], list[dict[str, float]], int, EpochPosition | None, FaultLog]:
    """The optimiser, schedule, metrics and data position of the checkpoint being resumed (the
    model's weights are loaded before DDP wraps it), and the restart recorded with its cause; or a
    fresh start. Returns (history, step_log, epochs_done, position in the epoch, fault log)."""
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    history: list[dict[str, float]] = []
    step_log: list[dict[str, float]] = []
    epochs_done = 0
    position: EpochPosition | None = None
    faults = FaultLog()
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        history, step_log, epochs_done = state["history"], state["step_log"], state["epochs_done"]
        position = EpochPosition(**state["position"]) if state.get("position") else None
        faults = FaultLog(**state.get("faults", {}))
        finished = epochs_done >= epochs
        if not finished:
            faults.record_restart(
                state["global_step"], run_dir, driver_id, state.get("resumed_from"), world
            )
        if rank == 0 and finished:
            log.info("the run already has its %d epochs: nothing to train", epochs_done)
        elif rank == 0:
            log.info(
                "resuming at epoch %d step %d of %d (%s)",
                epochs_done + 1,
                position.step if position else 0,
                steps,
                faults.restarts[-1]["cause"],
            )
    elif read_progress(run_dir) is not None:  # lost before its first checkpoint: starts over
        faults.record_restart(0, run_dir, driver_id, None, world)
    return history, step_log, epochs_done, position, faults


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """Runs on every worker: build, restore if the run has a checkpoint, train, evaluate, report."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    config = TrainConfig(**loop_config["config"])
    quiet_ray_output(config.verbose)
    info = DatasetInfo(**loop_config["dataset"])
    driver_id: str = loop_config["driver_id"]
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    device = ray.train.torch.get_device()
    torch.manual_seed(config.seed)

    # Raises, naming the fix, if the global batch does not split over this worker count (elastic).
    per_worker_batch_size(config.global_batch_size, world, config.grad_accum_steps)
    data_dir = resolve_storage(config.resolved_data_dir())
    train_rows = ImageRows.read(data_dir, "train", config.limit_train_rows)
    val_rows = ImageRows.read(data_dir, "val", config.limit_val_rows)
    steps = steps_per_epoch(len(train_rows), config.global_batch_size)

    run_dir = resolve_storage(config.storage_path).join(config.run_name)
    model = build_model(info.num_classes, info.channels)
    state = latest_state(run_dir)
    if state is not None:
        load_model_weights(model, state["model"])
    model = ray.train.torch.prepare_model(model)  # moves to the device, wraps in DDP if world > 1
    optimizer = build_optimizer(model, config)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(steps * config.epochs, config.warmup_fraction)
    )
    history, step_log, epochs_done, position, faults = restore_progress(
        state, optimizer, scheduler, run_dir, driver_id, steps, config.epochs
    )

    def checkpoint_state(epochs: int, at: EpochPosition | None, dtype: str | None) -> dict:
        return {
            "model": unwrap(model).state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "epochs_done": epochs,
            "position": dataclasses.asdict(at) if at else None,
            "global_step": epochs * steps + (at.step if at else 0),
            "world_size": world,
            "compute_dtype": dtype,
            "history": history,
            "step_log": step_log,
            "faults": dataclasses.asdict(faults),
            "config": dataclasses.asdict(config),
            "dataset": dataclasses.asdict(info),
        }

    upload = upload_with_retries(config.storage_path, config.storage_patience_s)
    sink = rank_zero_sink(loop_config, rank)
    tracked_rows = [len(step_log)]  # step_log rows already sent to the tracker (a resume's are)
    try:
        compute_dtype: str | None = state.get("compute_dtype") if state else None
        stop_at = config.stop_at_step
        if state is not None and stop_at is not None and state["global_step"] >= stop_at:
            if rank == 0:
                log.info("the run is already at step %d (--stop-at-step)", state["global_step"])
            return
        for epoch in range(epochs_done + 1, config.epochs + 1):

            def after_step(
                step: int,
                current: Callable[[], EpochPosition],
                epoch: int = epoch,
                dtype: str | None = compute_dtype,
            ) -> None:
                """Mid-epoch checkpoints: every N steps, at a preemption notice, at --stop-at-step."""
                global_step = (epoch - 1) * steps + step
                if rank == 0 and len(step_log) > tracked_rows[0]:  # a new interval loss to log
                    tracked_rows[0] = len(step_log)
                    interval = {"train_loss_interval": step_log[-1]["train_loss_interval"]}
                    sink.log(interval | {"lr": scheduler.get_last_lr()[0]}, global_step)
                reasons = []
                if (
                    config.checkpoint_every_steps
                    and global_step % config.checkpoint_every_steps == 0
                ):
                    reasons.append("every")
                every = config.preemption_check_steps
                if every and global_step % every == 0 and faults.check_preemption(global_step):
                    reasons.append("preemption")
                if config.stop_at_step == global_step:
                    reasons.append("stop")
                if rank == 0 and (global_step % config.log_every_steps == 0 or reasons):
                    write_progress(run_dir, global_step, driver_id, world, faults.attempt)
                if step == steps or not reasons:
                    return  # the epoch's own checkpoint follows at its end
                at = current()
                report_checkpoint(
                    {
                        "epoch": epoch - 1 + step / steps,
                        "global_step": global_step,
                        SCORE: NOT_EVALUATED,
                    },
                    checkpoint_state(epoch - 1, at, dtype),
                    upload,
                )
                if "stop" in reasons:
                    raise StopAtStepReached

            first_step = position.step if position else 0
            batches = epoch_batches(
                train_rows, epoch, range(first_step, steps), config, rank, world, device
            )
            row: dict[str, float] = {"epoch": epoch}
            try:
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
                    start=position,
                    after_step=after_step,
                )
            except StopAtStepReached:
                if rank == 0:
                    log.info("stopped at step %d as asked (--stop-at-step)", config.stop_at_step)
                return
            position = None
            row |= trained
            row |= val_metrics(model, val_rows, device, config.bf16)
            row["lr"] = scheduler.get_last_lr()[0]
            history.append(row)
            sink.log(row, step=epoch * steps)
            sink.flush()  # in the store before the report: a sweep may stop the trial on it
            if rank == 0:
                log.info(
                    "epoch %d/%d  train loss %.4f  val loss %.4f  val accuracy %.4f  %.0f img/s",
                    epoch,
                    config.epochs,
                    row["train_loss"],
                    row["val_loss"],
                    row["val_accuracy"],
                    row["train_images_per_s"],
                )
            report_checkpoint(
                {**row, "global_step": epoch * steps},
                checkpoint_state(epoch, None, compute_dtype),
                upload,
            )
            if rank == 0:  # after the report: the CSV never lists an epoch without its checkpoint
                write_metrics_csv(run_dir.join(METRICS_FILE), history)
            if config.stop_at_step == epoch * steps:
                if rank == 0:
                    log.info("stopped at step %d as asked (--stop-at-step)", config.stop_at_step)
                return
    finally:
        sink.close()  # sends what rank 0 queued (bounded wait)


# ---------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------


def run(config: TrainConfig, callbacks: Sequence[UserCallback] = ()) -> dict[str, Any]:
    """Check everything that can be checked, train, then write curves and summary.json.

    `callbacks` join the run's (a sweep passes Tune's, which forwards every report to Tune).
    """
    started = time.perf_counter()
    storage, data_dir = locate_run(config)
    info = inspect_dataset(data_dir)
    train_rows = min(info.train_rows, config.limit_train_rows or info.train_rows)
    if steps_per_epoch(train_rows, config.global_batch_size) < 1:
        raise ConfigError(
            f"{train_rows} training rows make no full global batch of {config.global_batch_size}: "
            "use more rows or a smaller --global-batch-size"
        )
    config = dataclasses.replace(config, storage_path=storage.uri, data_dir=data_dir.uri)

    start_ray_for_run(config, storage, data_dir)
    tracked = open_for_config(config, storage, pipeline="mnist_resnet", version=__version__)

    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "config": dataclasses.asdict(config),
            "dataset": dataclasses.asdict(info),
            "driver_id": uuid.uuid4().hex,  # tells a worker restart from a rerun of the command
            "tracked": dataclasses.asdict(tracked) if tracked else None,
        },
        scaling_config=build_scaling_config(config),
        run_config=build_run_config(
            config, score_attribute=SCORE, score_order="max", callbacks=callbacks
        ),
        torch_config=build_torch_config(config),
    )
    log.info(
        "training %s on %d worker(s) for %d epoch(s); run folder %s",
        config.run_name,
        config.num_workers,
        config.epochs,
        storage.join(config.run_name),
    )
    with failed_on_error(tracked):
        result = fit(trainer, config.storage_path)
        summary = write_run_outputs(storage.join(config.run_name), result, config, info, started)
    run_dir = storage.join(config.run_name)
    finish_for_summary(tracked, run_dir, summary)
    return summary


def evaluate_test_split_once(checkpoint_uri: str, config: TrainConfig) -> dict[str, Any]:
    """The chosen checkpoint's test loss and accuracy, in a Ray task on a worker's resources (a GPU
    if the run had them; the driver may sit on a CPU-only head node)."""
    started = time.perf_counter()
    task = ray.remote(checkpoint_test_metrics).options(
        num_cpus=config.cpus_per_worker,
        num_gpus=1 if config.use_gpu else 0,
        # Not inside the caller's placement group (a sweep trial's holds a tenth of a CPU): the
        # run's workers have ended, their resources are free in the cluster.
        scheduling_strategy="DEFAULT",
    )
    result: dict[str, Any] = ray.get(task.remote(checkpoint_uri, config.limit_test_rows))
    result["test_s"] = time.perf_counter() - started
    log.info(
        "test accuracy %.4f on %d images, checkpoint of epoch %d (chosen by %s)",
        result["test_accuracy"], result["test_rows"], result["epoch"], SCORE,
    )  # fmt: skip
    return result


def write_run_outputs(
    run_dir: StoragePath,
    result: ray.train.Result,
    config: TrainConfig,
    info: DatasetInfo,
    started: float,
) -> dict[str, Any]:
    """Curves PNG and summary.json from the checkpointed history (covers resumed runs too)."""
    best = best_complete_checkpoint(result, SCORE, "max")
    if result.checkpoint is None:
        raise RuntimeError(f"run {config.run_name} finished without a checkpoint under {run_dir}")
    with result.checkpoint.as_directory() as folder:
        state = load_state(folder)
    history = state["history"]
    progress = {
        "global_step": state["global_step"],
        "stopped_mid_epoch": state.get("position") is not None,
        **FaultLog(**state.get("faults", {})).summary(),
    }
    if not history:  # stopped (--stop-at-step) before the first epoch ended
        summary = {
            **summary_header("mnist_resnet", __version__, config.run_name, run_dir),
            **progress,
        }
        summary |= {"epochs_done": 0, "best": None, "latest_checkpoint": result.checkpoint.path}
        write_summary(run_dir.join(SUMMARY_FILE), summary)
        return summary
    write_metrics_csv(run_dir.join(METRICS_FILE), history)
    # Interval losses (x: fractional epoch) and per-epoch metrics share the plot's epoch axis.
    plot_curves(
        run_dir.join(CURVES_FILE),
        sorted(state["step_log"] + history, key=lambda row: row["epoch"]),
        [
            ("loss", ["train_loss_interval", "val_loss"]),
            ("accuracy", ["train_accuracy", "val_accuracy"]),
        ],
        title=f"{config.run_name}: ResNet18 on {info.source}",
        log_y=["loss"],
    )
    if best is None:
        raise RuntimeError(
            f"run {config.run_name} has no complete evaluated checkpoint in {run_dir}"
        )
    # The history row of the chosen checkpoint's epoch (a torn best one is passed over for the next).
    chosen = next(m["epoch"] for c, m in result.best_checkpoints if c.path == best.path)
    best_row = next(row for row in history if row["epoch"] == chosen)
    best_uri = run_dir.uri_for(best.path)
    summary = {
        **summary_header("mnist_resnet", __version__, config.run_name, run_dir),
        "epochs_done": len(history),
        **progress,
        "final": history[-1],
        "best": best_row,
        "best_checkpoint": best_uri,
        "test": evaluate_test_split_once(best_uri, config),
        "latest_checkpoint": run_dir.uri_for(result.checkpoint.path),
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
