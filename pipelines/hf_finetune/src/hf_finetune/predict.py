"""Classify sentences with a run's best checkpoint: a file's lines one batch at a time, printed as
`label<TAB>probability<TAB>sentence`; a folder or bucket of text files as Ray Data batch inference
written to Parquet."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hf_finetune.config import TRAIN_COMMAND
from hf_finetune.evaluate import load_classifier, predict_ids
from raytrain_common.runs import chosen_checkpoint
from raytrain_common.storage import resolve_storage
from raytrain_common.text import iter_decoded

if TYPE_CHECKING:
    from hf_finetune.config import PredictConfig

CHUNK_BYTES = 1 << 20


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


def file_lines(path: str, encoding: str) -> Iterator[str]:
    """A text file's lines, decoded a MiB at a time: a file of any size in bounded memory, and a
    byte that is not `encoding` refused with its place in the file."""

    def chunks() -> Iterator[bytes]:
        with Path(path).expanduser().open("rb") as stream:
            while chunk := stream.read(CHUNK_BYTES):
                yield chunk

    pending = ""
    for text, _ in iter_decoded(chunks(), encoding, path):
        *complete, pending = (pending + text).split("\n")
        yield from complete
    if pending:
        yield pending


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
            "path": batch["path"],
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
