"""What the run reports, and when: the window's loss and gradient norm (read once per window: the
only host syncs of the loop), tokens/s and MFU, peak memory, and rank 0's progress lines and MLflow
rows. The run's history (metrics.csv) is kept in the checkpoints (checkpointer.py's RunState)."""

from __future__ import annotations

import contextlib
import logging

import ray.train
import ray.train.torch
import torch
import torch.distributed as dist

from llm_fsdp.loss import NextTokenLoss
from llm_fsdp.run_state import RunState, WorkerContext
from llm_fsdp.task import model_flops_per_token
from raytrain_common.hardware import peak_bf16_flops, peak_memory_gb
from raytrain_common.loop import StartupClock, ThroughputMeter, require_finite
from raytrain_common.metrics import eta
from raytrain_common.tracking import rank_zero_sink

log = logging.getLogger("llm_fsdp")


class MetricsLogger:
    """What the run reports: the window's loss and gradient norm (read once per window: the only
    host syncs of the loop), tokens/s and MFU, peak memory, and rank 0's lines and MLflow rows."""

    def __init__(
        self,
        context: WorkerContext,
        model: NextTokenLoss,
        optimizer: torch.optim.Optimizer,
        clock: StartupClock,
    ) -> None:
        self.config, self.seq_len = context.config, context.info.seq_len
        self.clock, self.last_step = clock, context.last_step
        micro, loop_config = context.micro, context.loop_config
        self.optimizer = optimizer  # the step's learning rate is in its param groups
        self.device, self.rank = ray.train.torch.get_device(), dist.get_rank()
        self.tokens_per_rank_step = micro * self.config.grad_accum_steps * self.seq_len
        self.meter = ThroughputMeter(
            self.config.global_batch_size * self.seq_len,
            flops_per_item=model_flops_per_token(model, self.seq_len),
            peak_flops=(peak_bf16_flops(self.device) or 0.0) * dist.get_world_size(),
        )
        self.window_loss = torch.zeros((), device=self.device)
        self.sink = rank_zero_sink(loop_config, self.rank)
        self.row: dict[str, float] = {}

    def step_end(self, run: RunState, *, loss_sum: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Count the step; every --log-every-steps and at the last step, the window's row."""
        self.window_loss += loss_sum
        self.meter.step()
        if run.startup_s is None:
            run.startup_s = self.clock.first_step(self.rank)
            run.startup_phases = self.clock.phases()
        self.row = {"step": run.step}
        if run.step % self.config.log_every_steps == 0 or run.step == self.last_step:
            self.row |= self.window_row(run.step, grad_norm)
            self.window_loss.zero_()

    def window_row(self, step: int, grad_norm: torch.Tensor) -> dict[str, float]:
        """One metrics row for the steps since the last one: loss, lr, throughput, MFU, memory."""
        rate = self.meter.window()
        row = {
            "train_loss": mean_window_loss(
                self.window_loss, self.tokens_per_rank_step * rate.steps, step
            ),
            "lr": self.optimizer.param_groups[0]["lr"],
            "grad_norm": float(grad_norm),
            "tokens_per_s": rate.items_per_s,
            "workers": dist.get_world_size(),  # changes when an elastic run shrinks or grows
        }
        if rate.mfu is not None:
            row["mfu"] = rate.mfu
        if (memory := peak_memory_gb(self.device)) is not None:
            row["peak_memory_gb"] = memory
        if self.rank == 0:
            mfu = f"  MFU {row['mfu']:.1%}" if "mfu" in row else ""
            peak = f"  peak {row['peak_memory_gb']:.1f} GiB" if "peak_memory_gb" in row else ""
            log.info(
                "step %d/%d  loss %.4f  lr %.2e  %.0f tokens/s  %s%s%s",
                *(step, self.config.max_steps, row["train_loss"], row["lr"], rate.items_per_s),
                *(eta(self.config.max_steps - step, rate.seconds_per_step), mfu, peak),
            )
        return row

    def record(self, run: RunState, validation: dict[str, float] | None) -> None:
        """The step's row, with its validation when there was one, in the history and MLflow (a
        validation in the store before the checkpoint reports it: a sweep may stop on it)."""
        self.row |= validation or {}
        if len(self.row) > 1:
            run.history.append(self.row)
            self.sink.log(self.row, run.step)
            if validation:
                self.sink.flush()

    def paused(self) -> contextlib.AbstractContextManager[None]:
        """Evaluation and checkpoints are left out of tokens/s."""
        return self.meter.paused()

    def close(self) -> None:
        self.sink.close()  # sends what rank 0 queued (bounded wait)


def mean_window_loss(local_sums: torch.Tensor, tokens_per_rank: int, step: int) -> float:
    """The global per-token training loss of a window of steps (one collective, one host sync)."""
    total = local_sums.clone()
    dist.all_reduce(total)
    mean = total.item() / (tokens_per_rank * dist.get_world_size())
    where = f"in the steps up to {step} (rank {dist.get_rank()})"
    return require_finite(mean, where, "lower --lr, or raise --warmup-steps")
