"""Test-split accuracy and macro F1 of a checkpoint, in one process, with a confusion matrix.

`train` scores the checkpoint the validation split chose on the test split once, as it ends
(summary.py calls `score_checkpoint`); `hf-finetune evaluate` scores another checkpoint or split
with the same function.
"""

from __future__ import annotations

import contextlib
import posixpath
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import ray.train
import torch
from transformers import AutoTokenizer, DataCollatorWithPadding

from hf_finetune.checkpointer import HF_CHECKPOINT
from hf_finetune.config import PREPARE_COMMAND, TRAIN_COMMAND
from hf_finetune.task import is_model_folder, load_trained
from raytrain_common.checkpoint import verify_checkpoint
from raytrain_common.labelled.prepare import DataError, inspect_dataset
from raytrain_common.labelled.tokenized import TokenizedSplit
from raytrain_common.metrics import (
    SUMMARY_FILE,
    classification_scores,
    confusion_matrix,
    plot_confusion_matrix,
    write_summary,
)
from raytrain_common.runs import chosen_checkpoint, read_run_summary
from raytrain_common.storage import resolve_storage

CONFUSION_FILE = "confusion_matrix.png"


@contextlib.contextmanager
def model_folder(checkpoint: str) -> Iterator[Path]:
    """A Hugging Face folder (a checkpoint's `checkpoint/` or an export) on any storage, checked,
    as a local folder: one on S3 or GCS is copied to a scratch folder first (Ray's
    `Checkpoint.as_directory`), a local one read in place."""
    location = resolve_storage(checkpoint)
    with ray.train.Checkpoint(location.path, location.filesystem).as_directory() as local:
        folder = Path(local)
        if not is_model_folder(folder):
            raise DataError(f"{checkpoint!r} is not a Hugging Face model folder (no config.json)")
        if posixpath.basename(posixpath.dirname(location.path)).startswith("checkpoint_"):
            verify_checkpoint(folder)  # a run's checkpoint: TornCheckpointError when cut off
        yield folder


def load_classifier(checkpoint: str) -> tuple[Any, Any]:
    """Model and tokenizer from a Hugging Face folder on any storage (`model_folder`)."""
    with model_folder(checkpoint) as folder:
        return load_trained(folder), AutoTokenizer.from_pretrained(folder)


@torch.inference_mode()
def predict_ids(
    model: Any, tokenizer: Any, input_ids: list[list[int]], batch_size: int = 256
) -> np.ndarray:
    """Class probabilities for pre-tokenised rows, on the model's device, batched by length to pad
    little."""
    collate = DataCollatorWithPadding(tokenizer)
    order = np.argsort([len(ids) for ids in input_ids], kind="stable")
    probabilities = np.zeros((len(input_ids), model.config.num_labels), dtype=np.float32)
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        batch = collate([{"input_ids": input_ids[i]} for i in rows]).to(model.device)
        probabilities[rows] = torch.softmax(model(**batch).logits.float(), -1).cpu().numpy()
    return probabilities


def predict_split(
    model: Any, tokenizer: Any, rows: TokenizedSplit, chunk: int = 4096
) -> np.ndarray:
    """The predicted label of every row of a split, read from its row file `chunk` rows at a time
    (rows of similar length together): memory holds a chunk's tokens, the labels and lengths, and
    the predictions (24 bytes a row), not the split's tokens."""
    order = np.argsort(rows.lengths, kind="stable")
    predicted = np.zeros(len(rows), dtype=np.int64)
    for start in range(0, len(order), chunk):
        chosen = order[start : start + chunk]
        ids = [row[1 : 1 + row[0]].tolist() for row in rows.token_rows(chosen)]
        predicted[chosen] = predict_ids(model, tokenizer, ids).argmax(-1)
    return predicted


def score_checkpoint(
    checkpoint: str, data_dir: str, split: str, limit: int | None, confusion: str, title: str
) -> dict[str, Any]:
    """Accuracy, macro F1 and the confusion matrix of `checkpoint` on `split`'s first `limit`
    rows (all: None), on this process's GPU if it has one; the matrix drawn to `confusion`."""
    data = resolve_storage(data_dir)
    info = inspect_dataset(data, PREPARE_COMMAND)
    model, tokenizer = load_classifier(checkpoint)
    if [model.config.id2label[i] for i in range(model.config.num_labels)] != info.labels:
        raise DataError(
            f"{checkpoint} predicts {list(model.config.id2label.values())}, the data at "
            f"{data.uri} has labels {info.labels}: evaluate on the data the run trained on"
        )
    model.to("cuda" if torch.cuda.is_available() else "cpu")
    rows = TokenizedSplit.open(data, split, info.max_length, limit=limit)
    labels, predictions = rows.labels, predict_split(model, tokenizer, rows)
    matrix = confusion_matrix(labels, predictions, info.num_labels)
    # The same words as every pipeline: test_* for the split reported, val_* for the one choosing.
    prefix = {"validation": "val"}.get(split, split)
    scores = classification_scores(labels, predictions, info.num_labels)
    majority = float(np.bincount(labels, minlength=info.num_labels).max() / len(labels))
    plot_confusion_matrix(
        resolve_storage(confusion),
        matrix,
        info.labels,
        scores["accuracy"],
        scores["f1"],
        f"{title} on {split}",
    )
    return {
        "split": split,
        f"{prefix}_rows": len(labels),
        "checkpoint": checkpoint,
        **{f"{prefix}_{name}": value for name, value in scores.items()},
        f"{prefix}_majority_share": majority,
        "confusion_matrix": matrix.tolist(),
        "confusion_png": confusion,
    }


def evaluate(
    storage_path: str, run_name: str, checkpoint: str | None = None, split: str = "test"
) -> dict[str, Any]:
    """Score a checkpoint (the run's best when None) on `split`, draw its matrix beside the run's,
    and add the result to summary.json's `evaluations` (its `test` stays train's, scored once)."""
    run_dir = resolve_storage(storage_path).join(run_name)
    summary = read_run_summary(run_dir, TRAIN_COMMAND)
    checkpoint = checkpoint or chosen_checkpoint(run_dir, "best", TRAIN_COMMAND)
    confusion = run_dir.join(f"confusion_matrix-{split}-{checkpoint_name(checkpoint)}.png").uri
    result = score_checkpoint(
        checkpoint, summary["config"]["data_dir"], split, None, confusion, run_name
    )
    evaluations = [*summary.get("evaluations", []), result]
    write_summary(run_dir.join(SUMMARY_FILE), {**summary, "evaluations": evaluations})
    return result


def checkpoint_name(checkpoint: str) -> str:
    """<run>/checkpoint_<time>/checkpoint → checkpoint_<time>; an export folder → its own name."""
    folder, name = posixpath.split(resolve_storage(checkpoint).path.rstrip("/"))
    return posixpath.basename(folder) if name == HF_CHECKPOINT else name
