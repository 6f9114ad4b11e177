"""The packed token file: uint16 when the vocabulary fits and int32 when it does not, the header
checked on open (a truncated copy, another preparation's file, a file of another tool), and a split
on object storage copied once per node while a folder is read in place."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from llm_fsdp.tokens import (
    HEADER_BYTES,
    TOKEN_FILE,
    TokenBlocks,
    TokenFileError,
    TokenFileWriter,
    open_token_file,
)
from raytrain_common.storage import resolve_storage

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
    with pytest.raises(TokenFileError, match=r"no token file of llm-fsdp.*prepare --force"):
        TokenBlocks(path)
    path.write_bytes(whole)
    with pytest.raises(TokenFileError, match=r"blocks of 9 tokens .* records 65 .*another prep"):
        TokenBlocks(path).check(65, 300)


def test_a_folder_of_another_version_names_prepare(tmp_path: Path) -> None:
    (tmp_path / "train").mkdir()
    with pytest.raises(TokenFileError, match=r"no tokens.bin in .*prepare --force"):
        open_token_file(resolve_storage(tmp_path / "train"), BLOCK, 300)


@pytest.fixture
def bucket(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    moto_server = pytest.importorskip("moto.server")
    import boto3

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    _, port = server.get_host_and_port()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    boto3.client(
        "s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1"
    ).create_bucket(Bucket="corpus")
    yield f"s3://corpus/data/train?endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"
    server.stop()


def test_a_local_folder_is_read_in_place_and_object_storage_is_copied_once_per_node(
    tmp_path: Path, bucket: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    local = tmp_path / "train"
    local.mkdir()
    write_documents(local / TOKEN_FILE, documents_of(300, count=30), 300)
    in_place = open_token_file(resolve_storage(local), BLOCK, 300)
    assert in_place.path == local / TOKEN_FILE  # no copy

    monkeypatch.setenv("RAYTRAIN_ROW_CACHE", str(tmp_path / "cache"))
    remote = resolve_storage(bucket)
    remote.join(TOKEN_FILE).write_bytes((local / TOKEN_FILE).read_bytes())
    with caplog.at_level(logging.INFO, logger="llm_fsdp.tokens"):
        first = open_token_file(remote, BLOCK, 300)
        again = open_token_file(remote, BLOCK, 300)
    copies = [r for r in caplog.records if "to this node's cache" in r.getMessage()]
    assert len(copies) == 1 and "GB" in copies[0].getMessage()  # its size, said before it starts
    assert first.path == again.path and first.path.is_relative_to(tmp_path / "cache")
    assert np.array_equal(first.take(np.arange(len(first))), in_place.take(np.arange(len(first))))
