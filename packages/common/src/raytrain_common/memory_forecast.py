"""How much memory one training worker will need, forecast without a GPU and without the weights.

A GPU that runs out of memory at step 1 costs a queue wait and a cluster start-up. The forecast
builds the pipeline's real model and loss under `FakeTensorMode` (shapes and dtypes, no storage),
runs one forward pass on a micro-batch of the run's size, and adds up every tensor autograd saves
for the backward pass: that is the activation memory, measured on the real code rather than taken
from a formula. Parameters, gradients and optimizer state follow from the parameter count, the
precision and the sharding (FSDP divides them by the ranks).

What it does not see: torch.compile's fusions (they keep fewer tensors, so a compiled run needs
less than forecast), kernels' temporary workspaces and the allocator's fragmentation, which the
fixed and proportional overheads below stand for.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

GiB = 2**30
# The CUDA context, cuBLAS/cuDNN workspaces and NCCL buffers: what a GPU process holds before the
# first tensor (~0.5-1 GiB on an H100).
FIXED_OVERHEAD_BYTES = 1 * GiB
# Fragmentation of the caching allocator and transient buffers, in proportion to the rest.
PROPORTIONAL_OVERHEAD = 0.10


@dataclass(frozen=True)
class TrainingStep:
    """One worker's training step, as the pipeline runs it, for the forecast.

    `build_model` and `make_batch` are called under FakeTensorMode: they must create tensors the
    usual way (no data read, no weights loaded). `loss` runs the forward pass the pipeline runs.
    """

    build_model: Callable[[], nn.Module]
    make_batch: Callable[[int], Any]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    micro_batch: int  # samples per forward pass on one worker
    grad_accum_steps: int
    compute_dtype: torch.dtype  # of the activations (bf16 under autocast or bf16 parameters)
    master_dtype: torch.dtype = torch.float32  # of the parameters the optimizer updates
    optimizer_bytes_per_param: int = 8  # AdamW: two fp32 moments; SGD with momentum: 4
    shard_states_over: int = 1  # FSDP: parameters, gradients and optimizer state split over ranks
    # DeepSpeed ZeRO over `ranks`: stage 2 splits gradients and optimizer state, stage 3 the
    # parameters too; `offload` keeps the optimizer state (and the parameters) in host memory.
    zero_stage: int = 0
    offload: str = "none"  # none, optimizer or optimizer+params
    ranks: int = 1
    # A bf16 copy of the parameters for compute when they are kept in fp32 (FSDP mixed precision).
    compute_copy_of_params: bool = False
    activation_checkpointing: bool = False
    blocks: Callable[[nn.Module], list[nn.Module]] | None = None  # what checkpointing wraps
    description: str = ""


@dataclass(frozen=True)
class Forecast:
    parameters: int  # count
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    overhead_bytes: int
    micro_batch: int

    @property
    def state_bytes(self) -> int:
        return self.parameter_bytes + self.gradient_bytes + self.optimizer_bytes

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.activation_bytes + self.overhead_bytes

    def describe(self) -> str:
        return (
            f"{self.total_bytes / GiB:.1f} GiB per worker: parameters "
            f"{self.parameter_bytes / GiB:.2f} + gradients {self.gradient_bytes / GiB:.2f} + "
            f"optimizer {self.optimizer_bytes / GiB:.2f} + activations "
            f"{self.activation_bytes / GiB:.2f} (micro-batch {self.micro_batch}) + overhead "
            f"{self.overhead_bytes / GiB:.2f}; {self.parameters / 1e6:.1f} M parameters"
        )


def saved_activation_bytes(step: TrainingStep, micro_batch: int, *, checkpointed: bool) -> int:
    """Bytes autograd keeps between one forward pass and its backward (parameters excluded)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True), _default_dtype(step.compute_dtype):
        model = step.build_model()  # built in the compute dtype: fake parameters cannot be cast
        if checkpointed and step.blocks is not None:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                checkpoint_wrapper,
            )

            blocks = step.blocks(model)
            for index, block in enumerate(list(blocks)):
                blocks[index] = checkpoint_wrapper(block)
        parameters = {id(p) for p in model.parameters()}
        saved: dict[int, int] = {}

        def remember(tensor: torch.Tensor) -> torch.Tensor:
            base = tensor
            while base._base is not None:  # a view keeps its base alive: count the base once
                base = base._base
            if id(base) not in parameters:
                saved[id(base)] = base.numel() * base.element_size()
            return tensor

        batch = step.make_batch(micro_batch)
        with torch.autograd.graph.saved_tensors_hooks(remember, lambda tensor: tensor):
            step.loss(model, batch)
        return sum(saved.values())


def forecast(step: TrainingStep, *, micro_batch: int | None = None) -> Forecast:
    """The peak memory of one worker for `step` (at another micro-batch size when given)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    micro = micro_batch or step.micro_batch
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = step.build_model()
        unique = {id(p): p for p in model.parameters()}.values()
        count = sum(p.numel() for p in unique)
        # Gradients and optimiser state exist for the parameters that train only (a frozen base
        # under LoRA has neither).
        trained = sum(p.numel() for p in unique if p.requires_grad)
    shards = max(1, step.shard_states_over)
    master = count * _bytes(step.master_dtype) / shards
    copy = count * _bytes(step.compute_dtype) if step.compute_copy_of_params else 0
    gradients = trained * _bytes(step.master_dtype) / shards
    optimizer = trained * step.optimizer_bytes_per_param / shards
    if step.zero_stage:
        ranks = max(1, step.ranks)
        gradients, optimizer = gradients / ranks, optimizer / ranks
        master = master / ranks if step.zero_stage == 3 else master
        optimizer = 0 if step.offload != "none" else optimizer
        master = 0 if step.offload == "optimizer+params" else master
    activations = saved_activation_bytes(step, micro, checkpointed=False)
    if step.activation_checkpointing and step.blocks is not None:
        # Checkpointed: each block's input is kept, and one block's activations are rebuilt at a
        # time.
        kept = saved_activation_bytes(step, micro, checkpointed=True)
        with FakeTensorMode(allow_non_fake_inputs=True):
            blocks = len(step.blocks(step.build_model()))
        activations = kept + activations // max(1, blocks)
    body = master + copy + gradients + optimizer + activations
    overhead = FIXED_OVERHEAD_BYTES + PROPORTIONAL_OVERHEAD * body
    return Forecast(
        parameters=count,
        parameter_bytes=int(master + copy),
        gradient_bytes=int(gradients),
        optimizer_bytes=int(optimizer),
        activation_bytes=int(activations),
        overhead_bytes=int(overhead),
        micro_batch=micro,
    )


# DeepSpeed's own order of trying (fastest first): more sharding, then host memory.
ZERO_STEPS = ((2, "none"), (2, "optimizer"), (3, "none"), (3, "optimizer"), (3, "optimizer+params"))


def fitting_knobs(
    step: TrainingStep,
    result: Forecast,
    limit_bytes: int,
    *,
    fsdp: bool,
    deepspeed: bool = False,
    on_gpu: bool = True,
) -> list[str]:
    """The changes that bring the forecast under `limit_bytes`, each with its own forecast; the
    global batch stays the same in every one (so does the learning-rate schedule). `deepspeed`: the
    pipeline has --deepspeed, and the first ZeRO stage (or offload, on GPUs: on a CPU the host
    memory is the same memory) past the step's own that fits is named."""
    knobs: list[str] = []
    fixed = result.total_bytes - result.activation_bytes * (1 + PROPORTIONAL_OVERHEAD)
    per_sample = result.activation_bytes / result.micro_batch * (1 + PROPORTIONAL_OVERHEAD)
    room = limit_bytes - fixed
    if room > per_sample:
        for split in range(2, result.micro_batch + 1):
            if result.micro_batch % split:
                continue
            micro = result.micro_batch // split
            if micro * per_sample <= room:
                knobs.append(
                    f"--grad-accum-steps {step.grad_accum_steps * split} (micro-batch {micro}, "
                    f"same global batch): ~{(fixed + micro * per_sample) / GiB:.1f} GiB"
                )
                break
    if step.blocks is not None and not step.activation_checkpointing:
        checkpointed = forecast(_with(step, activation_checkpointing=True))
        if checkpointed.total_bytes <= limit_bytes:
            knobs.append(f"--activation-checkpointing: ~{checkpointed.total_bytes / GiB:.1f} GiB")
    if fsdp:
        states = result.state_bytes * step.shard_states_over
        rest = result.total_bytes - result.state_bytes
        for ranks in (2, 4, 8, 16, 32, 64):
            if ranks > step.shard_states_over and rest + states / ranks <= limit_bytes:
                knobs.append(
                    f"FSDP over {ranks} GPUs (--num-workers {ranks}): ~"
                    f"{(rest + states / ranks) / GiB:.1f} GiB; the activations do not shrink"
                )
                break
    if deepspeed:
        current = (step.zero_stage, step.offload)
        later = ZERO_STEPS[ZERO_STEPS.index(current) + 1 :] if current in ZERO_STEPS else ZERO_STEPS
        for stage, offload in later:
            if offload != "none" and not on_gpu:
                continue
            candidate = forecast(_with(step, zero_stage=stage, offload=offload))
            if candidate.total_bytes <= limit_bytes:
                flags = f"--deepspeed zero{stage}" + (f" --offload {offload}" * (offload != "none"))
                knobs.append(f"{flags}: ~{candidate.total_bytes / GiB:.1f} GiB")
                break
    if not knobs:
        knobs.append(
            "none of micro-batch 1, activation checkpointing or sharding fits: a GPU with more "
            "memory, or a smaller model"
        )
    return knobs


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _with(step: TrainingStep, **changes: Any) -> TrainingStep:
    import dataclasses

    return dataclasses.replace(step, **changes)
