"""Packing: EOS-ended tokenised documents (from `pretokenize(..., max_length=None, eos_id=...)`) →
fixed blocks of `seq_len + 1` tokens for causal-LM training, with no padding and no token lost
but the final tail. The output folder holds `part-*.parquet` (column `input_ids`, fixed-size lists
of int32) and `stats.json`, written last, so it marks a complete folder.
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


class BlockFiles:
    """Writes blocks to `part-NNNNN.parquet` files of `rows_per_file` blocks each (the last one
    shorter), holding at most one file's worth in memory."""

    def __init__(self, output: StoragePath, block_size: int, rows_per_file: int) -> None:
        self.output, self.block_size, self.rows_per_file = output, block_size, rows_per_file
        self.pending: list[np.ndarray] = []
        self.files = 0

    def add(self, blocks: np.ndarray) -> None:
        self.pending.append(blocks)
        self.flush()

    def flush(self, final: bool = False) -> None:
        while self.pending and (final or sum(map(len, self.pending)) >= self.rows_per_file):
            blocks = np.concatenate(self.pending)
            self.pending.clear()
            head, rest = blocks[: self.rows_per_file], blocks[self.rows_per_file :]
            if len(rest):
                self.pending.append(rest)
            values = pa.array(head.reshape(-1), type=pa.int32())
            column = pa.FixedSizeListArray.from_arrays(values, self.block_size)
            target = self.output.join(f"part-{self.files:05d}.parquet")
            self.files += 1
            with target.filesystem.open_output_stream(target.path) as stream:
                pq.write_table(pa.table({"input_ids": column}), stream)


def first_order_value(file: StoragePath, order_column: str) -> int:
    """The smallest `order_column` value of a Parquet file (-1 when it has no rows)."""
    with file.filesystem.open_input_file(file.path) as stream:
        order = pq.read_table(stream, columns=[order_column])[order_column]
    return int(pa.compute.min(order).as_py()) if len(order) else -1


def pack_blocks(
    documents: StoragePath,
    output: StoragePath,
    *,
    block_size: int,
    order_column: str,
    rows_per_file: int = 8192,
) -> PackStats:
    """Concatenate tokenised documents in `order_column` order and cut them into `block_size`
    blocks.

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
    writer = BlockFiles(output, block_size, rows_per_file)
    carry = np.zeros(0, dtype=np.int32)
    documents_read = tokens = blocks = 0
    for file in sorted(files, key=lambda file: first_order_value(file, order_column)):
        with file.filesystem.open_input_file(file.path) as stream:
            table = pq.read_table(stream, columns=[order_column, "input_ids"]).sort_by(order_column)
        ids = table.column("input_ids").combine_chunks()
        documents_read += len(ids)
        flat = ids.flatten().to_numpy().astype(np.int32, copy=False)
        tokens += len(flat)
        stream_ids = np.concatenate([carry, flat])
        full = len(stream_ids) // block_size
        if full:
            writer.add(stream_ids[: full * block_size].reshape(full, block_size))
            blocks += full
        carry = stream_ids[full * block_size :]
    writer.flush(final=True)
    if blocks == 0:
        raise TokenizeError(
            f"{tokens} tokens in {documents_read} documents make no block of "
            f"{block_size}: give a larger corpus or a shorter sequence length"
        )
    stats = PackStats(documents_read, tokens, block_size, blocks, tokens_dropped=len(carry))
    marker.write_text(json.dumps(asdict(stats), indent=2) + "\n")
    return stats


def read_pack_stats(folder: StoragePath) -> PackStats:
    marker = folder.join(STATS_FILE)
    if not marker.exists():
        raise FileNotFoundError(f"{folder} has no {STATS_FILE}: it was not packed completely")
    return PackStats(**json.loads(marker.read_text()))
