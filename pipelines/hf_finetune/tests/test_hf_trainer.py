"""What the pipeline relies on in the Hugging Face Trainer, checked on a real Trainer with a tiny
BERT in one process (seconds, no Ray): the training split's own order is the one the Trainer reads,
every epoch and in a resumed one, and evaluation leaves the RNG a checkpoint saves untouched (the
one correction `ValidatingTrainer` makes, which stock transformers needs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

from hf_finetune.validator import ValidatingTrainer
from raytrain_common.labelled.tokenized import TokenizedSplit

ROWS, BATCH, EPOCHS = 64, 8, 2  # 8 steps an epoch


class RecordedSplit(TokenizedSplit):
    """A split in memory that records the row behind every item the Trainer reads."""

    def __init__(self, rows: int, seed: int | None) -> None:
        rng = np.random.default_rng(0)
        lengths = rng.integers(3, 12, size=rows).astype(np.int32)
        ids = np.zeros((rows, 13), dtype=np.int32)
        ids[:, 0] = lengths
        ids[:, 1:] = rng.integers(5, 90, size=(rows, 12))
        super().__init__(InMemoryRows(ids), np.arange(rows) % 2, lengths)
        self.read: list[int] = []
        if seed is not None:
            self.shuffled(seed, group_batch=BATCH)

    def __getitem__(self, index: int) -> dict[str, Any]:
        self.read.append(index if self.order is None else int(self.order[index]))
        return super().__getitem__(index)


class InMemoryRows:
    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def take(self, indices: Any) -> np.ndarray:
        return self.array[np.asarray(indices, dtype=np.int64)]


def pad(items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    longest = max(len(item["input_ids"]) for item in items)
    ids = torch.zeros(len(items), longest, dtype=torch.long)
    for row, item in enumerate(items):
        ids[row, : len(item["input_ids"])] = torch.tensor(item["input_ids"])
    return {
        "input_ids": ids,
        "attention_mask": (ids != 0).long(),
        "labels": torch.tensor([item["labels"] for item in items]),
    }


def tiny_trainer(
    output_dir: Path, train: TokenizedSplit, kind: type[Trainer] = ValidatingTrainer
) -> Trainer:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=100,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        num_labels=2,
    )
    args = TrainingArguments(
        output_dir=str(output_dir),
        num_train_epochs=EPOCHS,
        per_device_train_batch_size=BATCH,
        per_device_eval_batch_size=BATCH,
        train_sampling_strategy="sequential",  # as train.py: the split brings its own order
        save_strategy="steps",
        save_steps=11,  # mid-epoch 2
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    return kind(
        model=BertForSequenceClassification(config),
        args=args,
        train_dataset=train,
        eval_dataset=RecordedSplit(16, seed=None),
        data_collator=pad,
    )


def test_the_trainer_reads_the_splits_order_every_epoch_and_a_resumed_epoch_exactly(
    tmp_path: Path,
) -> None:
    """Each epoch is the split's permutation for (seed, epoch), read whole; a run resumed from
    step 11 reads exactly the rows the uninterrupted run read after it (accelerate hands the epoch
    to the dataset's `set_epoch`, in a resumed epoch too: without that it would be epoch 0's)."""
    whole = RecordedSplit(ROWS, seed=5)
    tiny_trainer(tmp_path / "whole", whole).train()
    assert len(whole.read) == EPOCHS * ROWS
    epochs = [whole.read[:ROWS], whole.read[ROWS:]]
    for epoch, rows in enumerate(epochs):
        assert sorted(rows) == list(range(ROWS))  # every row once
        expected = RecordedSplit(ROWS, seed=5)
        expected.set_epoch(epoch)
        assert expected.order is not None
        assert rows == expected.order.tolist()
    assert epochs[0] != epochs[1]

    resumed = RecordedSplit(ROWS, seed=5)
    trainer = tiny_trainer(tmp_path / "resumed", resumed)
    trainer.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-11"))
    assert resumed.read == whole.read[11 * BATCH :]


def test_evaluation_leaves_the_rng_as_it_found_it(tmp_path: Path) -> None:
    """Stock transformers' evaluation draws from the global RNG (its DataLoader's seed), which the
    Trainer then saves in the checkpoint: an extra evaluation before a stop would change the
    resumed run's dropout. `ValidatingTrainer.evaluate` gives the RNG back as it was, and names its
    metrics `val_*`."""
    stock = tiny_trainer(tmp_path / "stock", RecordedSplit(ROWS, seed=5), kind=Trainer)
    before = torch.get_rng_state()
    stock.evaluate()
    assert not torch.equal(torch.get_rng_state(), before)  # what the override corrects

    ours = tiny_trainer(tmp_path / "ours", RecordedSplit(ROWS, seed=5))
    before = torch.get_rng_state()
    metrics = ours.evaluate()
    assert torch.equal(torch.get_rng_state(), before)
    assert "val_loss" in metrics
