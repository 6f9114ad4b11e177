"""MLflow tracking against real stores: the SQLite store a run writes by default, and a real
`mlflow server` on loopback that is stopped mid-run."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from raytrain_common.storage import redact_uri, resolve_storage
from raytrain_common.tracking import (
    CLIENT_ENV,
    MetricSink,
    TrackedRun,
    finish_tracked_run,
    flatten,
    open_tracked_run,
)
from raytrain_testkit.pace import paced


def open_run(folder: Path, run_name: str = "run", **changes: object) -> TrackedRun | None:
    location = resolve_storage(folder)
    arguments: dict = {
        "tracking": "mlflow",
        "tracking_uri": None,
        "storage": location,
        "run_dir": location.join(run_name),
        "experiment": "tests",
        "run_name": run_name,
        "params": {"lr": 0.1, "epochs": 2},
        "tags": {"pipeline": "tests"},
    }
    return open_tracked_run(**(arguments | changes))


def history(tracked: TrackedRun, key: str) -> list[tuple[int, float]]:
    client = MlflowClient(tracked.tracking_uri)
    return [(m.step, m.value) for m in client.get_metric_history(tracked.run_id, key)]


def test_a_run_logs_into_the_sqlite_store_under_the_storage_path_and_a_rerun_continues_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = open_run(tmp_path)
    assert first is not None
    assert first.tracking_uri == f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"
    sink = MetricSink(first)
    for step in range(1, 6):
        sink.log({"loss": 1.0 / step, "not_a_number": "x", "nan": float("nan")}, step)
    # flush: sent by the time it returns (before the thread is closed), as a sweep's report needs.
    assert sink.flush(timeout_s=paced(30))
    assert [step for step, _ in history(first, "loss")] == [1, 2, 3, 4, 5]
    sink.close()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "summary.json").write_text("{}")
    finish_tracked_run(
        first,
        artifacts=[resolve_storage(tmp_path / "run" / "summary.json")],
        tags={"best_checkpoint": "/somewhere/checkpoint_1", "unset": None},
    )

    # A rerun of the same run folder (after a crash it redoes steps 4 and 5): the same MLflow run,
    # the steps the store holds are not logged twice, the new ones are.
    with caplog.at_level(logging.WARNING):
        again = open_run(tmp_path, params={"lr": 0.1, "epochs": 3})
    assert again is not None and again.run_id == first.run_id
    assert "epochs (2 -> 3)" in caplog.text  # params are immutable: the change is named
    sink = MetricSink(again)
    for step in range(4, 9):
        sink.log({"loss": 1.0 / step}, step)
    sink.close()
    steps = [step for step, _ in history(again, "loss")]
    assert steps == list(range(1, 9))
    assert history(again, "loss")[0] == (1, 1.0)

    client = MlflowClient(again.tracking_uri)
    run = client.get_run(again.run_id)
    assert run.info.status == "RUNNING"  # reopened by the rerun
    assert run.data.params == {"lr": "0.1", "epochs": "2"}
    assert run.data.tags["best_checkpoint"] == "/somewhere/checkpoint_1"
    assert "unset" not in run.data.tags and "not_a_number" not in run.data.metrics
    assert "nan" not in run.data.metrics
    assert [a.path for a in client.list_artifacts(again.run_id)] == ["summary.json"]
    # The artifacts sit beside the store, under the storage path.
    assert list((tmp_path / "mlflow-artifacts").rglob("summary.json"))
    # Another run folder is another MLflow run in the same experiment.
    other = open_run(tmp_path, run_name="other")
    assert other is not None and other.run_id != first.run_id


def test_tracking_none_and_an_object_store_without_a_server_log_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert open_run(tmp_path, tracking="none") is None
    with caplog.at_level(logging.WARNING):
        remote = resolve_storage("s3://bucket/runs?endpoint_override=127.0.0.1:9&scheme=http")
        tracked = open_run(tmp_path, storage=remote, run_dir=remote.join("run"))
    assert tracked is None
    assert "set MLFLOW_TRACKING_URI (or --tracking-uri)" in caplog.text
    assert not (tmp_path / "mlflow.db").exists()
    MetricSink(None).log({"loss": 1.0}, 1)  # a sink of no run takes values and does nothing


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def mlflow_server(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A real `mlflow server` on loopback (its own process group: it starts a worker process),
    yielded once it answers its health check and a request to its store (`serving`): its socket
    listens before its worker has imported mlflow and made its store, and on a busy 2-core box a
    request in that gap waited past the client's 10 s timeout.
    One worker, not MLflow's default 4: each is a process importing mlflow, and this test sends a
    few requests at a time."""
    port = free_port()
    log_file = (tmp_path / "server.log").open("wb")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{tmp_path / 'server.db'}",
            "--default-artifact-root",
            (tmp_path / "server-artifacts").as_uri(),
        ],
        stdout=log_file,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        allowed_s = paced(180)  # ~15 s on an idle 2-core box
        deadline = time.monotonic() + allowed_s
        while not serving(url):
            if time.monotonic() > deadline or server.poll() is not None:
                log_text = (tmp_path / "server.log").read_text()[-2000:]
                pytest.fail(
                    f"mlflow server did not serve its store within {allowed_s:.0f} s:\n{log_text}"
                )
            time.sleep(0.5)
        yield url, server
    finally:
        with_group(server, signal.SIGKILL)


def serving(url: str) -> bool:
    """Whether the server at `url` answers its health check (a worker is up) and then a request
    that reads its store, which its worker makes at the first such request (MLflow's migrations on
    a new SQLite file: past the client's two 10 s tries once, beside the image's build)."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=paced(5)) as answer:
            if answer.status != 200:
                return False
        store = f"{url}/api/2.0/mlflow/experiments/get-by-name?experiment_name=Default"
        with urllib.request.urlopen(store, timeout=paced(60)) as answer:
            return answer.status == 200
    except OSError:  # refused, reset or timed out (URLError is an OSError)
        return False


def with_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, sig)
    process.wait(timeout=paced(30))


class Relay:
    """A TCP relay on loopback in front of the MLflow server. `cut` closes every connection through
    it and then closes each new one at once, counting them: the store has gone away for the sink
    (its pooled connections too). `mend` relays again: the store is back, with all it held."""

    def __init__(self, server_url: str) -> None:
        self._server_port = int(server_url.rsplit(":", 1)[1])
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        self._cut = False
        self.refused = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self) -> None:
        with self._lock:
            self._cut = True
            for connection in self._open:
                close_socket(connection)
            self._open.clear()

    def mend(self) -> None:
        with self._lock:
            self._cut = False

    def close(self) -> None:
        self.cut()
        self._listener.close()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):  # the listener was closed
            while True:
                client_side, _ = self._listener.accept()
                with self._lock:
                    if self._cut:
                        self.refused += 1
                        close_socket(client_side)
                        continue
                    try:
                        server_side = socket.create_connection(("127.0.0.1", self._server_port))
                    except OSError:  # the server is gone: so is the connection
                        close_socket(client_side)
                        continue
                    self._open += [client_side, server_side]
                for source, target in ((client_side, server_side), (server_side, client_side)):
                    threading.Thread(target=pump, args=(source, target), daemon=True).start()


def pump(source: socket.socket, target: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := source.recv(65536):
            target.sendall(data)
    close_socket(source)
    close_socket(target)


def close_socket(connection: socket.socket) -> None:
    with contextlib.suppress(OSError):
        connection.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv on it
    connection.close()


def wait_for_steps(tracked: TrackedRun, last: int) -> list[int]:
    deadline = time.monotonic() + paced(60)
    while len(history(tracked, "loss")) < last and time.monotonic() < deadline:
        time.sleep(0.5)
    return [step for step, _ in history(tracked, "loss")]


def test_a_server_receives_the_run_and_its_loss_mid_run_costs_a_warning_not_the_run(
    tmp_path: Path,
    mlflow_server: tuple[str, subprocess.Popen[bytes]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    server_url, server = mlflow_server
    relay = Relay(server_url)
    tracked = open_run(tmp_path, tracking_uri=relay.url)
    assert tracked is not None and tracked.tracking_uri == relay.url
    assert not (tmp_path / "mlflow.db").exists()  # a server given: no local store
    sink = MetricSink(tracked)
    for step in range(1, 4):
        sink.log({"loss": float(step)}, step)
    assert wait_for_steps(tracked, 3) == [1, 2, 3]
    assert sink.flush()  # and the sender has its answer: a lost answer would send them again

    with caplog.at_level(logging.WARNING):
        # The server hangs: the sender's request for step 4 cannot be answered before the
        # client's timeout, so a sink whose `log` waited on a send would take that long here.
        os.killpg(server.pid, signal.SIGSTOP)
        started = time.monotonic()
        for step in range(4, 200):
            sink.log({"loss": float(step)}, step)  # training goes on: never blocks, never raises
        request_timeout_s = float(CLIENT_ENV["MLFLOW_HTTP_REQUEST_TIMEOUT"])
        assert time.monotonic() - started < request_timeout_s / 2  # a bound, not a speed
        os.killpg(server.pid, signal.SIGCONT)  # back within the timeout: nothing is lost
        assert wait_for_steps(tracked, 199) == list(range(1, 200))
        assert sink.flush()

        # The store goes away: a warning, and the store is tried again every RETRY_EVERY_S (10 s),
        # not at every step: in a second of training at 50 steps/s, the failure (one connection
        # and its one retry) and nothing since. A sink that tried at every step would make ~100.
        relay.cut()
        for step in range(200, 250):
            sink.log({"loss": float(step)}, step)
            time.sleep(0.02)
        assert relay.refused <= 2
        assert "cannot be reached" in caplog.text
        relay.mend()  # back: the next retry sends what waited, once
        assert wait_for_steps(tracked, 249) == list(range(1, 250))
        assert "is back after" in caplog.text

        # The server is lost for good: training goes on, and the run's end costs a warning too.
        with_group(server, signal.SIGKILL)
        caplog.clear()
        for step in range(250, 260):
            sink.log({"loss": float(step)}, step)
        sink.close(timeout_s=paced(30))
        finish_tracked_run(tracked)
    assert "cannot be reached" in caplog.text
    assert "could not finish MLflow run" in caplog.text
    relay.close()
    # A run that starts while the server is down trains untracked, after a warning.
    with caplog.at_level(logging.WARNING):
        assert open_run(tmp_path, run_name="later", tracking_uri=server_url) is None
    assert "MLflow tracking is off for this run" in caplog.text


def test_a_tracking_uri_with_credentials_is_never_logged_with_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A store that fails at a URI holding a password (a database behind MLflow): the warning names
    the store with the password replaced, and no line of the log holds it; params that hold URIs
    (the config's) reach the store redacted too."""
    secret = "hunter2-not-a-real-password"
    uri = f"postgresql://mlflow:{secret}@127.0.0.1:9/mlflow"  # port 9 (discard): refused at once
    with caplog.at_level(logging.INFO):
        tracked = open_run(tmp_path, tracking="mlflow", tracking_uri=uri)
    assert tracked is None  # tracking off for this run, the run goes on
    assert "mlflow:***@127.0.0.1:9/mlflow" in caplog.text, caplog.text
    assert secret not in caplog.text, caplog.text
    assert flatten("", {"tracking_uri": uri, "data": {"dir": "s3://b/d?secret_key=abc"}}) == {
        "tracking_uri": "postgresql://mlflow:***@127.0.0.1:9/mlflow",
        "data.dir": "s3://b/d?secret_key=***",
    }


@pytest.mark.parametrize(
    ("uri", "shown"),
    [
        ("https://user:pw@mlflow.example.com/", "https://user:***@mlflow.example.com/"),
        ("https://token@mlflow.example.com", "https://***@mlflow.example.com"),
        (
            "s3://b/p?endpoint_override=h:9000&access_key=AK",
            "s3://b/p?endpoint_override=h:9000&access_key=***",
        ),
        ("https://x/y?sv=2024&sig=abc", "https://x/y?sv=2024&sig=***"),
        ("http://127.0.0.1:5000", "http://127.0.0.1:5000"),
        ("sqlite:////mnt/runs/mlflow.db", "sqlite:////mnt/runs/mlflow.db"),
        ("/mnt/runs/data", "/mnt/runs/data"),
    ],
)
def test_redact_uri(uri: str, shown: str) -> None:
    assert redact_uri(uri) == shown
