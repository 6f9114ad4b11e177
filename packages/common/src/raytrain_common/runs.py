"""The first and last lines of every pipeline's `run()`: where the run lives, the cluster joined
and the tracking run opened (`start_run`), what a failed `trainer.fit()` means (a storage outage
named as such, Ctrl-C), and the header every `summary.json` starts with. The training, the
`TorchTrainer` and `trainer.fit()` itself, stay in the pipelines."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import ray
import ray.train

from raytrain_common.checkpoint import raise_storage_error_of
from raytrain_common.configs import refuse_launcher_environment
from raytrain_common.loop import StartupClock
from raytrain_common.storage import StoragePath, check_writable, resolve_storage
from raytrain_common.tracking import (
    TrackedRun,
    failed_on_error,
    finish_for_summary,
    open_for_config,
    warm_tracking_store,
)


class LocatedRun(Protocol):
    """What `locate_run` reads of a pipeline's train config (named apart from Ray's RunConfig)."""

    storage_path: str
    run_name: str

    def validate(self) -> None: ...

    def resolved_data_dir(self) -> str: ...


def locate_run(config: LocatedRun) -> tuple[StoragePath, StoragePath]:
    """The run's storage (checked writable before anything starts) and its data folder, once the
    config's values are known to be sane and no launcher started the command."""
    config.validate()
    refuse_launcher_environment(os.environ)
    storage = resolve_storage(config.storage_path)
    check_writable(storage)
    return storage, resolve_storage(config.resolved_data_dir())


@contextlib.contextmanager
def fit_failures_named(storage_path: str) -> Iterator[None]:
    """Around `trainer.fit()`: a run that failed because its storage went away ends in one line
    naming the storage and the fix (StorageError), any other failure as Ray raised it. Ctrl-C
    during it is Ray Train's: its SIGINT handler aborts the controller and workers, then exits the
    process (SystemExit); that comes back as the KeyboardInterrupt it was, for the command to
    report."""
    try:
        yield
    except ray.train.TrainingFailedError as error:
        raise_storage_error_of(error, storage_path)
        raise
    except SystemExit as aborted:
        if aborted.code == signal.SIGTERM:  # ray.init's SIGTERM handler, outside a command
            raise
        raise KeyboardInterrupt("Ray Train aborted the run on SIGINT") from aborted


@dataclass
class StartedRun:
    """A checked run whose cluster is joined and whose tracking run is open (`start_run`)."""

    run_dir: StoragePath
    clock: StartupClock  # the driver's start-up phases, which the workers go on marking
    tracked: TrackedRun | None

    def loop_config(self, config: Any, **recipe: Any) -> dict[str, Any]:
        """`TorchTrainer`'s `train_loop_config`: the config (a dataclass, rebuilt once per worker),
        an id that tells a worker-group restart from a rerun of the command, the start-up phases
        so far and the tracking run; then the recipe's own values (dataclasses as dicts)."""
        return {
            "config": dataclasses.asdict(config),
            "driver_id": uuid.uuid4().hex,
            "startup": self.clock.marks,
            "tracked": dataclasses.asdict(self.tracked) if self.tracked else None,
            **{
                name: (
                    dataclasses.asdict(value)
                    if dataclasses.is_dataclass(value) and not isinstance(value, type)
                    else value
                )
                for name, value in recipe.items()
            },
        }

    @contextlib.contextmanager
    def failures_named(self, storage_path: str) -> Iterator[None]:
        """Around `trainer.fit()` and the outputs: the tracking run marked FAILED if they raise,
        a storage outage named as such (`fit_failures_named`)."""
        self.clock.mark("trainer")
        with failed_on_error(self.tracked), fit_failures_named(storage_path):
            yield

    def finish(self, summary: Mapping[str, Any]) -> dict[str, Any]:
        """The tracking run closed with the summary's files and test scores; the summary back."""
        finish_for_summary(self.tracked, self.run_dir, summary)
        return dict(summary)


def start_run(
    config: Any,
    storage: StoragePath,
    inputs: Mapping[str, StoragePath],
    clock: StartupClock,
    cluster_checks: Sequence[Callable[[], None]] = (),
) -> StartedRun:
    """Join or start the Ray cluster and refuse what cannot work on it (`start_ray_for_run`:
    storage and `inputs` every node must read, the worker group's resources, then the pipeline's
    own `cluster_checks`), then open the run's MLflow run, tagged with the pipeline (the config
    class's package) and its `__version__`. The tracking store is warmed while Ray starts; `clock`
    marks each phase."""
    from raytrain_common.ray_start import start_ray_for_run

    pipeline = type(config).__module__.split(".")[0]
    version = str(getattr(sys.modules[pipeline], "__version__", "unknown"))

    warm_tracking_store(config, storage)  # overlaps Ray's start
    clock.mark("checks")
    start_ray_for_run(config, storage, dict(inputs))
    for check in cluster_checks:
        check()
    clock.mark("ray_start")
    tracked = open_for_config(config, storage, pipeline=pipeline, version=version)
    clock.mark("tracking")
    return StartedRun(storage.join(config.run_name), clock, tracked)


def summary_header(
    pipeline: str, version: str, run_name: str, run_dir: StoragePath
) -> dict[str, Any]:
    """The keys every summary.json starts with, so runs of different pipelines read alike."""
    return {
        "pipeline": pipeline,
        "pipeline_version": version,
        "run_name": run_name,
        "run_dir": run_dir.uri,
    }


def evaluate_once(
    score: Callable[..., dict[str, Any]], *arguments: Any, use_gpu: bool, cpus: float
) -> dict[str, Any]:
    """`score(*arguments)` (a chosen checkpoint's test metrics), once, where it costs least: a GPU
    run's in a Ray task on a worker's resources (the driver may sit on a CPU-only head node), a CPU
    run's here, in the driver (starting a Ray worker for it, its imports, costs more than the
    scoring). The result gains `test_s`, the seconds it took."""
    started = time.perf_counter()
    if use_gpu:
        task = ray.remote(score).options(
            num_cpus=cpus,
            num_gpus=1,
            # Not inside the caller's placement group (a sweep trial's holds a tenth of a CPU): the
            # run's workers have ended, their resources are free in the cluster.
            scheduling_strategy="DEFAULT",
        )
        result: dict[str, Any] = ray.get(task.remote(*arguments))
    else:
        result = score(*arguments)
    result["test_s"] = time.perf_counter() - started
    return result


def read_run_summary(run_dir: StoragePath, train_command: str) -> dict[str, Any]:
    """A finished run's summary.json; a refusal naming the command that trains it
    (`train_command`, the pipeline's own) when the run has none."""
    from raytrain_common.metrics import SUMMARY_FILE

    summary_file = run_dir.join(SUMMARY_FILE)
    if not summary_file.exists():
        name = run_dir.uri.rstrip("/").rsplit("/", 1)[-1]
        raise FileNotFoundError(
            f"no {SUMMARY_FILE} in {run_dir.uri}: train first (`{train_command} --run-name "
            f"{name}`), or give --storage-path / --run-name of a finished run"
        )
    return dict(json.loads(summary_file.read_text()))


def chosen_checkpoint(run_dir: StoragePath, choice: str, train_command: str) -> str:
    """The URI of a finished run's `best` checkpoint (by its score; a run without one: its latest)
    or `latest`, found in the run folder by name, so a run folder copied or moved elsewhere uses its
    own; any other `choice` is a checkpoint given as it is."""
    if choice not in ("best", "latest"):
        return choice
    summary = read_run_summary(run_dir, train_command)
    chosen = str(summary.get(f"{choice}_checkpoint") or summary["latest_checkpoint"])
    inside = run_dir.join(chosen.rstrip("/").rsplit("/", 1)[-1])
    return inside.uri if inside.exists() else chosen
