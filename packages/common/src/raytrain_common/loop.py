"""The policies a training loop follows, the same in every pipeline, so the loop itself reads as
build → restore → for each step: train, log, maybe validate, maybe checkpoint → finish.

- `CheckpointPolicy.due(step, faults)`: whether this step ends with a checkpoint, and why (every N
  steps, every M minutes, a preemption notice, `--stop-at-step`, an epoch's end, the run's end).
- `ValidationPolicy.due(step)`: whether this step ends with an evaluation on the validation split.
- `ProgressNotes.note(step, faults)`: the last step reached, in progress.json, so a restart can
  count the steps it redoes (faults.py).
- `ThroughputMeter`: items per second and MFU over a window of steps, with evaluation and
  checkpoint time left out.

Every step count here is the number of optimiser steps the run has taken (1 after the first step),
the `step` of metrics.csv and of every report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray.train.collective

from raytrain_common.faults import FaultLog, write_progress
from raytrain_common.storage import StoragePath

log = logging.getLogger(__name__)

# Why a step ends with a checkpoint (several may hold at once).
EVERY = "every"  # --checkpoint-every-steps
TIMED = "timed"  # --checkpoint-every-minutes since the last checkpoint (rank 0's clock)
PREEMPTION = "preemption"  # Ray announced that a node of the run is being preempted
STOP = "stop"  # --stop-at-step: checkpoint, then leave the loop (a rerun continues)
EPOCH_END = "epoch_end"  # an epoch-counted run checkpoints every epoch, evaluated
END = "end"  # the run's last step


@dataclass(frozen=True)
class CheckpointDue:
    """The reasons this step ends with a checkpoint; empty when it does not."""

    reasons: frozenset[str] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.reasons)

    @property
    def stops(self) -> bool:
        """The loop ends after this checkpoint."""
        return STOP in self.reasons or END in self.reasons

    @property
    def at_epoch_end(self) -> bool:
        return EPOCH_END in self.reasons

    @property
    def preempted(self) -> bool:
        return PREEMPTION in self.reasons

    @property
    def timed(self) -> bool:
        """Only the clock asked for it (--checkpoint-every-minutes)."""
        return self.reasons == {TIMED}


@dataclass
class CheckpointPolicy:
    """When a training loop checkpoints.

    `every_steps`: also every N steps of the run (0: only at the boundaries below).
    `epoch_steps`: steps per epoch of an epoch-counted run (every epoch end checkpoints); None for a
    step-counted run.
    `last_step`: the run's end, always checkpointed.
    `stop_at_step`: checkpoint there and stop; a rerun continues.
    `preemption_check_steps`: ask Ray every N steps whether a node is being preempted (0: never).
    `every_minutes`: also once that long has passed since the last checkpoint (or the worker
    group's start), so a fault without notice loses at most that much work however long an epoch
    is (0: never). Rank 0's clock decides, at the preemption checks' steps (every 10 steps when
    those are off), and every rank learns it there (`broadcast_from_rank_zero`, a barrier): the
    ranks' own clocks could disagree about a step, and a checkpoint some ranks skip would hang.
    """

    every_steps: int
    last_step: int
    epoch_steps: int | None = None
    stop_at_step: int | None = None
    preemption_check_steps: int = 0
    every_minutes: float = 0.0
    last_checkpoint: float = field(default_factory=time.monotonic)  # monotonic seconds

    def due(self, step: int, faults: FaultLog) -> CheckpointDue:
        """Whether step `step` ends with a checkpoint. A collective when a preemption or clock check
        falls on this step: every rank calls it after every step, so all ranks ask at the same
        steps."""
        reasons = set()
        if self.every_steps and step % self.every_steps == 0:
            reasons.add(EVERY)
        if self.time_is_up(step):
            reasons.add(TIMED)
        every = self.preemption_check_steps
        if every and step % every == 0 and faults.check_preemption(step):
            reasons.add(PREEMPTION)
        if step == self.stop_at_step:
            reasons.add(STOP)
        if self.epoch_steps and step % self.epoch_steps == 0:
            reasons.add(EPOCH_END)
        if step >= self.last_step:
            reasons.add(END)
        if reasons:
            self.last_checkpoint = time.monotonic()
        return CheckpointDue(frozenset(reasons))

    def time_is_up(self, step: int) -> bool:
        """`every_minutes` have passed since the last checkpoint, by rank 0's clock, told to every
        rank (a barrier: called by every rank at the same steps)."""
        cadence = self.preemption_check_steps or 10
        if self.every_minutes <= 0 or step % cadence:
            return False
        late = time.monotonic() - self.last_checkpoint >= self.every_minutes * 60
        return bool(ray.train.collective.broadcast_from_rank_zero(late))

    def already_done(self, step: int) -> bool:
        """A run resumed at `step` has nothing left to train (its end or its --stop-at-step)."""
        return step >= self.last_step or (
            self.stop_at_step is not None and step >= self.stop_at_step
        )


@dataclass(frozen=True)
class ValidationPolicy:
    """When a training loop evaluates on the validation split: every `every_steps` steps (an epoch's
    length for an epoch-counted run) and at `last_step`."""

    every_steps: int
    last_step: int

    def due(self, step: int) -> bool:
        return step % self.every_steps == 0 or step == self.last_step


@dataclass
class ProgressNotes:
    """Rank 0 writes the last step reached to progress.json every `every_steps` steps, at every
    checkpoint and at an attempt's first step, so a restart knows how many steps it redoes (one
    small atomic write; storage errors cost a warning, never the run). At a preemption notice's
    checkpoint it is written first, with the notice, so a restart knows of the notice even when
    that checkpoint never completes. Each note lists the restarts so far: the first one of an
    attempt records its own restart before any checkpoint does. (It comes after that step's
    gradient all-reduce, so every rank has read the lost attempt's note by then.)"""

    run_dir: StoragePath
    driver_id: str
    world_size: int
    every_steps: int
    rank: int
    noted_attempt: int | None = field(default=None, init=False)

    def note(self, step: int, faults: FaultLog, checkpointing: bool = False) -> None:
        first_of_attempt = faults.attempt != self.noted_attempt
        if self.rank == 0 and (checkpointing or first_of_attempt or step % self.every_steps == 0):
            write_progress(
                self.run_dir,
                step,
                self.driver_id,
                self.world_size,
                faults.attempt,
                faults.current_notice,
                faults.restarts,
            )
            self.noted_attempt = faults.attempt


@dataclass(frozen=True)
class Throughput:
    """A window's rate: items (images, sentences, tokens) per second, seconds per step, and the
    model FLOPs utilisation when the accelerator's peak is known."""

    items_per_s: float
    seconds_per_step: float
    steps: int
    mfu: float | None


class ThroughputMeter:
    """Counts steps and time, leaving out what runs inside `paused()` (evaluation, checkpoints).

    `window()` gives the rate since the last window (for progress lines); `steady()` the rate since
    the meter started, after its first `warmup_steps` (allocator, kernels and compilation warm up).
    `flops_per_item` and `peak_flops` (all devices together) give MFU; leave them None for none.
    """

    def __init__(
        self,
        items_per_step: int,
        *,
        warmup_steps: int = 0,
        flops_per_item: float | None = None,
        peak_flops: float | None = None,
    ) -> None:
        self.items_per_step = items_per_step
        self.warmup_steps = warmup_steps
        self.flops_per_item = flops_per_item
        self.peak_flops = peak_flops
        self.restart()

    def restart(self) -> None:
        """Count from now, warm-up included (a new epoch)."""
        now = time.perf_counter()
        self.started = self.window_started = self.steady_started = now
        self.steps = self.window_steps = 0

    def step(self) -> None:
        self.steps += 1
        self.window_steps += 1
        if self.steps == self.warmup_steps:
            self.steady_started = time.perf_counter()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent inside is left out of every rate."""
        paused = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - paused
            self.started += spent
            self.window_started += spent
            self.steady_started += spent

    def window(self) -> Throughput:
        """The rate since the last call (or the start), then a new window."""
        now = time.perf_counter()
        rate = self._rate(self.window_steps, now - self.window_started)
        self.window_started, self.window_steps = now, 0
        return rate

    def steady(self) -> Throughput:
        """The rate since the start, past the warm-up steps when there were more steps than that."""
        now = time.perf_counter()
        if self.steps > self.warmup_steps:
            return self._rate(self.steps - self.warmup_steps, now - self.steady_started)
        return self._rate(self.steps, now - self.started)

    def _rate(self, steps: int, seconds: float) -> Throughput:
        seconds = max(seconds, 1e-9)
        items_per_s = steps * self.items_per_step / seconds
        mfu = None
        if self.flops_per_item is not None and self.peak_flops:
            mfu = items_per_s * self.flops_per_item / self.peak_flops
        return Throughput(items_per_s, seconds / max(steps, 1), steps, mfu)


def process_started_at() -> float:
    """When this process started, on time.time()'s scale (from /proc, to 10 ms); now where there
    is no /proc. A command's start-up is counted from here: Python, its imports and the CLI are
    part of what a user waits for."""
    try:
        after_name = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started_ticks = int(after_name[19])  # field 22, `starttime`, in clock ticks since boot
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        age = uptime - started_ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - max(age, 0.0)
    except (OSError, ValueError, IndexError):
        return time.time()


@dataclass
class RunRecord:
    """What every run's record holds, saved in each of its checkpoints: the faults it survived and
    how long the command that began this attempt took to its first step. A pipeline's `RunState`
    extends it with its own counters; `state_dict()` / `load_state_dict()` save and restore all of
    them (entries of a checkpoint that are no field are left alone)."""

    faults: FaultLog = field(default_factory=FaultLog)
    startup_s: float | None = None  # from the command's start to the first optimiser step
    startup_phases: dict[str, float] | None = None  # those seconds, phase by phase (StartupClock)

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in (item.name for item in dataclasses.fields(self)):
            if name in state and name != "faults":
                setattr(self, name, state[name])
        self.faults = FaultLog(**state.get("faults", {}))


def require_finite(loss: float, where: str, fix: str) -> float:
    """`loss`, or a stop at the first non-finite one (NaN, inf) naming where it came and what to
    change, rather than training on garbage (known_errors adds the usual causes)."""
    if not math.isfinite(loss):
        raise FloatingPointError(f"training loss is {loss} {where}: {fix}")
    return loss


class StartupClock:
    """The seconds from a command's start to its first optimiser step, phase by phase.

    `mark(phase)` records when `phase` ended; the driver marks its phases, hands `marks` to the
    workers in `train_loop_config`, and rank 0 marks the rest. `phases()` is summary.json's
    `startup_phases` (each phase's seconds, in order) and `total()` its `startup_s`."""

    def __init__(self, marks: dict[str, float] | float | None = None) -> None:
        """From the driver's `marks`; or, in the driver, from when the command started
        (time.time(), or now) with its first phase, `imports` (Python, imports and the command
        line), ending now. `began`: when this clock was made (time.perf_counter()), where a run's
        wall time counts from."""
        self.began = time.perf_counter()
        if isinstance(marks, dict):
            self.marks = dict(marks)
        else:
            self.marks = {"start": time.time() if marks is None else marks}
            self.mark("imports")

    def mark(self, phase: str) -> None:
        self.marks[phase] = time.time()

    def phases(self) -> dict[str, float]:
        pairs = itertools.pairwise(self.marks.items())
        return {phase: round(ended - before, 2) for (_, before), (phase, ended) in pairs}

    def total(self) -> float:
        times = list(self.marks.values())
        return times[-1] - times[0]

    def first_step(self, rank: int) -> float:
        """Marks the first optimiser step and returns `total()`; rank 0 logs it with its phases."""
        self.mark("first_step")
        seconds = self.total()
        if rank == 0:
            where = ", ".join(f"{phase} {s:.1f}" for phase, s in self.phases().items())
            log.info("first optimiser step %.1f s after `train` started (%s)", seconds, where)
        return seconds
