"""Pre-tokenisation throughput: Ray Data (`raytrain_common.pretokenize`) ÷
`datasets.map(batched=True)`.

Both tokenise the same VADER sentences (repeated to a size where fixed costs stop mattering) with
the same fast tokenizer and truncation, on the same cores, and both end with Parquet on disk. Ray's
start-up and its first-dataset warm-up are timed apart: a cluster pays them once, not per dataset.

    python -m benchmarks.hf_finetune.bench_tokenize [--copies 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import pyarrow as pa

from hf_finetune.data import download_vader, read_vader
from hf_finetune.model import default_model
from raytrain_common.storage import resolve_storage

log = logging.getLogger("benchmarks.hf_finetune.bench_tokenize")


def corpus(sdist: Path | None, copies: int, download_dir: Path) -> pa.Table:
    """VADER's text column `copies` times over, each copy with a marker so no row repeats
    exactly."""
    texts = read_vader(sdist or download_vader(download_dir)).column("text").to_pylist()
    rows = [f"{text} ({copy})" if copy else text for copy in range(copies) for text in texts]
    return pa.table({"text": rows})


def run_datasets_map(table: pa.Table, tokenizer_path: str, max_length: int, output: Path) -> float:
    """The Hugging Face way: `Dataset.map(batched=True)`, then `to_parquet`; seconds taken."""
    import datasets
    from datasets.table import InMemoryTable
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)

    def tokenize(batch: dict[str, list[str]]) -> dict[str, list]:
        ids = tokenizer(batch["text"], truncation=True, max_length=max_length)["input_ids"]
        return {"input_ids": ids, "length": [len(row) for row in ids]}

    mapped = datasets.Dataset(InMemoryTable(table)).map(tokenize, batched=True, batch_size=1000)
    output.mkdir(parents=True, exist_ok=True)
    mapped.to_parquet(str(output / "part-0.parquet"))
    return time.perf_counter() - started


def run_ray_data(
    table: pa.Table,
    tokenizer_path: str,
    max_length: int,
    output: Path,
    actors: int,
    batch_size: int,
) -> float:
    """`raytrain_common.pretokenize` on Ray Data (cluster already started); seconds taken."""
    import ray.data

    from raytrain_common.pretokenize import pretokenize

    started = time.perf_counter()
    blocks = [
        table.slice(start, batch_size * 4) for start in range(0, table.num_rows, batch_size * 4)
    ]
    pretokenize(
        ray.data.from_arrow(blocks),
        resolve_storage(output),
        tokenizer_path=tokenizer_path,
        text_column="text",
        max_length=max_length,
        actors=actors,
        batch_size=batch_size,
    )
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.hf_finetune.bench_tokenize", description=__doc__
    )
    parser.add_argument("--copies", type=int, default=8, help="VADER copies (23,703 rows each)")
    parser.add_argument("--rounds", type=int, default=3, help="measured runs of each")
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--actors", type=int, default=os.cpu_count() or 1, help="tokenizer actors")
    parser.add_argument("--batch-size", type=int, default=1024, help="rows per Ray Data batch")
    parser.add_argument("--vader-sdist", type=Path, default=None)
    args = parser.parse_args(argv)

    from raytrain_common.ray_start import init_ray

    tokenizer_path = default_model()
    with tempfile.TemporaryDirectory(prefix="bench-tokenize-") as scratch:
        root = Path(scratch)
        table = corpus(args.vader_sdist, args.copies, root / "download")
        started = time.perf_counter()
        init_ray(train_cpus=1)
        ray_start_s = time.perf_counter() - started
        # One unmeasured round on a slice: Ray's first dataset starts worker processes and Ray
        # Data's stats actor (a once-per-cluster cost, like start-up); both sides import and warm
        # up.
        warm_up = table.slice(0, 20_000)
        run_datasets_map(warm_up, tokenizer_path, args.max_length, root / "warm-hf")
        ray_warm_up_s = run_ray_data(
            warm_up,
            tokenizer_path,
            args.max_length,
            root / "warm-ray",
            args.actors,
            args.batch_size,
        )
        results = []
        for round_index in range(1, args.rounds + 1):
            baseline_s = run_datasets_map(table, tokenizer_path, args.max_length, root / "hf")
            ray_s = run_ray_data(
                table, tokenizer_path, args.max_length, root / "ray", args.actors, args.batch_size
            )
            results.append((round_index, baseline_s, ray_s))
            for folder in ("hf", "ray"):
                shutil.rmtree(root / folder, ignore_errors=True)

    rows = table.num_rows
    print(
        f"\n{rows:,} sentences, max {args.max_length} tokens, {os.cpu_count()} cores; "
        f"Ray start-up {ray_start_s:.1f} s and first-dataset warm-up {ray_warm_up_s:.1f} s (apart)"
    )
    print("| round | datasets.map rows/s | Ray Data rows/s | ratio (Ray ÷ datasets) |")
    print("| --- | --- | --- | --- |")
    for round_index, baseline_s, ray_s in results:
        print(
            f"| {round_index} | {rows / baseline_s:,.0f} | {rows / ray_s:,.0f} | "
            f"{baseline_s / ray_s:.3f} |"
        )
    ratio = sum(b for _, b, _ in results) / sum(r for _, _, r in results)
    print(f"\nratio over all rounds: {ratio:.3f}  (target ≥ 1.0)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
