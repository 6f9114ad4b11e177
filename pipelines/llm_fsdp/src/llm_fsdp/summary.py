"""What a finished run leaves: the chosen checkpoint's loss on the held-out test documents (scored
once), metrics.csv (one row per logged window, validation and checkpoint), curves.png and
summary.json, read from the latest checkpoint's run record."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import numpy as np
import ray
import ray.train

from llm_fsdp import __version__
from llm_fsdp.checkpointer import read_train_state
from llm_fsdp.config import TrainConfig
from llm_fsdp.evaluate import score_checkpoint
from llm_fsdp.model import ModelSpec
from llm_fsdp.validator import SCORE, read_async_validations
from raytrain_common.checkpoint import best_complete_checkpoint
from raytrain_common.faults import FaultLog
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
from raytrain_common.tokens.corpus import DatasetInfo

log = logging.getLogger("llm_fsdp")


def evaluate_test_split_once(checkpoint_uri: str, config: TrainConfig) -> dict[str, Any]:
    """The chosen checkpoint's loss and perplexity on the test split's first --test-blocks blocks,
    scored once (in a Ray task on a GPU run's worker resources, in the driver on CPUs)."""
    arguments = (checkpoint_uri, config.resolved_data_dir(), "test", config.test_blocks)
    result = evaluate_once(
        score_checkpoint, *arguments, use_gpu=config.use_gpu, cpus=config.cpus_per_worker
    )
    log.info(
        "test loss %.4f, perplexity %.1f on %d held-out blocks: checkpoint of step %d (chosen by "
        "%s)",
        *(result["test_loss"], result["test_perplexity"], result["test_blocks"], result["step"]),
        SCORE,
    )
    return result


def write_run_outputs(
    run_dir: StoragePath,
    result: ray.train.Result,
    config: TrainConfig,
    info: DatasetInfo,
    spec: ModelSpec,
    started: float,
) -> dict[str, Any]:
    """metrics.csv, curves.png and summary.json of a finished run."""
    if result.checkpoint is None:
        raise RuntimeError(f"run {config.run_name} finished without a checkpoint under {run_dir}")
    state = read_train_state(result.checkpoint)
    # --validation async: the tasks' scores, each a row of its step (after that step's others).
    scored = [
        {key: record[key] for key in ("step", "val_loss", "val_perplexity")}
        for record in read_async_validations(run_dir)
    ]
    history = sorted(state["history"] + scored, key=lambda row: row["step"])
    write_metrics_csv(run_dir.join(METRICS_FILE), history)
    plot_curves(
        run_dir.join(CURVES_FILE),
        history,
        [("loss", ["train_loss", "val_loss"]), ("tokens/s", ["tokens_per_s"])],
        x="step",
        title=f"{config.run_name}: {spec.name} on {info.source}",
        log_y=["loss"],
    )
    evals = [row for row in history if "val_loss" in row]
    best = best_complete_checkpoint(result, SCORE, "min")
    best_uri = run_dir.uri_for(best.path) if best else None
    windows = [row for row in history if "tokens_per_s" in row]
    # The first window holds the compilation and warm-up: the steady figures leave it out.
    steady = windows[1:] or windows
    summary = {
        **summary_header("llm_fsdp", __version__, config.run_name, run_dir),
        "model": spec.name,
        "lora_rank": spec.lora_rank,  # 0: full fine-tuning
        "parameters": state.get("parameters"),
        "trainable_parameters": state.get("trainable_parameters"),
        "steps_done": state["step"],
        "epochs_done": round(state["step"] * config.global_batch_size / info.blocks("train"), 4),
        "startup_s": state.get("startup_s"),
        "startup_phases": state.get("startup_phases"),
        **FaultLog(**state.get("faults", {})).summary(),
        "first": evals[0],
        "final": evals[-1],
        "best": min(evals, key=lambda row: row["val_loss"]),
        "val_loss_drop": 1 - evals[-1]["val_loss"] / evals[0]["val_loss"],
        "tokens_per_s": float(np.median([r["tokens_per_s"] for r in steady] or [0])),
        "mfu": _median_of(steady, "mfu"),
        "peak_memory_gb": max(
            (r["peak_memory_gb"] for r in windows if "peak_memory_gb" in r), default=None
        ),
        "compute_dtype": state.get("compute_dtype"),
        "worker_peak_rss_mb": state.get("worker_peak_rss_mb"),
        "checkpoint_stall_s": _median_of(history, "checkpoint_stall_s"),
        "best_checkpoint": best_uri,
        "test": evaluate_test_split_once(best_uri, config) if best_uri else None,
        "latest_checkpoint": run_dir.uri_for(result.checkpoint.path),
        "metrics_csv": run_dir.join(METRICS_FILE).uri,
        "curves_png": run_dir.join(CURVES_FILE).uri,
        "wall_time_s": time.perf_counter() - started,
        "config": dataclasses.asdict(config),
        "dataset": dataclasses.asdict(info),
        "versions": package_versions("transformers"),
    }
    write_summary(run_dir.join(SUMMARY_FILE), summary)
    return summary


def _median_of(rows: list[dict[str, float]], key: str) -> float | None:
    values = [row[key] for row in rows if key in row]
    return float(np.median(values)) if values else None
