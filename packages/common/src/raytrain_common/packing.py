"""Packing: EOS-ended tokenised documents (from `pretokenize(..., max_length=None, eos_id=...)`) →
fixed blocks of `seq_len + 1` tokens for causal-LM training, with no padding and no token lost
but the final tail. The output folder holds `part-*.parquet` (column `input_ids`, fixed-size lists of
int32) and `stats.json`, written last, so it marks a complete folder.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute
import pyarrow.parquet as pq

from raytrain_common.pretokenize import STATS_FILE, TokenizeError
from raytrain_common.storage import StoragePath, restart_marked_folder


@dataclass(frozen=True)
class PackStats:
    documents: int
    tokens: int  # EOS included
    block_size: int
    blocks: int
    tokens_dropped: int  # the tail after the last full block


def pack_blocks(
    documents: StoragePath,
    output: StoragePath,
    *,
    block_size: int,
    order_column: str,
    rows_per_file: int = 8192,
) -> PackStats:
    """Concatenate tokenised documents in `order_column` order and cut them into `block_size` blocks.

    Every token lands in exactly one block except the final tail (< block_size), which is counted as
    dropped. Streams file by file, so memory holds one file plus one output file, not the corpus.
    Writes `part-*.parquet` (column `input_ids`, fixed-size lists of int32) and `stats.json` last.
    """
    if block_size < 2:
        raise TokenizeError(f"block_size={block_size}: a block needs at least 2 tokens")
    files = documents.list_files(".parquet")
    if not files:
        raise TokenizeError(f"no tokenised documents in {documents.uri}: tokenise them first")
    marker = restart_marked_folder(output, STATS_FILE)

    def first_row(file: StoragePath) -> int:
        with file.filesystem.open_input_file(file.path) as stream:
            order = pq.read_table(stream, columns=[order_column])[order_column]
        return int(pa.compute.min(order).as_py()) if len(order) else -1

    carry = np.zeros(0, dtype=np.int32)
    pending: list[np.ndarray] = []
    counts = {"documents": 0, "tokens": 0, "blocks": 0, "files": 0}

    def flush(final: bool = False) -> None:
        while pending and (final or sum(len(p) for p in pending) >= rows_per_file):
            blocks = np.concatenate(pending)
            pending.clear()
            head, rest = blocks[:rows_per_file], blocks[rows_per_file:]
            if len(rest):
                pending.append(rest)
            values = pa.array(head.reshape(-1), type=pa.int32())
            table = pa.table({"input_ids": pa.FixedSizeListArray.from_arrays(values, block_size)})
            target = output.join(f"part-{counts['files']:05d}.parquet")
            counts["files"] += 1
            with target.filesystem.open_output_stream(target.path) as stream:
                pq.write_table(table, stream)

    for file in sorted(files, key=first_row):
        with file.filesystem.open_input_file(file.path) as stream:
            table = pq.read_table(stream, columns=[order_column, "input_ids"]).sort_by(order_column)
        ids = table.column("input_ids").combine_chunks()
        counts["documents"] += len(ids)
        flat = ids.flatten().to_numpy().astype(np.int32, copy=False)
        counts["tokens"] += len(flat)
        stream_ids = np.concatenate([carry, flat])
        full = len(stream_ids) // block_size
        if full:
            pending.append(stream_ids[: full * block_size].reshape(full, block_size))
            counts["blocks"] += full
        carry = stream_ids[full * block_size :]
        flush()
    flush(final=True)
    if counts["blocks"] == 0:
        raise TokenizeError(
            f"{counts['tokens']} tokens in {counts['documents']} documents make no block of "
            f"{block_size}: give a larger corpus or a shorter sequence length"
        )
    stats = PackStats(
        documents=counts["documents"],
        tokens=counts["tokens"],
        block_size=block_size,
        blocks=counts["blocks"],
        tokens_dropped=len(carry),
    )
    marker.write_text(json.dumps(asdict(stats), indent=2) + "\n")
    return stats


def read_pack_stats(folder: StoragePath) -> PackStats:
    marker = folder.join(STATS_FILE)
    if not marker.exists():
        raise FileNotFoundError(f"{folder} has no {STATS_FILE}: it was not packed completely")
    return PackStats(**json.loads(marker.read_text()))
