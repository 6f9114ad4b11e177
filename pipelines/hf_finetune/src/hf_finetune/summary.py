"""What a finished run leaves: the chosen checkpoint's test scores (evaluated once, with
confusion_matrix.png), metrics.csv (one row per evaluation), curves.png and summary.json, read from
the latest checkpoint's Trainer state."""

from __future__ import annotations

import dataclasses
import logging
import posixpath
import time
from typing import Any

import numpy as np
import ray
import ray.train

from hf_finetune import __version__
from hf_finetune.checkpointer import HF_CHECKPOINT, read_run_record
from hf_finetune.config import PREPARE_COMMAND, TrainConfig
from hf_finetune.evaluate import CONFUSION_FILE, score_checkpoint
from hf_finetune.metrics_logger import RATE_KEY
from hf_finetune.model import display_name
from hf_finetune.validator import SCORE
from raytrain_common.checkpoint import best_complete_checkpoint
from raytrain_common.faults import FaultLog
from raytrain_common.labelled.prepare import DatasetInfo, read_labels
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
from raytrain_common.storage import StoragePath, resolve_storage

log = logging.getLogger("hf_finetune")


def evaluate_test_split_once(
    checkpoint_uri: str, config: TrainConfig, run_dir: StoragePath
) -> dict[str, Any]:
    """The chosen checkpoint's test accuracy, macro F1 and confusion matrix, scored once (in a Ray
    task on a GPU run's worker resources, in the driver on CPUs)."""
    data_dir, confusion = config.resolved_data_dir(), run_dir.join(CONFUSION_FILE).uri
    split = (data_dir, "test", config.limit_test_rows, confusion, config.run_name)
    gpu, cpus = config.use_gpu, config.cpus_per_worker
    result = evaluate_once(score_checkpoint, checkpoint_uri, *split, use_gpu=gpu, cpus=cpus)
    log.info(
        "test accuracy %.4f, macro F1 %.4f on %d rows: %s (chosen by %s)",
        result["test_accuracy"],
        result["test_f1"],
        result["test_rows"],
        checkpoint_uri,
        SCORE,
    )
    return result


def epoch_history(
    trainer_state: dict[str, Any],
) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """One row per evaluation (each epoch's end, or every N steps), with the mean training loss
    logged since the evaluation before it, and the interval loss log."""
    step_log = [
        {"epoch": row["epoch"], "step": row["step"], "train_loss_interval": row["loss"]}
        for row in trainer_state["log_history"]
        if "loss" in row
    ]
    history: list[dict[str, float]] = []
    for row in trainer_state["log_history"]:
        if "val_loss" not in row:
            continue
        since = history[-1]["step"] if history else 0
        losses = [r["train_loss_interval"] for r in step_log if since < r["step"] <= row["step"]]
        epoch = row["epoch"]
        history.append(
            {
                "epoch": round(epoch) if abs(epoch - round(epoch)) < 1e-6 else round(epoch, 4),
                "step": row["step"],
                "train_loss": float(np.mean(losses)) if losses else float("nan"),
                "val_loss": row["val_loss"],
                "val_accuracy": row["val_accuracy"],
                "val_f1": row["val_f1"],
                "val_s": row["val_runtime"],
            }
        )
    return history, step_log


def steady_rate(trainer_state: dict[str, Any]) -> float | None:
    """Training sentences/s over the progress windows after the first (start-up and warm-up left
    out; evaluations and checkpoints lie outside every window). The windows hold equal step
    counts, so sentences over seconds is their rates' harmonic mean: a median would swing with
    where a window falls in the length-sorted mega-batches (long rows first)."""
    rates = [row[RATE_KEY] for row in trainer_state["log_history"] if RATE_KEY in row][1:]
    return len(rates) / sum(1 / rate for rate in rates) if rates and min(rates) > 0 else None


def write_run_outputs(
    run_dir: StoragePath,
    result: ray.train.Result,
    config: TrainConfig,
    info: DatasetInfo,
    started: float,
) -> dict[str, Any]:
    """metrics.csv, curves.png and summary.json from the latest checkpoint's Trainer state."""
    if result.checkpoint is None:
        raise RuntimeError(f"run {config.run_name} finished without a checkpoint under {run_dir}")
    state = read_run_record(result.checkpoint)
    history, step_log = epoch_history(state)
    best = best_complete_checkpoint(result, SCORE, "max", inside=HF_CHECKPOINT)
    write_metrics_csv(run_dir.join(METRICS_FILE), history)
    plot_curves(
        run_dir.join(CURVES_FILE),
        sorted(step_log + history, key=lambda row: row["epoch"]),
        [("loss", ["train_loss_interval", "val_loss"]), ("score", ["val_accuracy", "val_f1"])],
        title=f"{config.run_name}: {display_name(config.model or '')} on {info.source}",
        log_y=["loss"],
    )
    best_row = max(history, key=lambda row: row[SCORE])
    best_uri = run_dir.uri_for(posixpath.join(best.path, HF_CHECKPOINT)) if best else None
    summary = {
        **summary_header("hf_finetune", __version__, config.run_name, run_dir),
        "steps_done": state["global_step"],
        "epochs_done": round(state["epoch"], 4),
        "startup_s": state["startup_s"],
        "startup_phases": state["startup_phases"],
        **FaultLog(**state["faults"]).summary(),
        "compute_dtype": state["compute_dtype"],
        "worker_peak_rss_mb": state["worker_peak_rss_mb"],
        "lora_rank": config.lora_rank,  # 0: full fine-tuning
        "parameters": state["parameters"],
        "trainable_parameters": state["trainable_parameters"],
        "deepspeed": state["deepspeed"],  # stage, offload, version, world size; None: DDP
        "sentences_per_s": steady_rate(state),
        "labels": info.labels,
        "val_majority_share": majority_share(
            resolve_storage(config.resolved_data_dir()), "validation"
        ),
        "final": history[-1],
        "best": best_row,
        "best_checkpoint": best_uri,
        "test": evaluate_test_split_once(best_uri, config, run_dir) if best_uri else None,
        "latest_checkpoint": run_dir.uri_for(posixpath.join(result.checkpoint.path, HF_CHECKPOINT)),
        "metrics_csv": run_dir.join(METRICS_FILE).uri,
        "curves_png": run_dir.join(CURVES_FILE).uri,
        "wall_time_s": time.perf_counter() - started,
        "config": dataclasses.asdict(config),
        "dataset": dataclasses.asdict(info),
        "versions": package_versions("transformers", "accelerate", *optional_packages(config)),
    }
    write_summary(run_dir.join(SUMMARY_FILE), summary)
    return summary


def optional_packages(config: TrainConfig) -> list[str]:
    """The packages beyond the stack a run used: DeepSpeed's engine, PEFT's adapters."""
    return [
        name
        for name, used in (
            ("deepspeed", config.deepspeed != "none"),
            ("peft", config.lora_rank > 0),
        )
        if used
    ]


def majority_share(data_dir: StoragePath, split: str) -> float:
    """Accuracy of always answering the most common class: the bar a classifier must beat."""
    labels = read_labels(data_dir, split, PREPARE_COMMAND)
    return float(np.bincount(labels).max() / len(labels))
