"""The first and last lines of every pipeline's `run()`: where the run lives, what a failed
`trainer.fit()` means (a storage outage named as such, Ctrl-C), and the header every
`summary.json` starts with. The training, and `trainer.fit()` itself, stay in the pipelines."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import Any, Protocol

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
