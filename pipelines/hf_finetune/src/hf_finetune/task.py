"""The task, in one file: the classifier (a pretrained encoder with a new head), its loss and its
scores. train, evaluate and predict import them from here.

The loss is the model's own: a sequence classifier computes cross-entropy over its labels when the
batch carries `labels` (the Hugging Face Trainer passes them). The model knows nothing about how it
is parallelised: Ray Train's `prepare_trainer` and the Trainer apply DDP. Which models can be named
(the packaged MiniLM, a hub id, a local folder) is model.py's business.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import numpy as np
from transformers import AutoModelForSequenceClassification, EvalPrediction, PreTrainedModel
from transformers.utils import logging as hf_logging

from raytrain_common.metrics import classification_scores


def build_model(model: str, labels: Sequence[str]) -> PreTrainedModel:
    """The pretrained encoder with a freshly initialised head for `labels`, names kept in its
    config."""
    return AutoModelForSequenceClassification.from_pretrained(
        model,
        num_labels=len(labels),
        id2label=dict(enumerate(labels)),
        label2id={label: index for index, label in enumerate(labels)},
        # A checkpoint with another head (e.g. a run on other labels) gets a new one of the right
        # size.
        ignore_mismatched_sizes=True,
    )


def load_trained(folder: str | os.PathLike[str]) -> PreTrainedModel:
    """A fine-tuned classifier from a checkpoint's model folder, in eval mode (without
    transformers' weight-loading bar, a console line per load in evaluate and predict)."""
    hf_logging.disable_progress_bar()
    return AutoModelForSequenceClassification.from_pretrained(folder).eval()


def make_compute_metrics(num_labels: int) -> Callable[[EvalPrediction], dict[str, float]]:
    """The Trainer's `compute_metrics`: accuracy and macro F1 of an evaluation (prefixed `val_`)."""

    def compute_metrics(prediction: EvalPrediction) -> dict[str, float]:
        logits = (
            prediction.predictions[0]
            if isinstance(prediction.predictions, tuple)
            else prediction.predictions
        )
        predicted = np.asarray(logits).argmax(-1)
        return classification_scores(np.asarray(prediction.label_ids), predicted, num_labels)

    return compute_metrics
