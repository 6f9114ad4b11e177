"""Fine-tune a sequence classifier: Hugging Face `Trainer` in every Ray Train worker.

Read top to bottom: the metrics, the datasets, the per-worker loop (Trainer + RayTrainReportCallback +
prepare_trainer), then the driver that checks everything, launches `TorchTrainer` and writes the run's
outputs. Ray Train starts the process group; the Trainer sees it and wraps the model in DDP itself, so
`TrainingArguments` holds no deepspeed / fsdp settings.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import ray.train
import torch
import transformers
from ray.train import Checkpoint
from ray.train.huggingface.transformers import RayTrainReportCallback, prepare_trainer
from ray.train.torch import TorchTrainer
from transformers import (
    AutoTokenizer,
    DataCollatorWithPadding,
    EvalPrediction,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.trainer_callback import PrinterCallback

from hf_finetune import __version__
from hf_finetune.config import TrainConfig
from hf_finetune.data import (
    DataError,
    DatasetInfo,
    inspect_dataset,
    read_split,
    tokenizer_fingerprint,
)
from hf_finetune.model import build_model, display_name, resolve_model
from raytrain_common.configs import (
    ConfigError,
    build_run_config,
    build_scaling_config,
    build_torch_config,
    per_worker_batch_size,
)
from raytrain_common.metrics import (
    SUMMARY_FILE,
    package_versions,
    plot_curves,
    write_metrics_csv,
    write_summary,
)
from raytrain_common.ray_start import start_ray_for_run
from raytrain_common.storage import (
    StoragePath,
    check_writable,
    resolve_storage,
)

log = logging.getLogger("hf_finetune")

SCORE = "eval_f1"  # Ray keeps the best checkpoints by this; the Trainer prefixes eval metrics
METRICS_FILE = "metrics.csv"
CURVES_FILE = "curves.png"
HF_CHECKPOINT = RayTrainReportCallback.CHECKPOINT_NAME  # the HF folder inside a Ray checkpoint
DTYPE_FILE = "compute_dtype.json"  # beside the Trainer's files in each checkpoint


# ---------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------


def confusion_matrix(labels: np.ndarray, predictions: np.ndarray, num_labels: int) -> np.ndarray:
    """Rows: true class; columns: predicted class."""
    matrix = np.zeros((num_labels, num_labels), dtype=np.int64)
    np.add.at(matrix, (labels, predictions), 1)
    return matrix


def classification_scores(
    labels: np.ndarray, predictions: np.ndarray, num_labels: int
) -> dict[str, float]:
    """Accuracy and macro F1 (the mean of per-class F1, so a small class counts as much as a big one)."""
    matrix = confusion_matrix(labels, predictions, num_labels)
    true_positive = np.diag(matrix).astype(float)
    precision = np.divide(
        true_positive, matrix.sum(0), out=np.zeros(num_labels), where=matrix.sum(0) > 0
    )
    recall = np.divide(
        true_positive, matrix.sum(1), out=np.zeros(num_labels), where=matrix.sum(1) > 0
    )
    f1 = np.divide(
        2 * precision * recall,
        precision + recall,
        out=np.zeros(num_labels),
        where=(precision + recall) > 0,
    )
    return {"accuracy": float(true_positive.sum() / matrix.sum()), "f1": float(f1.mean())}


def make_compute_metrics(num_labels: int):
    def compute_metrics(prediction: EvalPrediction) -> dict[str, float]:
        logits = (
            prediction.predictions[0]
            if isinstance(prediction.predictions, tuple)
            else prediction.predictions
        )
        return classification_scores(
            np.asarray(prediction.label_ids), np.asarray(logits).argmax(-1), num_labels
        )

    return compute_metrics


# ---------------------------------------------------------------------------------------------
# Datasets: the pre-tokenised Parquet as map-style datasets the Trainer can sample and shard
# ---------------------------------------------------------------------------------------------


class TokenizedSplit(torch.utils.data.Dataset):
    """Rows of a pre-tokenised split; `DataCollatorWithPadding` pads each batch to its longest row.

    The Trainer's distributed sampler gives every rank its part, evaluation gathers the predictions
    exactly (no row lost or counted twice), and a resumed run skips the batches already seen.
    """

    def __init__(self, table: pa.Table, max_length: int) -> None:
        self.input_ids = table.column("input_ids").to_pylist()
        self.labels = table.column("label").to_numpy()
        # Untruncated lengths capped at the truncation: what the length-grouped sampler needs.
        self.lengths = np.minimum(table.column("length").to_numpy(), max_length).tolist()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"input_ids": self.input_ids[index], "labels": int(self.labels[index])}


class LengthGroupedTrainer(Trainer):
    """Hands the known token lengths to the length-grouped sampler instead of measuring every row."""

    def _get_train_sampler(self, train_dataset=None):
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        if self.args.train_sampling_strategy == "group_by_length" and isinstance(
            dataset, TokenizedSplit
        ):
            from transformers.trainer_pt_utils import LengthGroupedSampler

            return LengthGroupedSampler(
                self.args.train_batch_size * self.args.gradient_accumulation_steps,
                dataset=dataset,
                lengths=dataset.lengths,
            )
        return super()._get_train_sampler(train_dataset)


class ProgressLog(TrainerCallback):
    """One line every N steps on rank 0: step, epoch, loss, learning rate, sentences per second."""

    def __init__(self, global_batch_size: int) -> None:
        self.global_batch_size = global_batch_size
        self.last = (time.perf_counter(), 0)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        now = time.perf_counter()
        rate = (
            (state.global_step - self.last[1])
            * self.global_batch_size
            / max(now - self.last[0], 1e-9)
        )
        if "loss" in logs:
            log.info(
                "step %d/%d  epoch %.2f  loss %.4f  lr %.2e  %.1f sentences/s",
                state.global_step, state.max_steps, state.epoch or 0.0, logs["loss"],
                logs.get("learning_rate", float("nan")), rate,
            )  # fmt: skip
        elif "eval_loss" in logs:
            log.info(
                "epoch %.0f  eval loss %.4f  eval accuracy %.4f  eval F1 %.4f",
                state.epoch or 0.0, logs["eval_loss"], logs.get("eval_accuracy", float("nan")),
                logs.get("eval_f1", float("nan")),
            )  # fmt: skip
        self.last = (now, state.global_step)


class ComputeDtypeRecord(TrainerCallback):
    """Writes the dtype the forward pass computes in (bfloat16 under `--bf16` autocast) into each
    checkpoint, so the run's summary shows whether mixed precision was really in effect."""

    def __init__(self) -> None:
        self.dtype: str | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        def record(module: torch.nn.Module, inputs: Any, output: Any) -> None:
            logits = getattr(output, "logits", None)
            if logits is not None:
                self.dtype = str(logits.dtype).removeprefix("torch.")

        model.register_forward_hook(record)

    def on_save(self, args, state, control, **kwargs):
        if self.dtype is not None and state.is_world_process_zero:
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            (folder / DTYPE_FILE).write_text(json.dumps({"compute_dtype": self.dtype}))


class NonFiniteLossGuard(TrainerCallback):
    """Stops the run at the first NaN/inf logged loss, naming the step, instead of training on garbage."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        loss = (logs or {}).get("loss")
        if loss is not None and not math.isfinite(loss):
            rank = ray.train.get_context().get_world_rank()
            raise FloatingPointError(
                f"rank {rank}: training loss is {loss} at step {state.global_step}: lower --lr, "
                "or drop --bf16"
            )


# ---------------------------------------------------------------------------------------------
# The per-worker loop
# ---------------------------------------------------------------------------------------------


def training_arguments(config: TrainConfig, output_dir: str, workers: int) -> TrainingArguments:
    return TrainingArguments(
        output_dir=output_dir,
        num_train_epochs=config.epochs,
        per_device_train_batch_size=per_worker_batch_size(
            config.global_batch_size, workers, config.grad_accum_steps
        ),
        per_device_eval_batch_size=config.eval_batch_size,
        gradient_accumulation_steps=config.grad_accum_steps,
        learning_rate=config.lr,
        weight_decay=config.weight_decay,
        warmup_steps=config.warmup_fraction,  # a float below 1 is a share of all steps
        lr_scheduler_type=config.lr_schedule,
        max_grad_norm=config.grad_clip_norm,
        # Evaluate, then save, at every epoch end: each checkpoint Ray receives carries its eval F1.
        eval_strategy="epoch",
        save_strategy="epoch",
        logging_strategy="steps",
        logging_steps=config.log_every_steps,
        save_total_limit=1,  # local copies only; Ray keeps the run's checkpoints in storage
        bf16=config.bf16,
        use_cpu=not config.use_gpu,
        ddp_find_unused_parameters=False,
        # Sequence classifiers take **kwargs but average their loss themselves; token averaging
        # across devices would scale that mean by the world size (logged losses ×N, clipping off).
        average_tokens_across_devices=False,
        dataloader_pin_memory=config.use_gpu,
        train_sampling_strategy="group_by_length" if config.group_by_length else "random",
        seed=config.seed,
        data_seed=config.seed,
        report_to="none",
        disable_tqdm=True,
    )


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    config = TrainConfig(**loop_config["config"])
    info = DatasetInfo(**loop_config["dataset"])
    data_dir = resolve_storage(config.resolved_data_dir())
    context = ray.train.get_context()
    workers = context.get_world_size()

    train_set = TokenizedSplit(
        read_split(data_dir, "train", config.limit_train_rows), info.max_length
    )
    eval_set = TokenizedSplit(
        read_split(data_dir, "validation", config.limit_eval_rows), info.max_length
    )
    transformers.utils.logging.disable_progress_bar()  # bars from every worker garble the log
    transformers.utils.logging.set_verbosity_error()  # e.g. the load report naming the new head
    tokenizer = AutoTokenizer.from_pretrained(info.tokenizer)
    model = build_model(loop_config["model"], info.labels)

    with tempfile.TemporaryDirectory(prefix="hf-finetune-") as output_dir:
        trainer = LengthGroupedTrainer(
            model=model,
            args=training_arguments(config, output_dir, workers),
            train_dataset=train_set,
            eval_dataset=eval_set,
            processing_class=tokenizer,  # saved in every checkpoint, so each one predicts on its own
            data_collator=DataCollatorWithPadding(
                tokenizer, pad_to_multiple_of=8 if config.use_gpu else None
            ),
            compute_metrics=make_compute_metrics(info.num_labels),
            callbacks=[
                ComputeDtypeRecord(),  # before Ray's callback, which uploads the checkpoint
                RayTrainReportCallback(),
                NonFiniteLossGuard(),
                ProgressLog(config.global_batch_size),
            ],
        )
        trainer.remove_callback(PrinterCallback)  # ProgressLog prints instead of raw dicts
        trainer = prepare_trainer(trainer)
        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None:
            trainer.train()
        else:
            with checkpoint.as_directory() as folder:
                resume_from = Path(folder) / HF_CHECKPOINT
                if context.get_world_rank() == 0:
                    log.info("resuming from %s", checkpoint.path)
                trainer.train(resume_from_checkpoint=str(resume_from))


# ---------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------


def check_model_fits_data(model: str, info: DatasetInfo) -> None:
    """The data's token ids mean something only to the tokenizer that made them."""
    if model != info.tokenizer and tokenizer_fingerprint(model) != info.tokenizer_sha256:
        raise ConfigError(
            f"the data was tokenised for {info.tokenizer!r}, whose tokenizer differs from {model!r}'s: "
            f"rerun `hf-finetune prepare --model {model} --force`, or drop --model"
        )


def run(config: TrainConfig) -> dict[str, Any]:
    """Check everything that can be checked, train, then write metrics, curves and summary.json."""
    started = time.perf_counter()
    config.validate()
    storage = resolve_storage(config.storage_path)
    check_writable(storage)
    data_dir = resolve_storage(config.resolved_data_dir())
    info = inspect_dataset(data_dir)
    model = resolve_model(config.model or info.tokenizer)
    check_model_fits_data(model, info)
    train_rows = min(info.rows["train"], config.limit_train_rows or info.rows["train"])
    if train_rows < config.global_batch_size:
        raise DataError(
            f"{train_rows} training rows make no full batch of {config.global_batch_size}: "
            "use more rows or a smaller --global-batch-size"
        )
    config = dataclasses.replace(
        config, storage_path=storage.uri, data_dir=data_dir.uri, model=model
    )

    start_ray_for_run(config, storage, data_dir)

    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "config": dataclasses.asdict(config),
            "dataset": dataclasses.asdict(info),
            "model": model,
        },
        scaling_config=build_scaling_config(config),
        run_config=build_run_config(config, score_attribute=SCORE, score_order="max"),
        torch_config=build_torch_config(config),
    )
    log.info(
        "fine-tuning %s on %d rows, %d worker(s), %d epoch(s); run folder %s",
        display_name(model), train_rows, config.num_workers, config.epochs, storage.join(config.run_name),
    )  # fmt: skip
    result = trainer.fit()
    return write_run_outputs(storage.join(config.run_name), result, config, info, started)


def epoch_history(
    trainer_state: dict[str, Any],
) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """Per-epoch rows (eval metrics with the train loss of that epoch) and the interval loss log."""
    step_log = [
        {"epoch": row["epoch"], "step": row["step"], "train_loss_interval": row["loss"]}
        for row in trainer_state["log_history"]
        if "loss" in row
    ]
    history = []
    for row in trainer_state["log_history"]:
        if "eval_loss" not in row:
            continue
        epoch = round(row["epoch"])
        losses = [r["train_loss_interval"] for r in step_log if epoch - 1 < r["epoch"] <= epoch]
        history.append(
            {
                "epoch": epoch,
                "step": row["step"],
                "train_loss": float(np.mean(losses)) if losses else float("nan"),
                "eval_loss": row["eval_loss"],
                "eval_accuracy": row["eval_accuracy"],
                "eval_f1": row["eval_f1"],
                "eval_runtime_s": row["eval_runtime"],
            }
        )
    return history, step_log


def read_trainer_state(checkpoint: Checkpoint) -> dict[str, Any]:
    """The Trainer's state of a checkpoint, with the compute dtype it recorded (None if absent)."""
    with checkpoint.as_directory() as folder:
        hf_folder = Path(folder) / HF_CHECKPOINT
        state = json.loads((hf_folder / "trainer_state.json").read_text())
        dtype_file = hf_folder / DTYPE_FILE
        state["compute_dtype"] = (
            json.loads(dtype_file.read_text())["compute_dtype"] if dtype_file.exists() else None
        )
        return state


def write_run_outputs(
    run_dir: StoragePath,
    result: ray.train.Result,
    config: TrainConfig,
    info: DatasetInfo,
    started: float,
) -> dict[str, Any]:
    """metrics.csv, curves.png and summary.json from the latest checkpoint's Trainer state."""
    if result.checkpoint is None:
        raise RuntimeError(f"run {config.run_name} finished without a checkpoint under {run_dir}")
    state = read_trainer_state(result.checkpoint)
    history, step_log = epoch_history(state)
    best = result.get_best_checkpoint(SCORE, "max") if result.best_checkpoints else None
    write_metrics_csv(run_dir.join(METRICS_FILE), history)
    plot_curves(
        run_dir.join(CURVES_FILE),
        sorted(step_log + history, key=lambda row: row["epoch"]),
        [("loss", ["train_loss_interval", "eval_loss"]), ("score", ["eval_accuracy", "eval_f1"])],
        title=f"{config.run_name}: {display_name(config.model or '')} on {info.source}",
        log_y=["loss"],
    )
    best_row = max(history, key=lambda row: row[SCORE])
    summary = {
        "pipeline": "hf_finetune",
        "pipeline_version": __version__,
        "run_name": config.run_name,
        "run_dir": run_dir.uri,
        "epochs_done": len(history),
        "global_step": state["global_step"],
        "compute_dtype": state["compute_dtype"],
        "labels": info.labels,
        "majority_share_validation": majority_share(
            resolve_storage(config.resolved_data_dir()), "validation"
        ),
        "final": history[-1],
        "best": best_row,
        "best_checkpoint": _uri(run_dir, best.path, HF_CHECKPOINT) if best else None,
        "latest_checkpoint": _uri(run_dir, result.checkpoint.path, HF_CHECKPOINT),
        "metrics_csv": run_dir.join(METRICS_FILE).uri,
        "curves_png": run_dir.join(CURVES_FILE).uri,
        "wall_time_s": time.perf_counter() - started,
        "config": dataclasses.asdict(config),
        "dataset": dataclasses.asdict(info),
        "versions": package_versions("transformers", "accelerate"),
    }
    write_summary(run_dir.join(SUMMARY_FILE), summary)
    return summary


def majority_share(data_dir: StoragePath, split: str) -> float:
    """Accuracy of always answering the most common class: the bar a classifier must beat."""
    labels = read_split(data_dir, split).column("label").to_numpy()
    return float(np.bincount(labels).max() / len(labels))


def _uri(run_dir: StoragePath, path: str, *inner: str) -> str:
    """A checkpoint's HF folder as a path or URI users can pass back (scheme kept for object stores)."""
    joined = "/".join([path.rstrip("/"), *inner])
    if run_dir.is_local:
        return joined
    return f"{run_dir.uri.split('://', 1)[0]}://{joined}"
