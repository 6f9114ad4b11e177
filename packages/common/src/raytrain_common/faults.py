"""What a run went through (preemption notices, restarts, the steps each restart redid), recorded in
every checkpoint and written to summary.json, and the one preemption check a training loop makes.

A restart resumes from the newest complete checkpoint; the steps taken after it are lost and done
again. To count them, rank 0 writes the last step it reached to `progress.json` in the run folder
every few steps (one small atomic write), and the resumed attempt compares. The note also carries
the restarts so far: an attempt lost before its first checkpoint saved its own restart in no
checkpoint, and the next restart reads it back from there.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import ray.train

from raytrain_common.storage import StoragePath

log = logging.getLogger(__name__)

PROGRESS_FILE = "progress.json"
PROGRESS_PAUSE_AFTER_ERROR_S = 60.0
_progress_paused_until = float("-inf")


@dataclass
class FaultLog:
    """Preemption notices acted on and restarts survived; saved in each checkpoint."""

    preemptions: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    restarts: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    @property
    def attempt(self) -> int:
        """Which attempt of the run this is, the same on every rank: the restarts behind it. A
        preemption notice and progress.json both carry it (with the driver), so a restart can tell
        whether the attempt it replaces is the one that received the notice."""
        return len(self.restarts)

    def check_preemption(self, step: int) -> bool:
        """Ask Ray whether a node of the run is being preempted; True (and recorded) the first time
        a notice is seen, so the caller checkpoints once per notice.

        A barrier across the worker group: every rank must call it at the same steps.
        """
        notice = ray.train.get_preemption_info()
        if notice is None:
            return False
        nodes = sorted(notice.preempted_node_to_ranks)
        if any(seen["node_ids"] == nodes for seen in self.preemptions):
            return False
        deadline_s = None if notice.deadline_ms is None else notice.deadline_ms / 1000 - time.time()
        self.preemptions.append(
            {
                "checkpoint_step": step,
                "attempt": self.attempt,
                "node_ids": nodes,
                "ranks": notice.preempted_ranks,
                "deadline_s_after_notice": None if deadline_s is None else round(deadline_s, 1),
            }
        )
        if ray.train.get_context().get_world_rank() == 0:
            log.warning(
                "preemption announced for rank(s) %s (deadline in %s s): checkpointing at step %d",
                notice.preempted_ranks,
                "?" if deadline_s is None else f"{deadline_s:.0f}",
                step,
            )
        return True

    def record_restart(
        self,
        resumed_at: int,
        run_dir: StoragePath,
        driver_id: str,
        checkpoint: str | None,
        world_size: int | None = None,
    ) -> dict[str, Any]:
        """Note a resume at `resumed_at`: how far the lost attempt had gone, what caused it, and the
        worker counts before and after (an elastic run shrinks after a loss and grows back)."""
        progress = read_progress(run_dir) or {}
        self.adopt_unsaved_restarts(progress)
        before = progress.get("world_size")
        last = max(resumed_at, progress.get("step", resumed_at))
        # A notice saved in this checkpoint that no restart has followed yet. It caused this restart
        # only if the lost attempt is the one that received it: a checkpoint keeps the notice as it
        # was when written, so a later attempt (or a rerun) resuming from the same checkpoint finds
        # it again, long after the preemption's own restart.
        pending = [p for p in self.preemptions if not p.get("restarted")]
        for notice in pending:
            notice["restarted"] = True
        lost_attempt = progress.get("attempt")
        missed = self.notice_without_checkpoint(progress)
        if pending and pending[-1].get("attempt", lost_attempt) == lost_attempt:
            cause = "preemption"
        elif missed is not None:
            cause = "preemption"
            self.preemptions.append({**missed, "restarted": True, "checkpoint_missed": True})
            warn_notice_checkpoint_missed(missed, resumed_at, last)
        elif progress.get("driver_id") == driver_id:
            # The same driver restarted its worker group: after a failure, or, in an elastic run
            # that found room for more workers, to grow (Ray stops a healthy group to resize it).
            grew = world_size is not None and before is not None and world_size > before
            cause = "resize" if grew else "worker failure"
        else:
            cause = "rerun"
        restart = {
            "resumed_at_step": resumed_at,
            "last_step_before": last,
            "steps_redone": last - resumed_at,
            "cause": cause,
            "checkpoint": checkpoint,
            "world_size_before": before,
            "world_size": world_size,
        }
        self.restarts.append(restart)
        return restart

    def adopt_unsaved_restarts(self, progress: dict[str, Any]) -> None:
        """Take the restarts progress.json lists past this (checkpoint's) log: those of attempts
        that were lost before they wrote a checkpoint. Two faults within one checkpoint interval
        are then both in summary.json, and `attempt` counts both."""
        noted = progress.get("restarts") or []
        if len(noted) > len(self.restarts) and noted[: len(self.restarts)] == self.restarts:
            self.restarts = [dict(restart) for restart in noted]

    @property
    def current_notice(self) -> dict[str, Any] | None:
        """The newest preemption notice this attempt received and no restart has followed yet:
        rank 0 notes it in progress.json before its checkpoint, so the restart still knows of it
        when that checkpoint never completes."""
        return next(
            (
                p
                for p in reversed(self.preemptions)
                if p.get("attempt") == self.attempt and not p.get("restarted")
            ),
            None,
        )

    def notice_without_checkpoint(self, progress: dict[str, Any]) -> dict[str, Any] | None:
        """The notice the lost attempt noted in progress.json when no checkpoint holds it: its
        checkpoint did not complete before the node went (a deadline shorter than the checkpoint
        takes), so the resume went back to an older one, or to the start."""
        notice = progress.get("notice")
        if not notice or notice.get("attempt") != progress.get("attempt"):
            return None
        if any(seen["node_ids"] == notice["node_ids"] for seen in self.preemptions):
            return None  # the checkpoint resumed from holds it: the usual case above
        return dict(notice)

    def summary(self) -> dict[str, Any]:
        return {
            "preemptions": self.preemptions,
            "restarts": self.restarts,
            "steps_redone": sum(r["steps_redone"] for r in self.restarts),
        }


def warn_notice_checkpoint_missed(notice: dict[str, Any], resumed_at: int, last: int) -> None:
    """Say, once (rank 0: every rank records the restart), that a preemption cost more than its
    notice should have, and why."""
    try:
        if ray.train.get_context().get_world_rank() != 0:
            return
    except RuntimeError:  # outside a training function (a unit test): no ranks to leave out
        pass
    deadline = notice.get("deadline_s_after_notice")
    log.warning(
        "the preemption notice at step %d (deadline in %s s) did not end in a complete "
        "checkpoint before the node went: resumed at step %d, %d step(s) redone. Give the nodes "
        "a longer notice (a pod's terminationGracePeriodSeconds) or make the checkpoint cheaper",
        notice["checkpoint_step"],
        "?" if deadline is None else f"{deadline:.0f}",
        resumed_at,
        last - resumed_at,
    )


def read_progress(run_dir: StoragePath) -> dict[str, Any] | None:
    target = run_dir.join(PROGRESS_FILE)
    return json.loads(target.read_text()) if target.exists() else None


def write_progress(
    run_dir: StoragePath,
    step: int,
    driver_id: str,
    world_size: int | None = None,
    attempt: int | None = None,
    notice: dict[str, Any] | None = None,
    restarts: list[dict[str, Any]] | None = None,
) -> None:
    """The last step rank 0 reached (atomic write), so a restart knows how many steps it redoes,
    the preemption notice this attempt is acting on, if any (`FaultLog.current_notice`), and the
    restarts so far (`FaultLog.adopt_unsaved_restarts`).

    Bookkeeping only: a storage hiccup costs a warning here, never the run (the checkpoint upload
    is where storage errors count).
    """
    global _progress_paused_until
    if time.monotonic() < _progress_paused_until:
        return
    progress: dict[str, Any] = {
        "step": step,
        "driver_id": driver_id,
        "attempt": attempt,
        "world_size": world_size,
    }
    if notice is not None:
        progress["notice"] = notice
    if restarts:
        progress["restarts"] = restarts
    try:
        run_dir.join(PROGRESS_FILE).write_text(json.dumps(progress))
    except OSError as error:
        # Each failed write can spend seconds in the storage client's own retries: pause the
        # notes for a while instead of slowing every step of an outage.
        _progress_paused_until = time.monotonic() + PROGRESS_PAUSE_AFTER_ERROR_S
        log.warning(
            "could not record progress in %s (notes paused for %.0f s): %s",
            run_dir.uri,
            PROGRESS_PAUSE_AFTER_ERROR_S,
            str(error).splitlines()[0][:200],
        )
