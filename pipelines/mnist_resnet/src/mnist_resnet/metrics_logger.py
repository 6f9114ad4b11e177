"""What the run reports, and when: the epoch's sums on every rank, throughput, the wait for data,
rank 0's progress lines, curve points, metrics.csv and MLflow rows."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import ray.train
import ray.train.torch
import torch
import torch.distributed as dist

from mnist_resnet.run_state import RunState, WorkerContext
from mnist_resnet.task import usable
from raytrain_common.hardware import peak_memory_gb
from raytrain_common.loop import StartupClock, ThroughputMeter, require_finite
from raytrain_common.metrics import METRICS_FILE, eta, write_metrics_csv
from raytrain_common.tracking import rank_zero_sink

log = logging.getLogger("mnist_resnet")

# The first steps of an epoch include warm-up (allocator, kernels); throughput skips them.
THROUGHPUT_SKIP_STEPS = 5


@dataclass
class EpochSums:
    """The epoch's sums over every rank: a mid-epoch checkpoint saves them, so a resumed epoch's
    training loss and accuracy equal an uninterrupted epoch's."""

    step: int = 0  # steps taken in the epoch
    loss_sum: float = 0.0
    correct: float = 0.0
    seen: float = 0.0
    train_s: float = 0.0
    skipped: float = 0.0  # rows whose file could not be decoded (counted as trained)


class EpochTotals:
    """This rank's running sums of the epoch (loss, correct, images) and of the logging interval,
    kept on the device: reading them makes the host wait, so they are read when a line is logged
    or a checkpoint gathers them (`state_dict`, a collective)."""

    def __init__(self, device: torch.device, rank: int, steps_per_epoch: int) -> None:
        self.device, self.rank, self.steps_per_epoch = device, rank, steps_per_epoch
        self.reset()

    def reset(self, carried: EpochSums | None = None) -> None:
        """A new epoch's sums; a resumed one's start from the checkpoint's, held on rank 0 only
        so that the all-reduce counts them once."""
        carried = carried or EpochSums()
        held = carried if self.rank == 0 else EpochSums()
        sums = [held.loss_sum, held.correct, held.seen, held.skipped]
        self.sums = torch.tensor(sums, device=self.device)
        self.interval = torch.zeros(2, device=self.device)  # summed micro-batch losses, batches
        self.train_s_before = carried.train_s
        self.started = self.last_step_ended = time.perf_counter()

    def add(self, logits: torch.Tensor, loss: torch.Tensor, labels: torch.Tensor) -> None:
        detached = loss.detach().float()
        decoded = usable(labels).sum().float()
        self.sums += torch.stack(
            [
                detached * decoded,
                (logits.argmax(dim=1) == labels).sum().float(),
                decoded,
                len(labels) - decoded,  # rows whose file could not be decoded
            ]
        )
        self.interval += torch.stack([detached, torch.ones_like(detached)])

    def step_ended(self) -> None:
        """The epoch's training time runs to here (validation and checkpoints come after)."""
        self.last_step_ended = time.perf_counter()

    def interval_loss(self) -> float:
        """Mean micro-batch loss since the last call, on this rank."""
        loss_sum, batches = self.interval.tolist()
        self.interval.zero_()
        return loss_sum / max(batches, 1)

    def state_dict(self, step: int) -> dict[str, float]:
        """The epoch's sums over every rank after the run's `step` (a collective: every rank
        calls it)."""
        totals = self.sums.clone()
        if dist.is_initialized():
            dist.all_reduce(totals)
        loss_sum, correct, seen, skipped = totals.tolist()
        train_s = self.train_s_before + self.last_step_ended - self.started
        in_epoch = (step - 1) % self.steps_per_epoch + 1
        return dataclasses.asdict(EpochSums(in_epoch, loss_sum, correct, seen, train_s, skipped))

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """A mid-epoch checkpoint's sums (None, or a checkpoint at an epoch's end: a new epoch).
        Checkpoints before 0.20 also held the epoch's rows here; those are TrainingRows'."""
        fields = {field.name for field in dataclasses.fields(EpochSums)}
        self.reset(EpochSums(**{k: v for k, v in state.items() if k in fields}) if state else None)


class MetricsLogger:
    """What the run reports. Every rank keeps the epoch's sums (loss, accuracy, images), the
    throughput meter and its wait for data; rank 0 writes the progress lines, the curve points,
    metrics.csv and the MLflow rows (through the sink, which never blocks a step)."""

    def __init__(self, context: WorkerContext, run: RunState, clock: StartupClock) -> None:
        self.config, self.rank, self.run = context.config, context.rank, run
        self.device = ray.train.torch.get_device()
        self.clock = clock
        self.run_dir, self.steps = context.run_dir, context.steps
        self.totals = EpochTotals(self.device, self.rank, self.steps)
        self.meter = ThroughputMeter(
            self.config.global_batch_size, warmup_steps=THROUGHPUT_SKIP_STEPS
        )
        self.sink = rank_zero_sink(context.loop_config, self.rank)
        self.data_wait_s, self.lr, self.epoch_rate = 0.0, 0.0, 0.0
        self.skipped_named: set[str] = set()  # files this rank could not decode, logged once

    def timed(
        self, batches: Iterable[dict[str, torch.Tensor]]
    ) -> Iterator[dict[str, torch.Tensor]]:
        """An epoch's batches, timing this rank's wait for each (about none when ingest keeps
        up) and when the run's first batch came, and naming the files skipped in them."""
        self.data_wait_s = 0.0
        iterator = iter(batches)
        while True:
            started = time.perf_counter()
            batch = next(iterator, None)
            self.data_wait_s += time.perf_counter() - started
            if batch is None:
                return
            if self.run.first_batch_s is None:
                self.clock.mark("first_batch")
                self.run.first_batch_s = self.clock.total()
            self.note_skipped(batch.pop("skipped", []))
            yield batch

    def note_skipped(self, files: list[str]) -> None:
        """One line for each file this rank could not decode, the first time it meets it (its
        row still counts as trained: the epoch goes on without it)."""
        for file in files:
            if file not in self.skipped_named:
                self.skipped_named.add(file)
                log.warning(
                    "rank %d: skipped %s; it counts as trained this epoch (in metrics.csv's "
                    "skipped_files). Remove it from the tree before the next `prepare`",
                    *(self.rank, file),
                )

    def step_end(self, run: RunState, *, lr: float) -> None:
        """Count the step; rank 0's progress line every --log-every-steps and at an epoch's end
        (no collective: the epoch's sums over every rank are gathered by the checkpoint)."""
        self.meter.step()
        self.totals.step_ended()
        self.lr = lr
        if run.startup_s is None:
            run.startup_s = self.clock.first_step(self.rank)
            run.startup_phases = self.clock.phases()
        epoch_end = run.step % self.steps == 0
        if self.rank == 0 and (run.step % self.config.log_every_steps == 0 or epoch_end):
            self.sink.log(self.interval_row(run), run.step)
        if epoch_end:  # the rate of the epoch's training alone (validation comes after)
            self.epoch_rate = self.meter.steady().items_per_s

    def interval_row(self, run: RunState) -> dict[str, float]:
        """Rank 0's progress line and curve point for the steps since the last one."""
        loss, step, steps = self.totals.interval_loss(), run.step, self.steps
        require_finite(loss, f"at step {step} (rank 0)", "lower --lr, or set --grad-clip-norm")
        rate = self.meter.window()
        run.step_log.append({"epoch": step / steps, "train_loss_interval": loss})
        position = f"epoch {(step - 1) // steps + 1} step {(step - 1) % steps + 1}/{steps}"
        remaining = eta(self.config.epochs * steps - step, rate.seconds_per_step)
        log.info(
            "%s  loss %.4f  lr %.4g  %.0f img/s  %s",
            *(position, loss, self.lr, rate.items_per_s, remaining),
        )
        return {"train_loss_interval": loss, "lr": self.lr}

    def epoch_row(
        self, run: RunState, sums: dict[str, float], validation: dict[str, float] | None
    ) -> dict[str, float]:
        """The ended epoch's row of metrics.csv and MLflow, from its sums over every rank and its
        validation scores (None under --validation async), on every rank alike (the checkpointer
        flushes it to the store before its report: a sweep may stop the trial on it)."""
        loss = require_finite(
            sums["loss_sum"] / sums["seen"],
            f"(the mean of epoch {run.step // self.steps})",
            "lower --lr, or set --grad-clip-norm",
        )
        row = {
            "epoch": run.step // self.steps,
            "step": run.step,
            "train_loss": loss,
            "train_accuracy": sums["correct"] / sums["seen"],
            "train_images_per_s": self.epoch_rate,
            "train_s": sums["train_s"],
            "skipped_files": sums["skipped"],
            **(validation or {}),
            "lr": self.lr,
        }
        if (memory := peak_memory_gb(self.device)) is not None:
            row["peak_memory_gb"] = memory  # on a GPU
        row["data_wait_share"] = self.data_wait_s / max(sums["train_s"], 1e-9)
        if self.rank == 0 and "val_loss" in row:
            log.info(
                "epoch %d/%d  train loss %.4f  val loss %.4f  val accuracy %.4f  %.0f img/s",
                *(row["epoch"], self.config.epochs, row["train_loss"], row["val_loss"]),
                *(row["val_accuracy"], row["train_images_per_s"]),
            )
        elif self.rank == 0:  # --validation async: a Ray task scores the epoch's checkpoint
            log.info(
                "epoch %d/%d  train loss %.4f  %.0f img/s  (validation: a task on the checkpoint)",
                *(row["epoch"], self.config.epochs, row["train_loss"], row["train_images_per_s"]),
            )
        run.history.append(row)
        self.sink.log(row, run.step)
        return row

    def next_epoch(self, run: RunState) -> None:
        """After the epoch's checkpoint was reported, so metrics.csv never lists an epoch without
        its checkpoint: rank 0 rewrites it; every rank starts the next epoch's sums and meter."""
        if self.rank == 0:
            write_metrics_csv(self.run_dir.join(METRICS_FILE), run.history)
        self.totals.reset()
        self.meter.restart()

    def flush(self) -> None:
        """Wait, briefly, until what rank 0 logged is in MLflow (at once while the store is away:
        its values wait in memory)."""
        self.sink.flush()

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """Time spent inside (a mid-epoch checkpoint) is left out of the rates."""
        return self.meter.paused()

    def close(self) -> None:
        self.sink.close()  # sends what rank 0 queued (bounded wait)
