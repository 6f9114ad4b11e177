"""What `train` leaves once the run ends: the chosen checkpoint's test metrics (evaluated once),
curves.png and summary.json, read from the checkpointed history (so resumed runs are whole)."""

from __future__ import annotations

import dataclasses
import json
import logging
import posixpath
import time
from typing import Any

import ray
import ray.train

from mnist_resnet import __version__
from mnist_resnet.config import TrainConfig
from mnist_resnet.predict import checkpoint_test_metrics
from mnist_resnet.validator import SCORE, read_async_validations
from raytrain_common.checkpoint import (
    best_complete_checkpoint,
    load_state,
    newest_complete_checkpoint,
)
from raytrain_common.faults import FaultLog
from raytrain_common.images.dataset import DatasetInfo
from raytrain_common.metrics import (
    CURVES_FILE,
    METRICS_FILE,
    SUMMARY_FILE,
    package_versions,
    plot_curves,
    write_metrics_csv,
    write_summary,
)
from raytrain_common.runs import evaluate_once, summary_header
from raytrain_common.storage import StoragePath

log = logging.getLogger("mnist_resnet")


def evaluate_test_split_once(checkpoint_uri: str, config: TrainConfig) -> dict[str, Any]:
    """The chosen checkpoint's test loss and accuracy, evaluated once (in a Ray task on a GPU
    run's worker resources, in the driver on CPUs: `evaluate_once`)."""
    result = evaluate_once(
        checkpoint_test_metrics,
        *(checkpoint_uri, config.limit_test_rows),
        use_gpu=config.use_gpu,
        cpus=config.cpus_per_worker,
    )
    log.info(
        "test accuracy %.4f on %d images, checkpoint of epoch %d (chosen by %s)",
        result["test_accuracy"],
        result["test_rows"],
        result["epoch"],
        SCORE,
    )
    return result


def finished_run_summary(
    config: TrainConfig, storage: StoragePath, steps_per_epoch: int
) -> dict[str, Any] | None:
    """The summary.json of a run that has trained to its last step (its end, or its
    --stop-at-step) and whose newest complete checkpoint is the one that summary names: a rerun of
    it has nothing to train, and answers with that summary at once rather than starting Ray
    Train's worker group to find so (20-40 s on 2 cores). None when there is something to train:
    no summary yet, more steps asked for (--epochs raised), or a checkpoint newer than the summary
    or torn."""
    last_step = steps_per_epoch * config.epochs
    if config.stop_at_step is not None:
        last_step = min(last_step, config.stop_at_step)
    run_dir = storage.join(config.run_name)
    target = run_dir.join(SUMMARY_FILE)
    if not target.exists():
        return None
    summary: dict[str, Any] = json.loads(target.read_text())
    latest = summary.get("latest_checkpoint")
    if summary.get("steps_done", 0) < last_step or not latest:
        return None
    newest = newest_complete_checkpoint(run_dir)
    if newest is None or posixpath.basename(newest.path) != posixpath.basename(latest.rstrip("/")):
        return None
    log.info(
        "%s has trained all its %d steps already: nothing to train (raise --epochs to go on)",
        *(config.run_name, summary["steps_done"]),
    )
    return summary


def write_run_outputs(
    run_dir: StoragePath,
    result: ray.train.Result,
    config: TrainConfig,
    info: DatasetInfo,
    steps: int,
    started: float,
) -> dict[str, Any]:
    """Curves PNG and summary.json from the checkpointed history (covers resumed runs too)."""
    best = best_complete_checkpoint(result, SCORE, "max")
    if result.checkpoint is None:
        raise RuntimeError(f"run {config.run_name} finished without a checkpoint under {run_dir}")
    with result.checkpoint.as_directory() as folder:
        state = load_state(folder)
    history = state["history"]
    validations = read_async_validations(run_dir)  # --validation async: the tasks' scores
    for row in history:
        if (scored := validations.get(row["step"])) is not None:
            row.update({key: scored[key] for key in ("val_loss", "val_accuracy", "val_s")})
    progress = run_progress(state, steps)
    if not history:  # stopped (--stop-at-step) before the first epoch ended
        summary = {
            **summary_header("mnist_resnet", __version__, config.run_name, run_dir),
            **progress,
        }
        summary |= {"best": None, "latest_checkpoint": result.checkpoint.path}
        write_summary(run_dir.join(SUMMARY_FILE), summary)
        return summary
    write_metrics_and_curves(run_dir, state, f"{config.run_name}: ResNet18 on {info.source}")
    if best is None:
        raise RuntimeError(
            f"run {config.run_name} has no complete evaluated checkpoint in {run_dir}"
        )
    # The history row of the chosen checkpoint's epoch (a torn best one is passed over for the
    # next).
    chosen = next(m["epoch"] for c, m in result.best_checkpoints if c.path == best.path)
    best_row = next(row for row in history if row["epoch"] == chosen)
    best_uri = run_dir.uri_for(best.path)
    summary = {
        **summary_header("mnist_resnet", __version__, config.run_name, run_dir),
        **progress,
        "final": history[-1],
        "best": best_row,
        "best_checkpoint": best_uri,
        "test": evaluate_test_split_once(best_uri, config),
        "latest_checkpoint": run_dir.uri_for(result.checkpoint.path),
        "metrics_csv": run_dir.join(METRICS_FILE).uri,
        "curves_png": run_dir.join(CURVES_FILE).uri,
        # Async validation ran beside training: its seconds are not the run's.
        "train_time_s": sum(
            row["train_s"] + (row["val_s"] if config.validation == "inline" else 0.0)
            for row in history
        ),
        "compute_dtype": state.get("compute_dtype"),
        "decoded_on": state.get("decoded_on", {}),
        # Files that failed to decode in training (changed or removed since prepare), each epoch's
        # count as in metrics.csv; the ranks' logs name them. prepare's own: dataset.bad_files.
        "skipped_files": [int(row.get("skipped_files", 0)) for row in history],
        "peak_memory_gb": max(
            (r["peak_memory_gb"] for r in history if "peak_memory_gb" in r), default=None
        ),
        "wall_time_s": time.perf_counter() - started,
        "config": dataclasses.asdict(config),
        "dataset": dataclasses.asdict(info),
        "versions": package_versions("torchvision"),
    }
    write_summary(run_dir.join(SUMMARY_FILE), summary)
    return summary


def run_progress(state: dict[str, Any], steps: int) -> dict[str, Any]:
    """How far the run got, what it went through and how long it took to start."""
    return {
        "steps_done": state["step"],
        "epochs_done": round(state["step"] / steps, 4),
        "stopped_mid_epoch": state.get("position") is not None,
        "startup_s": state.get("startup_s"),
        "startup_phases": state.get("startup_phases"),
        "first_batch_s": state.get("first_batch_s"),
        "worker_peak_rss_mb": state.get("worker_peak_rss_mb"),  # stopped runs' too
        **FaultLog(**state.get("faults", {})).summary(),
    }


def write_metrics_and_curves(run_dir: StoragePath, state: dict[str, Any], title: str) -> None:
    """metrics.csv, and curves.png where interval losses (x: fractional epoch) and per-epoch
    metrics share the epoch axis."""
    history = state["history"]
    write_metrics_csv(run_dir.join(METRICS_FILE), history)
    plot_curves(
        run_dir.join(CURVES_FILE),
        sorted(state["step_log"] + history, key=lambda row: row["epoch"]),
        [
            ("loss", ["train_loss_interval", "val_loss"]),
            ("accuracy", ["train_accuracy", "val_accuracy"]),
        ],
        title=title,
        log_y=["loss"],
    )
