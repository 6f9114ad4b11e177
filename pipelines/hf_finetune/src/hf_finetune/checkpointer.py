"""When the run checkpoints, what a checkpoint holds beside the Trainer's files, and how a run
resumes from one.

The Trainer saves at every epoch's end itself (`save_strategy="epoch"`), and Ray's
`RayTrainReportCallback` reports each save from every rank (rank 0's folder holds the model,
optimiser and schedule, each rank adds its RNG state; Ray merges them). The Checkpointer adds what
a run on a cluster needs on top:

- the steps `CheckpointPolicy` names (every --checkpoint-every-steps, a new preemption notice,
  --stop-at-step) evaluate and save at once (evaluated, so Ray ranks the checkpoint by its real
  score), and --stop-at-step stops there; a stop mid-epoch is evaluated and saved once (the Trainer
  would end the stopped epoch with a second evaluation and save of the same step);
- progress.json notes the last step reached, so a restart can count the steps it redoes;
- each checkpoint gets the run's record (compute dtype, preemptions, restarts, start-up, peak
  memory) and then a manifest of its files, before Ray's callback uploads it: a checkpoint cut off
  later is found and never loaded.
"""

from __future__ import annotations

import json
import logging
import posixpath
from pathlib import Path
from typing import Any

import torch
from ray.train import Checkpoint
from ray.train.huggingface.transformers import RayTrainReportCallback
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from hf_finetune.run_state import RunState, WorkerContext
from raytrain_common.checkpoint import write_manifest
from raytrain_common.faults import read_progress
from raytrain_common.hardware import workers_peak_rss_mb
from raytrain_common.loop import END, CheckpointPolicy, ProgressNotes, StartupClock
from raytrain_common.storage import StoragePath
from raytrain_common.zero import CONFIG_FILE as DEEPSPEED_CONFIG
from raytrain_common.zero import engine_record

log = logging.getLogger("hf_finetune")

HF_CHECKPOINT = RayTrainReportCallback.CHECKPOINT_NAME  # the HF folder inside a Ray checkpoint
RECORD_FILE = "run_record.json"  # compute dtype and faults, beside the Trainer's files


class Checkpointer:
    """Decides the checkpoints the Trainer does not make by itself, writes the run's record into
    every checkpoint, and restores that record when the run resumes."""

    def __init__(self, context: WorkerContext, run: RunState, clock: StartupClock) -> None:
        self.config, self.run, self.clock = context.config, run, clock
        self.rank, self.world = context.rank, context.world
        self.run_dir, self.driver_id = context.run_dir, context.loop_config["driver_id"]
        self.progress = ProgressNotes(
            self.run_dir, self.driver_id, self.world, self.config.log_every_steps, self.rank
        )
        self.policy: CheckpointPolicy | None = None
        self.saved_step: int | None = None

    def restore(self, checkpoint: Checkpoint | None) -> bool:
        """Load the run's record of the checkpoint being resumed (the Trainer loads its own
        state) and note this restart with its cause; False when the run is already at its
        --stop-at-step (nothing to train)."""
        run = self.run
        if checkpoint is None:
            if read_progress(self.run_dir) is not None:  # lost before its first checkpoint
                run.faults.record_restart(0, self.run_dir, self.driver_id, None, self.world)
            return True
        state = read_run_record(checkpoint)
        step = state["global_step"]
        if self.config.stop_at_step is not None and step >= self.config.stop_at_step:
            return False
        run.load_state_dict(state)
        if state["epoch"] < self.config.epochs:
            restart = run.faults.record_restart(
                step, self.run_dir, self.driver_id, checkpoint.path, self.world
            )
            if restart["cause"] == "rerun":  # this command's own start-up is measured anew
                run.startup_s = run.startup_phases = None
        if self.rank == 0:
            log.info("resuming from %s", checkpoint.path)
        return True

    def train_begin(self, last_step: int, model: torch.nn.Module | None) -> None:
        self.policy = CheckpointPolicy(
            every_steps=self.config.checkpoint_every_steps,
            last_step=last_step,
            stop_at_step=self.config.stop_at_step,
            preemption_check_steps=self.config.preemption_check_steps,
            every_minutes=self.config.checkpoint_every_minutes,
        )
        if model is not None:
            model.register_forward_hook(self.record_dtype)
            self.run.parameters, self.run.trainable_parameters = parameter_counts(model)
        if self.config.deepspeed != "none":
            self.run.deepspeed = engine_record(self.config, self.world)

    def record_dtype(self, module: torch.nn.Module, inputs: Any, output: Any) -> None:
        logits = getattr(output, "logits", None)
        if logits is not None:
            self.run.compute_dtype = str(logits.dtype).removeprefix("torch.")

    def step_end(self, step: int, epoch_end: bool) -> tuple[bool, bool]:
        """After every step, on every rank (a collective when it asks Ray about a preemption):
        (evaluate and save now, stop after it)."""
        assert self.policy is not None, "train_begin comes first"
        run = self.run
        if run.startup_s is None:
            run.startup_s = self.clock.first_step(self.rank)
            run.startup_phases = self.clock.phases()
        due = self.policy.due(step, run.faults)
        self.progress.note(step, run.faults, checkpointing=bool(due))
        save_now = bool(due.reasons - {END}) and not epoch_end  # the Trainer saves epoch ends
        return save_now, step == self.config.stop_at_step

    def saves_again(self, step: int) -> bool:
        """The Trainer ends a stopped epoch as a finished one: not a second save of one step."""
        return step != self.saved_step

    def complete(self, folder: Path, step: int, model: torch.nn.Module | None) -> None:
        """The run's record, then the manifest, into the Trainer's checkpoint folder (rank 0's),
        before Ray's callback uploads it. A LoRA run's folder gets the classifier's config.json
        too (PEFT saves the adapters alone): its labels and head size, for loading it back."""
        self.saved_step = step
        peak_rss_mb = workers_peak_rss_mb()  # on every rank: a collective
        if self.rank != 0:
            return
        if model is not None and hasattr(model, "peft_config"):
            model.config.save_pretrained(folder)
        record = {"worker_peak_rss_mb": peak_rss_mb, **self.run.state_dict()}
        (folder / RECORD_FILE).write_text(json.dumps(record))
        write_manifest(folder)


class DeepSpeedConfigCallback(TrainerCallback):
    """Writes the DeepSpeed config as the Trainer filled it (every "auto" resolved) beside the
    run, from rank 0 as training begins: what ran, for the user to read (or pass to their own)."""

    def __init__(self, run_dir: StoragePath, rank: int) -> None:
        self.run_dir, self.rank = run_dir, rank

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        filled = getattr(args, "hf_deepspeed_config", None)
        if filled is not None and self.rank == 0:
            self.run_dir.join(DEEPSPEED_CONFIG).write_text(json.dumps(filled.config, indent=2))


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(all, training) parameters of the model as built, before ZeRO-3 partitions them (its
    shards count a rank's part; `ds_numel` is a partitioned parameter's whole size)."""
    sizes = [(getattr(p, "ds_numel", p.numel()), p.requires_grad) for p in model.parameters()]
    return sum(size for size, _ in sizes), sum(size for size, trains in sizes if trains)


def engine_of(checkpoint: Checkpoint) -> dict[str, Any] | None:
    """The DeepSpeed engine a checkpoint's record names (None: DDP), read from its one small file
    where it lies: the driver checks a resume without downloading the checkpoint's shards."""
    record = posixpath.join(checkpoint.path, HF_CHECKPOINT, RECORD_FILE)
    try:
        with checkpoint.filesystem.open_input_stream(record) as stream:
            engine: dict[str, Any] | None = json.loads(stream.read()).get("deepspeed")
    except FileNotFoundError:  # a checkpoint from before the record: DDP's
        return None
    return engine


def read_run_record(checkpoint: Checkpoint) -> dict[str, Any]:
    """The Trainer's state of a checkpoint, with the run's record: compute dtype and faults."""
    with checkpoint.as_directory() as folder:
        hf_folder = Path(folder) / HF_CHECKPOINT
        state = json.loads((hf_folder / "trainer_state.json").read_text())
        record_file = hf_folder / RECORD_FILE
        record = json.loads(record_file.read_text()) if record_file.exists() else {}
        state["compute_dtype"] = record.get("compute_dtype")
        state["faults"] = record.get("faults", {})
        state["startup_s"] = record.get("startup_s")
        state["startup_phases"] = record.get("startup_phases")
        state["worker_peak_rss_mb"] = record.get("worker_peak_rss_mb")
        for key in ("parameters", "trainable_parameters", "deepspeed"):
            state[key] = record.get(key)
        return state


class CheckpointerCallback(TrainerCallback):
    """The Trainer's events, handed to the Checkpointer. Listed before RayTrainReportCallback,
    which uploads the checkpoint this one completes."""

    def __init__(self, checkpointer: Checkpointer) -> None:
        self.checkpointer = checkpointer

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        self.checkpointer.train_begin(state.max_steps, model)

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        epoch = state.epoch or 0.0
        save_now, stop = self.checkpointer.step_end(
            state.global_step, epoch_end=abs(epoch - round(epoch)) < 1e-6
        )
        if save_now:
            control.should_evaluate = control.should_save = True
        if stop:
            control.should_training_stop = True
        return control

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        if not self.checkpointer.saves_again(state.global_step):
            control.should_evaluate = control.should_save = False
        return control

    def on_save(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        self.checkpointer.complete(folder, state.global_step, model)
