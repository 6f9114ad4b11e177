"""The typed configs of every command, and the fine-tuning run's CPU and GPU presets.

Every field is a command-line flag (`hf-finetune train --help`); a preset sets train's defaults.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from raytrain_common.cli import option
from raytrain_common.configs import (
    ConfigError,
    ConsoleSettings,
    DataLocation,
    EpochSettings,
    RunLocation,
    TrainingSettings,
)
from raytrain_common.lora import LoraSettings
from raytrain_common.sweep import SweepSettings
from raytrain_common.text import UTF8
from raytrain_common.zero import DeepSpeedSettings

DEFAULT_DATA_FOLDER = "data/text_classification"
RUN_NAME = "hf_finetune"
VADER_SOURCE = "vader"
PREPARE_COMMAND = "hf-finetune prepare"  # the fix that data errors name
TRAIN_COMMAND = "hf-finetune train"  # the fix that errors about a missing run name


@dataclass(kw_only=True)
class PrepareConfig(DataLocation, ConsoleSettings):
    data_folder: ClassVar[str] = DEFAULT_DATA_FOLDER
    dataset: str = option(
        VADER_SOURCE,
        f"{VADER_SOURCE} (offline: 23,703 human-rated sentences, binary sentiment), CSV / TSV / "
        "JSONL / Parquet files or folders (comma-separated; local, s3://, gs://), or a Hugging "
        "Face hub dataset name.",
    )
    dataset_config: str | None = option(None, "Hub dataset configuration name.")
    encoding: str = option(
        UTF8,
        "Of CSV / TSV / JSONL files: utf-8 (a byte-order "
        "mark is fine), cp1252, latin-1, utf-16, ….",
    )
    text_column: str = option("text", "Column holding the sentences.")
    label_column: str = option("label", "Column holding the class labels.")
    stratify_column: str | None = option(
        None, "Column whose mix every split keeps (none: source for vader, else the label)."
    )
    validation_fraction: float = option(0.1, "Share of rows held out for validation.")
    test_fraction: float = option(0.1, "Share of rows held out for the test split.")
    max_length: int = option(128, "Tokens kept per sentence.")
    seed: int = option(0, "Seed of the split.")
    model: str | None = option(
        None, "Hub id or local folder whose tokenizer to use (none: the offline MiniLM-L6)."
    )
    vader_sdist: str | None = option(None, "A downloaded vaderSentiment-3.3.2.tar.gz to read.")
    force: bool = option(False, "Rewrite a dataset prepared before.")


@dataclass(kw_only=True)
class EvaluateConfig(RunLocation):
    run_name: str = option(RUN_NAME, "Run whose best checkpoint is used.")
    checkpoint: str | None = option(
        None, "A Hugging Face model folder (none: the run's best checkpoint)."
    )


@dataclass(kw_only=True)
class ExportConfig(EvaluateConfig):
    output: str | None = option(None, "Folder to write (none: <run folder>/export).")
    adapter_only: bool = option(
        False,
        "A LoRA run's adapters alone (adapter_model.safetensors; PeftModel.from_pretrained(base, "
        "folder) loads them), instead of the model with them merged in.",
    )


@dataclass(kw_only=True)
class PredictConfig(EvaluateConfig):
    input: str = option(
        "-",
        "One sentence per line: a file, answered line by line at once ('-': standard input); or a "
        "folder or bucket prefix of such .txt files (any depth, any number), classified by Ray "
        "Data actors into --predictions.",
        positional=True,
    )
    encoding: str = option(UTF8, "Of the input files.")
    predictions: str | None = option(
        None,
        "Parquet folder the predictions of a folder input are written to: one row per non-blank "
        "line (none: <run folder>/predictions-<time>).",
    )
    inference_batch_size: int = option(
        64, "Sentences per model call (in each Ray Data actor for a folder input)."
    )


@dataclass(kw_only=True)
class TrainConfig(EpochSettings, TrainingSettings, DeepSpeedSettings, LoraSettings):
    """The library's loop, epoch, DeepSpeed and LoRA flags (raytrain_common.configs, .zero, .lora)
    with this pipeline's defaults, then the recipe's own: the model, its optimiser and schedule,
    batching for evaluation."""

    data_folder: ClassVar[str] = DEFAULT_DATA_FOLDER
    sample_noun: ClassVar[str] = "Sentences"
    run_name: str = option(RUN_NAME)
    model: str | None = option(
        None,
        "Hub id or local Hugging Face folder (default: the model the data was tokenised for).",
    )
    eval_batch_size: int = option(128, "Most sentences per evaluation batch on each worker.")
    lr: float = option(1e-4, "Peak learning rate of AdamW.")
    weight_decay: float = option(0.01, "AdamW weight decay.")
    lr_schedule: str = option("linear", "Decay after warm-up: linear, cosine or constant.")
    grad_clip_norm: float = option(1.0, "Clip the gradient norm to this.")
    bf16: bool = option(False, "bfloat16 mixed precision (GPUs with bf16 support).")
    group_by_length: bool = option(
        True, "Batch sentences of similar length together: less padding, faster steps."
    )

    def validate(self) -> None:
        """Raise on values that cannot work, naming the value and the fix, before anything
        starts."""
        self.validate_training_settings()
        self.validate_epochs()
        self.validate_deepspeed()
        self.validate_lora()
        for name in ("lr", "eval_batch_size", "grad_clip_norm"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)}: it must be above 0")
        if self.lr_schedule not in ("linear", "cosine", "constant"):
            raise ConfigError(
                f"lr_schedule={self.lr_schedule!r}: choose linear, cosine or constant"
            )


def cpu_preset() -> TrainConfig:
    """Two CPU workers on a laptop or CI box: VADER to ≥ 0.80 test accuracy in under 25 minutes."""
    return TrainConfig()


def gpu_preset() -> TrainConfig:
    """All GPUs of the cluster (set --num-workers), bf16, larger batches, three epochs."""
    return dataclasses.replace(
        TrainConfig(),
        use_gpu=True,
        bf16=True,
        num_workers=1,
        cpus_per_worker=4.0,
        global_batch_size=64,
        eval_batch_size=256,
        epochs=3,
    )


PRESETS = {"cpu": cpu_preset(), "gpu": gpu_preset()}


SWEEP_NAME = "hf_finetune_sweep"


@dataclass(kw_only=True)
class SweepConfig(TrainConfig, SweepSettings):
    """`hf-finetune sweep`: the train options every trial starts from, then the sweep's own."""


def cpu_sweep_preset() -> SweepConfig:
    """6 trials of one worker each, two at a time, on 1,024 training sentences for 3 epochs (ASHA
    compares validation F1 after each): ~10 minutes on a 2-core box."""
    return SweepConfig(
        **dataclasses.asdict(cpu_preset())
        | {"epochs": 3, "limit_train_rows": 1024, "limit_val_rows": 512, "limit_test_rows": 512},
        sweep_name=SWEEP_NAME,
        num_samples=6,
        max_concurrent_trials=2,
        workers_per_trial=1,
        lr_min=1e-6,
        lr_max=5e-4,
        batch_sizes="16,32",
        warmup_fractions="0,0.1",
        weight_decays="0,0.01",
    )


def gpu_sweep_preset() -> SweepConfig:
    """One GPU per trial on the whole training split, 3 epochs, as many trials at once as the
    cluster has GPUs (set --max-concurrent-trials)."""
    return SweepConfig(
        **dataclasses.asdict(gpu_preset()),
        sweep_name=SWEEP_NAME,
        num_samples=16,
        max_concurrent_trials=4,
        workers_per_trial=1,
        lr_min=1e-5,
        lr_max=3e-4,
        batch_sizes="32,64,128",
        warmup_fractions="0,0.1",
        weight_decays="0,0.01",
    )


SWEEP_PRESETS = {"cpu": cpu_sweep_preset(), "gpu": gpu_sweep_preset()}
