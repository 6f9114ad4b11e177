"""What the run reports, and when: a progress line every --log-every-steps on rank 0 (step, epoch,
loss, learning rate, sentences/s with evaluation and checkpoint time left out), every logged value
to MLflow under the names the other pipelines use (docs/vocabulary.md), and a stop at the first
non-finite loss. `MetricsLogger` owns the meter, the sink and the lines; `LoggerCallback` is the
Trainer's hook onto it."""

from __future__ import annotations

import logging
from typing import Any, ClassVar

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from hf_finetune.run_state import WorkerContext
from hf_finetune.validator import SCORE
from raytrain_common.loop import ThroughputMeter, require_finite
from raytrain_common.metrics import eta
from raytrain_common.tracking import rank_zero_sink

log = logging.getLogger("hf_finetune")

RATE_KEY = "train_sentences_per_s"  # a progress line's rate, in the Trainer's log history


class MetricsLogger:
    """The throughput meter, rank 0's lines and the MLflow sink of a fine-tuning run."""

    # The Trainer's log keys → the names every pipeline uses.
    NAMES: ClassVar[dict[str, str]] = {
        "loss": "train_loss_interval",
        "learning_rate": "lr",
        "grad_norm": "grad_norm",
        "val_loss": "val_loss",
        "val_accuracy": "val_accuracy",
        "val_f1": "val_f1",
        "val_runtime": "val_s",
    }

    def __init__(self, context: WorkerContext) -> None:
        self.rank = context.rank
        self.meter = ThroughputMeter(context.config.global_batch_size)
        self.sink = rank_zero_sink(context.loop_config, self.rank)

    def step_end(self) -> None:
        self.meter.step()

    def evaluated(self) -> None:
        self.meter.window()  # the evaluation's time is not training time

    def log(self, logs: dict[str, float], state: TrainerState) -> None:
        """A Trainer log entry: checked, printed (rank 0) and sent to MLflow (rank 0)."""
        if "loss" in logs:
            where = f"at step {state.global_step} (rank {self.rank})"
            require_finite(logs["loss"], where, "lower --lr, or drop --bf16")
        if not state.is_world_process_zero:
            return
        if "loss" in logs:
            rate = self.meter.window()
            # Kept in the Trainer's state (saved with each checkpoint) for summary.json.
            state.log_history[-1][RATE_KEY] = rate.items_per_s
            log.info(
                "step %d/%d  epoch %.2f  loss %.4f  lr %.2e  %.1f sentences/s  %s",
                *(state.global_step, state.max_steps, state.epoch or 0.0, logs["loss"]),
                *(logs.get("learning_rate", float("nan")), rate.items_per_s),
                eta(state.max_steps - state.global_step, rate.seconds_per_step),
            )
        elif "val_loss" in logs:
            log.info(
                "epoch %.2f  val loss %.4f  val accuracy %.4f  val F1 %.4f",
                *(state.epoch or 0.0, logs["val_loss"]),
                *(logs.get("val_accuracy", float("nan")), logs.get("val_f1", float("nan"))),
            )
        named = {new: logs[old] for old, new in self.NAMES.items() if old in logs}
        if named:
            self.sink.log({**named, "epoch": state.epoch or 0.0}, state.global_step)
        if SCORE in logs:  # an evaluation: in the store before its checkpoint is reported
            self.sink.flush()

    def close(self) -> None:
        self.sink.close()


class LoggerCallback(TrainerCallback):
    """The Trainer's events, handed to the MetricsLogger."""

    def __init__(self, logger: MetricsLogger) -> None:
        self.logger = logger

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.logger.step_end()

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.logger.evaluated()

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        if logs:
            self.logger.log(logs, state)
