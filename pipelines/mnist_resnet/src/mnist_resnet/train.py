"""Data-parallel training of ResNet18 on MNIST (or an image tree) with Ray Train and Ray Data.

Read top to bottom: the optimiser and schedule, one step, evaluation, the per-worker loop, then the
driver that checks the inputs, builds the datasets, launches `TorchTrainer`, and reports the chosen
checkpoint's test accuracy.

Data: Ray Data reads, shuffles, decodes and augments the images (ingest.py) and streams each worker
its shard: `ray.train.get_dataset_shard("train").iter_torch_batches(...)`. Every epoch is a fresh
permutation; every row is trained once per epoch, also across a resume on another worker count
(the checkpoint keeps the epoch's trained rows; a resumed epoch reads the rest).
Checkpoints are ranked by validation accuracy; the test split is evaluated once, on the chosen one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
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
from ray.train import UserCallback
from ray.train.torch import TorchTrainer
from torch import nn

from mnist_resnet import __version__
from mnist_resnet.config import TrainConfig
from mnist_resnet.data import DatasetInfo, inspect_dataset, on_device
from mnist_resnet.ingest import (
    POSITION_FILE,
    REST_OF_EPOCH,
    TRAIN,
    VAL,
    DataShardError,
    EpochRows,
    EvenTrainingEveryValidationRow,
    ImageData,
    epoch_seed,
    position_file,
)
from mnist_resnet.predict import checkpoint_test_metrics
from mnist_resnet.task import autocast, build_model, evaluate, loss_fn
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
from raytrain_common.faults import FaultLog, read_progress
from raytrain_common.hardware import peak_memory_gb, workers_peak_rss_mb
from raytrain_common.loop import (
    CheckpointPolicy,
    ProgressNotes,
    ThroughputMeter,
    startup_seconds,
)
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
    warm_tracking_store,
)

log = logging.getLogger("mnist_resnet")

SCORE = "val_accuracy"  # checkpoints, sweeps and early stopping choose by it; never by test
# The score of a mid-epoch checkpoint, which is not evaluated: below any real accuracy, so Ray keeps
# it only as the latest (Ray's checkpoint ranking takes numbers only: NaN reaches it as None).
NOT_EVALUATED = -1.0
# The first steps of an epoch include warm-up (allocator, kernels); throughput skips them.
THROUGHPUT_SKIP_STEPS = 5
VAL_BATCH_ROWS = 512


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


# ---------------------------------------------------------------------------------------------
# The data order, one step, the epoch's sums
# ---------------------------------------------------------------------------------------------


@dataclass
class EpochPosition:
    """Where a run is inside an epoch, saved with every mid-epoch checkpoint so a resume continues
    exactly there: the steps taken in the epoch, and the epoch's sums over all ranks so far (its
    training loss and accuracy then equal an uninterrupted epoch's)."""

    step: int = 0
    loss_sum: float = 0.0
    correct: float = 0.0
    seen: float = 0.0
    train_s: float = 0.0
    trained_rows: torch.Tensor | None = None  # the epoch's rows trained, a bitmap (EpochRows)


class EpochTotals:
    """This rank's running sums of the epoch (loss, correct, images) and of the logging interval,
    kept on the device: reading them makes the host wait, so they are read when a line is logged."""

    def __init__(self, device: torch.device, rank: int, carried: EpochPosition | None) -> None:
        carried = carried or EpochPosition()
        # Sums from before a resume live on rank 0 only, so the all-reduce counts them once.
        on_this_rank = carried if rank == 0 else EpochPosition()
        self.sums = torch.tensor(
            [on_this_rank.loss_sum, on_this_rank.correct, on_this_rank.seen], device=device
        )
        self.interval = torch.zeros(2, device=device)  # summed micro-batch losses, micro-batches
        self.train_s_before = carried.train_s
        self.started = time.perf_counter()

    def add(self, logits: torch.Tensor, loss: torch.Tensor, labels: torch.Tensor) -> None:
        detached = loss.detach().float()
        self.sums += torch.stack(
            [detached * len(labels), (logits.argmax(dim=1) == labels).sum().float(),
             torch.tensor(float(len(labels)), device=labels.device)]
        )  # fmt: skip
        self.interval += torch.stack([detached, torch.ones_like(detached)])

    def interval_loss(self) -> float:
        """Mean micro-batch loss since the last call, on this rank."""
        loss_sum, batches = self.interval.tolist()
        self.interval.zero_()
        return loss_sum / max(batches, 1)

    def position(self, step_in_epoch: int, rows: EpochRows | None = None) -> EpochPosition:
        """The epoch's sums over every rank, and its rows trained when `rows` is given (a
        collective: every rank calls it)."""
        totals = self.sums.clone()
        if dist.is_initialized():
            dist.all_reduce(totals)
        loss_sum, correct, seen = totals.tolist()
        train_s = self.train_s_before + time.perf_counter() - self.started
        trained = None if rows is None else torch.from_numpy(rows.merged(totals.device))
        return EpochPosition(step_in_epoch, loss_sum, correct, seen, train_s, trained)


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    batch: dict[str, torch.Tensor],
    info: DatasetInfo,
    config: TrainConfig,
    totals: EpochTotals,
) -> str:
    """One optimiser step over this rank's rows (uint8 images, normalised on the model's device),
    in `grad_accum_steps` micro-batches; returns the dtype the forward pass computed in (bfloat16
    when autocast is really in effect)."""
    device = totals.sums.device
    inputs = on_device(batch, info, device)
    images, labels = inputs["image"], inputs["label"]
    model.train()
    logits = torch.empty(0)
    batches = [
        {"image": part, "label": part_labels}
        for part, part_labels in zip(
            images.chunk(config.grad_accum_steps),
            labels.chunk(config.grad_accum_steps),
            strict=True,
        )
    ]
    for index, batch in enumerate(batches):
        # Between micro-batches, gradients stay local; DDP all-reduces once per optimiser step.
        last = index == len(batches) - 1
        no_sync = getattr(model, "no_sync", None)
        with contextlib.nullcontext() if last or no_sync is None else no_sync():
            with autocast(batch["image"].device, config.bf16):
                logits = model(batch["image"])
                loss = loss_fn(logits, batch["label"])
            (loss / len(batches)).backward()
        totals.add(logits, loss, batch["label"])
    if config.grad_clip_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return str(logits.dtype).removeprefix("torch.")


def val_metrics(
    model: nn.Module, info: DatasetInfo, device: torch.device, bf16: bool
) -> dict[str, float]:
    """Validation loss and accuracy over every row of the split: each rank its shard (split
    unevenly, see EvenTrainingEveryValidationRow), reduced over all."""
    started = time.perf_counter()
    shard = ray.train.get_dataset_shard(VAL)
    batches = (
        on_device(batch, info, device)
        for batch in shard.iter_torch_batches(batch_size=VAL_BATCH_ROWS, device="cpu")
    )
    metrics = evaluate(model, batches, device, bf16, split="val")
    return {**metrics, "val_s": time.perf_counter() - started}


# ---------------------------------------------------------------------------------------------
# What a checkpoint holds besides the weights, and the steps that write one
# ---------------------------------------------------------------------------------------------


@dataclass
class RunState:
    """The run's record, saved in every checkpoint: steps done, one row per epoch, the interval
    losses (curves), the position inside an epoch, faults survived, and timing."""

    step: int = 0
    history: list[dict[str, float]] = dataclasses.field(default_factory=list)
    step_log: list[dict[str, float]] = dataclasses.field(default_factory=list)
    position: EpochPosition | None = None
    faults: FaultLog = dataclasses.field(default_factory=FaultLog)
    decoded_on: dict[str, int] = dataclasses.field(default_factory=dict)  # rank 0's batches by node
    compute_dtype: str | None = None
    startup_s: float | None = None
    first_batch_s: float | None = None


def build_training(
    info: DatasetInfo, config: TrainConfig, steps: int, state: dict[str, Any] | None
) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """The model (the checkpoint's weights loaded before DDP wraps it), optimiser and schedule."""
    torch.manual_seed(config.seed)
    model = build_model(info.num_classes, info.channels)
    if state is not None:
        load_model_weights(model, state["model"])
    model = ray.train.torch.prepare_model(model)  # moves to the device, wraps in DDP if world > 1
    optimizer = build_optimizer(model, config)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(steps * config.epochs, config.warmup_fraction)
    )
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
    return model, optimizer, scheduler


def restore_run(
    state: dict[str, Any] | None,
    run_dir: StoragePath,
    driver_id: str,
    world: int,
    checkpoints: CheckpointPolicy,
) -> RunState:
    """The record of the checkpoint being resumed, with this restart noted and its cause; or a
    fresh record (a restart that lost its run before the first checkpoint is noted too)."""
    if state is None:
        run = RunState()
        if read_progress(run_dir) is not None:  # lost before its first checkpoint: starts over
            run.faults.record_restart(0, run_dir, driver_id, None, world)
        return run
    run = RunState(
        step=state["step"],
        history=state["history"],
        step_log=state["step_log"],
        position=EpochPosition(**state["position"]) if state.get("position") else None,
        faults=FaultLog(**state.get("faults", {})),
        decoded_on=state.get("decoded_on", {}),
        compute_dtype=state.get("compute_dtype"),
        startup_s=state.get("startup_s"),
        first_batch_s=state.get("first_batch_s"),
    )
    if checkpoints.already_done(run.step):
        log.info("the run is already at step %d: nothing to train", run.step)
    else:
        restart = run.faults.record_restart(
            run.step, run_dir, driver_id, state.get("resumed_from"), world
        )
        log.info("resuming at step %d (%s)", run.step, restart["cause"])
        if restart["cause"] == "rerun":  # this command's own start-up is measured anew
            run.startup_s = run.first_batch_s = None
    return run


def checkpoint_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    run: RunState,
    loop_config: dict[str, Any],
) -> dict[str, Any]:
    return {
        "model": unwrap(model).state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        **dataclasses.asdict(run),
        "world_size": ray.train.get_context().get_world_size(),
        "worker_peak_rss_mb": workers_peak_rss_mb(),  # on every rank: a collective
        "config": loop_config["config"],
        "dataset": loop_config["dataset"],
    }


def log_interval(
    run: RunState,
    totals: EpochTotals,
    meter: ThroughputMeter,
    lr: float,
    step: int,
    steps: int,
    config: TrainConfig,
) -> dict[str, float]:
    """Rank 0's progress line and curve point for the steps since the last one."""
    loss = totals.interval_loss()
    if not math.isfinite(loss):
        raise FloatingPointError(
            f"rank 0: loss is {loss} at step {step}; lower --lr, or set --grad-clip-norm"
        )
    rate = meter.window()
    run.step_log.append({"epoch": step / steps, "train_loss_interval": loss})
    log.info(
        "epoch %d step %d/%d  loss %.4f  lr %.4g  %.0f img/s  %s",
        (step - 1) // steps + 1, (step - 1) % steps + 1, steps, loss, lr, rate.items_per_s,
        eta(config.epochs * steps - step, rate.seconds_per_step),
    )  # fmt: skip
    return {"train_loss_interval": loss, "lr": lr}


def end_epoch(
    model: nn.Module,
    info: DatasetInfo,
    totals: EpochTotals,
    meter: ThroughputMeter,
    lr: float,
    step: int,
    steps: int,
    config: TrainConfig,
    rows: EpochRows,
) -> dict[str, float]:
    """The epoch's row of metrics.csv: training sums over every rank, then validation; first a
    check that the ranks trained every row of the epoch once (collectives, on every rank)."""
    device = totals.sums.device
    check_trained_once(rows, steps * config.global_batch_size, device)
    epoch = step // steps
    final = totals.position(steps)
    train_loss = final.loss_sum / final.seen
    if not math.isfinite(train_loss):  # every rank sees the same reduced value and stops alike
        raise FloatingPointError(
            f"mean training loss of epoch {epoch} is {train_loss}; lower --lr, or set "
            "--grad-clip-norm"
        )
    row = {
        "epoch": epoch,
        "step": step,
        "train_loss": train_loss,
        "train_accuracy": final.correct / final.seen,
        "train_images_per_s": meter.steady().items_per_s,
        "train_s": final.train_s,
        **val_metrics(model, info, device, config.bf16),
        "lr": lr,
    }
    if (memory := peak_memory_gb(device)) is not None:
        row["peak_memory_gb"] = memory  # on a GPU
    if not dist.is_initialized() or dist.get_rank() == 0:
        log.info(
            "epoch %d/%d  train loss %.4f  val loss %.4f  val accuracy %.4f  %.0f img/s",
            epoch, config.epochs, row["train_loss"], row["val_loss"], row["val_accuracy"],
            row["train_images_per_s"],
        )  # fmt: skip
    return row


# ---------------------------------------------------------------------------------------------
# The per-worker loop
# ---------------------------------------------------------------------------------------------


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """Runs on every worker: build, restore, then for each epoch and each batch of this worker's
    shard: train, log, and at epoch ends validate and checkpoint (mid-epoch checkpoints: every N
    steps, preemption, --stop-at-step)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    config = TrainConfig(**loop_config["config"])
    quiet_ray_output(config.verbose)
    info = DatasetInfo(**loop_config["dataset"])
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    device = ray.train.torch.get_device()
    # Raises, naming the fix, if the global batch does not split over this worker count (elastic).
    accum = config.grad_accum_steps
    rows_per_step = per_worker_batch_size(config.global_batch_size, world, accum) * accum

    train_rows = min(info.train_rows, config.limit_train_rows or info.train_rows)
    steps = steps_per_epoch(train_rows, config.global_batch_size)
    run_dir = resolve_storage(config.storage_path).join(config.run_name)
    state = latest_state(run_dir)
    model, optimizer, scheduler = build_training(info, config, steps, state)
    checkpoints = checkpoint_policy(config, steps)
    run = restore_run(state, run_dir, loop_config["driver_id"], world, checkpoints)
    progress = ProgressNotes(run_dir, loop_config["driver_id"], world, config.log_every_steps, rank)
    meter = ThroughputMeter(config.global_batch_size, warmup_steps=THROUGHPUT_SKIP_STEPS)
    totals = EpochTotals(device, rank, run.position)
    sink = rank_zero_sink(loop_config, rank)
    checkpointer = Checkpointer(model, optimizer, scheduler, loop_config, run_dir, rank)
    batching = {"batch_size": rows_per_step, "drop_last": True, "device": "cpu",
                "local_shuffle_buffer_size": loop_config["local_shuffle_rows"]}  # fmt: skip
    done = checkpoints.already_done(run.step)
    try:
        for epoch in range(run.step // steps + 1, 0 if done else config.epochs + 1):
            # A resumed epoch reads the rows it has not trained; else all, in a fresh order.
            resumed = run.position is not None and run.position.trained_rows is not None
            shard = ray.train.get_dataset_shard(REST_OF_EPOCH if resumed else TRAIN)
            rows = EpochRows(train_rows, carried_rows(run, rank) if resumed else None)
            waited = DataWait()
            seed = epoch_seed(config.seed + rank, epoch)
            batches = shard.iter_torch_batches(**batching, local_shuffle_seed=seed)
            for batch in waited.timed(batches):
                dtype = train_step(model, optimizer, scheduler, batch, info, config, totals)
                checkpointer.trained(batch, rows, run, dtype)
                meter.step()
                step = run.step = run.step + 1
                lr = scheduler.get_last_lr()[0]
                if run.startup_s is None:
                    run.startup_s = startup_seconds(loop_config["launched_at"], rank)
                due = checkpoints.due(step, run.faults)  # on every rank: may ask Ray (a barrier)
                if rank == 0 and (step % config.log_every_steps == 0 or due.at_epoch_end):
                    sink.log(log_interval(run, totals, meter, lr, step, steps, config), step)
                progress.note(step, run.faults, checkpointing=bool(due))
                if due.at_epoch_end:
                    with meter.paused():
                        row = end_epoch(model, info, totals, meter, lr, step, steps, config, rows)
                        row["data_wait_share"] = waited.seconds / max(row["train_s"], 1e-9)
                        run.history.append(row)
                        sink.log(row, step)
                        sink.flush()  # in the store before the report: a sweep may stop the trial on it
                        run.position = None
                        checkpointer.save(run, row, epoch, rows, finished=True)
                    # After the report: the CSV never lists an epoch without its checkpoint.
                    if rank == 0:
                        write_metrics_csv(run_dir.join(METRICS_FILE), run.history)
                    totals = EpochTotals(device, rank, None)
                    meter.restart()
                elif due:
                    with meter.paused():
                        run.position = totals.position((step - 1) % steps + 1, rows)
                        metrics = {"epoch": step / steps, "step": step, SCORE: NOT_EVALUATED}
                        checkpointer.save(run, metrics, epoch, rows, finished=False)
                if due.stops:
                    if rank == 0 and step == config.stop_at_step:
                        log.info("stopped at step %d as asked (--stop-at-step)", step)
                    return
            check_epoch_ended(run.step, epoch, steps, rank)
    finally:
        sink.close()  # sends what rank 0 queued (bounded wait)


def carried_rows(run: RunState, rank: int) -> np.ndarray | None:
    """The resumed epoch's rows trained before the stop: rank 0 carries them (so the merge counts
    them once)."""
    trained = run.position.trained_rows if run.position is not None else None
    return trained.numpy() if trained is not None and rank == 0 else None


def checkpoint_policy(config: TrainConfig, steps: int) -> CheckpointPolicy:
    """Checkpoints at epoch ends, every --checkpoint-every-steps, on a preemption notice and at
    --stop-at-step."""
    return CheckpointPolicy(
        every_steps=config.checkpoint_every_steps,
        last_step=steps * config.epochs,
        epoch_steps=steps,
        stop_at_step=config.stop_at_step,
        preemption_check_steps=config.preemption_check_steps,
    )


def check_epoch_ended(step: int, epoch: int, steps: int, rank: int) -> None:
    if step != epoch * steps:
        raise DataShardError(
            f"rank {rank}'s shard of epoch {epoch} ended after step {step}; the epoch ends at "
            f"step {epoch * steps}: the dataset changed under the run?"
        )


class Checkpointer:
    """Writes the run's checkpoints: the state from rank 0, the epoch's trained rows beside it
    (what the dataset factory of a resumed epoch reads), each rank's row-id audit, and the report
    every rank makes (a barrier). It also keeps, per batch, what those need."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        loop_config: dict[str, Any],
        run_dir: StoragePath,
        rank: int,
    ) -> None:
        config = TrainConfig(**loop_config["config"])
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.loop_config, self.rank = loop_config, rank
        self.upload = upload_with_retries(config.storage_path, config.storage_patience_s)
        self.audit = RowIdAudit(run_dir, rank, enabled=config.record_row_ids)

    def trained(
        self, batch: dict[str, torch.Tensor], rows: EpochRows, run: RunState, dtype: str
    ) -> None:
        """Note a batch trained on: its ids, the dtype it computed in, and (rank 0) where it was
        decoded and when the run's first batch came."""
        run.compute_dtype = dtype
        ids = batch["id"].numpy()
        rows.mark(ids)
        self.audit.add(ids)
        if self.rank == 0:
            count_decode_nodes(run.decoded_on, batch["decode_node"].numpy())
        if run.first_batch_s is None:
            run.first_batch_s = time.time() - self.loop_config["launched_at"]

    def save(
        self,
        run: RunState,
        metrics: dict[str, float],
        epoch: int,
        rows: EpochRows,
        finished: bool,
    ) -> None:
        """Checkpoint `run` with `metrics`; a finished epoch's next one starts with no rows."""
        state = checkpoint_state(self.model, self.optimizer, self.scheduler, run, self.loop_config)
        self.audit.write(epoch, run.step)
        trained = run.position.trained_rows if run.position is not None else None
        place = (epoch + 1, rows.bits[:0]) if finished else (epoch, trained.numpy())  # type: ignore[union-attr]
        report_checkpoint(metrics, state, self.upload, {POSITION_FILE: position_file(*place)})


class DataWait:
    """Seconds this rank spent waiting for its next batch: with ingest keeping up, about none."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def timed(
        self, batches: Iterable[dict[str, torch.Tensor]]
    ) -> Iterator[dict[str, torch.Tensor]]:
        iterator = iter(batches)
        while True:
            started = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            self.seconds += time.perf_counter() - started
            yield batch


def check_trained_once(rows: EpochRows, expected: int, device: torch.device) -> None:
    """At an epoch's end: every rank's rows together are `expected` distinct rows (a collective)."""
    distinct = int(np.unpackbits(rows.merged(device)).sum())
    if distinct != expected:
        raise DataShardError(f"the epoch trained {distinct} distinct rows, not {expected}")


def count_decode_nodes(counts: dict[str, int], node_tags: np.ndarray) -> None:
    """Add one batch's rows to `counts`, by the node (its id's first 15 hex digits) that decoded
    them: where the data work ran."""
    for tag, rows in zip(*np.unique(node_tags, return_counts=True), strict=True):
        key = f"{int(tag):015x}"
        counts[key] = counts.get(key, 0) + int(rows)


class RowIdAudit:
    """With --record-row-ids, each rank writes the ids of the rows it trained on with every
    checkpoint, to <run>/row_ids/epoch-E/step-S-rank-R.npy: steps lost to a failure (trained after
    the last checkpoint, then redone) are never written, so the files count each row's training
    in the run that was kept."""

    def __init__(self, run_dir: StoragePath, rank: int, enabled: bool) -> None:
        self.folder, self.rank, self.enabled = run_dir.join("row_ids"), rank, enabled
        self.ids: list[np.ndarray] = []

    def add(self, ids: np.ndarray) -> None:
        if self.enabled:
            self.ids.append(ids.copy())

    def write(self, epoch: int, step: int) -> None:
        if not self.enabled:
            return
        ids = np.concatenate(self.ids) if self.ids else np.zeros(0, dtype=np.int64)
        buffer = io.BytesIO()
        np.save(buffer, ids)
        self.folder.join(f"epoch-{epoch}", f"step-{step:07d}-rank-{self.rank}.npy").write_bytes(
            buffer.getvalue()
        )
        self.ids = []


# ---------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------


def run(config: TrainConfig, callbacks: Sequence[UserCallback] = ()) -> dict[str, Any]:
    """Check everything that can be checked, train, then write curves and summary.json.

    `callbacks` join the run's (a sweep passes Tune's, which forwards every report to Tune).
    """
    started, launched_at = time.perf_counter(), time.time()
    storage, data_dir = locate_run(config)
    info = inspect_dataset(data_dir)
    train_rows = min(info.train_rows, config.limit_train_rows or info.train_rows)
    if steps_per_epoch(train_rows, config.global_batch_size) < 1:
        raise ConfigError(
            f"{train_rows} training rows make no full global batch of {config.global_batch_size}: "
            "use more rows or a smaller --global-batch-size"
        )
    config = dataclasses.replace(config, storage_path=storage.uri, data_dir=data_dir.uri)

    warm_tracking_store(config, storage)  # overlaps Ray's start
    start_ray_for_run(config, storage, data_dir)
    tracked = open_for_config(config, storage, pipeline="mnist_resnet", version=__version__)

    # Ray Data reads, shuffles and decodes the images on the cluster's CPUs (ingest.py). Ray calls
    # these factories at every worker-group start, so a restart reads the newest checkpoint's place.
    data = ImageData(
        data_dir=data_dir.uri,
        info=dataclasses.asdict(info),
        run_dir=storage.join(config.run_name).uri,
        seed=config.seed,
        augment=config.resolved_augment(info.image_root is not None, info.channels),
        limit_train_rows=config.limit_train_rows,
        limit_val_rows=config.limit_val_rows,
        progress_bars=config.verbose,
    )
    trainer = TorchTrainer(
        train_loop_per_worker,
        datasets={TRAIN: data.train, REST_OF_EPOCH: data.rest_of_epoch, VAL: data.val},
        dataset_config=EvenTrainingEveryValidationRow(),
        train_loop_config={
            "config": dataclasses.asdict(config),
            "dataset": dataclasses.asdict(info),
            "local_shuffle_rows": data.local_shuffle_rows,
            "driver_id": uuid.uuid4().hex,  # tells a worker restart from a rerun of the command
            "launched_at": launched_at,
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
    """The chosen checkpoint's test loss and accuracy. A GPU run's is evaluated in a Ray task on a
    worker's resources (the driver may sit on a CPU-only head node); a CPU run's here, in the
    driver: starting a Ray worker for it (its imports, ~4 s) costs more than the evaluation."""
    started = time.perf_counter()
    if config.use_gpu:
        task = ray.remote(checkpoint_test_metrics).options(
            num_cpus=config.cpus_per_worker,
            num_gpus=1,
            # Not inside the caller's placement group (a sweep trial's holds a tenth of a CPU): the
            # run's workers have ended, their resources are free in the cluster.
            scheduling_strategy="DEFAULT",
        )
        result: dict[str, Any] = ray.get(task.remote(checkpoint_uri, config.limit_test_rows))
    else:
        result = checkpoint_test_metrics(checkpoint_uri, config.limit_test_rows)
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
    steps = steps_per_epoch(
        min(info.train_rows, config.limit_train_rows or info.train_rows), config.global_batch_size
    )
    progress = {
        "steps_done": state["step"],
        "epochs_done": round(state["step"] / steps, 4),
        "stopped_mid_epoch": state.get("position") is not None,
        "startup_s": state.get("startup_s"),
        "first_batch_s": state.get("first_batch_s"),
        **FaultLog(**state.get("faults", {})).summary(),
    }
    if not history:  # stopped (--stop-at-step) before the first epoch ended
        summary = {
            **summary_header("mnist_resnet", __version__, config.run_name, run_dir),
            **progress,
        }
        summary |= {"best": None, "latest_checkpoint": result.checkpoint.path}
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
        **progress,
        "final": history[-1],
        "best": best_row,
        "best_checkpoint": best_uri,
        "test": evaluate_test_split_once(best_uri, config),
        "latest_checkpoint": run_dir.uri_for(result.checkpoint.path),
        "metrics_csv": run_dir.join(METRICS_FILE).uri,
        "curves_png": run_dir.join(CURVES_FILE).uri,
        "train_time_s": sum(row["train_s"] + row["val_s"] for row in history),
        "compute_dtype": state.get("compute_dtype"),
        "decoded_on": state.get("decoded_on", {}),
        "worker_peak_rss_mb": state.get("worker_peak_rss_mb"),
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
