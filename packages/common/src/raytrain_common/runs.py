"""The first and last lines of every pipeline's `run()`: where the run lives, what a failed
`trainer.fit()` means (a storage outage named as such, Ctrl-C), and the header every
`summary.json` starts with. The training, and `trainer.fit()` itself, stay in the pipelines."""

from __future__ import annotations

import contextlib
import json
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import ray
import ray.train

from raytrain_common.checkpoint import raise_storage_error_of
from raytrain_common.storage import StoragePath, check_writable, resolve_storage


class LocatedRun(Protocol):
    """What `locate_run` reads of a pipeline's train config (named apart from Ray's RunConfig)."""

    storage_path: str
    run_name: str

    def validate(self) -> None: ...

    def resolved_data_dir(self) -> str: ...


def locate_run(config: LocatedRun) -> tuple[StoragePath, StoragePath]:
    """The run's storage (checked writable before anything starts) and its data folder, once the
    config's values are known to be sane."""
    config.validate()
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
