"""The parts of a sweep that need no cluster: its options, its search space, the printed command
line and the folder a sweep claims (the sweeps themselves run in each pipeline's tests)."""

from __future__ import annotations

import dataclasses
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from raytrain_common.cli import option
from raytrain_common.configs import ConfigError
from raytrain_common.storage import resolve_storage
from raytrain_common.sweep import (
    Objective,
    SweepSettings,
    claim_sweep_folder,
    search_space,
    train_command,
    train_fields,
    with_interpreter,
)


@dataclass(kw_only=True)
class Train:
    storage_path: str = option("./runs", "")
    run_name: str = option("run", "")
    lr: float = option(0.1, "")
    epochs: int = option(2, "")
    limit_train_rows: int | None = option(None, "")
    bf16: bool = option(False, "")
    parent_run_id: str | None = option(None, "")


@dataclass(kw_only=True)
class Sweep(Train, SweepSettings):
    pass


def test_the_search_space_holds_what_was_asked_and_bad_options_are_refused() -> None:
    space = search_space(SweepSettings(lr_min=1e-4, lr_max=1e-2, batch_sizes="64, 128"))
    assert set(space) == {"lr", "global_batch_size"}
    assert space["global_batch_size"].categories == [64, 128]
    assert space["lr"].lower == 1e-4 and space["lr"].upper == 1e-2
    for bad, named in (
        ({"lr_min": 0.0}, "lr_min"),
        ({"lr_min": 1.0, "lr_max": 0.1}, "lr_min"),
        ({"num_samples": 0}, "num_samples"),
        ({"reduction_factor": 1}, "reduction_factor"),
        ({"weight_decays": "0.1,x"}, "weight_decays"),
        ({"sweep_name": "a/b"}, "sweep_name"),
    ):
        with pytest.raises(ConfigError, match=named):
            SweepSettings(**bad).validate_sweep()


def test_the_printed_command_is_the_preset_plus_what_differs_and_the_best_values() -> None:
    preset = Train()
    sweep = Sweep(
        storage_path="/data/runs",
        epochs=3,
        limit_train_rows=512,
        bf16=True,
        run_name="ignored",
        parent_run_id="p",
    )
    base = train_fields(sweep, Train)
    assert type(base) is Train and base.limit_train_rows == 512
    command = train_command(
        "pipe train --preset cpu",
        base,
        preset,
        {"lr": 0.0123456},
        {"limit_train_rows": None, "epochs": 2},
        "best",
    )
    assert shlex.split(command) == [
        "pipe",
        "train",
        "--preset",
        "cpu",
        "--storage-path",
        "/data/runs",
        "--bf16",
        "--lr",
        "0.01235",
        "--run-name",
        "best",
    ]
    # A full run that keeps a slice the preset does not have says so.
    command = train_command("pipe train", base, preset, {}, {"limit_train_rows": 1000}, "best")
    assert "--limit-train-rows 1000" in command
    # The same with this interpreter, for shells where the console script is not on PATH.
    assert shlex.split(with_interpreter(command))[:4] == [sys.executable, "-m", "pipe", "train"]
    assert dataclasses.asdict(base)["epochs"] == 3


def test_a_sweep_folder_belongs_to_one_pipeline(tmp_path: Path) -> None:
    folder = resolve_storage(tmp_path / "sweeps" / "lr")
    objective = Objective("accuracy", "max", time_attr="epoch", max_t=3)
    claim_sweep_folder(folder, "vision", objective)
    claim_sweep_folder(folder, "vision", objective)  # its own rerun resumes it
    with pytest.raises(
        ConfigError, match=r"holds a sweep of vision .* choose another --sweep-name"
    ):
        claim_sweep_folder(folder, "text", Objective("f1", "max", time_attr="epoch", max_t=3))


@pytest.mark.parametrize("mode", ["max", "min"])
def test_a_resumed_sweeps_asha_judges_new_trials_against_the_trials_before_the_interruption(
    tmp_path: Path, mode: str
) -> None:
    """Tune restores a sweep's scheduler as the sweep created it, rungs empty: the trial that
    reached rung 1 before the interruption must still count. The trials are Tune's own (stub)
    Trial objects; the scheduler goes through pickle as `Tuner.restore` brings it back."""
    import pickle

    from ray.tune.experiment import Trial
    from ray.tune.schedulers import ASHAScheduler, TrialScheduler

    from raytrain_common.sweep_scheduler import ResumableASHA

    sweep = resolve_storage(tmp_path / "sweep")
    sweep.mkdir()
    good, bad = (0.9, 0.2) if mode == "max" else (0.2, 0.9)
    asha = {
        "time_attr": "epoch",
        "max_t": 2,
        "grace_period": 1,
        "reduction_factor": 2,
        "stop_last_trials": False,
    }

    def as_created(scheduler: ASHAScheduler) -> ASHAScheduler:
        scheduler.set_search_properties("score", mode)
        return scheduler

    def report(scheduler: ASHAScheduler, trial: Trial, score: float) -> str:
        return scheduler.on_trial_result(None, trial, {"epoch": 1.0, "score": score})

    before, lagging = (Trial("trainable", trial_id=name, stub=True) for name in ("a", "b"))
    created = as_created(ResumableASHA(sweep.uri, **asha))
    created.forget_rungs()
    pickled = pickle.dumps(created)  # what tuner.pkl holds: the scheduler before any trial

    # Before the interruption one trial reached the first rung with a good score (a report
    # without the score, a training log row, changes nothing).
    first_run = pickle.loads(pickled)
    first_run.on_trial_add(None, before)
    first_run.on_trial_result(None, before, {"epoch": 0.5, "train_loss": 1.0})
    assert report(first_run, before, good) == TrialScheduler.CONTINUE

    resumed = pickle.loads(pickled)
    resumed.on_trial_add(None, before)
    resumed.on_trial_add(None, lagging)
    # The first trial to reach the rung after the restart lags the one before it: stopped.
    assert report(resumed, lagging, bad) == TrialScheduler.STOP
    # The restored trial reporting its rung again is not judged twice.
    assert report(resumed, before, good) == TrialScheduler.CONTINUE

    # Tune's own ASHA, restored the same way, lets the lagging trial run on: what this replaces.
    plain = pickle.loads(pickle.dumps(as_created(ASHAScheduler(**asha))))
    plain.on_trial_add(None, before)
    plain.on_trial_add(None, lagging)
    assert report(plain, lagging, bad) == TrialScheduler.CONTINUE

    # A new sweep in the folder (one Tune cannot restore) starts with empty rungs.
    as_created(ResumableASHA(sweep.uri, **asha)).forget_rungs()
    fresh = pickle.loads(pickled)
    fresh.on_trial_add(None, lagging)
    assert report(fresh, lagging, bad) == TrialScheduler.CONTINUE

    # Rungs another sweep left (other milestones) are refused by name, not mixed in.
    other = as_created(ResumableASHA(sweep.uri, **{**asha, "max_t": 4}))
    other.forget_rungs()
    other.on_trial_add(None, before)
    report(other, before, good)
    with pytest.raises(
        ConfigError, match=r"asha_rungs.json holds ASHA rungs at .* another sweep's"
    ):
        pickle.loads(pickled).on_trial_add(None, lagging)
