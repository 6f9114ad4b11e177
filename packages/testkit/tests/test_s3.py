"""The loopback S3 server: pyarrow reads back what it wrote through the URI options, byte ranges
included, and the server's process is gone after the block."""

from __future__ import annotations

import socket

import pytest

from raytrain_common.storage import resolve_storage
from raytrain_testkit.pace import paced

pytest.importorskip("moto.server")


def test_a_server_of_its_own_serves_pyarrow_and_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    from raytrain_testkit.s3 import s3_server

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")  # pyarrow signs only with credentials
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    data = bytes(range(256)) * 4096
    with s3_server(buckets=["kit"]) as server:
        target = resolve_storage(server.uri("kit", "a", "file.bin"))
        target.write_bytes(data)
        listed = server.client.list_objects_v2(Bucket="kit")["Contents"]
        assert "a/file.bin" in {item["Key"] for item in listed}  # pyarrow adds "a/" too
        with target.filesystem.open_input_file(target.path) as stream:
            assert stream.size() == len(data)
            assert stream.read_at(10, 1000) == data[1000:1010]
        port = int(server.endpoint.rsplit(":", 1)[1])
    with pytest.raises(ConnectionRefusedError):  # the server process is gone: nothing listens
        socket.create_connection(("127.0.0.1", port), timeout=paced(1)).close()
