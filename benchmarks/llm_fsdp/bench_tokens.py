"""A step's token reads from object storage against the same file on a local disk (`nox -s
bench_tokens`), in this one process.

A token file of `--blocks` blocks of 2,049 uint16 tokens (SmolLM2's sequence length plus one) is
written to a local folder and to an S3 protocol server on loopback (moto, in a process of its own:
every request crosses HTTP, but not a network, so a real bucket's ~10-30 ms a request comes on
top, and the server's Python, a few ms a request, shares this box's 2 cores with the reads). The
loopback server's time per ranged request grows with the object's size (inline, a step waited 34,
53 and 652 ms on files of 4, 20 and 78 MiB), an artifact of the server, hence a 20 MiB default.
Each step reads one rank's micro-batch (`--rows` blocks of the step's global batch, in the run's
order: `raytrain_common.tokens.order`) the way training does:

- local: `TokenBlocks.take` by `os.preadv` at the blocks' offsets (page cache warm);
- S3, inline: `TokenBlocks.take` by ranged requests, the step waiting for them;
- S3, read ahead: `ReadAhead` fetches the next step's blocks while a step "trains" (a sleep of
  `--compute-ms`, standing for the forward and backward pass); what a step still waits is timed.

Printed: bytes and requests per step, ms a step waits for its data, and the ratios to the local
read. A node-local copy of the file (llm-fsdp 0.12's way) would first transfer the whole file.

    python -m benchmarks.llm_fsdp.bench_tokens [--blocks 5000] [--rows 16] [--steps 100] [--compute-ms 50]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from raytrain_common.storage import resolve_storage
from raytrain_common.tokens.file import (
    TOKEN_FILE,
    ReadAhead,
    RemoteFile,
    TokenBlocks,
    TokenFileWriter,
)
from raytrain_common.tokens.order import global_batch_indices, micro_batches
from raytrain_testkit.s3 import s3_server

BLOCK_LEN = 2049
VOCAB = 49_152  # SmolLM2's: uint16 tokens
RANKS = 8  # the global batch is RANKS × --rows blocks; this process reads rank 0's share


def write_token_file(folder: Path, blocks: int) -> Path:
    folder.mkdir(parents=True)
    writer = TokenFileWriter(folder / TOKEN_FILE, BLOCK_LEN, VOCAB)
    rng = np.random.default_rng(0)
    for start in range(0, blocks, 1000):
        count = min(1000, blocks - start)
        writer.append(rng.integers(0, VOCAB, size=count * BLOCK_LEN, dtype=np.int64))
    writer.close()
    return folder / TOKEN_FILE


def step_rows(step: int, rows: int, blocks: int) -> np.ndarray:
    """Rank 0's blocks of optimiser step `step` (0-based), as training cuts them."""
    indices = global_batch_indices(step, rows * RANKS, blocks, seed=0)
    return micro_batches(indices, 0, RANKS, 1)[0]


def inline_ms(source: TokenBlocks, rows: int, steps: int) -> float:
    started = time.perf_counter()
    for step in range(steps):
        source.take(step_rows(step, rows, len(source)))
    return (time.perf_counter() - started) / steps * 1e3


def read_ahead_wait_ms(source: TokenBlocks, rows: int, steps: int, compute_s: float) -> float:
    """The ms a step waits for its blocks when the next step's are fetched during its compute."""
    ahead, waited = ReadAhead(source), 0.0
    try:
        for step in range(steps):
            following = [step_rows(step + 1, rows, len(source))] if step + 1 < steps else None
            started = time.perf_counter()
            ahead.take([step_rows(step, rows, len(source))], following)
            waited += time.perf_counter() - started
            time.sleep(compute_s)
    finally:
        ahead.close()
    return waited / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=5_000, help="blocks in the token file")
    parser.add_argument("--rows", type=int, default=16, help="one rank's blocks per step")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--compute-ms", type=float, default=50.0)
    args = parser.parse_args()

    # pyarrow signs its requests only with credentials; unsigned uploads are sent in a chunked
    # encoding that the loopback server stores as is. Never valid on AWS.
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ.setdefault(name, "testing")
    with s3_server(buckets=["bench"]) as server, tempfile.TemporaryDirectory() as scratch:
        local_file = write_token_file(Path(scratch) / "train", args.blocks)
        remote = resolve_storage(server.uri("bench", "train", TOKEN_FILE))
        remote.write_bytes(local_file.read_bytes())
        measure(TokenBlocks(local_file), TokenBlocks(remote), args)


def measure(local: TokenBlocks, on_s3: TokenBlocks, args: argparse.Namespace) -> None:
    assert isinstance(on_s3.file, RemoteFile)
    inline_ms(local, args.rows, 5)  # first-use costs, outside the timing
    local_ms = inline_ms(local, args.rows, args.steps)
    opened = (on_s3.file.bytes_read, on_s3.file.requests)
    s3_ms = inline_ms(on_s3, args.rows, args.steps)
    per_step_bytes = (on_s3.file.bytes_read - opened[0]) / args.steps
    per_step_requests = (on_s3.file.requests - opened[1]) / args.steps
    ahead_ms = read_ahead_wait_ms(on_s3, args.rows, args.steps, args.compute_ms / 1e3)
    file_mb = on_s3.file.size / 2**20
    print(
        f"token file {file_mb:.0f} MiB ({len(local):,} blocks of {BLOCK_LEN} uint16 tokens); "
        f"one rank's {args.rows} blocks a step, {args.steps} steps; compute {args.compute_ms:g} ms"
    )
    print("| read | KiB a step | requests a step | ms a step waits | ÷ local |")
    print("| --- | --- | --- | --- | --- |")
    kib = args.rows * local.row_bytes / 1024
    print(f"| local file, preadv | {kib:.0f} | - | {local_ms:.2f} | 1.00 |")
    print(
        f"| S3 (loopback), inline | {per_step_bytes / 1024:.0f} | {per_step_requests:.1f} "
        f"| {s3_ms:.2f} | {s3_ms / local_ms:.1f} |"
    )
    print(
        f"| S3 (loopback), read ahead | {per_step_bytes / 1024:.0f} | {per_step_requests:.1f} "
        f"| {ahead_ms:.2f} | {ahead_ms / local_ms:.1f} |"
    )
    print(f"a node-local copy would transfer {file_mb:.0f} MiB before the first step")


if __name__ == "__main__":
    main()
