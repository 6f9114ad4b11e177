"""Ray start-up: join the cluster a RayJob gives us, or start a local one that cannot deadlock.

On a 2-core box, `ray.init()` offers 2 logical CPUs; two train workers take both, and Ray Data's
read tasks then wait for a CPU for ever, silently. A local cluster here offers the train workers'
CPUs plus some for Ray Data. Both kinds of cluster are checked for the resources a run asks for, so
a run that could never be scheduled fails with a message instead of hanging.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import shutil
import signal
import socket
import time
from collections.abc import Iterator
from typing import Any

import ray
import ray.util

from raytrain_common.configs import RayTrainSettings
from raytrain_common.storage import StoragePath, check_shared_for_cluster

log = logging.getLogger(__name__)

# Quiet and deterministic defaults for every process of the run (driver, controller, workers).
RUN_ENV = {
    # The print patch clashes with libraries that capture stdout and doubles lines.
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    # Ray Train's controller sleeps this long between looks at its workers (Ray's default: 2 s), and
    # each step of a worker group's start and end waits for one: every run starts and ends seconds
    # sooner, and a dead worker is noticed sooner. Ray Train passes it from the driver to the
    # controller; a poll is one small call per worker.
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
}
DATA_CPUS = 2.0
# Whether commands that start Ray leave its own lines on the console (their --verbose sets it).
_CONSOLE = {"verbose": False}

# Lines Ray's processes print that say nothing about this run, kept off the console (they stay in
# Ray's log folder). Errors and warnings of the run itself are never among them.
KNOWN_HARMLESS_LINES = (
    # Ray Train's own PreemptionWatcher actor is created with max_restarts and its arguments in the
    # object store; core_worker logs that at ERROR level on every run (ray-project/ray#53727).
    re.compile(r"PreemptionWatcher.*constructor arguments in the object store"),
    # Ray Train's controller and workers narrating the worker group's start-up, at INFO level.
    re.compile(
        r"^(Requesting resources|Attempting to start training worker group|"
        r"Started training worker group|Setting up process group for|- \(ip=)"
    ),
    # Ray Data's split coordinator narrating each execution of a dataset (every epoch), at INFO,
    # and its Parquet reader's sizing estimates (the train controller plans each dataset).
    re.compile(
        r"^(Starting execution of Dataset|Execution plan of Dataset|Progress bars disabled"
        r"|.*Dataset \S+ execution finished in"
        r"|Estimated parquet (encoding ratio|reader batch size))"
    ),
    # Ray Train's controller narrating async validation (ValidationConfig) at INFO, four lines a
    # checkpoint; its warnings (a validation that failed or timed out) still show.
    re.compile(
        r"^(Launched async validation task for checkpoint|Finished async validation task"
        r"|Running validations for checkpoint|Staged validations for checkpoint)"
    ),
    # Ray Train's controller finding the run's own snapshot on a rerun, at INFO: the run's own
    # "resuming at step N" line says it, and the advice to delete the folder does not apply.
    re.compile(
        r"^(A run snapshot was found in storage folder|This snapshot contains a list of "
        r"checkpoints|If you meant to start a brand new training job)"
    ),
)


def show_ray_output(verbose: bool) -> None:
    """A command's --verbose: Ray's own progress bars and internal lines on the console too."""
    _CONSOLE["verbose"] = verbose


class _TokenNotice(logging.Filter):
    """Ray's notice, at every local start, that token authentication is on (Ray's default, which
    this project relies on): drops that one line, never a warning that it is off."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled")


def _quiet_token_notice() -> None:
    # The logger of the module that prints it (a name only: no private call).
    notices = logging.getLogger("ray._private.authentication.authentication_token_setup")
    if not any(isinstance(f, _TokenNotice) for f in notices.filters):
        notices.addFilter(_TokenNotice())


class ResourceError(RuntimeError):
    """The cluster cannot give the run what it asks for; the message says what to change."""


def init_ray(train_cpus: float, *, data_cpus: float = DATA_CPUS) -> bool:
    """Join `RAY_ADDRESS` if set, else start a new local cluster; return True when it is local.

    A local cluster gets max(cores, train_cpus) + data_cpus logical CPUs: the extra ones are
    scheduling slots for Ray Data, not extra cores, and torch threads in each worker are limited to
    the worker's CPUs by Ray (OMP_NUM_THREADS), so the box is not oversubscribed by more than that.

    Its processes inherit RUN_ENV from this one's environment, so no runtime_env is set (a job's
    runtime_env would keep idle workers from serving the run's actors and tasks). Ray's prestart
    of one idle worker per logical CPU when the first driver connects is turned off: the run's
    actors and tasks start the workers they need (a 1-worker run on a 2-core box, 6 pairs: ~5
    CPU-seconds less in 5 of them, 2.2 s sooner on average). The dashboard stays: Ray
    Train's placement-group cleaner asks its State API whether the controller lives, and warns
    every few seconds without it.
    """
    os.environ.update({key: value for key, value in RUN_ENV.items() if key not in os.environ})
    if not _CONSOLE["verbose"]:
        _quiet_token_notice()
    if ray.is_initialized():
        return not os.environ.get("RAY_ADDRESS")
    address = os.environ.get("RAY_ADDRESS")
    if address:
        with sigterm_kept():
            ray.init(address=address, logging_level=logging.WARNING)
        quiet_ray_output(_CONSOLE["verbose"])
        log.info("joined Ray cluster at %s: %s", address, _describe(ray.cluster_resources()))
        return False
    cores = os.cpu_count() or 1
    os.environ.setdefault("RAY_prestart_worker_first_driver", "0")  # read by the new raylet
    num_cpus = math.ceil(max(cores, train_cpus) + data_cpus)
    # "local", not None: with None, Ray joins whatever cluster /tmp/ray/ray_current_cluster names
    # (the last `ray start` or test cluster, even one long dead) and then refuses num_cpus.
    # A cluster of your own is joined through RAY_ADDRESS (its address, or "auto").
    with sigterm_kept(), own_address_for_its_processes():
        ray.init(
            address="local",
            num_cpus=num_cpus,
            object_store_memory=object_store_bytes(),
            logging_level=logging.WARNING,
        )
    quiet_ray_output(_CONSOLE["verbose"])
    log.info("started a local Ray cluster: %s", _describe(ray.cluster_resources()))
    return True


@contextlib.contextmanager
def own_address_for_its_processes() -> Iterator[None]:
    """While a local cluster starts: its GCS on a free port, and that address in RAY_ADDRESS of the
    processes it starts (its raylet takes this process's environment), then RAY_ADDRESS as it was
    here. Ray Train's PlacementGroupCleaner looks its cluster up by address; without one it scans
    the machine's processes, and with a second cluster on the box (another command's, a test's)
    it fails ("Found multiple active Ray instances"), so the placement group of a run it was to
    clean up (a sweep's trial stopped by ASHA) stayed reserved and starved the next trial."""
    with socket.socket() as probe:
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    saved = {name: os.environ.get(name) for name in ("RAY_ADDRESS", "RAY_GCS_SERVER_PORT")}
    os.environ["RAY_GCS_SERVER_PORT"] = str(port)
    os.environ["RAY_ADDRESS"] = f"{ray.util.get_node_ip_address()}:{port}"
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def object_store_bytes() -> int | None:
    """A local cluster's object store where /dev/shm is smaller than Ray's default (30 % of the
    memory; a container's /dev/shm often is): 80 % of /dev/shm's free space, so the store stays in
    memory, where Ray would move all of it to /tmp's disk ("This will harm performance"). None
    (Ray's default) where /dev/shm is large enough, or too small to hold a useful store (Docker's
    64 MB: there Ray's fallback to /tmp is the better one)."""
    try:
        shm_free = shutil.disk_usage("/dev/shm").free
    except OSError:
        return None
    # Private: no public Ray API gives the memory Ray sizes its default store by (a container's
    # cgroup limit, not the host's memory); compared with it, the store is never larger than Ray's.
    default = 0.3 * ray._private.utils.get_system_memory()
    if shm_free >= default:
        return None
    usable = int(shm_free * 0.8)
    return usable if usable >= 512 * 2**20 else None


@contextlib.contextmanager
def sigterm_kept() -> Iterator[None]:
    """Keep a command's SIGTERM handler (cli.interruptible) across `ray.init`, which sets its own
    (sys.exit), so SIGTERM still ends the command as Ctrl-C does, in one line."""
    before = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if getattr(before, "raytrain_interrupt", False):
            with contextlib.suppress(ValueError):  # not the main thread
                signal.signal(signal.SIGTERM, before)


def start_ray_for_run(
    settings: RayTrainSettings, storage: StoragePath, inputs: dict[str, StoragePath]
) -> None:
    """Join or start the cluster, then refuse what cannot work before any worker starts.

    A node-local storage path or input (`inputs`: what it is, e.g. "--data-dir" → where) on a
    multi-node cluster, and a worker group the cluster cannot hold (after waiting 5 minutes for
    autoscaled nodes on a remote cluster), each fail with what to change.
    """
    show_ray_output(settings.verbose)
    is_local = init_ray(train_cpus=settings.num_workers * settings.cpus_per_worker)
    quiet_ray_output(settings.verbose)
    if not settings.verbose:
        log.info("Ray's own lines are in %s (--verbose shows them here)", ray_log_folder())
    nodes = alive_nodes()
    check_shared_for_cluster(storage, nodes, assume_shared=settings.storage_is_shared)
    for what, path in inputs.items():
        check_shared_for_cluster(path, nodes, assume_shared=settings.storage_is_shared, reads=what)
    hint = (
        "Drop --use-gpu / use --preset cpu, or set RAY_ADDRESS to a cluster with GPUs."
        if settings.use_gpu
        else "Lower --num-workers or --cpus-per-worker."
    )
    require_resources(settings.needed_resources(), wait_s=0 if is_local else 300, hint=hint)


def alive_nodes() -> int:
    return sum(1 for node in ray.nodes() if node.get("Alive"))


def require_resources(needed: dict[str, float], *, wait_s: float = 0.0, hint: str = "") -> None:
    """Raise if the cluster lacks `needed` (e.g. {"GPU": 4}); wait up to `wait_s` for it to grow.

    Remote clusters may still be adding worker pods when the driver starts, hence the wait; a local
    cluster never grows, so there the answer is immediate.
    """
    deadline = time.monotonic() + wait_s
    while True:
        available = ray.cluster_resources()
        missing = {
            name: amount
            for name, amount in needed.items()
            if available.get(name, 0.0) + 1e-9 < amount
        }
        if not missing:
            return
        if time.monotonic() >= deadline:
            wanted = ", ".join(f"{name}={amount:g}" for name, amount in missing.items())
            raise ResourceError(
                f"the run needs {wanted} but the Ray cluster has {_describe(available)}. "
                f"{hint}".strip()
            )
        time.sleep(2.0)


def _describe(resources: dict[str, float]) -> str:
    shown = [f"{name}={resources.get(name, 0.0):g}" for name in ("CPU", "GPU")]
    return ", ".join(shown) + f" on {alive_nodes()} node(s)"


class _RayInternalLines(logging.Filter):
    """Passes warnings and errors, and every line that is not Ray's own."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or f"{os.sep}ray{os.sep}" not in record.pathname


class _ProgressBarsOff(logging.Filter):
    """Ray Data warns that its progress bars are off: quiet_ray_output turned them off."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "progress bars" not in record.getMessage().lower()


def quiet_ray_output(verbose: bool) -> None:
    """Keep the console to the run's own lines: Ray Data's progress bars and execution plans, and
    Ray Train's per-report and per-checkpoint INFO lines, stay in Ray's log files
    (/tmp/ray/session_latest/logs) unless `verbose`. Call it in the driver and in each worker."""
    if verbose:
        return
    import ray.data

    data = ray.data.DataContext.get_current()  # datasets carry it to Ray Data's own processes
    data.enable_progress_bars = False
    data.print_on_execution_start = False
    data.enable_auto_log_stats = False
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, _RayInternalLines) for f in handler.filters):  # once per process
            handler.addFilter(_RayInternalLines())
    # Ray Train's worker-side loggers (one is named by its file path, so it is found by module).
    from ray.train.v2._internal.execution import context, storage

    for name in (context.__file__, storage.__name__, "ray.data"):
        logging.getLogger(name).setLevel(logging.WARNING)
    progress = logging.getLogger("ray.data._internal.progress")  # Ray's own handler, not root's
    if not any(isinstance(f, _ProgressBarsOff) for f in progress.filters):
        progress.addFilter(_ProgressBarsOff())
    _filter_streamed_lines()


def _filter_streamed_lines() -> None:
    """In the driver, drop KNOWN_HARMLESS_LINES from what Ray streams from its other processes.

    Ray prints those through one handler of its stream dispatcher; it is wrapped, once, with a
    filter. Private API: if Ray changes it, the lines simply show again.
    """
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:
        return
    with dispatcher._lock:
        handlers = []
        for name, handler in dispatcher.handlers:
            if name == "ray_print_logs" and not getattr(handler, "_raytrain_filtered", False):
                handler = _without_harmless_lines(handler)
            handlers.append((name, handler))
        dispatcher.handlers = handlers


# Ray Train's controller, when its autoscaling coordinator does not answer within its timeout (a
# busy box): a WARNING with a traceback, ~17 lines at every start, which its own words call "safe to
# ignore" when transient. One line says so instead; the traceback stays in Ray's log files.
SAFE_TO_IGNORE = re.compile(r"^Failed to (send resource request|get reserved resources) for ")
TRACEBACK_LINE = re.compile(
    r"^(Traceback \(most recent call last\):|\s|During handling of|The above exception|$"
    r"|[\w.]+(Error|Exception|Timeout)\b)"
)


def _without_harmless_lines(handler: Any) -> Any:
    in_traceback: dict[Any, bool] = {}  # by process: a traceback may continue in the next batch

    def filtered(data: dict[str, Any]) -> None:
        lines, pid = [], data.get("pid")
        for line in data.get("lines", []):
            if in_traceback.get(pid) and TRACEBACK_LINE.match(line):
                continue
            in_traceback[pid] = False
            if SAFE_TO_IGNORE.match(line):
                in_traceback[pid] = True
                line = (
                    "Ray Train's autoscaling request timed out (a busy CPU; Ray calls it safe "
                    f"to ignore when it passes): its traceback is in {ray_log_folder()}"
                )
            if not any(pattern.search(line) for pattern in KNOWN_HARMLESS_LINES):
                lines.append(line)
        if lines:
            handler({**data, "lines": lines})

    filtered._raytrain_filtered = True  # type: ignore[attr-defined]
    return filtered


def ray_log_folder() -> str:
    """This session's log folder on this node, where every Ray process writes its lines."""
    try:
        return str(ray._private.worker.global_worker.node.get_logs_dir_path())
    except Exception:
        return "/tmp/ray/session_latest/logs"
