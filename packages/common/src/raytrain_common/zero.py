"""DeepSpeed ZeRO through the Hugging Face Trainer inside Ray Train workers.

What a Trainer-based pipeline needs unchanged: the flags (`DeepSpeedSettings`), the DeepSpeed
config built from them (`deepspeed_config`, the Trainer fills every `"auto"` from its own
arguments), the one step that lets the Trainer see Ray Train's world on a machine without GPUs
(`join_ray_world`), what a checkpoint records of the engine (`engine_record`) and the checks a
resume makes against it, and the consolidation of a ZeRO checkpoint's shards into one set of
weights (`consolidated_state_dict`).

Why `join_ray_world`: with no GPU, accelerate 1.15 finds no communication backend for a DeepSpeed
run (it looks for one only among accelerators) and counts one process, while DeepSpeed's engine
joins the process group Ray Train made and sees them all. The Trainer then asks for a batch sized
for a world of one and DeepSpeed refuses it (`train_batch_size` ≠ micro-batch × accumulation ×
world). Setting accelerate's shared state up first, on gloo, makes both count Ray Train's workers;
the Trainer reuses it (`accelerator_config={"use_configured_state": True}`). On GPUs accelerate
finds NCCL itself and nothing is pre-configured.

On CPU, DeepSpeed runs on its CPU accelerator (`DS_ACCELERATOR=cpu`, gloo where oneCCL is absent)
and compiles two small ops with the system's C++ compiler on first use (the shared-memory
collective and, with offload, its CPU Adam), cached per machine under ~/.cache/torch_extensions:
`prebuild_cpu_ops` does that once, where an environment is set up.
"""

from __future__ import annotations

import contextlib
import glob
import io
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from raytrain_common.configs import ConfigError
from raytrain_common.options import option

ZeroStage = Literal["none", "zero2", "zero3"]
Offload = Literal["none", "optimizer", "optimizer+params"]
CONFIG_FILE = "deepspeed_config.json"  # beside the run: the config as the Trainer filled it
STAGES = {"none": 0, "zero2": 2, "zero3": 3}


@dataclass(kw_only=True)
class DeepSpeedSettings:
    """`--deepspeed` and `--offload`: ZeRO's sharding of optimiser state, gradients (zero2) and
    parameters (zero3) across the workers, and what moves to host memory."""

    deepspeed: ZeroStage = option(
        "none",
        "Train through DeepSpeed ZeRO: zero2 shards optimiser state and gradients over the "
        "workers, zero3 the parameters too (none: DDP).",
    )
    offload: Offload = option(
        "none",
        "With --deepspeed: keep the optimiser state (optimizer) or it and the parameters "
        "(optimizer+params, zero3 only) in host memory; the optimiser steps on the CPU.",
    )

    def validate_deepspeed(self) -> None:
        if self.deepspeed not in STAGES:
            raise ConfigError(f"--deepspeed {self.deepspeed}: choose none, zero2 or zero3")
        if self.offload not in ("none", "optimizer", "optimizer+params"):
            raise ConfigError(
                f"--offload {self.offload}: choose none, optimizer or optimizer+params"
            )
        if self.offload != "none" and self.deepspeed == "none":
            raise ConfigError(
                f"--offload {self.offload} without --deepspeed: offload is ZeRO's; add "
                "--deepspeed zero2 (optimizer) or --deepspeed zero3"
            )
        if self.offload == "optimizer+params" and self.deepspeed != "zero3":
            raise ConfigError(
                f"--offload optimizer+params with --deepspeed {self.deepspeed}: only ZeRO-3 "
                "shards (and so can offload) the parameters; use --deepspeed zero3 or --offload "
                "optimizer"
            )

    @property
    def zero_stage(self) -> int:
        return STAGES[self.deepspeed]


def deepspeed_config(stage: int, offload: str, use_gpu: bool) -> dict[str, Any]:
    """The DeepSpeed config of a run: ZeRO `stage` and `offload` from its flags, everything the
    Trainer knows left to `"auto"` (batch sizes, accumulation, clipping, precision, bucket sizes).

    No optimiser or scheduler: the Trainer's own AdamW (with its weight-decay groups) and schedule
    are used, as in the run's DDP mode, so both modes train the same recipe; with the optimiser
    offloaded, accelerate swaps that AdamW for DeepSpeed's CPU Adam with the same groups.
    ZeRO-3 checkpoints keep the shards only (no 16-bit gather at every save): `export`,
    `evaluate` and `predict` consolidate them in full precision (`consolidated_state_dict`)."""
    zero: dict[str, Any] = {
        "stage": stage,
        "overlap_comm": use_gpu,  # overlaps on GPU streams; on CPU it only adds buffers
        "contiguous_gradients": True,
        "reduce_bucket_size": "auto",
    }
    if offload in ("optimizer", "optimizer+params"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": use_gpu}
    if offload == "optimizer+params":
        zero["offload_param"] = {"device": "cpu", "pin_memory": use_gpu}
    if stage == 3:
        zero |= {
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
            "stage3_gather_16bit_weights_on_model_save": False,
        }
    return {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
        "zero_optimization": zero,
        "wall_clock_breakdown": False,
    }


def trainer_arguments(settings: DeepSpeedSettings, use_gpu: bool) -> dict[str, Any]:
    """The `TrainingArguments` keywords of a DeepSpeed run (none of DDP's): the config, and on
    CPU the shared state `join_ray_world` set up, which the Trainer must reuse."""
    if settings.deepspeed == "none":
        return {}
    arguments: dict[str, Any] = {
        "deepspeed": deepspeed_config(settings.zero_stage, settings.offload, use_gpu)
    }
    if not use_gpu:
        arguments |= {"use_cpu": False, "accelerator_config": {"use_configured_state": True}}
    return arguments


def join_ray_world(use_gpu: bool, verbose: bool = False) -> None:
    """In a Ray Train worker, before `TrainingArguments`: on CPU, make accelerate (and so the
    Trainer) count Ray Train's workers on gloo, as DeepSpeed does (the module docstring says why).
    Unless `verbose`, DeepSpeed's narration stays off the console (`quiet_deepspeed`)."""
    if not verbose:
        quiet_deepspeed()
    if use_gpu:
        return
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from accelerate import PartialState

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # read by PartialState while it starts
    try:
        # DeepSpeed prints a line per process as it loads its shared-memory collective.
        printed = contextlib.nullcontext() if verbose else contextlib.redirect_stdout(io.StringIO())
        with printed:
            PartialState(backend="gloo")
    finally:
        del os.environ["ACCELERATE_USE_DEEPSPEED"]


class _DropLines(logging.Filter):
    def __init__(self, *fragments: str) -> None:
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(fragment in message for fragment in self.fragments)


def quiet_deepspeed() -> None:
    """Off the console: DeepSpeed 0.19's calls of torch's renamed collectives (a FutureWarning
    at every step), and the Trainer's advice, at every ZeRO-3 save, to recover weights with
    zero_to_fp32.py (`consolidated_state_dict` does that where weights are read)."""
    warnings.filterwarnings("ignore", r"`torch\.distributed\.\w+` is deprecated", FutureWarning)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # its INFO: a line per N steps
    # torch's extension loader warns, on a machine without CUDA, that it found no CUDA runtime.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    trainer_log = logging.getLogger("transformers.trainer")
    if not any(isinstance(f, _DropLines) for f in trainer_log.filters):
        trainer_log.addFilter(_DropLines("stage3_gather_16bit_weights_on_model_save=false"))


def engine_record(settings: DeepSpeedSettings, world_size: int) -> dict[str, Any]:
    """What a checkpoint notes of the engine that wrote it: the version, stage and world size its
    shards depend on (`check_resume` compares them)."""
    deepspeed = import_deepspeed()
    return {
        "version": deepspeed.__version__,
        "stage": settings.deepspeed,
        "offload": settings.offload,
        "world_size": world_size,
    }


def check_resume(
    record: dict[str, Any] | None,
    settings: DeepSpeedSettings,
    world_size: int,
    checkpoint: str,
    export_command: str,
) -> None:
    """Refuse, before any worker starts, a resume the checkpoint's ZeRO shards cannot take:
    another stage (or DeepSpeed against DDP), another worker count, another DeepSpeed version.
    `record`: the checkpoint's `engine_record` (None: a DDP checkpoint)."""
    fresh = f"or start a new run from its weights: `{export_command}`, then --model <export>"
    if record is None:
        if settings.deepspeed != "none":
            raise ConfigError(
                f"checkpoint {checkpoint} was written by a DDP run: resume it without "
                f"--deepspeed, {fresh}"
            )
        return
    if settings.deepspeed != record["stage"]:
        raise ConfigError(
            f"checkpoint {checkpoint} holds DeepSpeed {record['stage']} shards: resume it with "
            f"--deepspeed {record['stage']}, {fresh}"
        )
    if world_size != record["world_size"]:
        raise ConfigError(
            f"checkpoint {checkpoint} is split over {record['world_size']} workers by ZeRO "
            f"(each holds its part of the optimiser state), and this run has {world_size}: "
            f"resume with --num-workers {record['world_size']}, {fresh} (DeepSpeed's "
            "ds_to_universal converts shards for another worker count)"
        )
    deepspeed = import_deepspeed()
    if record["version"] != deepspeed.__version__:
        raise ConfigError(
            f"checkpoint {checkpoint} was written by DeepSpeed {record['version']} and this "
            f"environment has {deepspeed.__version__}, whose ZeRO checkpoint layout may differ: "
            f"install deepspeed=={record['version']} to resume it, {fresh}"
        )


def name_cpu_accelerator() -> None:
    """Tell DeepSpeed it runs on the CPU where no GPU is: else every process that imports it (as
    transformers and PEFT do on their own, DeepSpeed or not) warns that it guessed so."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def import_deepspeed() -> Any:
    """`deepspeed`, told where it runs (`name_cpu_accelerator`)."""
    name_cpu_accelerator()
    import deepspeed

    return deepspeed


def is_zero_checkpoint(folder: str | os.PathLike[str]) -> bool:
    """A folder DeepSpeed's engine saved into (its `latest` tag and global_step*/ shards)."""
    return bool(glob.glob(os.path.join(folder, "global_step*")))


def has_consolidated_weights(folder: str | os.PathLike[str]) -> bool:
    """Whether a Hugging Face folder holds its weights (a ZeRO-3 checkpoint holds shards only)."""
    names = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
    return any((Path(folder) / name).exists() for name in names)


class UnsafeCheckpointError(ConfigError):
    """A ZeRO checkpoint file that refers to code beyond what DeepSpeed's files hold: one line."""


def check_zero_pickles(folder: str | os.PathLike[str], rank: int | None = None) -> None:
    """Prove a ZeRO checkpoint's files safe to unpickle before DeepSpeed reads them.

    DeepSpeed unpickles its shards unrestricted (`weights_only=False`), which runs whatever code a
    file names. Each file (with `rank`, only those that rank reads) is first read by torch's
    restricted unpickler (`weights_only=True`), allowing the few DeepSpeed classes its files hold
    besides tensors and containers (the ZeRO stage enum, the loss scalers); a file naming anything
    else is refused. DeepSpeed then reads the same bytes. Costs one more read of the files."""
    import torch

    deepspeed = import_deepspeed()
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler

    allowed = [deepspeed.runtime.zero.config.ZeroStageEnum, LossScaler, DynamicLossScaler]
    for path in sorted(Path(folder).glob("global_step*/*.pt")):
        other_ranks = rank is not None and not path.name.startswith(f"zero_pp_rank_{rank}_")
        if other_ranks and "zero_pp_rank_" in path.name:
            continue
        try:
            with torch.serialization.safe_globals(allowed):
                torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as error:  # the unpickler's refusal, whatever it names
            raise UnsafeCheckpointError(
                f"{path} is not loaded: torch's restricted unpickler refuses it "
                f"({str(error).splitlines()[-1][:200]}); a ZeRO checkpoint holds tensors and "
                "DeepSpeed's own stage and loss-scaler objects only. Use checkpoints your runs "
                "wrote, or load this one yourself if you trust where it came from"
            ) from error


def consolidated_state_dict(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """The full-precision weights of a ZeRO checkpoint, gathered from every worker's shard
    (DeepSpeed's own zero_to_fp32 reader, after `check_zero_pickles`), on the CPU: what `export`
    saves in one file."""
    check_zero_pickles(folder)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    # It narrates each file and draws progress bars; the caller reports what it made.
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return dict(get_fp32_state_dict_from_zero_checkpoint(str(folder)))


def prebuild_cpu_ops() -> None:
    """Compile DeepSpeed's CPU ops (shared-memory collective, CPU Adam) into the per-machine cache
    now, so no training run or timed test pays for it (~1 minute on 2 cores)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.ops.op_builder.cpu import CPUAdamBuilder, ShareMemCommBuilder

    for builder in (ShareMemCommBuilder(), CPUAdamBuilder()):
        builder.load(verbose=False)


if __name__ == "__main__":  # python -m raytrain_common.zero: the environment's one-time build
    prebuild_cpu_ops()
