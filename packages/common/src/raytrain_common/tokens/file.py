"""The packed token file: one flat, headered binary per split (`train/tokens.bin`), written once by
`prepare` and read in place by training, a block of `seq_len + 1` tokens at an offset.

Layout: a 64-byte little-endian header, then `blocks × block_len` tokens, block after block:

    magic  b"LLMTOKS\\0"   version  u32   itemsize  u32 (2: uint16, 4: int32)
    block_len  u64         blocks   u64   vocab_size  u64            (zero-padded to 64 bytes)

Tokens are uint16 when every id fits (a vocabulary of at most 65,536: GPT-2's 50,257, SmolLM2's
49,152), int32 otherwise: half the disk, page cache and transfer of int32 for today's tokenizers.
The header is checked when the file is opened (magic, version, size against the counts) and
against what the dataset expects (block length, vocabulary), so a file of another preparation, a
truncated copy or a file of another tool fails at once, naming the fix.

Where training reads it: in place wherever the split's folder is a path (a local disk or a shared
mount: NFS, FSx, a PVC), with no copy; on object storage (S3, GCS) by ranged reads of the blocks a
step asks for (one request per run of adjacent blocks, the requests of a step side by side), with
no copy on the node either: a rank's 16 blocks of 2,049 uint16 tokens transfer 64 KiB, where a
node-local copy of a 1 T-token file would be 2 TB before the first step. `ReadAhead` (below)
fetches the next step's blocks while this one trains.
"""

from __future__ import annotations

import os
import shutil
import struct
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from raytrain_common.rowfile import own_suffix
from raytrain_common.storage import StoragePath

TOKEN_FILE = "tokens.bin"
MAGIC = b"LLMTOKS\x00"
VERSION = 1
HEADER = struct.Struct("<8sIIQQQ")
HEADER_BYTES = 64
UINT16_VOCAB = 1 << 16
COPY_CHUNK_BYTES = 64 << 20
RUN_BYTES = 8 << 20  # the most one read asks for (a long run of adjacent blocks is cut up)
REMOTE_READS_IN_FLIGHT = 16  # ranged requests to object storage at once, per open file


class TokenFileError(ValueError):
    """A token file that does not match its header or its dataset; the message names the fix."""


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every token id fits in it, else int32."""
    return np.dtype(np.uint16) if vocab_size <= UINT16_VOCAB else np.dtype(np.int32)


class TokenFileWriter:
    """Appends documents' tokens to `path` (written under a name of its own, renamed on `close`);
    `close` keeps the whole blocks of `block_len`, drops the tail and writes the header."""

    def __init__(self, path: Path, block_len: int, vocab_size: int) -> None:
        self.path, self.block_len, self.vocab_size = path, block_len, vocab_size
        self.dtype = token_dtype(vocab_size)
        self.partial = path.with_name(f"{path.name}.{own_suffix()}")
        self.out = open(self.partial, "wb")  # noqa: SIM115  (closed by close() or abort())
        self.out.write(bytes(HEADER_BYTES))
        self.tokens = 0

    def append(self, tokens: np.ndarray) -> None:
        if len(tokens) and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            raise TokenFileError(
                f"token ids {tokens.min()}..{tokens.max()} outside the vocabulary of "
                f"{self.vocab_size}: the tokenizer and the recorded vocabulary size disagree"
            )
        self.out.write(tokens.astype(self.dtype, copy=False).tobytes())
        self.tokens += len(tokens)

    def append_file(self, part: Path, tokens: int) -> None:
        """A part file of `tokens` ids already in this file's type, byte for byte (then removed)."""
        size = part.stat().st_size
        if size != tokens * self.dtype.itemsize:
            raise TokenFileError(
                f"{part} is {size:,} bytes, not the {tokens:,} {self.dtype} tokens its task wrote: "
                "was the data folder changed during prepare? Rerun prepare --force"
            )
        with open(part, "rb") as source:
            shutil.copyfileobj(source, self.out, COPY_CHUNK_BYTES)
        part.unlink()
        self.tokens += tokens

    def close(self) -> tuple[int, int]:
        """(blocks, tokens dropped after the last whole block); the file is in place."""
        blocks = self.tokens // self.block_len
        self.out.truncate(HEADER_BYTES + blocks * self.block_len * self.dtype.itemsize)
        self.out.seek(0)
        self.out.write(
            HEADER.pack(
                MAGIC, VERSION, self.dtype.itemsize, self.block_len, blocks, self.vocab_size
            )
        )
        self.out.flush()
        os.fsync(self.out.fileno())
        self.out.close()
        os.replace(self.partial, self.path)
        return blocks, self.tokens - blocks * self.block_len

    def abort(self) -> None:
        self.out.close()
        self.partial.unlink(missing_ok=True)


class LocalFile:
    """A token file on a path (a local disk or a shared mount), read with `os.preadv` in place."""

    def __init__(self, path: Path) -> None:
        self.name = str(path)
        self.fd: int | None = os.open(path, os.O_RDONLY)
        self.size = os.fstat(self.fd).st_size

    def read_into(self, buffer: np.ndarray, offset: int) -> int:
        if self.fd is None:
            raise ValueError(f"{self.name} is closed")
        return os.preadv(self.fd, [buffer], offset)

    def read_many(self, reads: list[tuple[np.ndarray, int]]) -> list[int]:
        """`read_into` for each (buffer, offset), one after another: a local read takes
        microseconds."""
        return [self.read_into(buffer, offset) for buffer, offset in reads]

    def close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)


class RemoteFile:
    """A token file on object storage (S3, GCS), read by byte range: each read is one ranged GET
    through pyarrow's file system (`read_at`, which is safe to call from several threads), so a
    node holds and transfers the blocks a step asks for, never a copy of the file."""

    def __init__(self, source: StoragePath) -> None:
        self.name = source.uri
        try:
            self.file: Any = source.filesystem.open_input_file(source.path)
        except FileNotFoundError as error:
            raise TokenFileError(
                f"no {TOKEN_FILE} at {source.uri}: rerun the pipeline's `prepare`"
            ) from error
        self.size = self.file.size()
        self.pool = ThreadPoolExecutor(REMOTE_READS_IN_FLIGHT, thread_name_prefix="token-reads")
        self.bytes_read = 0  # what this process fetched, for the benchmark and the tests
        self.requests = 0
        self.counting = threading.Lock()  # reads run in several threads

    def read_into(self, buffer: np.ndarray, offset: int) -> int:
        data = self.file.read_at(buffer.nbytes, offset)
        with self.counting:
            self.bytes_read += len(data)
            self.requests += 1
        buffer.view(np.uint8).reshape(-1)[: len(data)] = np.frombuffer(data, dtype=np.uint8)
        return len(data)

    def read_many(self, reads: list[tuple[np.ndarray, int]]) -> list[int]:
        """`read_into` for each (buffer, offset), side by side: each request to object storage
        waits milliseconds for its answer, and the waits overlap."""
        if len(reads) == 1:
            return [self.read_into(*reads[0])]
        return list(self.pool.map(lambda read: self.read_into(*read), reads))

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.file.close()


class TokenBlocks:
    """The blocks of a token file, read by index: a process holds the blocks it asked for, never
    the split. A path is read in place (`LocalFile`); object storage by ranged reads
    (`RemoteFile`), adjacent blocks in one request and the requests of a call side by side.
    `take` returns int32 rows whatever the file's token type."""

    def __init__(self, source: Path | StoragePath) -> None:
        self.file: LocalFile | RemoteFile = (
            LocalFile(source) if isinstance(source, Path) else RemoteFile(source)
        )
        self.path = source
        header = np.zeros(HEADER_BYTES, dtype=np.uint8)
        read = self.file.read_into(header, 0)
        if read < HEADER.size or header.tobytes()[:8] != MAGIC:
            self.close()
            raise TokenFileError(
                f"{self.file.name} is no token file (no {MAGIC!r} header): rerun the pipeline's "
                "`prepare --force` for this data folder"
            )
        fields = HEADER.unpack(header.tobytes()[: HEADER.size])
        _, version, itemsize, self.block_len, self.blocks, self.vocab_size = fields
        size = self.file.size
        expected = HEADER_BYTES + self.blocks * self.block_len * itemsize
        if version != VERSION or itemsize not in (2, 4) or size != expected:
            self.close()
            raise TokenFileError(
                f"{self.file.name}: version {version}, {itemsize}-byte tokens, {size:,} bytes "
                f"where the header's {self.blocks:,} blocks of {self.block_len} need "
                f"{expected:,} (a truncated copy, or another version's file): copy it again, or "
                "rerun the pipeline's `prepare --force`"
            )
        self.dtype = np.dtype(np.uint16) if itemsize == 2 else np.dtype(np.int32)
        self.row_bytes = self.block_len * itemsize

    def __len__(self) -> int:
        return self.blocks

    def close(self) -> None:
        file = getattr(self, "file", None)
        if file is not None:
            file.close()

    def __del__(self) -> None:
        self.close()

    @property
    def nbytes(self) -> int:
        """The blocks' size as int32 (what `take` returns)."""
        return self.blocks * self.block_len * 4

    def check(self, block_len: int, vocab_size: int) -> TokenBlocks:
        """This file, if it holds blocks of `block_len` tokens of a `vocab_size` vocabulary."""
        if (self.block_len, self.vocab_size) != (block_len, vocab_size):
            raise TokenFileError(
                f"{self.path} holds blocks of {self.block_len} tokens of a {self.vocab_size}-token "
                f"vocabulary, but the dataset records {block_len} and {vocab_size}: the file is "
                "from another preparation; rerun the pipeline's `prepare --force`"
            )
        if self.dtype != token_dtype(vocab_size):
            raise TokenFileError(
                f"{self.path} stores {self.dtype} tokens, not the {token_dtype(vocab_size)} a "
                f"{vocab_size}-token vocabulary is written as: rerun the pipeline's `prepare --force`"
            )
        return self

    def take(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """Blocks `indices`, in that order, as int32 (len(indices), block_len). Each run of
        adjacent blocks is one read (a block asked for twice is read once); on object storage the
        reads of a call go side by side."""
        indices = np.asarray(indices, dtype=np.int64)
        if indices.size and (indices.min() < 0 or indices.max() >= self.blocks):
            raise IndexError(
                f"blocks {indices.min()}..{indices.max()} of {self.blocks} in {self.path}"
            )
        wanted, inverse = np.unique(indices, return_inverse=True)
        runs = block_runs(wanted, max(1, RUN_BYTES // self.row_bytes))
        parts = [np.empty((count, self.block_len), dtype=self.dtype) for _, count in runs]
        offsets = [HEADER_BYTES + first * self.row_bytes for first, _ in runs]
        for part, offset, read in zip(
            parts, offsets, self.file.read_many(list(zip(parts, offsets, strict=True))), strict=True
        ):
            if read != part.nbytes:
                block = (offset - HEADER_BYTES) // self.row_bytes
                raise OSError(
                    f"{self.file.name}: short read at block {block} (truncated? copy it again)"
                )
        if not parts:
            return np.empty((0, self.block_len), dtype=np.int32)
        return np.concatenate(parts)[inverse.reshape(-1)].astype(np.int32, copy=False)

    def read_all(self, chunk_blocks: int = 65_536) -> Iterator[np.ndarray]:
        """Every block in order, a chunk at a time."""
        for start in range(0, self.blocks, chunk_blocks):
            yield self.take(np.arange(start, min(start + chunk_blocks, self.blocks)))


class ReadAhead:
    """Reads the blocks a step will need in a thread while the step before trains, so a step does
    not wait for storage (object storage answers each request in tens of milliseconds).
    `take(now, following)` returns the blocks of `now` (arrays of block indices), read ahead when
    the previous call named them, and starts reading `following`."""

    def __init__(self, blocks: TokenBlocks) -> None:
        self.blocks = blocks
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="token-read-ahead")
        self.pending: tuple[list[bytes], Future[list[np.ndarray]]] | None = None

    def take(self, now: list[np.ndarray], following: list[np.ndarray] | None) -> list[np.ndarray]:
        pending, self.pending = self.pending, None
        if pending is not None and pending[0] == [part.tobytes() for part in now]:
            rows = pending[1].result()
        else:
            rows = self.read(now)
        if following is not None:
            key = [part.tobytes() for part in following]
            self.pending = (key, self.pool.submit(self.read, following))
        return rows

    def read(self, parts: list[np.ndarray]) -> list[np.ndarray]:
        """The blocks of every part in one `take` (one set of requests), split back."""
        rows = self.blocks.take(np.concatenate(parts))
        return np.split(rows, np.cumsum([len(part) for part in parts])[:-1])

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def block_runs(sorted_blocks: np.ndarray, longest: int) -> list[tuple[int, int]]:
    """(first, count) of each run of consecutive block numbers in `sorted_blocks` (distinct,
    ascending), none longer than `longest`."""
    if not len(sorted_blocks):
        return []
    starts = np.flatnonzero(np.diff(sorted_blocks) != 1) + 1
    runs = []
    for run in np.split(sorted_blocks, starts):
        for offset in range(0, len(run), longest):
            runs.append((int(run[offset]), min(longest, len(run) - offset)))
    return runs


def open_token_file(split_dir: StoragePath, block_len: int, vocab_size: int) -> TokenBlocks:
    """The split's token file, read in place: by offset when the folder is a path (local disk or a
    shared mount), by ranged reads on object storage (no copy on the node)."""
    source = split_dir.join(TOKEN_FILE)
    if split_dir.is_local:
        if not source.exists():
            raise TokenFileError(
                f"no {TOKEN_FILE} in {split_dir.uri}: the data folder was prepared by an earlier "
                "version (token rows in Parquet); rerun the pipeline's `prepare --force`"
            )
        return TokenBlocks(Path(source.path)).check(block_len, vocab_size)
    return TokenBlocks(source).check(block_len, vocab_size)
