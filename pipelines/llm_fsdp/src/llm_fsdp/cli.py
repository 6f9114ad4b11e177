"""`llm-fsdp prepare | train | evaluate | export | generate`: the commands a user runs, each with
--help."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from llm_fsdp import __version__
from llm_fsdp.config import (
    PRESETS,
    SWEEP_PRESETS,
    TRAIN_COMMAND,
    EvaluateConfig,
    ExportConfig,
    GenerateConfig,
    PrepareConfig,
    SweepConfig,
    TrainConfig,
)
from llm_fsdp.model import SMOLLM2, SMOLLM2_FOLDER, ModelError
from raytrain_common.cli import command_parser, config_from_args, run_commands, user_errors
from raytrain_common.configs import ConfigError
from raytrain_common.loop import process_started_at
from raytrain_common.metrics import SUMMARY_FILE
from raytrain_common.ray_start import show_ray_output
from raytrain_common.runs import chosen_checkpoint, read_run_summary
from raytrain_common.storage import join_uri, resolve_storage
from raytrain_common.sweep import SWEEP_HELP
from raytrain_common.text import check_encoding
from raytrain_common.tokens.corpus import SPLITS, DataError

# Errors of the user's input (the library's and these): one line, exit status 2, no traceback.
USER_ERRORS = user_errors(DataError, ModelError)


def build_parser() -> argparse.ArgumentParser:
    return command_parser(
        "llm-fsdp",
        "Train a causal LM with FSDP2 on Ray Train (sharded checkpoints, resumable).",
        {
            "prepare": ("a corpus → tokenised, packed blocks in a token file", PrepareConfig),
            "train": (
                "train with FSDP2; rerun with the same --run-name to continue",
                TrainConfig,
                PRESETS,
            ),
            "sweep": (SWEEP_HELP, SweepConfig, SWEEP_PRESETS),
            "evaluate": (
                "a checkpoint's loss and perplexity on a split (train scores its best once)",
                EvaluateConfig,
            ),
            "export": ("a checkpoint → a Hugging Face safetensors folder", ExportConfig),
            "generate": ("sample text from a checkpoint or an export", GenerateConfig),
        },
    )


def main(argv: list[str] | None = None) -> int:
    """`llm-fsdp COMMAND ...`: bad input ends in one line (exit 2), Ctrl-C or SIGTERM in one line
    naming the checkpoint a rerun continues from (raytrain_common.cli.run_commands)."""
    return run_commands("llm-fsdp", build_parser(), COMMANDS, USER_ERRORS, argv)


def cmd_prepare(args: argparse.Namespace) -> int:
    from llm_fsdp.data import prepare
    from llm_fsdp.model import convert_smollm2

    config = config_from_args(args, PrepareConfig)
    show_ray_output(config.verbose)
    data_dir = resolve_storage(config.resolved_data_dir())
    tokenizer = config.tokenizer
    if tokenizer == SMOLLM2:
        storage = resolve_storage(config.storage_path)
        tokenizer = str(convert_smollm2(Path(storage.path) / SMOLLM2_FOLDER))
    with tempfile.TemporaryDirectory(prefix="llm-fsdp-download-") as download_root:
        info = prepare(
            config.dataset,
            data_dir,
            tokenizer=tokenizer,
            seq_len=config.seq_len,
            download_dir=Path(download_root),
            text_column=config.text_column,
            validation_fraction=config.validation_fraction,
            seed=config.seed,
            force=config.force,
            encoding=check_encoding(config.encoding),
            glob=config.glob,
        )
    packing = [info.packing[split] for split in SPLITS]
    if info.files:
        read, skipped = info.files["read"], info.files["skipped"]
        print(
            f"files: {sum(read.values())} read ({', '.join(f'{n} {s}' for s, n in read.items())}), "
            f"{sum(skipped.values())} skipped "
            f"({', '.join(f'{n} {s}' for s, n in skipped.items()) or 'none'})"
        )
    held_out = "documents" if info.split_by == "documents" else "document ends"
    documents = " + ".join(str(info.documents[split]) for split in SPLITS)
    tokens = " + ".join(f"{split['tokens']:,}" for split in packing)
    blocks = " + ".join(f"{split['blocks']:,}" for split in packing)
    print(
        f"corpus: {info.source}, {documents} {held_out} (train + validation + test)\n"
        f"tokens: {tokens} → {blocks} blocks of {info.seq_len + 1} "
        f"({sum(split['tokens_dropped'] for split in packing)} tokens dropped); vocabulary "
        f"{info.vocab_size:,}\n"
        f"written to {data_dir.uri}"
    )
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from llm_fsdp.train import run

    config = config_from_args(args, TrainConfig, PRESETS)
    print(describe_run(run(config, started_at=process_started_at())))
    return 0


def describe_run(summary: dict[str, Any]) -> str:
    """The lines `train` ends with: how validation loss moved, speed, the chosen checkpoint's test
    score, and where everything went."""
    first, final, best, test = (summary[key] for key in ("first", "final", "best", "test"))
    drop = summary["val_loss_drop"]
    change = f"{drop:.1%} lower" if drop >= 0 else f"{-drop:.1%} higher"
    speed = f"{summary['tokens_per_s']:.0f} tokens/s"
    if summary["mfu"] is not None:
        speed += f", MFU {summary['mfu']:.1%}, peak memory {summary['peak_memory_gb']:.1f} GiB"
    lines = [
        f"validation loss {first['val_loss']:.4f} → {final['val_loss']:.4f} ({change}) "
        f"at step {summary['steps_done']}; perplexity {final['val_perplexity']:.1f}; {speed}",
        f"best validation loss {best['val_loss']:.4f} at step {best['step']:.0f}",
        f"test loss {test['test_loss']:.4f}, perplexity {test['test_perplexity']:.1f} on "
        f"{test['test_tokens']:,} tokens of held-out documents (that checkpoint, evaluated once)"
        if test
        else "no complete checkpoint to test: see the warnings above",
        f"metrics: {summary['metrics_csv']}",
        f"curves: {summary['curves_png']}",
        f"best checkpoint: {summary['best_checkpoint']}",
        f"latest checkpoint: {summary['latest_checkpoint']}",
        f"summary: {resolve_storage(summary['run_dir']).join(SUMMARY_FILE).uri}",
    ]
    return "\n".join(lines)


def cmd_sweep(args: argparse.Namespace) -> int:
    from llm_fsdp.train import SCORE, run
    from raytrain_common.sweep import Objective, sweep_command

    config = config_from_args(args, SweepConfig, SWEEP_PRESETS)
    return sweep_command(
        config,
        args.preset,
        program="llm-fsdp",
        version=__version__,
        train_class=TrainConfig,
        presets=PRESETS,
        train=run,
        objective=Objective(SCORE, "min", time_attr="step", max_t=config.max_steps),
        full_run_fields=("max_steps", "warmup_steps", "eval_every_steps", "checkpoint_every_steps"),
    )


def cmd_evaluate(args: argparse.Namespace) -> int:
    from llm_fsdp.evaluate import score_checkpoint

    config = config_from_args(args, EvaluateConfig)
    if config.split not in SPLITS:
        raise ConfigError(f"--split {config.split}: choose one of {', '.join(SPLITS)}")
    run_dir = resolve_storage(config.storage_path).join(config.run_name)
    checkpoint = chosen_checkpoint(run_dir, config.checkpoint, TRAIN_COMMAND)
    data_dir = read_run_summary(run_dir, TRAIN_COMMAND)["config"]["data_dir"]
    result = score_checkpoint(checkpoint, data_dir, config.split, config.blocks)
    prefix = {"validation": "val"}.get(config.split, config.split)
    print(
        f"{config.split} loss {result[f'{prefix}_loss']:.4f}, perplexity "
        f"{result[f'{prefix}_perplexity']:.1f} over {result[f'{prefix}_tokens']:,} tokens "
        f"({result[f'{prefix}_blocks']:,} blocks) of {checkpoint} (step {result['step']})"
    )
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from llm_fsdp.export import export

    config = config_from_args(args, ExportConfig)
    run_dir = resolve_storage(config.storage_path).join(config.run_name)
    checkpoint = chosen_checkpoint(run_dir, config.checkpoint, TRAIN_COMMAND)
    output = config.output or join_uri(config.run_dir(), "export")
    folder = export(checkpoint, output, adapter_only=config.adapter_only)
    loads = (
        "PeftModel.from_pretrained(base, folder)"
        if config.adapter_only
        else "AutoModelForCausalLM.from_pretrained"
    )
    print(f"exported {checkpoint}\nto {folder} ({loads} loads it)")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from llm_fsdp.export import export, generate

    config = config_from_args(args, GenerateConfig)
    if config.model_dir is not None and not (Path(config.model_dir) / "config.json").exists():
        raise DataError(f"{config.model_dir} is not a Hugging Face model folder (no config.json)")
    with tempfile.TemporaryDirectory(prefix="llm-fsdp-generate-") as scratch:
        folder = config.model_dir
        if folder is None:
            run_dir = resolve_storage(config.storage_path).join(config.run_name)
            checkpoint = chosen_checkpoint(run_dir, config.checkpoint, TRAIN_COMMAND)
            folder = str(export(checkpoint, str(Path(scratch) / "model")))
        sample = generate(
            folder,
            config.prompt,
            config.max_new_tokens,
            config.temperature,
            config.top_k,
            config.seed,
        )
        print(sample)
    return 0


COMMANDS = {
    "prepare": cmd_prepare,
    "train": cmd_train,
    "sweep": cmd_sweep,
    "evaluate": cmd_evaluate,
    "export": cmd_export,
    "generate": cmd_generate,
}
