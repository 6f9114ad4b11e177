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
mount: NFS, FSx, a PVC), with no copy; from object storage (S3, GCS) through a node-local cache of
the whole file, downloaded once per node with its size logged first (`raytrain_common.rowfile`'s
cache folder and lock).
"""

from __future__ import annotations

import logging
import os
import shutil
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from raytrain_common.rowfile import cache_folder, locked, own_suffix, private_folder
from raytrain_common.storage import StoragePath

log = logging.getLogger(__name__)

TOKEN_FILE = "tokens.bin"
MAGIC = b"LLMTOKS\x00"
VERSION = 1
HEADER = struct.Struct("<8sIIQQQ")
HEADER_BYTES = 64
UINT16_VOCAB = 1 << 16
COPY_CHUNK_BYTES = 64 << 20


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


class TokenBlocks:
    """The blocks of a token file, read by index with `os.preadv`: a process holds the blocks it
    asked for, never the split. `take` returns int32 rows whatever the file's token type."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = os.open(path, os.O_RDONLY)
        header = os.pread(self.fd, HEADER.size, 0)
        if len(header) < HEADER.size or header[:8] != MAGIC:
            self.close()
            raise TokenFileError(
                f"{path} is no token file of llm-fsdp (no {MAGIC!r} header): rerun `llm-fsdp "
                "prepare --force` for this data folder"
            )
        _, version, itemsize, self.block_len, self.blocks, self.vocab_size = HEADER.unpack(header)
        size = os.fstat(self.fd).st_size
        expected = HEADER_BYTES + self.blocks * self.block_len * itemsize
        if version != VERSION or itemsize not in (2, 4) or size != expected:
            self.close()
            raise TokenFileError(
                f"{path}: version {version}, {itemsize}-byte tokens, {size:,} bytes where the "
                f"header's {self.blocks:,} blocks of {self.block_len} need {expected:,} (a "
                "truncated copy, or another version's file): copy it again, or rerun `llm-fsdp "
                "prepare --force`"
            )
        self.dtype = np.dtype(np.uint16) if itemsize == 2 else np.dtype(np.int32)
        self.row_bytes = self.block_len * itemsize

    def __len__(self) -> int:
        return self.blocks

    def close(self) -> None:
        fd, self.fd = getattr(self, "fd", None), None
        if fd is not None:
            os.close(fd)

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
                "from another preparation; rerun `llm-fsdp prepare --force`"
            )
        if self.dtype != token_dtype(vocab_size):
            raise TokenFileError(
                f"{self.path} stores {self.dtype} tokens, not the {token_dtype(vocab_size)} a "
                f"{vocab_size}-token vocabulary is written as: rerun `llm-fsdp prepare --force`"
            )
        return self

    def take(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """Blocks `indices`, in that order, as int32 (len(indices), block_len)."""
        if self.fd is None:
            raise ValueError(f"{self.path} is closed")
        out = np.empty((len(indices), self.block_len), dtype=self.dtype)
        for position, row in enumerate(indices):
            if not 0 <= row < self.blocks:
                raise IndexError(f"block {row} of {self.blocks} in {self.path}")
            read = os.preadv(self.fd, [out[position]], HEADER_BYTES + int(row) * self.row_bytes)
            if read != self.row_bytes:
                raise OSError(f"{self.path}: short read at block {row} (truncated? copy it again)")
        return out.astype(np.int32, copy=False)

    def read_all(self, chunk_blocks: int = 65_536) -> Iterator[np.ndarray]:
        """Every block in order, a chunk at a time."""
        for start in range(0, self.blocks, chunk_blocks):
            yield self.take(np.arange(start, min(start + chunk_blocks, self.blocks)))


def open_token_file(split_dir: StoragePath, block_len: int, vocab_size: int) -> TokenBlocks:
    """The split's token file, read in place when the folder is a path (local disk or a shared
    mount); from object storage, a node-local copy, downloaded once per node."""
    source = split_dir.join(TOKEN_FILE)
    if split_dir.is_local:
        if not source.exists():
            raise TokenFileError(
                f"no {TOKEN_FILE} in {split_dir.uri}: the data folder was prepared by llm-fsdp "
                "0.10 or earlier; rerun `llm-fsdp prepare --force`"
            )
        return TokenBlocks(Path(source.path)).check(block_len, vocab_size)
    return TokenBlocks(cached_copy(source)).check(block_len, vocab_size)


def cached_copy(source: StoragePath) -> Path:
    """`source` (on object storage) in this node's cache, downloaded once per node under a lock;
    the copy is named by the source's size and time, so a re-prepared file is fetched anew."""
    [info] = source.filesystem.get_file_info([source.path])
    if info.size is None or info.size < 0:
        raise TokenFileError(f"no {TOKEN_FILE} at {source.uri}: rerun `llm-fsdp prepare`")
    folder = cache_folder(source)
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"tokens-{info.size}-{info.mtime_ns or 0}.bin"
    locks = private_folder(
        Path(os.environ.get("TMPDIR", "/tmp")) / f"llm-token-locks-{os.getuid()}"
    )
    with locked(locks / f"{target.name}.lock"):
        if not target.exists():
            log.info(
                "copying %s (%.2f GB) to this node's cache %s: object storage is read once per "
                "node",
                source.uri,
                info.size / 1e9,
                target,
            )
            partial = target.with_name(f"{target.name}.{own_suffix()}")
            try:
                with (
                    source.filesystem.open_input_stream(source.path) as stream,
                    open(partial, "wb") as out,
                ):
                    while chunk := stream.read(COPY_CHUNK_BYTES):
                        out.write(chunk)
                    out.flush()
                    os.fsync(out.fileno())
                os.replace(partial, target)
            finally:
                partial.unlink(missing_ok=True)
    return target
