"""Ray Train's config objects, built from the typed config a pipeline extends.

A pipeline's config dataclass inherits `RayTrainSettings`, so one object (and one `--help`) holds
the model, data, loop and cluster options; the builders below turn it into what `TorchTrainer`
takes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig, UserCallback
from ray.train.torch import TorchConfig

from raytrain_common.options import option
from raytrain_common.storage import join_uri

PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]


class ConfigError(ValueError):
    """An option value that cannot work; the message names it and the fix."""


@dataclass(kw_only=True)
class StorageLocation:
    """Where every file of a pipeline lives; each command's config starts from one of these."""

    storage_path: str = option(
        "./runs",
        "Local folder, NFS mount, s3://bucket/prefix or gs://bucket/prefix shared by every node.",
    )


@dataclass(kw_only=True)
class DataLocation(StorageLocation):
    """A prepared dataset: `data_dir`, or the pipeline's data folder under the storage path.

    `prepare` writes where `train` reads because both ask `resolved_data_dir()`.
    """

    data_folder: ClassVar[str] = "data"
    data_dir: str | None = option(
        None, "Prepared dataset folder (none: <storage-path>/{data_folder})."
    )

    def default_data_folder(self) -> str:
        """The folder under the storage path; a config may pick it by its other options."""
        return self.data_folder

    def resolved_data_dir(self) -> str:
        return self.data_dir or join_uri(self.storage_path, self.default_data_folder())


@dataclass(kw_only=True)
class ConsoleSettings:
    """`--verbose` for commands that start Ray without training (prepare): see ray_start."""

    verbose: bool = option(
        False,
        "Show Ray's own progress bars and internal lines on the console, not only in its logs.",
    )


@dataclass(kw_only=True)
class RunLocation(StorageLocation):
    """One run's folder under the storage path: its checkpoints, metrics and summary."""

    run_name: str = option(
        "run",
        "Folder of this run under the storage path; "
        "rerunning with the same name continues the run.",
    )

    def check_options(self) -> None:
        """Called by `config_from_args` once the command line is read, before any work."""
        check_run_name(self.run_name)

    def run_dir(self) -> str:
        return join_uri(self.storage_path, self.run_name)


# Characters a run name may not hold: a folder separator (either OS's), an object store URI's
# query or fragment mark, NUL.
NOT_IN_RUN_NAMES = frozenset("/\\?#\0")


# What a distributed launcher (deepspeed, torchrun, accelerate launch, mpirun's wrappers) sets for
# each process it starts. Ray Train sets them itself, for each of its workers.
LAUNCHER_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")


def launcher_variables(environment: Mapping[str, str]) -> dict[str, str]:
    return {name: environment[name] for name in LAUNCHER_VARIABLES if name in environment}


def refuse_launcher_environment(environment: Mapping[str, str]) -> None:
    """A training command started by a distributed launcher is refused before Ray starts: each of
    the launcher's N copies would start a whole run of its own, into the same run folder, and the
    rendezvous variables it set (a MASTER_ADDR/MASTER_PORT, a LOCAL_RANK) name a process group
    that is not Ray Train's. Ray Train starts, ranks and connects the workers itself."""
    found = launcher_variables(environment)
    if found:
        named = ", ".join(f"{name}={value}" for name, value in found.items())
        raise ConfigError(
            f"this command was started with {named} in its environment, as a distributed "
            "launcher (deepspeed, torchrun, accelerate launch) sets for each process: Ray Train "
            "starts, ranks and connects the workers itself. Start the command once, without a "
            "launcher (--num-workers N for N workers, --use-gpu for GPUs), with those variables "
            "unset"
        )


def check_run_name(name: str) -> str:
    """A run name is one folder under the storage path: `..`, `/x` or `a/b` would put the run's
    checkpoints (and a rerun's deletions of old ones) somewhere else. Checked when the command line
    is read (`config_from_args`), before Ray starts."""
    if name in ("", ".", "..") or name != name.strip() or set(name) & NOT_IN_RUN_NAMES:
        raise ConfigError(
            f"--run-name {name!r}: give one folder name (letters, digits, '.', '-', '_'), not "
            "empty, '..', an absolute path or a path with '/': the run's folder is "
            "<storage-path>/<run-name>"
        )
    return name


@dataclass(kw_only=True)
class RayTrainSettings(RunLocation):
    """Cluster, storage and fault-tolerance options shared by every pipeline."""

    storage_is_shared: bool = option(
        False,
        "Treat a local-looking storage path as shared by every node (a mount type not recognised).",
    )
    num_workers: int = option(
        2, "Training workers (data-parallel ranks); the most of them when min_workers is set."
    )
    min_workers: int | None = option(
        None,
        "Make the run elastic: it starts with at least this many workers and grows to num_workers.",
    )
    elastic_resize_monitor_interval_s: float = option(
        60.0,
        "Elastic runs: seconds between checks for room to grow the worker group (a grow restarts "
        "the group from the latest checkpoint).",
    )
    use_gpu: bool = option(False, "One GPU per worker (or gpus_per_worker).")
    cpus_per_worker: float = option(1.0, "CPUs reserved per worker.")
    gpus_per_worker: float = option(1.0, "GPUs per worker when use_gpu.")
    placement_strategy: PlacementStrategy = option(
        "PACK", "Ray placement of workers: PACK fills nodes, SPREAD spreads over them."
    )
    accelerator_type: str | None = option(
        None, "Schedule only on nodes with this GPU type, e.g. A100 or H100."
    )
    worker_resource: str | None = option(
        None,
        "A custom Ray resource each worker takes one unit of (e.g. trainer, declared by the "
        "training nodes' `ray start --resources`): workers land only on those nodes, and a node "
        "group without it (CPU-only) is left to Ray Data.",
    )
    checkpoint_every_minutes: float = option(
        30.0,
        "Also checkpoint once this many minutes have passed since the last checkpoint, so a node "
        "lost without notice costs at most that much work however long an epoch is (0: off).",
    )
    train_node_labels: str | None = option(
        None,
        "Run the training workers only on nodes with these Ray node labels, key=value[,key=value] "
        "(set by `ray start --labels`, or a KubeRay group's `labels`), e.g. "
        "ray.io/node-group=train: Ray's own placement, in place of --worker-resource.",
    )
    num_to_keep: int = option(
        2, "Checkpoints kept: the best by the pipeline's score, plus always the latest."
    )
    max_failures: int = option(
        1,
        "Times the worker group is restarted from the "
        "latest checkpoint after a failure (-1: always).",
    )
    max_preemption_failures: int = option(
        -1,
        "Restarts after a node of the run is preempted (a spot reclaim announced by a drain), "
        "counted apart from max_failures (-1: always).",
    )
    preemption_grace_s: float = option(
        0.0,
        "Seconds the other workers may run past a preemption deadline (e.g. to finish an upload).",
    )
    storage_patience_s: float = option(
        300.0,
        "Seconds a checkpoint upload keeps retrying, with backoff, through a storage outage before "
        "the run fails naming the storage (the previous checkpoint stays loadable either way).",
    )
    backend: Literal["auto", "gloo", "nccl"] = option(
        "auto", "torch.distributed backend; auto means nccl on GPU, gloo on CPU."
    )
    timeout_s: int = option(1800, "torch.distributed collective timeout.")
    tracking: Literal["mlflow", "none"] = option(
        "mlflow",
        "Experiment tracking: mlflow logs params, metrics "
        "and artifacts from rank 0; none turns it off.",
    )
    tracking_uri: str | None = option(
        None,
        "MLflow tracking URI (a server, or sqlite:///…); none: $MLFLOW_TRACKING_URI, else "
        "sqlite:///<storage-path>/mlflow.db.",
    )
    experiment_name: str | None = option(
        None, "MLflow experiment the run is logged under (none: the pipeline's name)."
    )
    parent_run_id: str | None = option(
        None, "MLflow run to nest this run under (a sweep sets it for each trial)."
    )
    verbose: bool = option(
        False,
        "Show Ray's own progress bars and internal lines on the console, not only in its logs.",
    )

    def worker_counts(self) -> tuple[int, int]:
        """(fewest, most) workers the run may have."""
        return (self.min_workers or self.num_workers, self.num_workers)

    def validate_cluster_settings(self) -> None:
        """Raise on option values that cannot work, before anything starts."""
        low, high = self.worker_counts()
        if high < 1:
            raise ConfigError(f"num_workers={high}: it must be at least 1")
        if not 1 <= low <= high:
            raise ConfigError(
                f"min_workers={low} must lie between 1 and num_workers={high} (or be unset)"
            )
        if self.cpus_per_worker <= 0:
            raise ConfigError(f"cpus_per_worker={self.cpus_per_worker}: it must be above 0")
        if self.use_gpu and self.gpus_per_worker <= 0:
            raise ConfigError(f"gpus_per_worker={self.gpus_per_worker}: it must be above 0")
        if self.num_to_keep < 1:
            raise ConfigError(f"num_to_keep={self.num_to_keep}: keep at least 1 checkpoint")
        if self.elastic_resize_monitor_interval_s < 0:
            raise ConfigError(
                f"elastic_resize_monitor_interval_s={self.elastic_resize_monitor_interval_s}: "
                "it must be 0 or more"
            )
        if self.storage_patience_s < 0:
            raise ConfigError(f"storage_patience_s={self.storage_patience_s}: it must be 0 or more")
        node_labels(self.train_node_labels, "--train-node-labels")  # raises when malformed
        if self.checkpoint_every_minutes < 0:
            raise ConfigError(
                f"checkpoint_every_minutes={self.checkpoint_every_minutes}: it must be 0 or more"
            )
        if self.preemption_grace_s < 0:
            raise ConfigError(f"preemption_grace_s={self.preemption_grace_s}: it must be 0 or more")

    def needed_resources(self) -> dict[str, float]:
        """What the smallest allowed worker group takes from the cluster."""
        low, _ = self.worker_counts()
        needed = {"CPU": low * self.cpus_per_worker}
        if self.use_gpu:
            needed["GPU"] = low * self.gpus_per_worker
        if self.worker_resource:
            needed[self.worker_resource] = float(low)
        return needed


@dataclass(kw_only=True)
class TrainingSettings(RayTrainSettings, DataLocation):
    """The loop's flags every pipeline has: the batch, logging, the checkpoint policy inside a run,
    where it stops, the seed. A pipeline's `TrainConfig` adds its model's and optimiser's, and gives
    its own defaults with `option(value)` (the help stays this one)."""

    sample_noun: ClassVar[str] = "Samples"  # what a batch holds, in the help: Images, Sentences…
    run_name: str = option("run", "Run folder under the storage path; rerun to continue it.")
    global_batch_size: int = option(32, "{sample_noun} per optimiser step over all workers.")
    grad_accum_steps: int = option(1, "Micro-batches per optimiser step: memory per step ÷ this.")
    log_every_steps: int = option(50, "Progress line every N optimiser steps (rank 0).")
    checkpoint_every_steps: int = option(
        0,
        "Also checkpoint (and validate) every N optimiser steps, so a restart loses at most N "
        "(0: at the ends of epochs only).",
    )
    preemption_check_steps: int = option(
        10,
        "Every N steps, ask Ray whether a node of the run is being preempted; if so, checkpoint "
        "at once (0: never ask).",
    )
    stop_at_step: int | None = option(
        None,
        "Checkpoint and stop after this optimiser step of the run; the schedule still runs to "
        "the run's end, and a rerun continues (time-boxed or preemptible jobs).",
    )
    seed: int = option(0, "Seed of weights init and of every epoch's data order.")

    def validate_training_settings(self) -> None:
        """Raise on loop and cluster values that cannot work, naming the value and the fix."""
        self.validate_cluster_settings()
        check_batch_splits_for_every_worker_count(
            self.global_batch_size, self, self.grad_accum_steps
        )
        if self.log_every_steps <= 0:
            raise ConfigError(f"log_every_steps={self.log_every_steps}: it must be above 0")
        for name in ("checkpoint_every_steps", "preemption_check_steps"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)}: give 0 (off) or a step count")
        if self.stop_at_step is not None and self.stop_at_step < 1:
            raise ConfigError(
                f"stop_at_step={self.stop_at_step}: it must be at least 1 (beyond the run's last "
                "step the run simply ends there)"
            )


@dataclass(kw_only=True)
class EpochSettings:
    """A run counted in epochs over rows it may slice (smoke runs, tests, sweeps)."""

    epochs: int = option(2, "Total epochs of the run (a rerun continues up to this many).")
    warmup_fraction: float = option(0.1, "Share of all steps spent warming the learning rate up.")
    limit_train_rows: int | None = option(
        None, "Train on the first N rows only (smoke runs, tests; prepare wrote them shuffled)."
    )
    limit_val_rows: int | None = option(
        None, "Validate (choose checkpoints) on the first N validation rows only."
    )
    limit_test_rows: int | None = option(
        None, "Score the chosen checkpoint on the first N test rows only."
    )

    def validate_epochs(self) -> None:
        if self.epochs <= 0:
            raise ConfigError(f"epochs={self.epochs}: it must be above 0")
        if not 0 <= self.warmup_fraction < 1:
            raise ConfigError(f"warmup_fraction={self.warmup_fraction}: it must be in [0, 1)")
        for name in ("limit_train_rows", "limit_val_rows", "limit_test_rows"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name}={value}: give a positive row count or none")


@dataclass(kw_only=True)
class ValidationSettings:
    """Where the validation that picks checkpoints runs: in the loop, or in a Ray task beside it."""

    validation: Literal["inline", "async"] = option(
        "inline",
        "inline: the workers score the validation split at each validation point, training "
        "waits; async: a Ray task scores each checkpoint while training goes on (Ray Train's "
        "ValidationConfig), on --validation-cpus / --validation-gpus.",
    )
    validation_cpus: float = option(1.0, "CPUs of the async validation task.")
    validation_gpus: float = option(0.0, "GPUs of the async validation task (1: its own GPU).")

    def validate_validation(self) -> None:
        if self.validation not in ("inline", "async"):
            raise ConfigError(f"validation={self.validation!r}: choose inline or async")
        if self.validation_cpus <= 0 or self.validation_gpus < 0:
            raise ConfigError(
                f"validation_cpus={self.validation_cpus}, validation_gpus={self.validation_gpus}: "
                "give above 0 CPUs and 0 or more GPUs"
            )


def per_worker_batch_size(global_batch_size: int, workers: int, grad_accum_steps: int = 1) -> int:
    """Micro-batch size of one worker; the global batch must split evenly so every rank steps
    alike."""
    if grad_accum_steps < 1:
        raise ConfigError(f"grad_accum_steps={grad_accum_steps}: it must be at least 1")
    parts = workers * grad_accum_steps
    if global_batch_size < 1 or global_batch_size % parts:
        raise ConfigError(
            f"global_batch_size={global_batch_size} does not divide evenly over {workers} "
            f"worker(s) × {grad_accum_steps} accumulation step(s): choose a multiple of {parts}, "
            f"e.g. {max(parts, global_batch_size // parts * parts)}"
        )
    return global_batch_size // parts


def check_batch_splits_for_every_worker_count(
    global_batch_size: int, settings: RayTrainSettings, grad_accum_steps: int = 1
) -> None:
    """An elastic run may get any worker count between min and max: the global batch (and with it
    the learning rate and the steps per epoch) stays the same only if it splits evenly over each."""
    low, high = settings.worker_counts()
    uneven = [
        workers
        for workers in range(low, high + 1)
        if global_batch_size % (workers * grad_accum_steps)
    ]
    if not uneven:
        return
    if low == high:
        per_worker_batch_size(global_batch_size, high, grad_accum_steps)  # names the fix
    need = math.lcm(*range(low, high + 1)) * grad_accum_steps
    raise ConfigError(
        f"global_batch_size={global_batch_size} does not split evenly over {uneven} worker(s) "
        f"× {grad_accum_steps} accumulation step(s), and an elastic run (min_workers={low}, "
        f"num_workers={high}) may get any count in between: choose a multiple of {need}, "
        "or a range of worker counts that all divide it"
    )


def node_labels(text: str | None, flag: str) -> dict[str, str] | None:
    """`key=value[,key=value]` as the label selector Ray takes (None for none); an error naming
    `flag` when it is not of that form."""
    if not text:
        return None
    pairs = [pair.split("=", 1) for pair in text.split(",")]
    if any(len(pair) != 2 or not pair[0].strip() or not pair[1].strip() for pair in pairs):
        raise ConfigError(
            f"{flag}={text!r}: give key=value pairs separated by commas, as the nodes were "
            "labelled (`ray start --labels ray.io/node-group=train`)"
        )
    return {key.strip(): value.strip() for key, value in pairs}


def build_scaling_config(settings: RayTrainSettings) -> ScalingConfig:
    low, high = settings.worker_counts()
    resources: dict[str, float] = {"CPU": settings.cpus_per_worker}
    if settings.use_gpu:
        resources["GPU"] = settings.gpus_per_worker
    if settings.worker_resource:
        resources[settings.worker_resource] = 1.0
    return ScalingConfig(
        num_workers=high if low == high else (low, high),
        use_gpu=settings.use_gpu,
        resources_per_worker=resources,
        placement_strategy=settings.placement_strategy,
        accelerator_type=settings.accelerator_type,
        label_selector=node_labels(settings.train_node_labels, "--train-node-labels"),
        elastic_resize_monitor_interval_s=settings.elastic_resize_monitor_interval_s,
    )


def build_run_config(
    settings: RayTrainSettings,
    *,
    score_attribute: str | None,
    score_order: Literal["max", "min"] = "max",
    callbacks: Sequence[UserCallback] = (),
) -> RunConfig:
    return RunConfig(
        name=settings.run_name,
        callbacks=list(callbacks),
        storage_path=settings.storage_path,
        checkpoint_config=CheckpointConfig(
            num_to_keep=settings.num_to_keep,
            checkpoint_score_attribute=score_attribute,
            checkpoint_score_order=score_order,
        ),
        failure_config=FailureConfig(
            max_failures=settings.max_failures,
            max_preemption_failures=settings.max_preemption_failures,
            preemption_grace_s=settings.preemption_grace_s,
        ),
    )


def build_torch_config(settings: RayTrainSettings) -> TorchConfig:
    backend = settings.backend
    if backend == "auto":
        backend = "nccl" if settings.use_gpu else "gloo"
    return TorchConfig(backend=backend, timeout_s=settings.timeout_s)
