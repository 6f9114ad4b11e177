"""Experiment tracking with MLflow: one MLflow run per training run, continued on every resume.

Who logs what:
- the driver opens (or finds again) the MLflow run, logs the config as params and the system tags,
  and at the end the summary, the curves and the best checkpoint's URI (`open_tracked_run`,
  `finish_tracked_run`);
- rank 0 of the worker group logs the metrics with their step (`MetricSink`), so N workers never
  log N copies.

The MLflow run is found again by the run folder's URI (tag `raytrain.run_dir`): a worker restart, a
driver killed and rerun, or a rerun of the same `--run-name` all continue it. Steps at or below the
last one the store holds for a metric are not logged again, so the history has monotonic steps
and no duplicates (the pipelines resume exactly, so a redone step has the value already logged).

Tracking never costs the training run: a store that cannot be reached when the run opens turns
tracking off with a warning; one that goes away mid-run costs a warning, and the metrics logged
meanwhile wait in memory (bounded) and are sent when it comes back. `metrics.csv` and
`summary.json` are written either way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import queue
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raytrain_common.metrics import CURVES_FILE, METRICS_FILE, SUMMARY_FILE, package_versions
from raytrain_common.storage import StoragePath, redact_uri, redact_uri_in

log = logging.getLogger(__name__)

TRACKING_DB = "mlflow.db"
ARTIFACTS_FOLDER = "mlflow-artifacts"
RUN_DIR_TAG = "raytrain.run_dir"
PARENT_TAG = "mlflow.parentRunId"
# A server that has gone away must cost seconds, not MLflow's default of 7 retries with backoff
# (minutes per call): the sink retries on its own schedule instead.
CLIENT_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
_RETRY = object()  # the queue's "nothing new: time to retry" marker
PENDING_LIMIT = 100_000  # metric values kept while the store is away; older ones are dropped
RETRY_EVERY_S = 10.0


@dataclass(frozen=True)
class TrackedRun:
    """What a worker needs to log into the driver's MLflow run (picklable, sent in the loop
    config)."""

    tracking_uri: str
    run_id: str
    experiment_id: str


def default_tracking_uri(storage: StoragePath) -> str | None:
    """`$MLFLOW_TRACKING_URI`, else a SQLite store beside the runs when the storage is a local or
    mounted folder. SQLite cannot live in an object store: there tracking needs a server."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    if storage.is_local:
        return f"sqlite:///{Path(storage.path).resolve() / TRACKING_DB}"
    return None


def resolve_tracking_uri(
    tracking: str, tracking_uri: str | None, storage: StoragePath
) -> str | None:
    """The store a run logs to, or None when tracking is off (`--tracking none`, or no store)."""
    if tracking == "none":
        return None
    uri = tracking_uri or default_tracking_uri(storage)
    if uri is None:
        log.warning(
            "MLflow tracking is off: the storage path %s is an object store, where no SQLite store "
            "can live; set MLFLOW_TRACKING_URI (or --tracking-uri) to a tracking server",
            storage.uri,
        )
    return uri


def client(tracking_uri: str) -> Any:
    """An MLflow client with short HTTP timeouts (imported late: only tracked runs pay for it)."""
    os.environ.update({k: v for k, v in CLIENT_ENV.items() if k not in os.environ})
    if tracking_uri.startswith("sqlite:///"):
        Path(tracking_uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    from mlflow.tracking import MlflowClient

    # MLflow narrates creating and migrating a new SQLite store at INFO, on the console.
    for name in ("mlflow.store.db.utils", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    return MlflowClient(tracking_uri=tracking_uri)


def experiment_id(mlflow_client: Any, name: str, artifact_location: str | None) -> str:
    """The experiment's id, created on first use (two sweep trials may race to create it)."""
    found = mlflow_client.get_experiment_by_name(name)
    if found is not None:
        return str(found.experiment_id)
    try:
        return str(mlflow_client.create_experiment(name, artifact_location=artifact_location))
    except Exception:
        found = mlflow_client.get_experiment_by_name(name)
        if found is None:
            raise
        return str(found.experiment_id)


def find_run(mlflow_client: Any, experiment: str, run_dir_uri: str) -> Any | None:
    """The MLflow run that tracks this run folder, if one was opened before."""
    quoted = run_dir_uri.replace("'", "\\'")
    runs = mlflow_client.search_runs(
        [experiment],
        filter_string=f"tags.`{RUN_DIR_TAG}` = '{quoted}'",
        max_results=1,
        order_by=["attributes.start_time ASC"],
    )
    return runs[0] if runs else None


def open_tracked_run(
    *,
    tracking: str,
    tracking_uri: str | None,
    storage: StoragePath,
    run_dir: StoragePath,
    experiment: str,
    run_name: str,
    params: Mapping[str, Any],
    tags: Mapping[str, str],
    parent_run_id: str | None = None,
) -> TrackedRun | None:
    """Open the MLflow run of `run_dir`, or continue the one opened by an earlier attempt.

    Params are immutable in MLflow: a rerun that changed an option keeps the first value and says
    which ones differ (the run folder's checkpoints hold the config each attempt ran with).
    """
    uri = resolve_tracking_uri(tracking, tracking_uri, storage)
    if uri is None:
        return None
    try:
        mlflow_client = client(uri)
        artifacts = None
        if uri.startswith("sqlite:///") and not os.environ.get("MLFLOW_TRACKING_URI"):
            artifacts = (
                Path(uri.removeprefix("sqlite:///")).parent.joinpath(ARTIFACTS_FOLDER).as_uri()
            )
        experiment_key = experiment_id(mlflow_client, experiment, artifacts)
        existing = find_run(mlflow_client, experiment_key, run_dir.uri)
        all_tags = {RUN_DIR_TAG: run_dir.uri, **tags}
        if parent_run_id:
            all_tags[PARENT_TAG] = parent_run_id
        if existing is None:
            run = mlflow_client.create_run(experiment_key, run_name=run_name, tags=all_tags)
            logged: dict[str, str] = {}
            action = "opened"
        else:
            run = existing
            mlflow_client.update_run(run.info.run_id, status="RUNNING")
            for key, value in all_tags.items():
                mlflow_client.set_tag(run.info.run_id, key, value)
            logged = dict(run.data.params)
            action = "continues"
        run_id = run.info.run_id
        log_params(mlflow_client, run_id, params, logged)
    except Exception as error:
        log.warning(
            "MLflow tracking is off for this run: the store at %s failed (%s: %s); the run goes on "
            "and writes metrics.csv and summary.json as always",
            redact_uri(uri),
            type(error).__name__,
            redact_uri_in(str(error).splitlines()[0], uri) if str(error) else "",
        )
        return None
    log.info("MLflow run %s %s in %s (experiment %s)", run_id, action, redact_uri(uri), experiment)
    return TrackedRun(tracking_uri=uri, run_id=run_id, experiment_id=experiment_key)


def log_params(
    mlflow_client: Any, run_id: str, params: Mapping[str, Any], logged: Mapping[str, str]
) -> None:
    from mlflow.entities import Param

    fresh = {key: _param_text(value) for key, value in params.items() if key not in logged}
    changed = sorted(
        key for key, value in params.items() if key in logged and logged[key] != _param_text(value)
    )
    if changed:
        log.warning(
            "this rerun changed %s; MLflow keeps each param's first value (the checkpoints record "
            "the config of every attempt)",
            ", ".join(f"{key} ({logged[key]} -> {_param_text(params[key])})" for key in changed),
        )
    items = [Param(key, value) for key, value in fresh.items()]
    for start in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
        mlflow_client.log_batch(run_id, params=items[start : start + 100])


def _param_text(value: Any) -> str:
    return str(value)[:6000]


def flatten(prefix: str, values: Mapping[str, Any]) -> dict[str, Any]:
    """{"a": {"b": 1}} as {"prefix.a.b": 1}: nested config sections as MLflow param names."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}.{key}" if prefix else key
        if isinstance(value, Mapping):
            flat |= flatten(name, value)
        else:
            # A URI given as a setting (tracking, storage, data) keeps no credential in the store.
            flat[name] = redact_uri(value) if isinstance(value, str) else value
    return flat


def finish_tracked_run(
    tracked: TrackedRun | None,
    *,
    status: str = "FINISHED",
    artifacts: Sequence[StoragePath] = (),
    tags: Mapping[str, str | None] | None = None,
    metrics: Mapping[str, float] | None = None,
) -> None:
    """Attach the run's files, tag its outcome (e.g. the best checkpoint's URI), log its final
    metrics (e.g. the chosen checkpoint's test accuracy), and close it."""
    if tracked is None:
        return
    try:
        mlflow_client = client(tracked.tracking_uri)
        for key, number in (metrics or {}).items():
            mlflow_client.log_metric(tracked.run_id, key, float(number))
        for key, value in (tags or {}).items():
            if value is not None:
                mlflow_client.set_tag(tracked.run_id, key, str(value))
        with tempfile.TemporaryDirectory() as scratch:
            for artifact in artifacts:
                if not artifact.exists():
                    continue
                local = Path(artifact.path)
                if not artifact.is_local:  # MLflow uploads local files: fetch the object first
                    local = Path(scratch, local.name)
                    local.write_bytes(artifact.read_bytes())
                mlflow_client.log_artifact(tracked.run_id, str(local))
        mlflow_client.set_terminated(tracked.run_id, status=status)
    except Exception as error:
        log.warning(
            "could not finish MLflow run %s at %s (%s: %s); the run's files are in place",
            tracked.run_id,
            redact_uri(tracked.tracking_uri),
            type(error).__name__,
            redact_uri_in(str(error), tracked.tracking_uri),
        )


@contextlib.contextmanager
def failed_on_error(tracked: TrackedRun | None) -> Iterator[None]:
    """Mark the MLflow run FAILED when the training run raises (a killed driver leaves it RUNNING
    until the rerun continues it)."""
    try:
        yield
    except BaseException:
        finish_tracked_run(tracked, status="FAILED")
        raise


def _numbers(metrics: Mapping[str, Any]) -> dict[str, float]:
    return {
        key: float(value)
        for key, value in metrics.items()
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    }


class MetricSink:
    """Rank 0's metric logger: `log` never blocks training and never raises.

    A background thread sends the values; while the store is away they wait (at most
    PENDING_LIMIT values) and are retried every RETRY_EVERY_S seconds. `flush` waits, briefly, for
    what is queued to be sent: before an evaluation is reported to Ray, so a sweep that stops the
    trial on that report (ASHA) cannot kill it before the evaluation reached the store.
    """

    def __init__(self, tracked: TrackedRun | None) -> None:
        self.tracked = tracked
        self._queue: queue.Queue[tuple[dict[str, float], int, int] | threading.Event | None] = (
            queue.Queue()
        )
        self._last_step: dict[str, int] | None = None
        self._client: Any = None  # the sender thread's MLflow client, made as it starts
        self._thread: threading.Thread | None = None
        if tracked is not None:
            self._thread = threading.Thread(target=self._send_loop, name="mlflow-sink", daemon=True)
            self._thread.start()

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        if self.tracked is None:
            return
        values = _numbers(metrics)
        if values:
            self._queue.put((values, int(step), int(time.time() * 1000)))

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait at most `timeout_s` for what was logged so far to be sent (at once when the store is
        away: its values wait in memory as always); True if it was."""
        if self._thread is None:
            return True
        sent = threading.Event()
        self._queue.put(sent)
        return sent.wait(timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        """Send what is queued (waiting at most `timeout_s`), then stop the thread."""
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning(
                "MLflow at %s did not take the last metrics within %.0f s; they are in metrics.csv",
                redact_uri(self.tracked.tracking_uri) if self.tracked else "?",
                timeout_s,
            )
        self._thread = None

    def _send_loop(self) -> None:
        """The sender thread: take what was queued, send it, retry every RETRY_EVERY_S while the
        store is away, and release the flushes waiting on it."""
        pending: list[Any] = []
        # Connect now, not at the first value: the store's start-up (MLflow's imports, SQLAlchemy's
        # schema check: ~2.5 CPU-seconds) overlaps the run's own start instead of delaying the
        # first checkpoint's flush, which a preemption notice may leave only seconds for.
        failing_since = self._send(pending, None)
        tried_at = time.monotonic()
        closing = False
        while not closing:
            retry_at = tried_at + RETRY_EVERY_S
            try:
                first: object = self._queue.get(
                    timeout=max(retry_at - time.monotonic(), 0.0) if pending else None
                )
            except queue.Empty:
                first = _RETRY
            closing, flushes = self._take_queued(first, pending)
            del pending[:-PENDING_LIMIT]
            # While the store is away, a value logged waits for the next retry: trying the store
            # at every step would take the GIL from the training loop for each failed request.
            if failing_since is None or closing or time.monotonic() >= retry_at:
                failing_since = self._send(pending, failing_since)
                tried_at = time.monotonic()
            for flushed in flushes:
                flushed.set()

    def _take_queued(self, item: object, pending: list[Any]) -> tuple[bool, list[threading.Event]]:
        """`item`, then whatever else waits in the queue: metrics join `pending`; returns whether
        the sink is closing and the flushes to release once they are sent."""
        from mlflow.entities import Metric

        closing, flushes = False, []
        while True:
            if item is None:
                closing = True
            elif isinstance(item, threading.Event):
                flushes.append(item)
            elif isinstance(item, tuple):
                values, step, stamp = item
                pending.extend(Metric(k, v, stamp, step) for k, v in values.items())
            if closing or self._queue.empty():
                return closing, flushes
            item = self._queue.get()

    def _send(self, pending: list[Any], failing_since: float | None) -> float | None:
        """Send the metrics the store does not hold yet and empty `pending`; on failure keep them
        and warn once. Returns since when the store has been failing (None: it answers)."""
        assert self.tracked is not None
        try:
            if self._client is None:
                self._client = client(self.tracked.tracking_uri)
            if self._last_step is None:
                self._last_step = self._logged_steps(self._client)
            fresh = [m for m in pending if m.step > self._last_step.get(m.key, -1)]
            for start in range(0, len(fresh), 1000):  # MLflow's batch limit
                self._client.log_batch(self.tracked.run_id, metrics=fresh[start : start + 1000])
            for metric in fresh:
                self._last_step[metric.key] = max(metric.step, self._last_step.get(metric.key, -1))
            pending.clear()
        except Exception as error:
            if failing_since is None:
                log.warning(
                    "MLflow at %s cannot be reached (%s); training goes on, metrics wait in "
                    "memory and are in metrics.csv",
                    *(redact_uri(self.tracked.tracking_uri), type(error).__name__),
                )
                return time.monotonic()
            return failing_since
        if failing_since is not None:
            log.warning(
                "MLflow at %s is back after %.0f s; the metrics logged meanwhile are sent",
                *(redact_uri(self.tracked.tracking_uri), time.monotonic() - failing_since),
            )
        return None

    def _logged_steps(self, mlflow_client: Any) -> dict[str, int]:
        """The last step the store holds for each metric of the run (from an earlier attempt)."""
        run = mlflow_client.get_run(self.tracked.run_id) if self.tracked else None
        if run is None:
            return {}
        last: dict[str, int] = {}
        for key in run.data.metrics:
            history = mlflow_client.get_metric_history(run.info.run_id, key)
            last[key] = max((m.step for m in history), default=-1)
        return last


def system_tags(pipeline: str, version: str, *, workers: int, device: str) -> dict[str, str]:
    """The tags every pipeline's MLflow run carries, so runs of different stacks compare."""
    versions = package_versions("transformers", "mlflow")
    return {
        "pipeline": pipeline,
        "pipeline_version": version,
        "num_workers": str(workers),
        "device": device,
        **{f"version.{name}": value for name, value in versions.items()},
    }


def rank_zero_sink(loop_config: Mapping[str, Any], rank: int) -> MetricSink:
    """The sink of the MLflow run the driver opened (`loop_config["tracked"]`) on rank 0; every
    other rank, and every rank of an untracked run, gets one that logs nothing."""
    tracked = loop_config.get("tracked")
    return MetricSink(TrackedRun(**tracked) if tracked and rank == 0 else None)


_warming: threading.Thread | None = None


def warm_tracking_store(config: Any, storage: StoragePath) -> None:
    """Import MLflow and open (create, migrate) the run's store in a background thread, while Ray
    starts in the foreground: `train` reaches its first step ~2-3 s sooner. Side-effect free
    beyond creating the store, which the run would do anyway; errors surface in open_for_config."""
    global _warming
    uri = (
        None if config.tracking == "none" else config.tracking_uri or default_tracking_uri(storage)
    )
    if uri is None or not uri.startswith("sqlite:///"):
        return  # a server: nothing slow to create, and its errors belong to open_for_config

    def warm() -> None:
        with contextlib.suppress(Exception):
            client(uri).search_experiments(max_results=1)

    _warming = threading.Thread(target=warm, name="mlflow-store-warm-up", daemon=True)
    _warming.start()


def open_for_config(
    config: Any, storage: StoragePath, *, pipeline: str, version: str
) -> TrackedRun | None:
    """`open_tracked_run` for a pipeline's train config (a RayTrainSettings dataclass): its fields
    as params, the system tags, the experiment named after the pipeline unless set."""
    if _warming is not None:
        _warming.join(timeout=60)
    return open_tracked_run(
        tracking=config.tracking,
        tracking_uri=config.tracking_uri,
        storage=storage,
        run_dir=storage.join(config.run_name),
        experiment=config.experiment_name or pipeline,
        run_name=config.run_name,
        params=flatten("", dataclasses.asdict(config)),
        tags=system_tags(
            pipeline,
            version,
            workers=config.num_workers,
            device="gpu" if config.use_gpu else "cpu",
        ),
        parent_run_id=config.parent_run_id,
    )


def finish_for_summary(tracked: TrackedRun | None, run_dir: StoragePath, summary: Mapping) -> None:
    """The end every pipeline's run shares: its summary, metrics table and curves attached, the
    best and latest checkpoints' URIs as tags, the test metrics of the chosen checkpoint (the
    summary's "test", where a pipeline reports one) logged, the MLflow run closed."""
    test = summary.get("test") or {}
    finish_tracked_run(
        tracked,
        artifacts=[run_dir.join(name) for name in (SUMMARY_FILE, METRICS_FILE, CURVES_FILE)],
        tags={
            "best_checkpoint": summary.get("best_checkpoint"),
            "latest_checkpoint": summary.get("latest_checkpoint"),
        },
        metrics={
            key: value
            for key, value in test.items()
            if key.startswith("test_") and isinstance(value, (int, float))
        },
    )
