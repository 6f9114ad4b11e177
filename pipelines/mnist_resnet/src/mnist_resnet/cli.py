"""`mnist-resnet prepare | train | sweep | predict`: the commands a user runs, each with
--help."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from mnist_resnet import __version__
from mnist_resnet.config import (
    PRESETS,
    SWEEP_PRESETS,
    PredictConfig,
    PrepareConfig,
    SweepConfig,
    TrainConfig,
)
from raytrain_common.cli import command_parser, config_from_args, run_commands, user_errors
from raytrain_common.images.dataset import DataError
from raytrain_common.ingest.epochs import DataChangedError
from raytrain_common.ingest.watch import IngestLostError
from raytrain_common.loop import process_started_at
from raytrain_common.metrics import SUMMARY_FILE
from raytrain_common.ray_start import show_ray_output
from raytrain_common.storage import files_of, resolve_storage
from raytrain_common.sweep import SWEEP_HELP

# Errors of the user's input (the library's and these), and faults whose cause and fix are known
# (an ingest node group lost): one line, exit status 2, no traceback.
USER_ERRORS = user_errors(DataError, DataChangedError, IngestLostError)


def build_parser() -> argparse.ArgumentParser:
    return command_parser(
        "mnist-resnet",
        "ResNet18 on MNIST with Ray Train (data-parallel, checkpointed, resumable).",
        {
            "prepare": (
                "MNIST, an IDX folder or a class-per-folder image tree → Parquet",
                PrepareConfig,
            ),
            "train": (
                "train with Ray Train; rerun with the same --run-name to continue",
                TrainConfig,
                PRESETS,
            ),
            "sweep": (SWEEP_HELP, SweepConfig, SWEEP_PRESETS),
            "predict": (
                "test accuracy and a picture from a run's best checkpoint, or classify --input "
                "images",
                PredictConfig,
            ),
        },
    )


def main(argv: list[str] | None = None) -> int:
    """`mnist-resnet COMMAND ...`: bad input ends in one line (exit 2), Ctrl-C or SIGTERM in one line
    naming the checkpoint a rerun continues from (raytrain_common.cli.run_commands)."""
    return run_commands("mnist-resnet", build_parser(), COMMANDS, USER_ERRORS, argv)


def cmd_prepare(args: argparse.Namespace) -> int:
    from mnist_resnet.prepare import BAD_FILES, prepare

    config = config_from_args(args, PrepareConfig)
    show_ray_output(config.verbose)
    data_dir = resolve_storage(config.resolved_data_dir())
    with tempfile.TemporaryDirectory(prefix="mnist-download-") as download_root:
        info = prepare(
            config.source,
            data_dir,
            Path(download_root),
            force=config.force,
            image_size=config.image_size,
            test_fraction=config.test_fraction,
            validation_fraction=config.validation_fraction,
            seed=config.seed,
            max_bad_fraction=config.max_bad_fraction,
            shards=config.shards,
            columns=(config.image_column, config.label_column),
        )
    shape = f"{info.height}×{info.width}" + ("" if info.channels == 1 else f"×{info.channels}")
    names = info.class_names or []
    classes = f" ({', '.join(names[:10])}{', …' if len(names) > 10 else ''})" if names else ""
    print(
        f"dataset: {info.train_rows} train + {info.val_rows} validation + {info.test_rows} test "
        f"images of {shape}, {info.num_classes} classes{classes}, from {info.source}"
        + (f"\ntest split: {info.notes['test_split']}" if "test_split" in info.notes else "")
        + f"\nvalidation split: {info.notes['val_split']}"
        + (
            f"\n{info.bad_files} file(s) cannot be decoded and were left out: "
            f"{files_of(data_dir, info.files_in).join(BAD_FILES)}"
            if info.bad_files
            else ""
        )
        + f"\nwritten to {data_dir}"
    )
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from mnist_resnet.train import run

    summary = run(config_from_args(args, TrainConfig, PRESETS), started_at=process_started_at())
    best = summary["best"]
    if summary["restarts"]:
        print(
            f"resumed {len(summary['restarts'])} time(s), "
            f"{summary['steps_redone']} step(s) redone: see summary.json"
        )
    if best is None:
        print(
            f"stopped at step {summary['steps_done']}, before the first epoch ended; rerun the "
            f"same command without --stop-at-step to continue: {summary['latest_checkpoint']}"
        )
        return 0
    test = summary["test"]
    print(
        f"best validation accuracy {best['val_accuracy']:.4f} at epoch {int(best['epoch'])} "
        f"of {summary['epochs_done']:g}; training took {summary['train_time_s']:.0f} s\n"
        f"test accuracy {test['test_accuracy']:.4f} on {test['test_rows']} images "
        f"(that checkpoint, evaluated once)\n"
        f"metrics: {summary['metrics_csv']}\ncurves: {summary['curves_png']}\n"
        f"best checkpoint: {summary['best_checkpoint']}\n"
        f"summary: {resolve_storage(summary['run_dir']).join(SUMMARY_FILE).uri}"
    )
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from mnist_resnet.train import SCORE, run
    from raytrain_common.sweep import Objective, sweep_command

    config = config_from_args(args, SweepConfig, SWEEP_PRESETS)
    return sweep_command(
        config,
        args.preset,
        program="mnist-resnet",
        version=__version__,
        train_class=TrainConfig,
        presets=PRESETS,
        train=run,
        objective=Objective(SCORE, "max", time_attr="epoch", max_t=config.epochs),
        full_run_fields=("limit_train_rows", "limit_val_rows", "limit_test_rows", "epochs"),
    )


def cmd_predict(args: argparse.Namespace) -> int:
    from mnist_resnet.predict import classify_files, predict, predict_files

    config = config_from_args(args, PredictConfig)
    if config.input is not None and Path(config.input).expanduser().is_file():
        for file, label, probability in classify_files(
            config.storage_path, config.run_name, config.input
        ):
            print(f"{label}\t{probability:.4f}\t{file}", flush=True)
        return 0
    if config.input is not None:
        run_dir = resolve_storage(config.storage_path).join(config.run_name)
        output = config.predictions or run_dir.join(time.strftime("predictions-%Y%m%d-%H%M%S")).uri
        done = predict_files(
            config.storage_path,
            config.run_name,
            config.input,
            output,
            batch_size=config.inference_batch_size,
        )
        print(
            f"{done['files']} files classified ({done['unreadable']} unreadable) in "
            f"{done['seconds']:.1f} s, {done['files_per_s']:.0f} files/s\n"
            f"predictions: {done['output']}"
        )
        return 0
    result = predict(config.storage_path, config.run_name, config.count, config.output)
    print(
        f"test accuracy {result['test_accuracy']:.4f} on {result['test_rows']} images "
        f"(checkpoint after epoch {result['epochs_done']})\npicture: {result['picture']}"
    )
    return 0


COMMANDS = {
    "prepare": cmd_prepare,
    "train": cmd_train,
    "sweep": cmd_sweep,
    "predict": cmd_predict,
}
