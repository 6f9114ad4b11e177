"""Fine-tune a sequence classifier: Hugging Face `Trainer` in every Ray Train worker.

Read top to bottom: the Trainer's arguments, the per-worker loop, then the driver that checks the
inputs, launches `TorchTrainer` and writes the run's outputs. Ray's calls are in the loop:
`prepare_trainer`, `RayTrainReportCallback` (every checkpoint the Trainer saves is reported, from
every rank), and `ray.train.get_checkpoint()` where a run resumes. Ray Train starts the process
group; the Trainer sees it and wraps the model in DDP itself, or, with --deepspeed, in a DeepSpeed
ZeRO engine (the config from raytrain_common.zero, filled by the Trainer and written beside the
run). --lora-rank trains LoRA adapters (raytrain_common.lora) under either.

The loop's components: `checkpointer.py` (the checkpoints the Trainer does not make, the run's
record in `run_state.py`), `validator.py`, `metrics_logger.py`, `summary.py`; their Trainer
callbacks only hand them the Trainer's events. The datasets are `raytrain_common.labelled`'s.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray.train
import transformers
from ray.train import UserCallback
from ray.train.huggingface.transformers import RayTrainReportCallback, prepare_trainer
from ray.train.torch import TorchTrainer
from transformers import (
    AutoTokenizer,
    DataCollatorWithPadding,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    TrainingArguments,
)
from transformers.trainer_callback import PrinterCallback

from hf_finetune.checkpointer import (
    HF_CHECKPOINT,
    Checkpointer,
    CheckpointerCallback,
    DeepSpeedConfigCallback,
    engine_of,
)
from hf_finetune.config import PREPARE_COMMAND, TrainConfig
from hf_finetune.metrics_logger import LoggerCallback, MetricsLogger
from hf_finetune.model import display_name, resolve_model
from hf_finetune.run_state import RunState, WorkerContext
from hf_finetune.summary import write_run_outputs
from hf_finetune.task import build_model, make_compute_metrics
from hf_finetune.validator import SCORE, ValidatingTrainer, eval_batch_per_worker
from raytrain_common.checkpoint import (
    newest_complete_checkpoint,
    resume_checkpoint,
    scratch_folder,
)
from raytrain_common.configs import (
    ConfigError,
    build_run_config,
    build_scaling_config,
    build_torch_config,
    per_worker_batch_size,
)
from raytrain_common.labelled.prepare import (
    DataError,
    DatasetInfo,
    inspect_dataset,
    tokenizer_fingerprint,
)
from raytrain_common.labelled.tokenized import TokenizedSplit
from raytrain_common.loop import StartupClock
from raytrain_common.ray_start import quiet_ray_output
from raytrain_common.runs import locate_run, start_run
from raytrain_common.storage import StoragePath, resolve_storage
from raytrain_common.zero import (
    check_resume,
    check_zero_pickles,
    join_ray_world,
    name_cpu_accelerator,
    trainer_arguments,
)

log = logging.getLogger("hf_finetune")

__all__ = ["SCORE", "run", "train_loop_per_worker"]


# ---------------------------------------------------------------------------------------------
# The Trainer's arguments
# ---------------------------------------------------------------------------------------------


def training_arguments(
    config: TrainConfig, output_dir: str, workers: int, val_rows: int
) -> TrainingArguments:
    # Evaluate, then save, at every epoch end (and at the steps the Checkpointer asks for): each
    # checkpoint Ray receives carries its own validation score, which Ray keeps the best ones by.
    return TrainingArguments(
        **trainer_arguments(config, config.use_gpu),  # DeepSpeed's, when --deepspeed: none for DDP
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
        **({} if config.deepspeed != "none" else {"use_cpu": not config.use_gpu}),
        ddp_find_unused_parameters=False,
        # Sequence classifiers take **kwargs but average their loss themselves; token averaging
        # across devices would scale that mean by the world size (logged losses ×N, clipping off).
        average_tokens_across_devices=False,
        dataloader_pin_memory=config.use_gpu,
        # The training split draws each epoch's order itself (TokenizedSplit): read it in order.
        train_sampling_strategy="sequential",
        seed=config.seed,
        report_to="none",
        disable_tqdm=True,
    )


def open_splits(
    config: TrainConfig, info: DatasetInfo, world: int
) -> tuple[TokenizedSplit, TokenizedSplit]:
    """The training split, in a fresh permutation every epoch drawn from (seed, epoch) (the same
    when a resumed epoch is read again), length-grouped per worker's batch; the validation split."""
    data_dir = resolve_storage(config.resolved_data_dir())
    group = config.global_batch_size // world if config.group_by_length else 0
    train_set = TokenizedSplit.open(data_dir, "train", info.max_length, config.limit_train_rows)
    val_set = TokenizedSplit.open(data_dir, "validation", info.max_length, config.limit_val_rows)
    return train_set.shuffled(config.seed, group_batch=group), val_set


def load_model(
    config: TrainConfig, info: DatasetInfo, model: str
) -> tuple[PreTrainedTokenizerBase, PreTrainedModel]:
    """The data's tokenizer (saved in every checkpoint) and the classifier, its new head seeded."""
    transformers.utils.logging.disable_progress_bar()  # bars from every worker garble the log
    transformers.utils.logging.set_verbosity_error()  # e.g. the load report naming the new head
    tokenizer = AutoTokenizer.from_pretrained(info.tokenizer)
    transformers.set_seed(config.seed)  # the new head's init: the same run gives the same weights
    return tokenizer, build_model(model, info.labels, config)


# ---------------------------------------------------------------------------------------------
# The per-worker loop
# ---------------------------------------------------------------------------------------------


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """Runs on every worker: the datasets, the model and a Hugging Face Trainer whose callbacks
    hand its events to the components; then train, resuming from the run's newest complete
    checkpoint if it has one."""
    context = WorkerContext.parse(loop_config)  # the typed config and dataset, the model
    config, info, world = context.config, context.info, context.world
    quiet_ray_output(config.verbose)
    name_cpu_accelerator()  # transformers and PEFT import DeepSpeed where it is installed
    if config.deepspeed != "none":
        join_ray_world(
            config.use_gpu, config.verbose
        )  # the Trainer must count Ray Train's workers, as DeepSpeed
    clock = StartupClock(loop_config["startup"])  # the driver's phases; rank 0 adds the rest
    clock.mark("worker_group")
    train_set, val_set = open_splits(config, info, world)
    tokenizer, model = load_model(config, info, context.model)
    clock.mark("model_build")

    # The Trainer holds the steps, weights, optimiser, schedule and data order, and restores them
    # itself (`resume_from_checkpoint`); the Checkpointer restores the run's record beside them.
    run = RunState()
    checkpoint = resume_checkpoint(
        ray.train.get_checkpoint(), context.run_dir, inside=HF_CHECKPOINT
    )
    checkpointer = Checkpointer(context, run, clock)
    if not checkpointer.restore(checkpoint):
        return  # already stopped there: a rerun with the same --stop-at-step does nothing
    logger = MetricsLogger(context)
    # The Trainer writes each checkpoint here before Ray copies it to storage.
    with scratch_folder("hf-finetune") as output_dir:
        trainer = ValidatingTrainer(
            model=model,
            args=training_arguments(config, output_dir, world, len(val_set)),
            train_dataset=train_set,
            eval_dataset=val_set,
            processing_class=tokenizer,  # in every checkpoint, so each one predicts on its own
            data_collator=DataCollatorWithPadding(
                tokenizer, pad_to_multiple_of=8 if config.use_gpu else None
            ),
            compute_metrics=make_compute_metrics(info.num_labels),
            callbacks=[
                CheckpointerCallback(checkpointer),  # completes the checkpoint Ray's one reports
                RayTrainReportCallback(),
                DeepSpeedConfigCallback(context.run_dir, context.rank),
                LoggerCallback(logger),
            ],
        )
        trainer.remove_callback(PrinterCallback)  # the MetricsLogger prints instead of raw dicts
        trainer = prepare_trainer(trainer)
        try:
            if checkpoint is None:
                trainer.train()
            else:
                with checkpoint.as_directory() as folder:
                    resume_from = Path(folder) / HF_CHECKPOINT
                    if config.deepspeed != "none":  # DeepSpeed unpickles its shards unrestricted
                        check_zero_pickles(resume_from, context.rank)
                    trainer.train(resume_from_checkpoint=str(resume_from))
        finally:
            logger.close()


# ---------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------


def check_model_fits_data(model: str, info: DatasetInfo) -> None:
    """The data's token ids mean something only to the tokenizer that made them."""
    if model != info.tokenizer and tokenizer_fingerprint(model) != info.tokenizer_sha256:
        raise ConfigError(
            f"the data was tokenised for {info.tokenizer!r}, whose tokenizer differs from "
            f"{model!r}'s: rerun `hf-finetune prepare --model {model} --force`, or drop --model"
        )


def check_resumable(config: TrainConfig, storage: StoragePath) -> None:
    """A rerun of a run with checkpoints resumes from its newest: refused now when its ZeRO shards
    cannot be read by this run (another stage or worker count, another DeepSpeed version)."""
    checkpoint = newest_complete_checkpoint(storage.join(config.run_name), HF_CHECKPOINT)
    if checkpoint is None:
        return
    export = f"hf-finetune export --checkpoint {checkpoint.path}/{HF_CHECKPOINT}"
    check_resume(engine_of(checkpoint), config, config.num_workers, checkpoint.path, export)


def check_run(config: TrainConfig) -> tuple[TrainConfig, DatasetInfo, StoragePath]:
    """Everything that can be checked before Ray starts: the options, the storage, the prepared
    data and the model that reads it. The config comes back with its paths and model resolved."""
    storage, data_dir = locate_run(config)
    info = inspect_dataset(data_dir, PREPARE_COMMAND)
    model = resolve_model(config.model or info.tokenizer)
    check_model_fits_data(model, info)
    check_resumable(config, storage)
    train_rows = min(info.rows["train"], config.limit_train_rows or info.rows["train"])
    if train_rows < config.global_batch_size:
        raise DataError(
            f"{train_rows} training rows make no full batch of {config.global_batch_size}: "
            "use more rows or a smaller --global-batch-size"
        )
    log.info(
        "fine-tuning %s on %d rows, %d worker(s), %d epoch(s); run folder %s",
        *(display_name(model), train_rows, config.num_workers, config.epochs),
        storage.join(config.run_name),
    )
    config = dataclasses.replace(
        config, storage_path=storage.uri, data_dir=data_dir.uri, model=model
    )
    return config, info, storage


def run(
    config: TrainConfig, callbacks: Sequence[UserCallback] = (), started_at: float | None = None
) -> dict[str, Any]:
    """Check everything that can be checked, train, then write metrics, curves and summary.json.

    `callbacks` join the run's (a sweep passes Tune's, which forwards every report to Tune);
    `started_at`: when the command started (time.time()), where its start-up is counted from.
    """
    clock = StartupClock(started_at)  # summary.json's startup_s, phase by phase
    config, info, storage = check_run(config)
    inputs = {"the data folder (--data-dir)": resolve_storage(config.resolved_data_dir())}
    started = start_run(config, storage, inputs, clock)
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=started.loop_config(config, dataset=info, model=config.model),
        scaling_config=build_scaling_config(config),
        run_config=build_run_config(
            config, score_attribute=SCORE, score_order="max", callbacks=callbacks
        ),
        torch_config=build_torch_config(config),
    )
    with started.failures_named(config.storage_path):
        result = trainer.fit()  # the workers train; it returns when the run has ended
        summary = write_run_outputs(started.run_dir, result, config, info, clock.began)
    return started.finish(summary)
