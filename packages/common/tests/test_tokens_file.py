"""The packed token file: uint16 when the vocabulary fits and int32 when it does not, the header
checked on open (a truncated copy, another preparation's file, a file of another tool), a folder
read in place, and a split on object storage read by ranged requests, with no copy on the node."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from raytrain_common.storage import join_uri, resolve_storage
from raytrain_common.tokens.file import (
    HEADER_BYTES,
    TOKEN_FILE,
    ReadAhead,
    RemoteFile,
    TokenBlocks,
    TokenFileError,
    TokenFileWriter,
    open_token_file,
)

BLOCK = 9


def write_documents(path: Path, documents: list[np.ndarray], vocab_size: int) -> tuple[int, int]:
    writer = TokenFileWriter(path, BLOCK, vocab_size)
    for document in documents:
        writer.append(document)
    return writer.close()


def documents_of(vocab_size: int, count: int = 7) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab_size, size=rng.integers(1, 30)) for _ in range(count)]


@pytest.mark.parametrize(("vocab_size", "itemsize"), [(50_257, 2), (65_536, 2), (151_936, 4)])
def test_blocks_round_trip_in_the_smallest_type_that_holds_the_vocabulary(
    tmp_path: Path, vocab_size: int, itemsize: int
) -> None:
    documents = documents_of(vocab_size)
    documents[0][0] = vocab_size - 1  # the largest id survives the narrow type
    blocks, dropped = write_documents(tmp_path / TOKEN_FILE, documents, vocab_size)
    stream = np.concatenate(documents)
    assert blocks == len(stream) // BLOCK and dropped == len(stream) % BLOCK
    assert (tmp_path / TOKEN_FILE).stat().st_size == HEADER_BYTES + blocks * BLOCK * itemsize
    read = TokenBlocks(tmp_path / TOKEN_FILE).check(BLOCK, vocab_size)
    assert read.dtype.itemsize == itemsize
    every = read.take(np.arange(blocks))
    assert every.dtype == np.int32
    assert np.array_equal(every.reshape(-1), stream[: blocks * BLOCK])
    assert np.array_equal(read.take([2, 0]), every[[2, 0]])
    assert not list(tmp_path.glob("*.partial"))  # written under its own name, then renamed


def test_an_id_outside_the_vocabulary_is_refused_and_leaves_no_file(tmp_path: Path) -> None:
    writer = TokenFileWriter(tmp_path / TOKEN_FILE, BLOCK, vocab_size=1000)
    with pytest.raises(TokenFileError, match=r"outside the vocabulary of 1000"):
        writer.append(np.array([5, 1000]))
    writer.abort()
    assert list(tmp_path.iterdir()) == []


def test_a_truncated_or_foreign_file_fails_on_open_naming_the_fix(tmp_path: Path) -> None:
    path = tmp_path / TOKEN_FILE
    write_documents(path, documents_of(300, count=20), 300)
    whole = path.read_bytes()
    path.write_bytes(whole[:-3])
    with pytest.raises(TokenFileError, match=r"a truncated copy.*copy it again"):
        TokenBlocks(path)
    path.write_bytes(b"PAR1" + whole[4:])
    with pytest.raises(TokenFileError, match=r"no token file \(no .* header\).*`prepare --force`"):
        TokenBlocks(path)
    path.write_bytes(whole)
    with pytest.raises(TokenFileError, match=r"blocks of 9 tokens .* records 65 .*another prep"):
        TokenBlocks(path).check(65, 300)


def test_a_folder_of_another_version_names_prepare(tmp_path: Path) -> None:
    (tmp_path / "train").mkdir()
    with pytest.raises(TokenFileError, match=r"no tokens.bin in .*prepare --force"):
        open_token_file(resolve_storage(tmp_path / "train"), BLOCK, 300)


def test_a_folder_is_read_in_place_and_object_storage_by_ranges_without_a_copy(
    tmp_path: Path, s3_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same blocks from a folder and from an S3 protocol server on loopback; on S3, a take
    transfers the header once (on open) and then only the blocks asked for, one request per run
    of adjacent blocks (a copy of the file would transfer all of it), and nothing is written to
    the node; the next step's blocks are read while this one trains (ReadAhead)."""
    local = tmp_path / "train"
    local.mkdir()
    write_documents(local / TOKEN_FILE, documents_of(300, count=200), 300)
    in_place = open_token_file(resolve_storage(local), BLOCK, 300)
    assert in_place.path == local / TOKEN_FILE  # no copy

    monkeypatch.setenv("RAYTRAIN_ROW_CACHE", str(tmp_path / "cache"))
    remote_dir = resolve_storage(join_uri(s3_prefix, "data", "train"))
    remote_dir.join(TOKEN_FILE).write_bytes((local / TOKEN_FILE).read_bytes())
    remote = open_token_file(remote_dir, BLOCK, 300)
    assert isinstance(remote.file, RemoteFile) and len(remote) == len(in_place) > 300
    assert remote.file.bytes_read == HEADER_BYTES  # the header, checked on open
    wanted = np.array([7, 300, 8, 9, 120, 7])  # 7-9 adjacent, 7 twice: three runs
    assert np.array_equal(remote.take(wanted), in_place.take(wanted))
    assert remote.file.requests == 1 + 3
    assert remote.file.bytes_read == HEADER_BYTES + 5 * remote.row_bytes  # 5 distinct blocks
    everything = np.arange(len(in_place))
    assert np.array_equal(remote.take(everything), in_place.take(everything))
    assert not (tmp_path / "cache").exists()  # nothing written on the node

    ahead = ReadAhead(remote)
    steps = [[np.array([3, 1]), np.array([40])], [np.array([2]), np.array([0, 41])]]
    assert all(
        np.array_equal(got, in_place.take(part))
        for got, part in zip(ahead.take(steps[0], steps[1]), steps[0], strict=True)
    )
    requests = remote.file.requests
    ahead.pending[1].result()  # type: ignore[index]  # step 2's read, started by step 1's take
    assert remote.file.requests > requests  # read before it is asked for
    requests = remote.file.requests
    assert all(
        np.array_equal(got, in_place.take(part))
        for got, part in zip(ahead.take(steps[1], None), steps[1], strict=True)
    )
    assert remote.file.requests == requests  # served from the read ahead
    ahead.close()

    truncated = resolve_storage(join_uri(s3_prefix, "data", "truncated"))
    truncated.join(TOKEN_FILE).write_bytes((local / TOKEN_FILE).read_bytes()[:-5])
    with pytest.raises(TokenFileError, match=r"truncated copy"):
        open_token_file(truncated, BLOCK, 300)
