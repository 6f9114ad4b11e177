"""The restart bookkeeping in summary.json: what caused each restart, read from the files a run
leaves (progress.json and the fault log saved in a checkpoint)."""

from __future__ import annotations

import json
from pathlib import Path

from raytrain_common.faults import PROGRESS_FILE, FaultLog, write_progress
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
