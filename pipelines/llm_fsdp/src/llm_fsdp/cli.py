"""`llm-fsdp prepare | train | export | generate`: the commands a user runs, each with --help."""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

from llm_fsdp.config import DEFAULT_DATA_FOLDER, PRESETS, SMOLLM2_DATA_FOLDER, TrainConfig
from llm_fsdp.data import BPE_PREFIX, GPT2_TOKENIZER, SHAKESPEARE_SOURCE, DataError
from llm_fsdp.model import SMOLLM2, SMOLLM2_FOLDER, ModelError
from raytrain_common.checkpoint import TornCheckpointError
from raytrain_common.cli import add_config_options, config_from_args, end_ray_before_error_line
from raytrain_common.configs import ConfigError
from raytrain_common.metrics import SUMMARY_FILE
from raytrain_common.pretokenize import TokenizeError
from raytrain_common.ray_start import ResourceError
from raytrain_common.storage import StorageError, resolve_storage
from raytrain_common.text import TextEncodingError, check_encoding

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
        prog="llm-fsdp",
        description="Train a causal LM with FSDP2 on Ray Train (sharded checkpoints, resumable).",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    prepare = commands.add_parser("prepare", help="a corpus → tokenised, packed Parquet blocks")
    prepare.add_argument(
        "--dataset",
        default=SHAKESPEARE_SOURCE,
        help=f"{SHAKESPEARE_SOURCE} (offline default: the complete works, one document per work), a text file or a folder read at any depth (.txt / .md / .rst / …: one document per file; JSONL / Parquet: one per row), or a hub dataset name",
    )
    prepare.add_argument(
        "--glob",
        default=None,
        help="which files of a folder to read, comma-separated patterns on the path under it "
        "(e.g. '*.md,*.rst'; default: every text, JSONL and Parquet suffix this reader knows)",
    )
    prepare.add_argument(
        "--encoding",
        default="utf-8",
        help="of the text files: utf-8 (the default; a byte-order mark is fine), cp1252, "
        "latin-1, utf-16, …",
    )
    prepare.add_argument(
        "--text-column", default="text", help="column of JSONL / Parquet / hub rows (default: text)"
    )
    prepare.add_argument(
        "--tokenizer",
        default=f"{BPE_PREFIX}4096",
        help=f"{BPE_PREFIX}N (byte-level BPE trained on the training documents; default {BPE_PREFIX}4096), {GPT2_TOKENIZER} (offline), {SMOLLM2} (converts the offline SmolLM2-135M too), a local folder or a hub id",
    )
    prepare.add_argument(
        "--seq-len",
        type=int,
        default=256,
        help="tokens per training sequence (blocks hold seq_len + 1; default 256)",
    )
    prepare.add_argument(
        "--validation-fraction",
        type=float,
        default=0.05,
        help="share of documents held out (at least one, and enough for a block; a corpus of "
        "few documents holds out the end of each instead)",
    )
    prepare.add_argument("--seed", type=int, default=0, help="seed of the document split")
    prepare.add_argument("--storage-path", default="./runs", help="(default: ./runs)")
    prepare.add_argument(
        "--data-dir",
        default=None,
        help=f"where to write (default: <storage-path>/{DEFAULT_DATA_FOLDER}, or <storage-path>/{SMOLLM2_DATA_FOLDER} with --tokenizer {SMOLLM2})",
    )
    prepare.add_argument("--force", action="store_true", help="rewrite a dataset prepared before")

    train = commands.add_parser(
        "train", help="train with FSDP2; rerun with the same --run-name to continue"
    )
    add_config_options(train, TrainConfig, PRESETS)

    for name, text in (
        ("export", "a checkpoint → a Hugging Face safetensors folder"),
        ("generate", "sample text from a checkpoint or an export"),
    ):
        sub = commands.add_parser(name, help=text)
        sub.add_argument("--storage-path", default="./runs", help="(default: ./runs)")
        sub.add_argument("--run-name", default="llm_fsdp", help="(default: llm_fsdp)")
        sub.add_argument(
            "--checkpoint",
            default="best",
            help="best (lowest validation loss, the default), latest, or a checkpoint folder",
        )
    commands.choices["export"].add_argument(
        "--output", default=None, help="(default: <run folder>/export)"
    )
    generate = commands.choices["generate"]
    generate.add_argument(
        "--model-dir",
        default=None,
        help="an exported (or any Hugging Face) model folder instead of a checkpoint",
    )
    generate.add_argument(
        "--prompt", default="", help="text to continue (default: start of a document)"
    )
    generate.add_argument("--max-new-tokens", type=int, default=200)
    generate.add_argument("--temperature", type=float, default=0.8)
    generate.add_argument("--top-k", type=int, default=50)
    generate.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except USER_ERRORS as error:
        end_ray_before_error_line()
        print(f"llm-fsdp {args.command}: error: {error}", file=sys.stderr)
        return 2


def cmd_prepare(args: argparse.Namespace) -> int:
    from llm_fsdp.data import prepare
    from llm_fsdp.model import convert_smollm2

    storage = resolve_storage(args.storage_path)
    default_folder = SMOLLM2_DATA_FOLDER if args.tokenizer == SMOLLM2 else DEFAULT_DATA_FOLDER
    data_dir = resolve_storage(args.data_dir) if args.data_dir else storage.join(default_folder)
    tokenizer = args.tokenizer
    if tokenizer == SMOLLM2:
        tokenizer = str(convert_smollm2(Path(storage.path) / SMOLLM2_FOLDER))
    with tempfile.TemporaryDirectory(prefix="llm-fsdp-download-") as download_root:
        info = prepare(
            args.dataset,
            data_dir,
            tokenizer=tokenizer,
            seq_len=args.seq_len,
            download_dir=Path(download_root),
            text_column=args.text_column,
            validation_fraction=args.validation_fraction,
            seed=args.seed,
            force=args.force,
            encoding=check_encoding(args.encoding),
            glob=args.glob,
        )
    train, val = info.packing["train"], info.packing["validation"]
    if info.files:
        read, skipped = info.files["read"], info.files["skipped"]
        print(
            f"files: {sum(read.values())} read ({', '.join(f'{n} {s}' for s, n in read.items())}), "
            f"{sum(skipped.values())} skipped ({', '.join(f'{n} {s}' for s, n in skipped.items()) or 'none'})"
        )
    held_out = "documents" if info.split_by == "documents" else "document ends"
    print(
        f"corpus: {info.source}, {info.documents['train']} + {info.documents['validation']} {held_out} (train + validation)\n"
        f"tokens: {train['tokens']:,} + {val['tokens']:,} → {train['blocks']:,} + {val['blocks']:,} blocks of {info.seq_len + 1} "
        f"({train['tokens_dropped'] + val['tokens_dropped']} tokens dropped); vocabulary {info.vocab_size:,}\n"
        f"written to {data_dir.uri}"
    )
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from llm_fsdp.train import run

    print(describe_run(run(config_from_args(args, TrainConfig, PRESETS))))
    return 0


def describe_run(summary: dict[str, Any]) -> str:
    """The lines `train` ends with: how validation loss moved, speed, and where everything went."""
    first, final, best = summary["first_eval"], summary["final_eval"], summary["best_eval"]
    drop = summary["val_loss_drop"]
    change = f"{drop:.1%} lower" if drop >= 0 else f"{-drop:.1%} higher"
    speed = f"{summary['tokens_per_s']:.0f} tokens/s"
    if summary["mfu"] is not None:
        speed += f", MFU {summary['mfu']:.1%}, peak memory {summary['peak_memory_gb']:.1f} GiB"
    return (
        f"validation loss {first['val_loss']:.4f} → {final['val_loss']:.4f} ({change}) "
        f"at step {summary['steps_done']}; perplexity {final['val_perplexity']:.1f}; {speed}\n"
        f"best validation loss {best['val_loss']:.4f} at step {best['step']:.0f}\n"
        f"metrics: {summary['metrics_csv']}\ncurves: {summary['curves_png']}\n"
        f"best checkpoint: {summary['best_checkpoint']}\n"
        f"latest checkpoint: {summary['latest_checkpoint']}\n"
        f"summary: {resolve_storage(summary['run_dir']).join(SUMMARY_FILE).uri}"
    )


def cmd_export(args: argparse.Namespace) -> int:
    from llm_fsdp.export import choose_checkpoint, export

    checkpoint = choose_checkpoint(args.checkpoint, args.storage_path, args.run_name)
    output = args.output or str(Path(args.storage_path) / args.run_name / "export")
    folder = export(checkpoint, output)
    print(f"exported {checkpoint}\nto {folder} (AutoModelForCausalLM.from_pretrained loads it)")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from llm_fsdp.export import choose_checkpoint, export, generate

    if args.model_dir is not None and not (Path(args.model_dir) / "config.json").exists():
        raise DataError(f"{args.model_dir} is not a Hugging Face model folder (no config.json)")
    with tempfile.TemporaryDirectory(prefix="llm-fsdp-generate-") as scratch:
        folder = args.model_dir
        if folder is None:
            checkpoint = choose_checkpoint(args.checkpoint, args.storage_path, args.run_name)
            folder = str(export(checkpoint, str(Path(scratch) / "model")))
        print(
            generate(
                folder, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed
            )
        )
    return 0


COMMANDS = {
    "prepare": cmd_prepare,
    "train": cmd_train,
    "export": cmd_export,
    "generate": cmd_generate,
}
