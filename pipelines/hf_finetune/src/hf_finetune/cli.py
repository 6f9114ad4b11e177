"""`hf-finetune prepare | train | evaluate | predict`: the commands a user runs, each with
--help."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

from hf_finetune import __version__
from hf_finetune.config import (
    PRESETS,
    SWEEP_PRESETS,
    EvaluateConfig,
    ExportConfig,
    PredictConfig,
    PrepareConfig,
    SweepConfig,
    TrainConfig,
)
from hf_finetune.model import ModelError
from raytrain_common.cli import command_parser, config_from_args, run_commands, user_errors
from raytrain_common.labelled.prepare import DataError
from raytrain_common.loop import process_started_at
from raytrain_common.metrics import SUMMARY_FILE
from raytrain_common.ray_start import show_ray_output
from raytrain_common.storage import resolve_storage
from raytrain_common.sweep import SWEEP_HELP
from raytrain_common.text import check_encoding, read_lines

# Errors of the user's input (the library's and these): one line, exit status 2, no traceback.
USER_ERRORS = user_errors(DataError, ModelError)


def build_parser() -> argparse.ArgumentParser:
    return command_parser(
        "hf-finetune",
        "Fine-tune a Hugging Face text classifier with Ray Train (checkpointed, resumable).",
        {
            "prepare": ("labelled text → split, pre-tokenised Parquet", PrepareConfig),
            "train": (
                "fine-tune with Ray Train; rerun with the same --run-name to continue",
                TrainConfig,
                PRESETS,
            ),
            "sweep": (SWEEP_HELP, SweepConfig, SWEEP_PRESETS),
            "evaluate": (
                "test accuracy, macro F1, confusion matrix of a checkpoint (train scores its "
                "best once)",
                EvaluateConfig,
            ),
            "predict": ("classify sentences from a file or standard input", PredictConfig),
            "export": (
                "a checkpoint → one Hugging Face folder (ZeRO shards gathered, LoRA merged)",
                ExportConfig,
            ),
        },
    )


def main(argv: list[str] | None = None) -> int:
    """`hf-finetune COMMAND ...`: bad input ends in one line (exit 2), Ctrl-C or SIGTERM in one line
    naming the checkpoint a rerun continues from (raytrain_common.cli.run_commands)."""
    return run_commands("hf-finetune", build_parser(), COMMANDS, USER_ERRORS, argv)


def cmd_prepare(args: argparse.Namespace) -> int:
    from hf_finetune.data import prepare
    from hf_finetune.model import resolve_model

    config = config_from_args(args, PrepareConfig)
    show_ray_output(config.verbose)
    config = dataclasses.replace(config, encoding=check_encoding(config.encoding))
    model = resolve_model(config.model)
    data_dir = resolve_storage(config.resolved_data_dir())
    with tempfile.TemporaryDirectory(prefix="hf-finetune-download-") as download_root:
        info = prepare(config, data_dir, model, Path(download_root), force=config.force)
    rows = ", ".join(f"{count} {split}" for split, count in info.rows.items())
    print(
        f"dataset: {rows} rows, labels {info.labels}, from {info.source}\n"
        f"tokenised for {info.tokenizer} (max {info.max_length} tokens)\nwritten to {data_dir.uri}"
    )
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from hf_finetune.train import run

    summary = run(config_from_args(args, TrainConfig, PRESETS), started_at=process_started_at())
    best, test = summary["best"], summary["test"]
    lines = [
        f"best validation F1 {best['val_f1']:.4f} (accuracy {best['val_accuracy']:.4f}) at epoch "
        f"{int(best['epoch'])} of {summary['epochs_done']}; majority class: "
        f"{summary['val_majority_share']:.4f}",
        f"test accuracy {test['test_accuracy']:.4f}, macro F1 {test['test_f1']:.4f} on "
        f"{test['test_rows']} rows (that checkpoint, evaluated once)"
        if test
        else "no complete checkpoint to test: see the warnings above",
        f"metrics: {summary['metrics_csv']}",
        f"curves: {summary['curves_png']}",
        f"best checkpoint: {summary['best_checkpoint']}",
        f"summary: {resolve_storage(summary['run_dir']).join(SUMMARY_FILE).uri}",
    ]
    print("\n".join(lines))
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from hf_finetune.train import SCORE, run
    from raytrain_common.sweep import Objective, sweep_command

    config = config_from_args(args, SweepConfig, SWEEP_PRESETS)
    return sweep_command(
        config,
        args.preset,
        program="hf-finetune",
        version=__version__,
        train_class=TrainConfig,
        presets=PRESETS,
        train=run,
        objective=Objective(SCORE, "max", time_attr="epoch", max_t=config.epochs),
        full_run_fields=("limit_train_rows", "limit_val_rows", "limit_test_rows", "epochs"),
    )


def cmd_evaluate(args: argparse.Namespace) -> int:
    from hf_finetune.evaluate import evaluate

    config = config_from_args(args, EvaluateConfig)
    result = evaluate(config.storage_path, config.run_name, config.checkpoint)
    print(
        f"test accuracy {result['test_accuracy']:.4f}, macro F1 {result['test_f1']:.4f} on "
        f"{result['test_rows']} rows (majority class {result['test_majority_share']:.4f})\n"
        f"confusion matrix: {result['confusion_png']}\nchecked checkpoint: {result['checkpoint']}"
    )
    return 0


def cmd_predict(args: argparse.Namespace) -> int:
    from hf_finetune.predict import predict_files, predict_lines

    config = config_from_args(args, PredictConfig)
    if config.input != "-" and not Path(config.input).expanduser().is_file():
        run_dir = resolve_storage(config.storage_path).join(config.run_name)
        output = config.predictions or run_dir.join(time.strftime("predictions-%Y%m%d-%H%M%S")).uri
        done = predict_files(config, output)
        print(
            f"{done['sentences']} sentences of {done['files']} files classified in "
            f"{done['seconds']:.1f} s, {done['sentences_per_s']:.0f} sentences/s\n"
            f"predictions: {done['output']}"
        )
        return 0
    lines: Iterable[str] = (
        sys.stdin if config.input == "-" else read_lines(config.input, config.encoding)
    )
    for label, probability, sentence in predict_lines(
        lines, config.storage_path, config.run_name, config.checkpoint, config.inference_batch_size
    ):
        print(f"{label}\t{probability:.4f}\t{sentence}", flush=True)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from hf_finetune.config import TRAIN_COMMAND
    from hf_finetune.export import export
    from raytrain_common.runs import chosen_checkpoint

    config = config_from_args(args, ExportConfig)
    run_dir = resolve_storage(config.storage_path).join(config.run_name)
    checkpoint = chosen_checkpoint(run_dir, config.checkpoint or "best", TRAIN_COMMAND)
    output = export(checkpoint, config.output or run_dir.join("export").uri, config.adapter_only)
    print(f"exported {checkpoint}\nto {output}")
    return 0


COMMANDS = {
    "prepare": cmd_prepare,
    "train": cmd_train,
    "sweep": cmd_sweep,
    "evaluate": cmd_evaluate,
    "predict": cmd_predict,
    "export": cmd_export,
}
