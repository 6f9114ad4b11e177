"""The task, in one file: the classifier (a pretrained encoder with a new head), its loss and its
scores. train, evaluate and predict import them from here.

With --lora-rank the classifier trains through LoRA adapters (raytrain_common.lora); with
--deepspeed its checkpoints may hold ZeRO shards: `load_trained` reads every kind as one plain model.

The loss is the model's own: a sequence classifier computes cross-entropy over its labels when the
batch carries `labels` (the Hugging Face Trainer passes them). The model knows nothing about how it
is parallelised: Ray Train's `prepare_trainer` and the Trainer apply DDP. Which models can be named
(the packaged MiniLM, a hub id, a local folder) is model.py's business.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    EvalPrediction,
    PreTrainedModel,
)
from transformers.utils import logging as hf_logging

from raytrain_common.checkpoint import load_model_weights
from raytrain_common.lora import LoraSettings, merged, with_lora
from raytrain_common.metrics import classification_scores
from raytrain_common.zero import (
    consolidated_state_dict,
    has_consolidated_weights,
    is_zero_checkpoint,
)

ADAPTER_CONFIG = "adapter_config.json"  # PEFT's: a LoRA run's checkpoints hold adapters only


def build_model(model: str, labels: Sequence[str], lora: LoraSettings | None = None) -> Any:
    """The pretrained encoder with a freshly initialised head for `labels`, names kept in its
    config; with `lora.lora_rank`, wrapped in LoRA adapters (PEFT's SEQ_CLS task: the adapters
    and the new head train, the encoder stays frozen)."""
    classifier = AutoModelForSequenceClassification.from_pretrained(
        model,
        num_labels=len(labels),
        id2label=dict(enumerate(labels)),
        label2id={label: index for index, label in enumerate(labels)},
        # A checkpoint with another head (e.g. a run on other labels) gets a new one of the right
        # size.
        ignore_mismatched_sizes=True,
    )
    if lora is None or not lora.lora_rank:
        return classifier
    return with_lora(
        classifier,
        rank=lora.lora_rank,
        alpha=lora.lora_alpha,
        dropout=lora.lora_dropout,
        targets=lora.lora_targets(),
        task_type="SEQ_CLS",
        name=model,
    )


def is_model_folder(folder: str | os.PathLike[str]) -> bool:
    """A folder `load_trained` reads: a Hugging Face model's (config.json) or LoRA adapters'."""
    return any((Path(folder) / name).exists() for name in ("config.json", ADAPTER_CONFIG))


def load_trained(folder: str | os.PathLike[str]) -> PreTrainedModel:
    """A fine-tuned classifier from a checkpoint's model folder or an export, in eval mode, as one
    plain model whatever trained it: LoRA adapters are merged into the base they name, and a
    ZeRO-3 checkpoint's shards are gathered in full precision (it holds no weights file). Without
    transformers' weight-loading bar, a console line per load in evaluate and predict."""
    hf_logging.disable_progress_bar()
    if (Path(folder) / ADAPTER_CONFIG).exists():
        return merged(load_adapted(folder)).eval()  # type: ignore[no-any-return]
    if is_zero_checkpoint(folder) and not has_consolidated_weights(folder):
        config = AutoConfig.from_pretrained(folder)
        model = AutoModelForSequenceClassification.from_config(config)
        load_model_weights(model, consolidated_state_dict(folder))
        return model.eval()
    return AutoModelForSequenceClassification.from_pretrained(folder).eval()


def load_adapted(folder: str | os.PathLike[str]) -> Any:
    """A LoRA checkpoint as PEFT's model: the base it names (adapter_config.json), with the head
    the checkpoint's config.json sizes and labels, then its adapters and trained head."""
    from peft import PeftConfig, PeftModel

    base = PeftConfig.from_pretrained(str(folder)).base_model_name_or_path
    hf_logging.set_verbosity_error()  # the base's report of the head it lacks: the adapters hold it
    classifier = AutoModelForSequenceClassification.from_pretrained(
        base, config=AutoConfig.from_pretrained(folder)
    )
    with warnings.catch_warnings():  # PEFT 0.21 asks transformers 5 a deprecated property
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated")
        return PeftModel.from_pretrained(classifier, str(folder))


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
