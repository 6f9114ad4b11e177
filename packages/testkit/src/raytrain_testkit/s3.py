"""An S3 protocol server (moto) on loopback, in a process of its own, for the tests and benchmarks
that read and write object storage as users' runs do.

Why a process of its own rather than moto's `ThreadedMotoServer` in the caller's process: the
server spends a few milliseconds of Python on each request, and in the caller's process it holds
the caller's interpreter lock meanwhile, so requests a client sends side by side (llm's ranged
reads, `nox -s bench_tokens`) would be answered one at a time by construction. (For the
class-sorted S3 tree test, which fetches from Ray's processes, it made no difference: 111 s with
the server in the test's process, 125 s with one of its own, one run each.)

Every Ray process reaches the server through pyarrow's S3 with the URI options `options` names and
the credentials the root conftest sets (pyarrow signs requests only when it has credentials; an
unsigned upload goes in a chunked encoding that moto stores as is). Never valid on AWS.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from raytrain_common.storage import join_uri
from raytrain_testkit.pace import paced

START_TIMEOUT_S = 60.0  # on the reference box: paced()


@dataclass(frozen=True)
class S3Server:
    endpoint: str  # host:port
    client: Any  # a boto3 S3 client of the server

    @property
    def options(self) -> str:
        """The URI options that point pyarrow's S3 at this server."""
        return f"endpoint_override={self.endpoint}&scheme=http&region=us-east-1"

    def uri(self, bucket: str, *parts: str) -> str:
        """`s3://bucket/parts…?options`."""
        return join_uri(f"s3://{bucket}/?{self.options}", *parts)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_until_listening(port: int, process: subprocess.Popen[bytes]) -> None:
    allowed_s = paced(START_TIMEOUT_S)
    deadline = time.monotonic() + allowed_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the S3 server on port {port} exited with {process.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=paced(1)):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"the S3 server did not listen on port {port} in {allowed_s:.0f} s")


def list_moto_services_once() -> None:
    """Make moto's server answer its per-request question (does the Host header name one of its
    services?) from one listing of its package folder. moto 5.2 lists the folder, ~250 `isdir`
    calls, on every request: ~19 % of the server's CPU while Ray's processes read an image tree
    from it (py-spy). The listing does not change while the server runs: the same answer."""
    from moto import backends

    services = tuple(backends.list_of_moto_modules())
    backends.list_of_moto_modules = lambda: services  # type: ignore[assignment]


# `python -m moto.server`, its service listing made once.
SERVER = (
    "import sys; from raytrain_testkit.s3 import list_moto_services_once; "
    "list_moto_services_once(); from moto.server import main; main(sys.argv[1:])"
)


@contextmanager
def s3_server(buckets: Sequence[str] = ()) -> Iterator[S3Server]:
    """A moto server on a free loopback port with `buckets` made; stopped on exit."""
    import boto3

    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-c", SERVER, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until_listening(port, process)
        client = boto3.client(
            "s3",
            endpoint_url=f"http://127.0.0.1:{port}",
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )
        for bucket in buckets:
            client.create_bucket(Bucket=bucket)
        yield S3Server(f"127.0.0.1:{port}", client)
    finally:
        process.terminate()
        try:
            process.wait(timeout=paced(10))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
