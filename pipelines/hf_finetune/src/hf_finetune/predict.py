"""Classify sentences with a run's best checkpoint: one `label<TAB>probability<TAB>sentence` per line."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from hf_finetune.evaluate import load_classifier, predict_ids, read_run_summary


def predict_lines(
    lines: Iterable[str],
    storage_path: str,
    run_name: str,
    checkpoint: str | None = None,
    batch_size: int = 64,
) -> Iterator[tuple[str, float, str]]:
    """(label, probability, sentence) for every non-blank line, in input order, batch by batch."""
    if checkpoint is None:
        _, summary = read_run_summary(storage_path, run_name)
        checkpoint = summary["best_checkpoint"]
    model, tokenizer = load_classifier(checkpoint)
    max_length = min(tokenizer.model_max_length, model.config.max_position_embeddings)
    batch: list[str] = []
    for line in lines:
        sentence = line.strip()
        if sentence:
            batch.append(sentence)
        if len(batch) == batch_size:
            yield from _classify(model, tokenizer, batch, max_length)
            batch = []
    if batch:
        yield from _classify(model, tokenizer, batch, max_length)


def _classify(
    model: Any, tokenizer: Any, sentences: list[str], max_length: int
) -> Iterator[tuple[str, float, str]]:
    ids = tokenizer(sentences, truncation=True, max_length=max_length)["input_ids"]
    probabilities = predict_ids(model, tokenizer, ids)
    best = probabilities.argmax(-1)
    for sentence, label, row in zip(sentences, best, probabilities, strict=True):
        yield model.config.id2label[int(label)], float(np.max(row)), sentence
