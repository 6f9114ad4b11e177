"""Hyperparameter sweeps with Ray Tune over a pipeline's own `run()`, Ray Train V2 style.

Each Tune trial runs a small driver function that calls the pipeline's `run(config, callbacks)`
with Tune's `TuneReportCallback`: the trial's TorchTrainer reports to Tune through it, and ASHA
stops the trials whose validation metric lags at each rung. A trial is a complete training run of
its own (checkpoints, metrics.csv, summary.json, an MLflow run nested under the sweep's), in
`<storage>/sweeps/<sweep-name>/trials/<trial id>`.

Resources: a trial's driver function takes a tenth of a CPU; its Train workers take theirs, and a
local cluster is started with room for every concurrent trial's workers plus Ray Data's tasks, so
trials never starve Ray Data (see `init_ray`). A sweep interrupted (Ctrl-C, a killed driver) and
rerun with the same name continues: finished trials are kept, unfinished ones resume from their
own latest checkpoint, and the trials not started yet start; ASHA starts from the rungs it had
(`sweep_scheduler.ResumableASHA` keeps them in the sweep folder: Tune does not save its scheduler).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ray.train import UserCallback

from raytrain_common.configs import ConfigError
from raytrain_common.metrics import (
    METRICS_FILE,
    SUMMARY_FILE,
    plot_curves,
    read_metrics_csv,
    write_metrics_csv,
    write_summary,
)
from raytrain_common.options import option
from raytrain_common.ray_start import init_ray
from raytrain_common.storage import StoragePath, resolve_storage
from raytrain_common.tracking import (
    PARENT_TAG,
    TrackedRun,
    client,
    finish_tracked_run,
    open_tracked_run,
    system_tags,
)

log = logging.getLogger(__name__)

SWEEPS_FOLDER = "sweeps"
RESULTS_FILE = "results.csv"
TRIALS_PICTURE = "trials.png"
BEST_FILE = "best.json"
SWEEP_FILE = "sweep.json"  # which pipeline's sweep the folder holds
TRIAL_DRIVER_CPU = 0.1
STATE_SAVE_S = 5
# Options the printed full-run command never repeats: the run gets a name of its own.
NOT_REPEATED = ("run_name", "parent_run_id")


@dataclass(kw_only=True)
class SweepSettings:
    """What a sweep tries and how; a pipeline's sweep config is its TrainConfig plus these."""

    sweep_name: str = option(
        "sweep", "Folder under <storage-path>/sweeps; rerunning the same name resumes the sweep."
    )  # each pipeline's presets name their own
    num_samples: int = option(8, "Trials drawn from the search space.")
    max_concurrent_trials: int = option(2, "Trials that run at once.")
    workers_per_trial: int = option(1, "Train workers of each trial.")
    lr_min: float = option(
        1e-3, "Search space: the learning rate is log-uniform in [lr-min, lr-max]."
    )
    lr_max: float = option(1.0, "Search space: the learning rate's upper end.")
    batch_sizes: str = option(
        "", "Search space: global batch sizes to choose from, comma-separated (empty: keep)."
    )
    warmup_fractions: str = option(
        "", "Search space: warm-up shares to choose from, comma-separated (empty: keep)."
    )
    weight_decays: str = option(
        "", "Search space: weight decays to choose from, comma-separated (empty: keep)."
    )
    grace_period: int = option(1, "ASHA: evaluations every trial gets before it can be stopped.")
    reduction_factor: int = option(2, "ASHA: at each rung only the best 1/N of trials go on.")
    sweep_seed: int = option(0, "Seed of the search space sampler.")

    def validate_sweep(self) -> None:
        for name in ("num_samples", "max_concurrent_trials", "workers_per_trial", "grace_period"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: it must be at least 1")
        if self.reduction_factor < 2:
            raise ConfigError(f"reduction_factor={self.reduction_factor}: it must be at least 2")
        if not 0 < self.lr_min <= self.lr_max:
            raise ConfigError(
                f"lr_min={self.lr_min}, lr_max={self.lr_max}: give 0 < lr-min <= lr-max"
            )
        for name in ("batch_sizes", "warmup_fractions", "weight_decays"):
            _number_list(getattr(self, name), name)
        if "/" in self.sweep_name or not self.sweep_name:
            raise ConfigError(f"sweep_name={self.sweep_name!r}: give a folder name without '/'")


@dataclass(frozen=True)
class Objective:
    """What ASHA ranks trials by: a metric every evaluation report carries."""

    metric: str
    mode: Literal["max", "min"]
    # The trial's progress as its own reports count it (e.g. "epoch"), and its value at the end of a
    # full trial: a trial resumed after an interrupted sweep goes on counting where it was, which
    # Tune's own training_iteration (reset by a restart) would not.
    time_attr: str
    max_t: float


def _number_list(text: str, name: str) -> list[float]:
    try:
        return [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"{name}={text!r}: give numbers separated by commas") from None


def search_space(settings: SweepSettings) -> dict[str, Any]:
    """Tune's param_space: the train config fields each trial overrides."""
    from ray import tune

    space: dict[str, Any] = {"lr": tune.loguniform(settings.lr_min, settings.lr_max)}
    choices = {
        "global_batch_size": [int(v) for v in _number_list(settings.batch_sizes, "batch_sizes")],
        "warmup_fraction": _number_list(settings.warmup_fractions, "warmup_fractions"),
        "weight_decay": _number_list(settings.weight_decays, "weight_decays"),
    }
    for field, values in choices.items():
        if values:
            space[field] = tune.choice(values)
    return space


def train_fields(config: Any, train_class: type) -> Any:
    """The `train_class` part of a sweep config (a subclass with the sweep's own fields): what a
    trial's workers rebuild from a dict."""
    names = {field.name for field in dataclasses.fields(train_class)}
    return train_class(**{k: v for k, v in dataclasses.asdict(config).items() if k in names})


def trial_config(
    base: Any,
    params: Mapping[str, Any],
    *,
    trials: StoragePath,
    trial_id: str,
    workers: int,
    tracking_uri: str | None,
    parent_run_id: str | None,
) -> Any:
    """The train config of one trial: the sweep's base, the sampled values, its own run folder."""
    return dataclasses.replace(
        base,
        **params,
        storage_path=trials.uri,
        run_name=trial_id,
        num_workers=workers,
        min_workers=None,
        tracking_uri=tracking_uri,
        parent_run_id=parent_run_id,
    )


def train_command(
    command: str,
    base: Any,
    defaults: Any,
    best: Mapping[str, Any],
    full: Mapping[str, Any],
    run_name: str,
) -> str:
    """The command line that trains the best config in full: the preset, every option the sweep's
    base changed from it (except the slices a full run drops), the best values and a run name."""
    changed: dict[str, Any] = {}
    for field in dataclasses.fields(base):
        if field.name in NOT_REPEATED or field.name in full:
            continue
        value = getattr(base, field.name)
        if value != getattr(defaults, field.name):
            changed[field.name] = value
    changed |= {key: value for key, value in full.items() if value != getattr(defaults, key)}
    changed |= dict(best)
    changed["run_name"] = run_name
    parts = shlex.split(command)
    for name, value in changed.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            parts.append(flag if value else f"--no-{name.replace('_', '-')}")
        elif value is None:
            parts += [flag, "none"]
        else:
            parts += [flag, _short(value)]
    return shlex.join(parts)


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def run_sweep(
    *,
    pipeline: str,
    version: str,
    settings: SweepSettings,
    base: Any,
    preset: Any,
    train: Callable[[Any, Sequence[UserCallback]], dict[str, Any]],
    objective: Objective,
    command: str,
    full_run: Mapping[str, Any],
) -> dict[str, Any]:
    """Run (or resume) the sweep; write its results table, curves picture and best config.

    `base` is the train config every trial starts from (the sweep's slices included); `preset` the
    preset it came from and `full_run` the values a full run takes instead of the slices (e.g.
    {"limit_train_rows": None}), for the printed command line.
    """
    from ray import tune

    settings.validate_sweep()
    base.validate()
    if getattr(base, "validation", "inline") != "inline":
        raise ConfigError(
            "sweep with --validation async: ASHA compares each report by its validation score, "
            "which an async validation adds later; use inline"
        )
    # Tune saves which trials finished every few seconds (what an interrupted sweep resumes
    # from), and trials keep the user's working folder (relative --model and such).
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", str(STATE_SAVE_S))
    os.environ.setdefault("RAY_CHDIR_TO_TRIAL_DIR", "0")
    base, storage = with_absolute_paths(base)
    sweep_dir = storage.join(SWEEPS_FOLDER, settings.sweep_name)
    per_trial = settings.workers_per_trial * base.cpus_per_worker + TRIAL_DRIVER_CPU
    init_ray(train_cpus=settings.max_concurrent_trials * per_trial)
    parent = open_sweep_run(pipeline, version, settings, base, objective, storage, sweep_dir)
    trial = trial_function(base, settings, objective, train, sweep_dir.join("trials"), parent)
    # The trial's driver only waits on its TorchTrainer (Tune refuses a request of nothing).
    trainable = tune.with_resources(trial, {"CPU": TRIAL_DRIVER_CPU})
    claim_sweep_folder(sweep_dir, pipeline, objective)
    if tune.Tuner.can_restore(sweep_dir.uri):
        log.info(
            "resuming sweep %s from %s: finished trials are kept",
            settings.sweep_name,
            sweep_dir.uri,
        )
        tuner = tune.Tuner.restore(sweep_dir.uri, trainable=trainable, resume_errored=True)
    else:
        tuner = new_tuner(trainable, settings, objective, storage, sweep_dir)
    results = tuner.fit()
    close_stopped_trial_runs(parent)
    outcome = write_sweep_outputs(
        sweep_dir, results, objective, settings, base, preset, command, full_run
    )
    finish_tracked_run(
        parent,
        artifacts=[sweep_dir.join(name) for name in (RESULTS_FILE, TRIALS_PICTURE, BEST_FILE)],
        tags={"best_trial": outcome.get("best_trial"), "best_command": outcome.get("command")},
    )
    return outcome


SWEEP_HELP = (
    "Ray Tune with ASHA over the learning rate (and the batch sizes, warm-ups and weight decays the "
    "preset lists); rerun the same --sweep-name to resume"
)


def sweep_command(
    config: Any,
    preset_name: str,
    *,
    program: str,
    version: str,
    train_class: type,
    presets: Mapping[str, Any],
    train: Callable[[Any, Sequence[UserCallback]], dict[str, Any]],
    objective: Objective,
    full_run_fields: Sequence[str],
) -> int:
    """A pipeline's `sweep` command: the sweep of `config` (its train part from the preset named
    `preset_name`), then its outcome printed with the command that trains the best trial in full,
    where `full_run_fields` take the preset's values again (e.g. the row limits a sweep sets). The
    sweep's folder and MLflow runs are named after `train_class`'s package (the pipeline's)."""
    preset = presets[preset_name]
    outcome = run_sweep(
        pipeline=train_class.__module__.split(".")[0],
        version=version,
        settings=config,
        base=train_fields(config, train_class),
        preset=preset,
        train=train,
        objective=objective,
        command=f"{program} train --preset {preset_name}",
        full_run={name: getattr(preset, name) for name in full_run_fields},
    )
    print_outcome(outcome, objective.metric)
    return 0


def with_absolute_paths(base: Any) -> tuple[Any, StoragePath]:
    """The config with a local storage path and data folder made absolute (trials run in Tune's
    actors: a relative path must not depend on their working folder), and its storage."""
    storage = resolve_storage(base.storage_path)
    if storage.is_local:
        storage = resolve_storage(Path(storage.path).resolve())
        base = dataclasses.replace(base, storage_path=storage.uri)
    data_dir = base.resolved_data_dir()
    if resolve_storage(data_dir).is_local:
        data_dir = str(Path(resolve_storage(data_dir).path).resolve())
    return dataclasses.replace(base, data_dir=data_dir), storage


def open_sweep_run(
    pipeline: str,
    version: str,
    settings: SweepSettings,
    base: Any,
    objective: Objective,
    storage: StoragePath,
    sweep_dir: StoragePath,
) -> TrackedRun | None:
    """The sweep's MLflow run, which every trial's run is nested under."""
    sweep_fields = {f.name for f in dataclasses.fields(SweepSettings)}
    return open_tracked_run(
        tracking=base.tracking,
        tracking_uri=base.tracking_uri,
        storage=storage,
        run_dir=sweep_dir,
        experiment=base.experiment_name or pipeline,
        run_name=f"sweep {settings.sweep_name}",
        params={
            **{
                f"sweep.{k}": v
                for k, v in dataclasses.asdict(settings).items()
                if k in sweep_fields
            },
            "sweep.metric": objective.metric,
            "sweep.mode": objective.mode,
        },
        tags={
            **system_tags(
                pipeline,
                version,
                workers=settings.workers_per_trial,
                device="gpu" if base.use_gpu else "cpu",
            ),
            "sweep": "parent",
        },
    )


def trial_function(
    base: Any,
    settings: SweepSettings,
    objective: Objective,
    train: Callable[[Any, Sequence[UserCallback]], dict[str, Any]],
    trials: StoragePath,
    parent: TrackedRun | None,
) -> Callable[[dict[str, Any]], None]:
    """What Tune runs for each trial: the pipeline's own `run` with the trial's parameters, its
    reports forwarded to Tune (the driver-function pattern of Ray Train V2)."""
    from ray import tune
    from ray.tune.integration.ray_train import TuneReportCallback

    def trial(params: dict[str, Any]) -> None:
        trial_id = tune.get_context().get_trial_id()
        finished = finished_trial_rows(trials.join(trial_id), objective)
        if finished is not None:
            # Trained to the end before the sweep was interrupted, but after Tune last saved its
            # state: hand Tune the trial's evaluations instead of training it again.
            for row in finished:
                tune.report(row)
            return
        config = trial_config(
            base,
            params,
            trials=trials,
            trial_id=trial_id,
            workers=settings.workers_per_trial,
            tracking_uri=parent.tracking_uri if parent else None,
            parent_run_id=parent.run_id if parent else None,
        )
        train(config, [TuneReportCallback()])

    return trial


def new_tuner(
    trainable: Any,
    settings: SweepSettings,
    objective: Objective,
    storage: StoragePath,
    sweep_dir: StoragePath,
) -> Any:
    """A new sweep: ASHA over the search space, `max_concurrent_trials` at a time."""
    from ray import tune
    from ray.tune.search import BasicVariantGenerator

    from raytrain_common.sweep_scheduler import ResumableASHA

    scheduler = ResumableASHA(
        sweep_dir.uri,
        time_attr=objective.time_attr,
        max_t=objective.max_t,
        grace_period=min(settings.grace_period, objective.max_t),
        reduction_factor=settings.reduction_factor,
        # A trial at its last report ends by itself: stopping it there would cut off its
        # summary.json and the close of its MLflow run.
        stop_last_trials=False,
    )
    scheduler.forget_rungs()  # of a sweep this folder held that Tune cannot restore
    return tune.Tuner(
        trainable,
        param_space=search_space(settings),
        tune_config=tune.TuneConfig(
            metric=objective.metric,
            mode=objective.mode,
            scheduler=scheduler,
            # The generator, not TuneConfig, must cap concurrency once a search_alg is given.
            search_alg=BasicVariantGenerator(
                random_state=settings.sweep_seed, max_concurrent=settings.max_concurrent_trials
            ),
            num_samples=settings.num_samples,
        ),
        run_config=tune.RunConfig(
            name=settings.sweep_name,
            storage_path=storage.join(SWEEPS_FOLDER).uri,
            verbose=0,
            # Tune's state (which trials finished) reaches the sweep folder every few seconds,
            # not every 5 minutes: what an interrupted sweep resumes from.
            sync_config=tune.SyncConfig(sync_period=STATE_SAVE_S),
        ),
    )


def claim_sweep_folder(sweep_dir: StoragePath, pipeline: str, objective: Objective) -> None:
    """Mark the folder as this pipeline's sweep, or refuse one another pipeline's sweep holds (a
    rerun resumes what the folder holds, so the two must match)."""
    marker = sweep_dir.join(SWEEP_FILE)
    mine = {"pipeline": pipeline, "metric": objective.metric}
    if marker.exists():
        found = json.loads(marker.read_text())
        if found != mine:
            raise ConfigError(
                f"{sweep_dir.uri} holds a sweep of {found.get('pipeline')} "
                f"({found.get('metric')}): "
                "choose another --sweep-name"
            )
        return
    sweep_dir.mkdir()
    marker.write_text(json.dumps(mine) + "\n")


def finished_trial_rows(
    run_dir: StoragePath, objective: Objective
) -> list[dict[str, float]] | None:
    """A trial's evaluations when its run ended (summary.json is written last), else None."""
    if not run_dir.join(SUMMARY_FILE).exists():
        return None
    return [
        row
        for row in read_metrics_csv(run_dir.join(METRICS_FILE))
        if objective.metric in row and objective.time_attr in row
    ]


def close_stopped_trial_runs(parent: TrackedRun | None) -> None:
    """Trials ASHA stopped were ended mid-run, before they could close their MLflow runs: mark
    them KILLED, as MLflow calls a run ended from outside."""
    if parent is None:
        return
    try:
        mlflow_client = client(parent.tracking_uri)
        children = mlflow_client.search_runs(
            [parent.experiment_id],
            filter_string=(
                f"tags.`{PARENT_TAG}` = '{parent.run_id}' and attributes.status = 'RUNNING'"
            ),
        )
        for run in children:
            mlflow_client.set_terminated(run.info.run_id, status="KILLED")
    except Exception as error:
        log.warning("could not close the stopped trials' MLflow runs: %s", error)


def trial_row(
    result: Any, objective: Objective, space_keys: list[str]
) -> tuple[dict[str, Any], list[tuple[float, float]]]:
    """One trial's row of results.csv, and its evaluations (progress, value) in order."""
    trial_id = result.path.rstrip("/").rsplit("/", 1)[-1] if result.path else "?"
    history = result.metrics_dataframe
    reported = (
        []
        if history is None or objective.metric not in history
        else (history[[objective.time_attr, objective.metric]].dropna().to_numpy().tolist())
    )
    # A trial that finished after Tune last saved reports its evaluations again on resume:
    # one evaluation per point of progress, the last one reported.
    evaluated = sorted({float(when): float(value) for when, value in reported}.items())
    values = [value for _, value in evaluated]
    reached = evaluated[-1][0] if evaluated else 0.0
    best_value = (max if objective.mode == "max" else min)(values) if values else math.nan
    metrics = result.metrics or {}
    row = {
        "trial_id": metrics.get("trial_id", trial_id),
        **{key: result.config.get(key) for key in space_keys},
        "evaluations": len(values),
        objective.time_attr: reached,
        f"best_{objective.metric}": best_value,
        "stopped_early": reached < objective.max_t - 1e-9 and result.error is None,
        "error": str(result.error).splitlines()[0] if result.error else "",
    }
    return row, evaluated


def write_sweep_outputs(
    sweep_dir: StoragePath,
    results: Any,
    objective: Objective,
    settings: SweepSettings,
    base: Any,
    preset: Any,
    command: str,
    full_run: Mapping[str, Any],
) -> dict[str, Any]:
    """results.csv (one row per trial), trials.png (every trial's metric by evaluation),
    best.json."""
    space_keys = list(search_space(settings))
    rows: list[dict[str, Any]] = []
    curves: list[dict[str, float]] = []
    for result in results:
        row, evaluated = trial_row(result, objective, space_keys)
        rows.append(row)
        label = f"{row['trial_id']} lr={result.config.get('lr', math.nan):.2g}"
        curves += [{objective.time_attr: when, label: value} for when, value in evaluated]
    rows.sort(key=lambda row: row["trial_id"])
    write_metrics_csv(sweep_dir.join(RESULTS_FILE), rows)
    if curves:
        names = sorted({key for row in curves for key in row if key != objective.time_attr})
        plot_curves(
            sweep_dir.join(TRIALS_PICTURE),
            curves,
            [(objective.metric, names)],
            x=objective.time_attr,
            title=f"sweep {settings.sweep_name}: {objective.metric} by trial",
        )
    finished = [row for row in rows if not math.isnan(row[f"best_{objective.metric}"])]
    if not finished:
        raise RuntimeError(
            f"no trial of sweep {settings.sweep_name} reported {objective.metric}; see the trials' "
            f"errors in {sweep_dir.join(RESULTS_FILE).uri}"
        )
    pick = max if objective.mode == "max" else min
    best = pick(finished, key=lambda row: row[f"best_{objective.metric}"])
    best_values = {key: best[key] for key in space_keys}
    outcome = {
        "sweep": settings.sweep_name,
        "trials": len(rows),
        "stopped_early": sum(1 for row in rows if row["stopped_early"]),
        "errored": sum(1 for row in rows if row["error"]),
        "best_trial": best["trial_id"],
        f"best_{objective.metric}": best[f"best_{objective.metric}"],
        "best_config": best_values,
        "command": train_command(
            command, base, preset, best_values, full_run, f"{settings.sweep_name}-best"
        ),
        "results_csv": sweep_dir.join(RESULTS_FILE).uri,
        "curves_png": sweep_dir.join(TRIALS_PICTURE).uri,
    }
    write_summary(sweep_dir.join(BEST_FILE), outcome)
    return outcome


def print_outcome(outcome: Mapping[str, Any], metric: str) -> None:
    print(
        f"sweep {outcome['sweep']}: {outcome['trials']} trials, {outcome['stopped_early']} stopped "
        f"early by ASHA, {outcome['errored']} failed"
    )
    print(
        f"best trial {outcome['best_trial']}: {metric} {outcome[f'best_{metric}']:.4f} with "
        f"{json.dumps(outcome['best_config'])}"
    )
    print(f"train it in full:\n  {outcome['command']}")
    print(f"  (the same outside this environment:\n  {with_interpreter(outcome['command'])})")
    print(f"results: {outcome['results_csv']}\ncurves: {outcome['curves_png']}")


def with_interpreter(command: str) -> str:
    """`pipe-name train …` as `<this Python> -m pipe_name train …`: runnable from any shell, also
    where the environment's console scripts are not on PATH (nox's environments are not)."""
    import sys

    script, *rest = shlex.split(command)
    return shlex.join([sys.executable, "-m", script.replace("-", "_"), *rest])
