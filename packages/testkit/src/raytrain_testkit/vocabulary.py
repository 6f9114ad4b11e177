"""The words every pipeline uses for the same things: summary.json's keys and metrics.csv's columns
(MLflow's metric names are the same columns, and `test_*` from summary.json's `test`).

docs/vocabulary.md is this record in prose, with the flags; tests check that each pipeline's
summary.json and metrics.csv use only these names, and that the document lists exactly them.
Two pipelines that mean different things use different names; one meaning has one name.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

# Every finished run's summary.json has these.
REQUIRED_SUMMARY_KEYS: dict[str, str] = {
    "pipeline": "the pipeline's package name",
    "pipeline_version": "its version",
    "run_name": "--run-name",
    "run_dir": "the run folder (local path or bucket URI)",
    "steps_done": "optimiser steps the run has taken, over all its attempts",
    "epochs_done": "passes over the training split those steps made (fractional mid-epoch)",
    "startup_s": "seconds from `train` starting to the first optimiser step of this command",
    "startup_phases": "those seconds by phase: imports, ray_start, worker_group, model_build, …",
    "preemptions": "preemption notices acted on (each: step, ranks, deadline)",
    "restarts": "restarts survived (each: resumed_at_step, last_step_before, steps_redone, cause)",
    "steps_redone": "steps trained twice because a restart resumed behind them",
    "final": "the last metrics row with a validation score",
    "best": "the metrics row of the best validation score (the checkpoint Ray ranks first)",
    "best_checkpoint": "that checkpoint's URI",
    "latest_checkpoint": "the newest checkpoint's URI",
    "metrics_csv": "metrics.csv's URI",
    "curves_png": "curves.png's URI",
    "compute_dtype": "the dtype the forward pass computed in (bfloat16 under --bf16)",
    "wall_time_s": "seconds the `train` command took",
    "config": "every setting of the run",
    "dataset": "the prepared dataset's dataset.json",
    "versions": "versions of Python, torch, Ray and the pipeline's libraries",
}
# Written by the pipelines that have them.
OPTIONAL_SUMMARY_KEYS: dict[str, str] = {
    "first": "the metrics row of the evaluation before the first step (step 0)",
    "test": "the best checkpoint's test metrics, scored once as train ends (test_loss, …)",
    "evaluations": "each later `evaluate` of a checkpoint (hf_finetune)",
    "stopped_mid_epoch": "the run stopped (--stop-at-step) inside an epoch",
    "train_time_s": "seconds of training and validation, summed over the epochs",
    "peak_memory_gb": "the most GPU memory the allocator handed out (GPU runs)",
    "worker_peak_rss_mb": "the most host memory (resident set, MiB) one training worker held",
    "model": "the model trained",
    "lora_rank": "the rank of the LoRA adapters trained (0: full fine-tuning)",
    "parameters": "the model's parameters (adapters included), each tied tensor counted once",
    "trainable_parameters": "the parameters that trained (under LoRA: the adapters)",
    "deepspeed": "a --deepspeed run's engine: ZeRO stage, offload, version, world size (null: DDP)",
    "labels": "the class names, in the order of the classifier's outputs",
    "val_majority_share": "validation accuracy of always answering the most common class",
    "val_loss_drop": "1 − final val_loss ÷ first val_loss",
    "tokens_per_s": "median tokens/s over the logging windows after the first",
    "sentences_per_s": (
        "training sentences/s over the progress windows after the first "
        "(evaluation and checkpoints left out)"
    ),
    "mfu": "median model FLOPs utilisation over those windows (GPUs with a known peak)",
    "checkpoint_stall_s": "median seconds training waited for a checkpoint",
    "first_batch_s": "seconds from `train` starting to the first batch reaching rank 0",
    "decoded_on": "rank 0's training rows by the node (id prefix) whose Ray Data task decoded them",
    "skipped_files": (
        "each epoch's skipped_files (metrics.csv): files that failed to decode in training"
    ),
    "written_at": "when summary.json was written (local time, ISO 8601 with its offset)",
}
SUMMARY_KEYS = REQUIRED_SUMMARY_KEYS | OPTIONAL_SUMMARY_KEYS

METRIC_COLUMNS: dict[str, str] = {
    "step": "optimiser steps taken when the row was written",
    "epoch": "epochs done when the row was written (fractional between epoch ends)",
    "lr": "the learning rate of the row's last step",
    "train_loss": "mean training loss over the steps since the previous row",
    "train_loss_interval": "mean training loss over the steps since the previous progress line",
    "train_accuracy": "training accuracy over the steps since the previous row",
    "train_images_per_s": "images/s over the row's steps, warm-up steps left out",
    "tokens_per_s": "tokens/s over the row's steps, evaluation and checkpoints left out",
    "mfu": "model FLOPs utilisation over the row's steps",
    "grad_norm": "the global gradient norm of the row's last step, before clipping",
    "workers": "the worker count (an elastic run shrinks and grows)",
    "peak_memory_gb": "the most GPU memory the allocator handed out so far",
    "train_s": "seconds of training the row covers",
    "val_s": "seconds the validation took",
    "val_loss": "mean loss on the validation split",
    "val_accuracy": "accuracy on the validation split",
    "val_f1": "macro F1 on the validation split",
    "val_perplexity": "exp(val_loss)",
    "checkpoint_stall_s": "seconds training waited for the checkpoint of this step",
    "data_wait_share": "share of the row's training time rank 0 waited for its next batch",
    "skipped_files": (
        "rows of the epoch whose file could not be decoded in training (counted as trained)"
    ),
}


def unknown_names(names: Iterable[str], known: Mapping[str, Any]) -> list[str]:
    """The names not in the vocabulary, sorted (an empty list when all are known)."""
    return sorted(set(names) - set(known))


def summary_problems(summary: Mapping[str, Any]) -> list[str]:
    """What keeps a finished run's summary.json from the vocabulary: unknown keys, missing ones,
    and metrics rows (final, best, first) with unknown columns."""
    problems = [f"unknown key {key!r}" for key in unknown_names(summary, SUMMARY_KEYS)]
    problems += [
        f"missing key {key!r}" for key in sorted(set(REQUIRED_SUMMARY_KEYS) - set(summary))
    ]
    for name in ("final", "best", "first"):
        row = summary.get(name) or {}
        problems += [f"{name}: unknown column {c!r}" for c in unknown_names(row, METRIC_COLUMNS)]
    return problems
