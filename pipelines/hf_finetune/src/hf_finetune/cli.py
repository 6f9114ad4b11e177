"""`hf-finetune prepare | train | evaluate | predict`: the commands a user runs, each with --help."""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

from hf_finetune.config import DEFAULT_DATA_FOLDER, PRESETS, TrainConfig
from hf_finetune.data import VADER_SOURCE, DataError, PrepareOptions
from hf_finetune.model import ModelError
from raytrain_common.checkpoint import TornCheckpointError
from raytrain_common.cli import add_config_options, config_from_args, end_ray_before_error_line
from raytrain_common.configs import ConfigError
from raytrain_common.metrics import SUMMARY_FILE
from raytrain_common.pretokenize import TokenizeError
from raytrain_common.ray_start import ResourceError
from raytrain_common.storage import StorageError, resolve_storage
from raytrain_common.text import TextEncodingError, check_encoding, decode_text

log = logging.getLogger("hf_finetune")

# Errors of the user's input: one line, exit status 2, no traceback.
USER_ERRORS = (
    ConfigError,
    DataError,
    ModelError,
    TokenizeError,
    TextEncodingError,
    StorageError,
    ResourceError,
    FileNotFoundError,
    TornCheckpointError,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-finetune",
        description="Fine-tune a Hugging Face text classifier with Ray Train (checkpointed, resumable).",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    prepare = commands.add_parser("prepare", help="labelled text → split, pre-tokenised Parquet")
    defaults = PrepareOptions()
    prepare.add_argument(
        "--dataset",
        default=VADER_SOURCE,
        help=f"{VADER_SOURCE} (offline default: 23,703 human-rated sentences, binary sentiment), "
        "CSV / TSV / JSONL / Parquet files or folders (comma-separated; local, s3://, gs://), "
        "or a Hugging Face hub dataset name",
    )
    prepare.add_argument("--dataset-config", default=None, help="hub dataset configuration name")
    prepare.add_argument(
        "--encoding",
        default=defaults.encoding,
        help="of CSV / TSV / JSONL files: utf-8 (the default; a byte-order mark is fine), "
        "cp1252, latin-1, utf-16, …",
    )
    prepare.add_argument("--text-column", default=defaults.text_column, help="(default: text)")
    prepare.add_argument("--label-column", default=defaults.label_column, help="(default: label)")
    prepare.add_argument(
        "--stratify-column",
        default=None,
        help="column whose mix every split keeps (default: source for vader, else the label)",
    )
    prepare.add_argument("--validation-fraction", type=float, default=defaults.validation_fraction)
    prepare.add_argument("--test-fraction", type=float, default=defaults.test_fraction)
    prepare.add_argument(
        "--max-length",
        type=int,
        default=defaults.max_length,
        help=f"tokens kept per sentence (default: {defaults.max_length})",
    )
    prepare.add_argument("--seed", type=int, default=defaults.seed, help="seed of the split")
    prepare.add_argument(
        "--model",
        default=None,
        help="hub id or local folder whose tokenizer to use (default: the offline MiniLM-L6)",
    )
    prepare.add_argument(
        "--vader-sdist", default=None, help="a downloaded vaderSentiment-3.3.2.tar.gz to read"
    )
    prepare.add_argument("--storage-path", default="./runs", help="(default: ./runs)")
    prepare.add_argument(
        "--data-dir",
        default=None,
        help=f"where to write (default: <storage-path>/{DEFAULT_DATA_FOLDER})",
    )
    prepare.add_argument("--force", action="store_true", help="rewrite a dataset prepared before")

    train = commands.add_parser(
        "train", help="fine-tune with Ray Train; rerun with the same --run-name to continue"
    )
    add_config_options(train, TrainConfig, PRESETS)

    for name, text in (
        ("evaluate", "test-split accuracy, macro F1 and a confusion matrix of the best checkpoint"),
        ("predict", "classify sentences from a file or standard input"),
    ):
        sub = commands.add_parser(name, help=text)
        sub.add_argument("--storage-path", default="./runs", help="(default: ./runs)")
        sub.add_argument("--run-name", default="hf_finetune", help="(default: hf_finetune)")
        sub.add_argument(
            "--checkpoint",
            default=None,
            help="a Hugging Face model folder (default: the run's best checkpoint)",
        )
    commands.choices["predict"].add_argument(
        "input", nargs="?", default="-", help="file with one sentence per line (default: stdin)"
    )
    commands.choices["predict"].add_argument(
        "--encoding", default="utf-8", help="of the input file (default: utf-8)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except USER_ERRORS as error:
        end_ray_before_error_line()
        print(f"hf-finetune {args.command}: error: {error}", file=sys.stderr)
        return 2


def cmd_prepare(args: argparse.Namespace) -> int:
    from hf_finetune.data import prepare
    from hf_finetune.model import resolve_model

    options = PrepareOptions(
        dataset=args.dataset,
        dataset_config=args.dataset_config,
        text_column=args.text_column,
        label_column=args.label_column,
        stratify_column=args.stratify_column,
        validation_fraction=args.validation_fraction,
        test_fraction=args.test_fraction,
        max_length=args.max_length,
        seed=args.seed,
        vader_sdist=args.vader_sdist,
        encoding=check_encoding(args.encoding),
    )
    model = resolve_model(args.model)
    storage = resolve_storage(args.storage_path)
    data_dir = (
        resolve_storage(args.data_dir) if args.data_dir else storage.join(DEFAULT_DATA_FOLDER)
    )
    with tempfile.TemporaryDirectory(prefix="hf-finetune-download-") as download_root:
        info = prepare(options, data_dir, model, Path(download_root), force=args.force)
    rows = ", ".join(f"{count} {split}" for split, count in info.rows.items())
    print(
        f"dataset: {rows} rows, labels {info.labels}, from {info.source}\n"
        f"tokenised for {info.tokenizer} (max {info.max_length} tokens)\nwritten to {data_dir.uri}"
    )
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from hf_finetune.train import run

    summary = run(config_from_args(args, TrainConfig, PRESETS))
    best = summary["best"]
    print(
        f"best validation F1 {best['eval_f1']:.4f} (accuracy {best['eval_accuracy']:.4f}) at epoch "
        f"{int(best['epoch'])} of {summary['epochs_done']}; majority class: "
        f"{summary['majority_share_validation']:.4f}\n"
        f"metrics: {summary['metrics_csv']}\ncurves: {summary['curves_png']}\n"
        f"best checkpoint: {summary['best_checkpoint']}\n"
        f"summary: {resolve_storage(summary['run_dir']).join(SUMMARY_FILE).uri}"
    )
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    from hf_finetune.evaluate import evaluate

    result = evaluate(args.storage_path, args.run_name, args.checkpoint)
    print(
        f"test accuracy {result['accuracy']:.4f}, macro F1 {result['f1']:.4f} on {result['rows']} "
        f"rows (majority class {result['majority_share']:.4f})\n"
        f"confusion matrix: {result['confusion_png']}\nchecked checkpoint: {result['checkpoint']}"
    )
    return 0


def cmd_predict(args: argparse.Namespace) -> int:
    from hf_finetune.predict import predict_lines

    if args.input == "-":
        lines: Iterable[str] = sys.stdin
    else:
        lines = decode_text(Path(args.input).read_bytes(), args.encoding, args.input).splitlines()
    for label, probability, sentence in predict_lines(
        lines, args.storage_path, args.run_name, args.checkpoint
    ):
        print(f"{label}\t{probability:.4f}\t{sentence}", flush=True)
    return 0


COMMANDS = {
    "prepare": cmd_prepare,
    "train": cmd_train,
    "evaluate": cmd_evaluate,
    "predict": cmd_predict,
}
