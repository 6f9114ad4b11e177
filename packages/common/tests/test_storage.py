from __future__ import annotations

import os
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from raytrain_common.storage import (
    StorageError,
    StoragePath,
    check_shared_for_cluster,
    check_writable,
    is_shared,
    mount_fs_type,
    resolve_storage,
    write_atomic,
    write_folder_whole,
)


def test_relative_local_path_becomes_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    storage = resolve_storage("runs")
    assert storage.is_local
    assert storage.path == str(tmp_path / "runs")
    assert storage.join("a", "b").path == str(tmp_path / "runs" / "a" / "b")


def test_file_uri_is_local(tmp_path: Path) -> None:
    assert resolve_storage(f"file://{tmp_path}").path == str(tmp_path)


def test_s3_uri_gives_s3_filesystem() -> None:
    # region and endpoint given, so pyarrow does not look the bucket up over the network
    storage = resolve_storage(
        "s3://bucket/prefix/runs?region=us-east-1&endpoint_override=127.0.0.1:9"
    )
    assert isinstance(storage.filesystem, pafs.S3FileSystem)
    assert storage.path == "bucket/prefix/runs"
    assert not storage.is_local
    assert is_shared(storage)


@pytest.mark.parametrize("location", ["ftp://host/runs", "hdfs://namenode/runs"])
def test_unknown_scheme_is_refused_with_the_fix(location: str) -> None:
    with pytest.raises(
        StorageError, match=r"use a local or NFS folder, s3://bucket/prefix or gs://"
    ):
        resolve_storage(location)


def test_empty_path_is_refused() -> None:
    with pytest.raises(StorageError, match="storage path is empty"):
        resolve_storage("  ")


def test_write_bytes_is_atomic_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = resolve_storage(tmp_path / "deep" / "file.txt")
    target.write_text("hello")
    assert target.read_text() == "hello"
    assert os.listdir(tmp_path / "deep") == ["file.txt"]


def test_failed_write_leaves_neither_target_nor_temporary(tmp_path: Path) -> None:
    target = resolve_storage(tmp_path / "file.bin")
    target.write_bytes(b"old")

    def half_then_crash(stream: pafs.NativeFile) -> None:
        stream.write(b"half")
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        write_atomic(target, half_then_crash)
    assert target.read_bytes() == b"old"  # the previous complete file is untouched
    assert os.listdir(tmp_path) == ["file.bin"]


def test_list_files_skips_hidden_and_temporary(tmp_path: Path) -> None:
    for name in ("b.parquet", "a.parquet", ".a.parquet.tmp-1", "_SUCCESS", "notes.txt"):
        (tmp_path / name).write_text("x")
    names = [
        file.uri.rsplit("/", 1)[-1] for file in resolve_storage(tmp_path).list_files(".parquet")
    ]
    assert names == ["a.parquet", "b.parquet"]


def test_mount_type_of_a_local_folder_is_known_and_not_shared(tmp_path: Path) -> None:
    assert mount_fs_type(str(tmp_path)) != ""
    assert mount_fs_type(str(tmp_path / "not" / "yet" / "made")) == mount_fs_type(str(tmp_path))
    assert not is_shared(resolve_storage(tmp_path))


def test_local_path_is_refused_on_a_multi_node_cluster(tmp_path: Path) -> None:
    storage = resolve_storage(tmp_path)
    check_shared_for_cluster(storage, num_nodes=1)  # one node: a local disk is fine
    with pytest.raises(StorageError) as caught:
        check_shared_for_cluster(storage, num_nodes=3)
    message = str(caught.value)
    assert "cluster has 3 nodes" in message
    assert "NFS / ReadWriteMany" in message and "s3://bucket/prefix" in message
    check_shared_for_cluster(storage, num_nodes=3, assume_shared=True)  # the user's override


def test_unwritable_storage_path_is_refused(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(StorageError, match=r"is not writable .*Point --storage-path at a folder"):
        check_writable(resolve_storage(blocker / "runs"))


def test_writable_storage_path_is_created_and_left_clean(tmp_path: Path) -> None:
    check_writable(resolve_storage(tmp_path / "runs"))
    assert os.listdir(tmp_path / "runs") == []


def test_a_folder_appears_whole_or_not_at_all(tmp_path: Path) -> None:
    """A writer stopped half-way leaves nothing under the target's name; one that finishes leaves
    its whole folder there."""
    target = resolve_storage(tmp_path / "predicted")

    def stopped(folder: StoragePath) -> None:
        Path(folder.path).mkdir()
        (Path(folder.path) / "part-0.parquet").write_bytes(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_folder_whole(target, stopped)
    assert not target.exists()
    assert [p.name.split(".partial-")[0] for p in tmp_path.iterdir()] == ["predicted"]

    def finished(folder: StoragePath) -> None:
        Path(folder.path).mkdir()
        for index in range(3):
            (Path(folder.path) / f"part-{index}.parquet").write_bytes(b"rows")

    write_folder_whole(target, finished)
    assert sorted(p.name for p in (tmp_path / "predicted").iterdir()) == [
        "part-0.parquet",
        "part-1.parquet",
        "part-2.parquet",
    ]
