"""Fine-tune a sequence classifier: Hugging Face `Trainer` in every Ray Train worker.

Read top to bottom: the metrics, the datasets, the per-worker loop (Trainer + RayTrainReportCallback +
prepare_trainer), then the driver that checks everything, launches `TorchTrainer` and writes the run's
outputs. Ray Train starts the process group; the Trainer sees it and wraps the model in DDP itself, so
`TrainingArguments` holds no deepspeed / fsdp settings.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import posixpath
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import closing
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa
import ray.train
import torch
import transformers
from ray.train import Checkpoint, UserCallback
from ray.train.huggingface.transformers import RayTrainReportCallback, prepare_trainer
from ray.train.torch import TorchTrainer
from transformers import (
    AutoTokenizer,
    DataCollatorWithPadding,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)
from transformers.trainer_callback import PrinterCallback
from transformers.trainer_pt_utils import LengthGroupedSampler

from hf_finetune import __version__
from hf_finetune.config import TrainConfig
from hf_finetune.data import (
    DataError,
    DatasetInfo,
    inspect_dataset,
    read_labels,
    tokenizer_fingerprint,
)
from hf_finetune.model import display_name, resolve_model
from hf_finetune.task import build_model, make_compute_metrics
from raytrain_common.checkpoint import (
    best_complete_checkpoint,
    resume_checkpoint,
    scratch_folder,
    write_manifest,
)
from raytrain_common.configs import (
    ConfigError,
    build_run_config,
    build_scaling_config,
    build_torch_config,
    per_worker_batch_size,
)
from raytrain_common.faults import FaultLog, read_progress
from raytrain_common.hardware import workers_peak_rss_mb
from raytrain_common.loop import (
    END,
    CheckpointPolicy,
    ProgressNotes,
    ThroughputMeter,
    startup_seconds,
)
from raytrain_common.metrics import (
    CURVES_FILE,
    METRICS_FILE,
    SUMMARY_FILE,
    eta,
    package_versions,
    plot_curves,
    write_metrics_csv,
    write_summary,
)
from raytrain_common.ray_start import quiet_ray_output, start_ray_for_run
from raytrain_common.rowfile import RowSource, row_file
from raytrain_common.runs import fit, locate_run, summary_header
from raytrain_common.storage import (
    StoragePath,
    resolve_storage,
)
from raytrain_common.tracking import (
    MetricSink,
    failed_on_error,
    finish_for_summary,
    open_for_config,
    rank_zero_sink,
    warm_tracking_store,
)

log = logging.getLogger("hf_finetune")

SCORE = "val_f1"  # Ray keeps the best checkpoints by this (and a sweep ranks trials by it)
# The prefix of the validation metrics the Trainer logs (its own default is "eval"): `val_*` names
# the split that chooses checkpoints in every pipeline, `test_*` the one reported once.
VAL_PREFIX = "val"
HF_CHECKPOINT = RayTrainReportCallback.CHECKPOINT_NAME  # the HF folder inside a Ray checkpoint
RECORD_FILE = "run_record.json"  # compute dtype and faults, beside the Trainer's files
RATE_KEY = "train_sentences_per_s"  # a progress line's rate, in the Trainer's log history


# ---------------------------------------------------------------------------------------------
# Datasets: the pre-tokenised Parquet as map-style datasets the Trainer can sample and shard
# ---------------------------------------------------------------------------------------------


class TokenizedSplit(torch.utils.data.Dataset):
    """Rows of a pre-tokenised split; `DataCollatorWithPadding` pads each batch to its longest row.

    The token ids are read by row index from a node-local row file built once from the Parquet
    (raytrain_common.rowfile), so a worker holds the rows of its batches, not the split: in memory
    stay the labels and lengths alone (16 bytes a row), which the length-grouped sampler needs. The
    Trainer's distributed sampler gives every rank its part, evaluation gathers the predictions
    exactly (no row lost or counted twice), and a resumed run skips the batches already seen.
    """

    def __init__(
        self,
        ids: RowSource,
        labels: np.ndarray,
        lengths: np.ndarray,
        rows: np.ndarray | None = None,
    ) -> None:
        self.ids = ids  # (rows, 1 + max_length) int32: the kept length, then the ids, zero-padded
        self.labels = labels
        # Untruncated lengths capped at the truncation: what the length-grouped sampler needs.
        self.lengths = lengths
        self.rows = rows  # item i is row rows[i] of the row file (None: row i)

    @classmethod
    def open(
        cls, data_dir: StoragePath, split: str, max_length: int, limit: int | None
    ) -> TokenizedSplit:
        """The split's first `limit` rows of its seeded order (row ids below `limit`: a random
        sample whatever order the files hold), all if None, read through this node's row files."""
        split_dir = data_dir.join(split)
        layout = f"ids{max_length}-i32-v1"
        ids = row_file(
            split_dir,
            "input_ids",
            ["input_ids"],
            functools.partial(token_rows, max_length=max_length),
            layout,
        )
        labelled = row_file(
            split_dir,
            "label_length_row",
            ["label", "length", "row"],
            functools.partial(label_length_rows, max_length=max_length),
            f"{layout}-row-i32",
        )
        # Read a chunk at a time; what stays is 8 bytes a row (int32 label and length).
        labels, lengths = [np.zeros(0, np.int32)], [np.zeros(0, np.int32)]
        kept, start = [np.zeros(0, np.int64)], 0
        for chunk in labelled.read_all():
            rows_read = len(chunk)
            if limit is not None:
                chosen = np.flatnonzero(chunk[:, 2] < limit)
                kept.append(chosen + start)
                chunk = chunk[chosen]
            labels.append(chunk[:, 0])
            lengths.append(chunk[:, 1])
            start += rows_read
        rows = None if limit is None else np.concatenate(kept)
        return cls(ids, np.concatenate(labels), np.concatenate(lengths), rows)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, Any]:
        row = self.ids.take([index if self.rows is None else int(self.rows[index])])[0]
        return {"input_ids": row[1 : 1 + row[0]].tolist(), "labels": int(self.labels[index])}


def token_rows(batch: pa.RecordBatch, max_length: int) -> np.ndarray:
    """A batch's token ids as fixed-size rows: the kept length (≤ max_length), then the ids."""
    ids = batch.column(batch.schema.get_field_index("input_ids"))
    offsets = ids.offsets.to_numpy()
    values = ids.values.to_numpy(zero_copy_only=False)
    rows = np.zeros((len(ids), 1 + max_length), dtype=np.int32)
    kept = np.minimum(np.diff(offsets), max_length)
    rows[:, 0] = kept
    for row, (start, length) in enumerate(zip(offsets[:-1], kept, strict=True)):
        rows[row, 1 : 1 + length] = values[start : start + length]
    return rows


def label_length_rows(batch: pa.RecordBatch, max_length: int) -> np.ndarray:
    """(label, length capped at max_length, row id) of each row; row id 0.. when there is none."""
    labels = batch.column(batch.schema.get_field_index("label")).to_numpy()
    lengths = batch.column(batch.schema.get_field_index("length")).to_numpy()
    index = batch.schema.get_field_index("row")
    rows = batch.column(index).to_numpy() if index >= 0 else np.arange(len(labels))
    return np.stack([labels, np.minimum(lengths, max_length), rows], axis=1).astype(np.int32)


class EpochSeededLengthGroupedSampler(LengthGroupedSampler):
    """Transformers' length-grouped order, drawn from a generator seeded by (seed, epoch).

    The stock sampler draws from the global RNG when an epoch starts, so a run resumed mid-epoch
    (whose RNG was restored to the checkpoint's step) would draw another order for that epoch and
    the Trainer's skip of the batches already seen would skip the wrong ones. The Trainer calls
    `set_epoch` before each epoch, resumed or not.
    """

    def __init__(self, *args: Any, seed: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seed = seed
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        self.generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)

    def __iter__(self) -> Iterator[int]:
        """Transformers' order (`get_length_grouped_indices`: a permutation cut into mega-batches
        of up to 50 batches, each sorted longest first, the longest row's mega-batch swapped to the
        front), computed in numpy: 8 bytes a row, where its Python lists take ~40."""
        lengths = np.asarray(self.lengths)
        rows = len(lengths)
        megabatch = max(min(rows // (self.batch_size * 4), 50), 1) * self.batch_size
        order = torch.randperm(rows, generator=self.generator).numpy()
        for start in range(0, rows, megabatch):
            part = order[start : start + megabatch]
            # Stable, as Python's sorted(reverse=True) is: equal lengths keep the drawn order.
            order[start : start + megabatch] = part[np.argsort(-lengths[part], kind="stable")]
        if rows:
            longest = int(np.argmax(lengths[order[::megabatch]])) * megabatch
            order[[0, longest]] = order[[longest, 0]]
        return (int(row) for row in order)


class LengthGroupedTrainer(Trainer):
    """Hands the known token lengths to the length-grouped sampler instead of measuring every row,
    and makes the data order and dropout stream independent of when the run evaluates and saves
    (exact mid-epoch resume)."""

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        # Evaluation's DataLoader draws a seed from the global RNG. The Trainer saves the RNG state
        # after evaluating, so a checkpoint evaluated where the uninterrupted run did not (a stop,
        # a preemption) would resume with another dropout stream. Evaluation leaves it untouched.
        cpu_state = torch.get_rng_state()
        cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        kwargs.setdefault("metric_key_prefix", VAL_PREFIX)
        try:
            return super().evaluate(*args, **kwargs)
        finally:
            torch.set_rng_state(cpu_state)
            if cuda_states is not None:
                torch.cuda.set_rng_state_all(cuda_states)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.epoch_sampler: EpochSeededLengthGroupedSampler | None = None
        self.add_callback(SamplerEpoch(self))

    def _get_train_sampler(self, train_dataset: Any = None) -> Any:
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        if self.args.train_sampling_strategy == "group_by_length" and isinstance(
            dataset, TokenizedSplit
        ):
            self.epoch_sampler = EpochSeededLengthGroupedSampler(
                self.args.train_batch_size * self.args.gradient_accumulation_steps,
                dataset=dataset,
                lengths=dataset.lengths,
                seed=self.args.data_seed if self.args.data_seed is not None else self.args.seed,
            )
            return self.epoch_sampler
        return super()._get_train_sampler(train_dataset)


class SamplerEpoch(TrainerCallback):
    """Seeds the sampler's order with the epoch at each epoch's start.

    The Trainer's own `set_epoch` does not reach the sampler in a resumed epoch: accelerate's
    `skip_first_batches` wraps the batch sampler once more, and the forwarding stops one level
    short, so the resumed epoch would be drawn in epoch 0's order (measured: losses 5-50 % off
    from the step after the resume).
    """

    def __init__(self, trainer: LengthGroupedTrainer) -> None:
        self.trainer = trainer

    def on_epoch_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.trainer.epoch_sampler is not None:
            # A resumed run starts inside an epoch (state.epoch 1.25: epoch index 1).
            self.trainer.epoch_sampler.set_epoch(math.floor((state.epoch or 0.0) + 1e-9))


class ProgressLog(TrainerCallback):
    """One line every N steps on rank 0: step, epoch, loss, learning rate, sentences per second
    (evaluation and checkpoint time left out of the rate)."""

    def __init__(self, global_batch_size: int) -> None:
        self.meter = ThroughputMeter(global_batch_size)

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.meter.step()

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.meter.window()  # the evaluation's time is not training time

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        if not state.is_world_process_zero or not logs:
            return
        if "loss" in logs:
            rate = self.meter.window()
            # Kept in the Trainer's state (saved with each checkpoint) for summary.json.
            state.log_history[-1][RATE_KEY] = rate.items_per_s
            log.info(
                "step %d/%d  epoch %.2f  loss %.4f  lr %.2e  %.1f sentences/s  %s",
                state.global_step,
                state.max_steps,
                state.epoch or 0.0,
                logs["loss"],
                logs.get("learning_rate", float("nan")),
                rate.items_per_s,
                eta(state.max_steps - state.global_step, rate.seconds_per_step),
            )
        elif "val_loss" in logs:
            log.info(
                "epoch %.2f  val loss %.4f  val accuracy %.4f  val F1 %.4f",
                state.epoch or 0.0,
                logs["val_loss"],
                logs.get("val_accuracy", float("nan")),
                logs.get("val_f1", float("nan")),
            )


class TrackerLog(TrainerCallback):
    """Every logged value to MLflow with the Trainer's global step, from rank 0 (the sink of other
    ranks logs nothing), under the names the other pipelines use (docs/vocabulary.md)."""

    NAMES: ClassVar[dict[str, str]] = {
        "loss": "train_loss_interval",
        "learning_rate": "lr",
        "grad_norm": "grad_norm",
        "val_loss": "val_loss",
        "val_accuracy": "val_accuracy",
        "val_f1": "val_f1",
        "val_runtime": "val_s",
    }

    def __init__(self, sink: MetricSink) -> None:
        self.sink = sink

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        if not state.is_world_process_zero or not logs:
            return
        named = {new: logs[old] for old, new in self.NAMES.items() if old in logs}
        if named:
            self.sink.log({**named, "epoch": state.epoch or 0.0}, state.global_step)
        if SCORE in logs:  # an evaluation: in the store before its checkpoint is reported
            self.sink.flush()


class FaultTolerance(TrainerCallback):
    """What the Trainer does not do by itself for a run on a cluster, with the same policies as the
    other pipelines' loops (raytrain_common.loop):

    - at the steps `CheckpointPolicy` names (every `--checkpoint-every-steps`, a new preemption
      notice, `--stop-at-step`), has the Trainer evaluate and save at once (evaluated, so Ray
      ranks the checkpoint by its real score), and stops at `--stop-at-step`; epoch ends and the
      run's end are the Trainer's own saves;
    - notes the last step reached (progress.json) so a restart can count the steps it redoes;
    - records the seconds from `train` to the first optimiser step (start-up);
    - writes the run's record (the dtype the forward pass computes in, preemptions, restarts,
      start-up) and then a manifest of the checkpoint's files into each checkpoint, before Ray's
      callback uploads it: a checkpoint cut off later is found and never loaded;
    - keeps a stop mid-epoch from being evaluated and saved twice: the Trainer ends a stopped
      epoch as a finished one, with its own evaluation and save of the step just saved.
    """

    def __init__(
        self,
        config: TrainConfig,
        progress: ProgressNotes,
        record: dict[str, Any],
        launched_at: float,
    ) -> None:
        self.config, self.progress, self.launched_at = config, progress, launched_at
        self.faults = FaultLog(**record.get("faults", {}))
        self.startup_s: float | None = record.get("startup_s")
        self.dtype: str | None = None
        self.checkpoints: CheckpointPolicy | None = None
        self.saved_step: int | None = None

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        self.checkpoints = CheckpointPolicy(
            every_steps=self.config.checkpoint_every_steps,
            last_step=state.max_steps,
            stop_at_step=self.config.stop_at_step,
            preemption_check_steps=self.config.preemption_check_steps,
        )
        if model is not None:
            model.register_forward_hook(self.record_dtype)

    def record_dtype(self, module: torch.nn.Module, inputs: Any, output: Any) -> None:
        logits = getattr(output, "logits", None)
        if logits is not None:
            self.dtype = str(logits.dtype).removeprefix("torch.")

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        assert self.checkpoints is not None  # set when training begins
        step = state.global_step
        if self.startup_s is None:
            self.startup_s = startup_seconds(self.launched_at, args.process_index)
        # A barrier: the Trainer ends steps in lockstep on every rank, so all ranks ask alike.
        due = self.checkpoints.due(step, self.faults)
        epoch_end = abs((state.epoch or 0.0) - round(state.epoch or 0.0)) < 1e-6
        if due.reasons - {END} and not epoch_end:  # the Trainer saves epoch ends itself
            control.should_evaluate = control.should_save = True
        if step == self.config.stop_at_step:
            control.should_training_stop = True
        self.progress.note(step, self.faults, checkpointing=bool(due))
        return control

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        if state.global_step == self.saved_step:  # stopped right after a checkpoint
            control.should_evaluate = control.should_save = False
        return control

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.saved_step = state.global_step
        peak_rss_mb = workers_peak_rss_mb()  # on every rank: a collective
        if state.is_world_process_zero:
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            record = {
                "worker_peak_rss_mb": peak_rss_mb,
                "compute_dtype": self.dtype,
                "faults": dataclasses.asdict(self.faults),
                "startup_s": self.startup_s,
            }
            (folder / RECORD_FILE).write_text(json.dumps(record))
            write_manifest(folder)


class NonFiniteLossGuard(TrainerCallback):
    """Stops the run at the first NaN/inf logged loss, naming the step, instead of training on garbage."""

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
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


def eval_batch_per_worker(rows: int, workers: int, most: int) -> int:
    """Each worker's evaluation batch: at most `most` rows, and as few filler rows as the split
    allows. Accelerate fills every worker's last evaluation batch to full size with rows from the
    split's start (and leaves them out of the scores), so a split smaller than workers × batch was
    evaluated many times over: 64 rows on 2 workers at 128 a batch made 256 rows of work, 4×. The
    same number of batches, evened out, makes 64 (2,370 rows: 2,380 instead of 2,560)."""
    batches = max(1, math.ceil(rows / (workers * most)))
    return max(1, math.ceil(rows / (workers * batches)))


def training_arguments(
    config: TrainConfig, output_dir: str, workers: int, val_rows: int
) -> TrainingArguments:
    # Evaluate, then save, at every epoch end (and at the steps FaultTolerance asks for): each
    # checkpoint Ray receives carries its own validation score, which Ray keeps the best ones by.
    return TrainingArguments(
        output_dir=output_dir,
        num_train_epochs=config.epochs,
        per_device_train_batch_size=per_worker_batch_size(
            config.global_batch_size, workers, config.grad_accum_steps
        ),
        per_device_eval_batch_size=eval_batch_per_worker(val_rows, workers, config.eval_batch_size),
        gradient_accumulation_steps=config.grad_accum_steps,
        learning_rate=config.lr,
        weight_decay=config.weight_decay,
        warmup_steps=config.warmup_fraction,  # a float below 1 is a share of all steps
        lr_scheduler_type=config.lr_schedule,
        max_grad_norm=config.grad_clip_norm,
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


def restore_record(
    checkpoint: Checkpoint | None, config: TrainConfig, run_dir: StoragePath, driver_id: str
) -> dict[str, Any] | None:
    """The run record (faults, start-up) of the checkpoint being resumed, with this restart noted
    and its cause; None when the run is already at its --stop-at-step (nothing to train)."""
    world = ray.train.get_context().get_world_size()
    if checkpoint is None:
        faults = FaultLog()
        if read_progress(run_dir) is not None:  # lost before its first checkpoint: starts over
            faults.record_restart(0, run_dir, driver_id, None, world)
        return {"faults": dataclasses.asdict(faults)}
    state = read_trainer_state(checkpoint)
    if config.stop_at_step is not None and state["global_step"] >= config.stop_at_step:
        return None
    record = {"faults": state["faults"], "startup_s": state["startup_s"]}
    if state["epoch"] < config.epochs:
        faults = FaultLog(**state["faults"])
        restart = faults.record_restart(
            state["global_step"], run_dir, driver_id, checkpoint.path, world
        )
        record["faults"] = dataclasses.asdict(faults)
        if restart["cause"] == "rerun":  # this command's own start-up is measured anew
            record["startup_s"] = None
    return record


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """Runs on every worker: the datasets, the model and a Hugging Face Trainer whose callbacks
    carry the policies (checkpoints, progress, throughput) and report to Ray; then train, resuming
    from the run's newest complete checkpoint if it has one."""
    config = TrainConfig(**loop_config["config"])
    quiet_ray_output(config.verbose)
    info = DatasetInfo(**loop_config["dataset"])
    data_dir = resolve_storage(config.resolved_data_dir())
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()

    train_set = TokenizedSplit.open(data_dir, "train", info.max_length, config.limit_train_rows)
    val_set = TokenizedSplit.open(data_dir, "validation", info.max_length, config.limit_val_rows)
    transformers.utils.logging.disable_progress_bar()  # bars from every worker garble the log
    transformers.utils.logging.set_verbosity_error()  # e.g. the load report naming the new head
    tokenizer = AutoTokenizer.from_pretrained(info.tokenizer)
    transformers.set_seed(config.seed)  # the new head's init: the same run gives the same weights
    model = build_model(loop_config["model"], info.labels)

    run_dir = resolve_storage(config.storage_path).join(config.run_name)
    driver_id: str = loop_config["driver_id"]
    checkpoint = resume_checkpoint(run_dir, inside=HF_CHECKPOINT)
    record = restore_record(checkpoint, config, run_dir, driver_id)
    if record is None:
        return  # already stopped there: a rerun with the same --stop-at-step does nothing
    progress = ProgressNotes(run_dir, driver_id, world, config.log_every_steps, rank)
    sink = rank_zero_sink(loop_config, rank)
    # The Trainer writes each checkpoint here before Ray copies it to storage.
    with scratch_folder("hf-finetune") as output_dir, closing(sink):
        trainer = LengthGroupedTrainer(
            model=model,
            args=training_arguments(config, output_dir, world, len(val_set)),
            train_dataset=train_set,
            eval_dataset=val_set,
            processing_class=tokenizer,  # saved in every checkpoint, so each one predicts on its own
            data_collator=DataCollatorWithPadding(
                tokenizer, pad_to_multiple_of=8 if config.use_gpu else None
            ),
            compute_metrics=make_compute_metrics(info.num_labels),
            callbacks=[
                # Before Ray's callback, which uploads the checkpoint this one completes.
                FaultTolerance(config, progress, record, loop_config["launched_at"]),
                RayTrainReportCallback(),
                NonFiniteLossGuard(),
                ProgressLog(config.global_batch_size),
                TrackerLog(sink),
            ],
        )
        trainer.remove_callback(PrinterCallback)  # ProgressLog prints instead of raw dicts
        trainer = prepare_trainer(trainer)
        if checkpoint is None:
            trainer.train()
            return
        with checkpoint.as_directory() as folder:
            if rank == 0:
                log.info("resuming from %s", checkpoint.path)
            trainer.train(resume_from_checkpoint=str(Path(folder) / HF_CHECKPOINT))


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


def run(config: TrainConfig, callbacks: Sequence[UserCallback] = ()) -> dict[str, Any]:
    """Check everything that can be checked, train, then write metrics, curves and summary.json.

    `callbacks` join the run's (a sweep passes Tune's, which forwards every report to Tune).
    """
    started, launched_at = time.perf_counter(), time.time()
    storage, data_dir = locate_run(config)
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

    warm_tracking_store(config, storage)  # overlaps Ray's start
    start_ray_for_run(config, storage, data_dir)
    tracked = open_for_config(config, storage, pipeline="hf_finetune", version=__version__)

    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "config": dataclasses.asdict(config),
            "dataset": dataclasses.asdict(info),
            "model": model,
            "driver_id": uuid.uuid4().hex,  # tells a worker restart from a rerun of the command
            "launched_at": launched_at,
            "tracked": dataclasses.asdict(tracked) if tracked else None,
        },
        scaling_config=build_scaling_config(config),
        run_config=build_run_config(
            config, score_attribute=SCORE, score_order="max", callbacks=callbacks
        ),
        torch_config=build_torch_config(config),
    )
    log.info(
        "fine-tuning %s on %d rows, %d worker(s), %d epoch(s); run folder %s",
        display_name(model),
        train_rows,
        config.num_workers,
        config.epochs,
        storage.join(config.run_name),
    )
    run_dir = storage.join(config.run_name)
    with failed_on_error(tracked):
        result = fit(trainer, config.storage_path)
        summary = write_run_outputs(run_dir, result, config, info, started)
    finish_for_summary(tracked, run_dir, summary)
    return summary


def epoch_history(
    trainer_state: dict[str, Any],
) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """One row per evaluation (each epoch's end, or every N steps), with the mean training loss
    logged since the evaluation before it, and the interval loss log."""
    step_log = [
        {"epoch": row["epoch"], "step": row["step"], "train_loss_interval": row["loss"]}
        for row in trainer_state["log_history"]
        if "loss" in row
    ]
    history: list[dict[str, float]] = []
    for row in trainer_state["log_history"]:
        if "val_loss" not in row:
            continue
        since = history[-1]["step"] if history else 0
        losses = [r["train_loss_interval"] for r in step_log if since < r["step"] <= row["step"]]
        epoch = row["epoch"]
        history.append(
            {
                "epoch": round(epoch) if abs(epoch - round(epoch)) < 1e-6 else round(epoch, 4),
                "step": row["step"],
                "train_loss": float(np.mean(losses)) if losses else float("nan"),
                "val_loss": row["val_loss"],
                "val_accuracy": row["val_accuracy"],
                "val_f1": row["val_f1"],
                "val_s": row["val_runtime"],
            }
        )
    return history, step_log


def steady_rate(trainer_state: dict[str, Any]) -> float | None:
    """Training sentences/s over the progress windows after the first (start-up and warm-up left
    out; evaluations and checkpoints lie outside every window). The windows hold equal step
    counts, so sentences over seconds is their rates' harmonic mean: a median would swing with
    where a window falls in the length-sorted mega-batches (long rows first)."""
    rates = [row[RATE_KEY] for row in trainer_state["log_history"] if RATE_KEY in row][1:]
    return len(rates) / sum(1 / rate for rate in rates) if rates and min(rates) > 0 else None


def read_trainer_state(checkpoint: Checkpoint) -> dict[str, Any]:
    """The Trainer's state of a checkpoint, with the run's record: compute dtype and faults."""
    with checkpoint.as_directory() as folder:
        hf_folder = Path(folder) / HF_CHECKPOINT
        state = json.loads((hf_folder / "trainer_state.json").read_text())
        record_file = hf_folder / RECORD_FILE
        record = json.loads(record_file.read_text()) if record_file.exists() else {}
        state["compute_dtype"] = record.get("compute_dtype")
        state["faults"] = record.get("faults", {})
        state["startup_s"] = record.get("startup_s")
        state["worker_peak_rss_mb"] = record.get("worker_peak_rss_mb")
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
    best = best_complete_checkpoint(result, SCORE, "max", inside=HF_CHECKPOINT)
    write_metrics_csv(run_dir.join(METRICS_FILE), history)
    plot_curves(
        run_dir.join(CURVES_FILE),
        sorted(step_log + history, key=lambda row: row["epoch"]),
        [("loss", ["train_loss_interval", "val_loss"]), ("score", ["val_accuracy", "val_f1"])],
        title=f"{config.run_name}: {display_name(config.model or '')} on {info.source}",
        log_y=["loss"],
    )
    best_row = max(history, key=lambda row: row[SCORE])
    summary = {
        **summary_header("hf_finetune", __version__, config.run_name, run_dir),
        "steps_done": state["global_step"],
        "epochs_done": round(state["epoch"], 4),
        "startup_s": state["startup_s"],
        **FaultLog(**state["faults"]).summary(),
        "compute_dtype": state["compute_dtype"],
        "worker_peak_rss_mb": state["worker_peak_rss_mb"],
        "sentences_per_s": steady_rate(state),
        "labels": info.labels,
        "val_majority_share": majority_share(
            resolve_storage(config.resolved_data_dir()), "validation"
        ),
        "final": history[-1],
        "best": best_row,
        "best_checkpoint": run_dir.uri_for(posixpath.join(best.path, HF_CHECKPOINT))
        if best
        else None,
        "latest_checkpoint": run_dir.uri_for(posixpath.join(result.checkpoint.path, HF_CHECKPOINT)),
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
    labels = read_labels(data_dir, split)
    return float(np.bincount(labels).max() / len(labels))
