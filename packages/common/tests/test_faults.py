"""The restart bookkeeping in summary.json: what caused each restart, read from the files a run
leaves (progress.json and the fault log saved in a checkpoint)."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest

from raytrain_common.faults import PROGRESS_FILE, FaultLog, write_progress
from raytrain_common.loop import ProgressNotes
from raytrain_common.storage import resolve_storage


def notice(attempt: int, step: int) -> dict:
    return {"checkpoint_step": step, "attempt": attempt, "node_ids": ["n1"], "ranks": [1]}


def test_a_preemption_is_the_cause_only_of_the_restart_that_replaced_the_attempt_it_reached(
    tmp_path: Path,
) -> None:
    run_dir = resolve_storage(tmp_path)
    # The attempt that got the notice checkpointed at step 30 and reached step 31 before its node
    # went.
    (tmp_path / PROGRESS_FILE).write_text(
        json.dumps({"step": 31, "driver_id": "d1", "attempt": 0, "world_size": 2})
    )
    saved = {"preemptions": [notice(0, 30)], "restarts": []}
    after_preemption = FaultLog(**json.loads(json.dumps(saved)))
    restart = after_preemption.record_restart(30, run_dir, "d1", "checkpoint_30", 2)
    assert (restart["cause"], restart["steps_redone"]) == ("preemption", 1)
    assert after_preemption.preemptions[0]["restarted"]

    # The restarted attempt went on to step 40; the newest checkpoint is torn, so a rerun of the
    # command resumes from checkpoint 30 again, whose saved notice is still pending.
    assert after_preemption.attempt == 1
    write_progress(run_dir, 40, "d1", 2, after_preemption.attempt)
    rerun = FaultLog(**json.loads(json.dumps(saved)))
    restart = rerun.record_restart(30, run_dir, "d2", "checkpoint_30", 2)
    assert (restart["cause"], restart["steps_redone"]) == ("rerun", 10)
    assert rerun.preemptions[0]["restarted"]

    # The same driver restarting its group from that checkpoint again is a worker failure.
    again = FaultLog(**json.loads(json.dumps(saved)))
    assert again.record_restart(30, run_dir, "d1", "checkpoint_30", 2)["cause"] == "worker failure"


def test_a_restart_onto_more_workers_by_the_same_driver_is_a_resize(tmp_path: Path) -> None:
    run_dir = resolve_storage(tmp_path)
    write_progress(run_dir, 12, "d1", 1)
    restart = FaultLog().record_restart(10, run_dir, "d1", "checkpoint_10", 2)
    assert restart["cause"] == "resize"
    assert (restart["world_size_before"], restart["world_size"]) == (1, 2)
    assert FaultLog().record_restart(10, run_dir, "d1", "checkpoint_10", 1)["cause"] == (
        "worker failure"
    )


def test_a_preemption_whose_checkpoint_missed_the_deadline_is_still_a_preemption(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """hf_finetune on a slow box: the notice came at step 5 with 22 s left, evaluating and writing
    the checkpoint took longer, the group was torn down at the deadline and resumed from the start.
    The restart is the preemption's (not a worker failure a user would look for a crash behind),
    and the log says what to change."""
    run_dir = resolve_storage(tmp_path)
    cut_off = FaultLog()
    cut_off.preemptions.append({**notice(0, 5), "deadline_s_after_notice": 22.0})
    assert cut_off.current_notice == cut_off.preemptions[0]
    # Rank 0 notes the notice before writing the checkpoint, which never completes.
    write_progress(run_dir, 5, "d1", 2, cut_off.attempt, cut_off.current_notice)

    fresh = FaultLog()  # no complete checkpoint: the restarted group starts over
    with caplog.at_level(logging.WARNING, logger="raytrain_common.faults"):
        restart = fresh.record_restart(0, run_dir, "d1", None, 2)
    assert (restart["cause"], restart["steps_redone"]) == ("preemption", 5)
    [preemption] = fresh.summary()["preemptions"]
    assert preemption["checkpoint_missed"] and preemption["restarted"]
    assert preemption["checkpoint_step"] == 5 and preemption["ranks"] == [1]
    [warning] = [r.getMessage() for r in caplog.records]
    assert "notice at step 5 (deadline in 22 s) did not end in a complete checkpoint" in warning
    assert "resumed at step 0, 5 step(s) redone" in warning
    assert "terminationGracePeriodSeconds" in warning

    # The restarted attempt notes no notice; a worker lost later is a worker failure, and the
    # preemption stays listed once.
    assert fresh.current_notice is None
    write_progress(run_dir, 9, "d1", 2, fresh.attempt, fresh.current_notice)
    assert "notice" not in json.loads((tmp_path / PROGRESS_FILE).read_text())
    later = FaultLog(**json.loads(json.dumps(dataclasses.asdict(fresh))))  # a checkpoint's copy
    assert later.record_restart(8, run_dir, "d1", "checkpoint_8", 2)["cause"] == "worker failure"
    assert len(later.preemptions) == 1

    # A notice whose checkpoint did complete is found there, as before, and not listed twice.
    write_progress(run_dir, 6, "d1", 2, 0, cut_off.current_notice)
    saved = FaultLog(**json.loads(json.dumps({"preemptions": cut_off.preemptions})))
    assert saved.record_restart(5, run_dir, "d1", "checkpoint_5", 2)["cause"] == "preemption"
    assert len(saved.preemptions) == 1 and "checkpoint_missed" not in saved.preemptions[0]


def test_a_restart_lost_before_its_first_checkpoint_is_still_listed(tmp_path: Path) -> None:
    """A preemption's restart resumed from step 20, and its node went 2 steps later, before that
    attempt wrote a checkpoint: the next restart resumes from step 20's checkpoint again, whose log
    knows neither. Both restarts are listed (the first from the attempt's first progress note), and
    the attempt count is 2, as on every rank."""
    run_dir = resolve_storage(tmp_path)
    saved = {"preemptions": [notice(0, 8)], "restarts": []}  # step 20's checkpoint, attempt 0
    write_progress(run_dir, 27, "d1", 2, 0, notice(0, 8))
    first = FaultLog(**json.loads(json.dumps(saved)))
    preempted = first.record_restart(20, run_dir, "d1", "checkpoint_20", 2)
    assert (preempted["cause"], preempted["steps_redone"]) == ("preemption", 7)
    notes = ProgressNotes(run_dir, "d1", 2, every_steps=50, rank=0)
    notes.note(21, first)  # the new attempt's first step: noted though 21 is off the cadence
    notes.note(22, first)  # and then only on the cadence
    assert json.loads((tmp_path / PROGRESS_FILE).read_text())["step"] == 21

    second = FaultLog(**json.loads(json.dumps(saved)))  # the same checkpoint's log again
    lost = second.record_restart(20, run_dir, "d1", "checkpoint_20", 2)
    assert (lost["cause"], lost["steps_redone"]) == ("worker failure", 1)
    assert second.restarts == [preempted, lost] and second.attempt == 2
    assert second.summary()["steps_redone"] == 8
