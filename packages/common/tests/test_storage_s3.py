"""The storage helpers against a real S3 protocol server on loopback (moto), not a mock of
pyarrow."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from raytrain_common.metrics import read_metrics_csv, write_metrics_csv
from raytrain_common.storage import (
    StorageError,
    check_writable,
    is_shared,
    join_uri,
    resolve_storage,
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
