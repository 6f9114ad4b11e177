"""Classify sentences with a run's best checkpoint: a file's lines one batch at a time, printed as
`label<TAB>probability<TAB>sentence`; a folder or bucket of text files as Ray Data batch inference
written to Parquet."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from hf_finetune.config import TRAIN_COMMAND
from hf_finetune.evaluate import load_classifier, predict_ids
from raytrain_common.runs import chosen_checkpoint
from raytrain_common.storage import resolve_storage

if TYPE_CHECKING:
    from hf_finetune.config import PredictConfig


def predict_lines(
    lines: Iterable[str],
    storage_path: str,
    run_name: str,
    checkpoint: str | None = None,
    batch_size: int = 64,
) -> Iterator[tuple[str, float, str]]:
    """(label, probability, sentence) for every non-blank line, in input order, batch by batch."""
    if checkpoint is None:
        run_dir = resolve_storage(storage_path).join(run_name)
        checkpoint = chosen_checkpoint(run_dir, "best", TRAIN_COMMAND)
    classify = SentenceClassifier(checkpoint, batch_size)
    sentences = (line for line in lines if line.strip())
    while batch := list(itertools.islice(sentences, batch_size)):
        out = classify({"text": np.array(batch, dtype=object)})
        yield from zip(out["label"], out["probability"].tolist(), out["text"], strict=True)


class SentenceClassifier:
    """A Ray Data actor holding one model, loaded once: a batch of lines in, each one's label and
    probability out."""

    def __init__(self, checkpoint: str, batch_size: int) -> None:
        self.model, self.tokenizer = load_classifier(checkpoint)
        self.max_length = min(
            self.tokenizer.model_max_length, self.model.config.max_position_embeddings
        )
        self.batch_size = batch_size

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        sentences = [str(text).strip() for text in batch["text"]]
        ids = self.tokenizer(sentences, truncation=True, max_length=self.max_length)["input_ids"]
        probabilities = predict_ids(self.model, self.tokenizer, ids, self.batch_size)
        best = probabilities.argmax(-1)
        labels = [self.model.config.id2label[int(label)] for label in best]
        return {
            **{key: column for key, column in batch.items() if key != "text"},  # e.g. its path
            "text": np.array(sentences, dtype=object),
            "label": np.array(labels, dtype=object),
            "probability": probabilities.max(-1),
        }


def predict_files(config: PredictConfig, output: str) -> dict[str, Any]:
    """Batch inference with Ray Data over every .txt file under `config.input` (a folder or a
    bucket prefix, any depth): Ray Data reads the lines, a pool of actors (one model each, a GPU
    each where the cluster has them) classifies them, and one Parquet row per non-blank line
    (path, text, label, probability) is written to `output`. Memory holds the batches in flight.
    A killed actor is restarted and its batches retried. A local `output` appears whole or not at
    all (written beside itself, then renamed)."""
    import ray.data

    from raytrain_common.inference import check_paths, predict_to_parquet
    from raytrain_common.ray_start import init_ray

    source, target = check_paths(config.input, output, input_flag="")
    run_dir = resolve_storage(config.storage_path).join(config.run_name)
    checkpoint = config.checkpoint or chosen_checkpoint(run_dir, "best", TRAIN_COMMAND)
    load_classifier(checkpoint)  # a torn or foreign checkpoint: refused here, in one line
    init_ray(train_cpus=1)
    lines = ray.data.read_text(
        source.path,
        encoding=config.encoding,
        include_paths=True,
        drop_empty_lines=True,
        filesystem=source.filesystem,
        file_extensions=["txt"],
    )
    model = {"checkpoint": checkpoint, "batch_size": config.inference_batch_size}
    batch = config.inference_batch_size
    written, seconds = predict_to_parquet(lines, SentenceClassifier, model, batch, target)
    rows = written.count_rows()  # from the Parquet's metadata: one row per line, any number
    return {
        "sentences": rows,
        "files": len(lines.input_files()),
        "output": target.uri,
        "checkpoint": checkpoint,
        "seconds": seconds,
        "sentences_per_s": rows / seconds if seconds else 0.0,
    }
