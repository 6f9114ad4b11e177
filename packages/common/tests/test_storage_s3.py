"""The storage helpers against a real S3 protocol server on loopback (moto), not a mock of
pyarrow."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow.fs as pafs
import pytest

from raytrain_common.metrics import read_metrics_csv, write_metrics_csv
from raytrain_common.storage import (
    FILES_IN,
    OutputMarker,
    StorageError,
    StoragePath,
    check_writable,
    files_of,
    is_shared,
    join_uri,
    resolve_storage,
    staged_output,
)

moto_server = pytest.importorskip("moto.server")


@pytest.fixture(scope="module")
def bucket_uri() -> Iterator[str]:
    import boto3

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    _, port = server.get_host_and_port()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AWS_ACCESS_KEY_ID", "testing")
        patch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        endpoint = f"127.0.0.1:{port}"
        boto3.client(
            "s3", endpoint_url=f"http://{endpoint}", region_name="us-east-1"
        ).create_bucket(Bucket="runs-bucket")
        yield f"s3://runs-bucket/team?endpoint_override={endpoint}&scheme=http&region=us-east-1"
    server.stop()


def test_s3_path_is_shared_writable_and_round_trips(bucket_uri: str) -> None:
    storage = resolve_storage(bucket_uri)
    assert not storage.is_local
    assert is_shared(storage)
    check_writable(storage)
    run_dir = storage.join("run-1")
    assert run_dir.uri.startswith("s3://runs-bucket/team/run-1?endpoint_override=")

    write_metrics_csv(run_dir.join("metrics.csv"), [{"epoch": 1, "loss": 0.5}])
    assert read_metrics_csv(run_dir.join("metrics.csv")) == [{"epoch": 1.0, "loss": 0.5}]
    for name in ("b.parquet", "a.parquet"):
        run_dir.join("data", name).write_bytes(b"x")
    listed = [file.path.rsplit("/", 1)[-1] for file in run_dir.join("data").list_files(".parquet")]
    assert listed == ["a.parquet", "b.parquet"]
    assert resolve_storage(run_dir.join("data", "a.parquet").uri).read_bytes() == b"x"


def test_missing_bucket_is_not_writable(bucket_uri: str) -> None:
    other = bucket_uri.replace("runs-bucket", "no-such-bucket")
    with pytest.raises(StorageError, match=r"is not writable .*check the credentials"):
        check_writable(resolve_storage(other))


def test_folders_and_checkpoint_uris_keep_the_options_of_an_object_store_uri(
    bucket_uri: str,
) -> None:
    """A storage URI with options (?endpoint_override=…): every folder computed under it, and every
    checkpoint URI a run reports, keeps them last, so each resolves to the same server."""
    data = join_uri(bucket_uri, "data", "images")
    assert data.startswith("s3://runs-bucket/team/data/images?endpoint_override=")
    assert data == resolve_storage(bucket_uri).join("data", "images").uri
    storage = resolve_storage(bucket_uri)
    storage.join("run", "checkpoint_1", "state.pt").write_bytes(b"weights")
    reported = storage.join("run", "checkpoint_1").path  # as Ray reports it: no scheme, no options
    uri = storage.uri_for(reported)
    assert uri.startswith("s3://runs-bucket/team/run/checkpoint_1?endpoint_override=")
    assert resolve_storage(uri).join("state.pt").read_bytes() == b"weights"
    assert join_uri("/local/runs", "data") == "/local/runs/data"
    assert resolve_storage("/local/runs").uri_for("/local/runs/x") == "/local/runs/x"


@dataclass(frozen=True)
class Made:
    """What a test output's marker holds."""

    version: int


MADE = OutputMarker.of("made.json", Made)


def write_output(target: StoragePath, version: int, fail_before_marker: bool = False) -> None:
    """An output of two files and its marker, as every prepare and export writes one."""
    with staged_output(target, MADE) as staged:
        for name in ("train/part-0.parquet", "train/part-1.parquet"):
            staged.folder.join(name).write_text(f"v{version}")
        if fail_before_marker:  # everything new is written: the one PUT that swaps is next
            raise OSError("injected: the connection dropped")
        staged.write_marker({"version": version})


def read_output(target: StoragePath) -> tuple[int, list[str]]:
    """The version an output's marker names, and its files' contents, as a reader finds them."""
    record = json.loads(target.join(MADE.name).read_text())
    files = files_of(target, record[FILES_IN]).join("train").list_files(".parquet")
    return record["version"], [file.read_text() for file in files]


def keys(target: StoragePath) -> set[str]:
    selector = pafs.FileSelector(target.path, recursive=True, allow_not_found=True)
    infos = target.filesystem.get_file_info(selector)
    return {info.path[len(target.path) + 1 :] for info in infos if info.type == pafs.FileType.File}


def test_a_forced_rewrite_on_an_object_store_swaps_in_one_put_and_a_failed_one_changes_nothing(
    bucket_uri: str,
) -> None:
    """No rename on S3: the new files go to a generation of their own and the marker, written
    last, names it. A rewrite that fails at its worst moment (every new file written, the marker
    not yet) or is killed leaves the old output readable as it was; the next one that completes
    deletes the old generation and whatever a killed one left."""
    target = resolve_storage(bucket_uri).join("outputs", "swap")
    write_output(target, 1)
    assert read_output(target) == (1, ["v1", "v1"])
    first = keys(target)
    assert first >= {"made.json"} and all(k.startswith("files-") for k in first - {"made.json"})

    with pytest.raises(OSError, match="injected"):
        write_output(target, 2, fail_before_marker=True)
    assert keys(target) == first and read_output(target) == (1, ["v1", "v1"])

    killed = target.join("files-20260101T000000-dead00", "train", "part-0.parquet")
    killed.write_text("v3, cut off")  # what a killed rewrite leaves: an unnamed generation
    assert read_output(target) == (1, ["v1", "v1"])
    write_output(target, 4)
    assert read_output(target) == (4, ["v4", "v4"])
    left = keys(target)
    assert len({k.split("/")[0] for k in left - {"made.json"}}) == 1  # the old and killed: gone
    assert not left & first - {"made.json"}


def test_a_block_that_completes_without_its_marker_keeps_the_old_output(bucket_uri: str) -> None:
    """Had the old marker stood for the new one, the old files it names would be deleted."""
    target = resolve_storage(bucket_uri).join("outputs", "unmarked")
    write_output(target, 1)
    unmarked = pytest.raises(RuntimeError, match="completed without its marker")
    with unmarked, staged_output(target, MADE) as staged:
        staged.folder.join("train", "part-0.parquet").write_text("v2")
    assert read_output(target) == (1, ["v1", "v1"])


@pytest.mark.parametrize(
    ("held", "message"),
    [
        ({"made.json": '{"name": "theirs"}'}, "holds a made.json this command did not write"),
        ({"made.json": '{"version": 1'}, "holds a made.json this command did not write"),
        ({"notes/thesis.tex": "mine"}, "holds files but no made.json"),
        ({".env": "SECRET=1"}, "holds hidden files only but no made.json"),
    ],
    ids=["another command's marker", "a marker cut short", "the user's files", "hidden files"],
)
def test_a_folder_that_is_not_this_commands_output_is_refused_on_an_object_store(
    bucket_uri: str, held: dict[str, str], message: str
) -> None:
    target = resolve_storage(bucket_uri).join("outputs", "refused", str(abs(hash(message))))
    for name, content in held.items():
        target.join(name).write_text(content)
    with pytest.raises(StorageError, match=message):
        write_output(target, 1)
    assert keys(target) == set(held)
