"""The memory forecast measures what autograd saves on fake tensors: exact on a model whose saved
tensors are known, and its knobs each fit the limit they were asked for."""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from raytrain_common.memory_forecast import (
    FIXED_OVERHEAD_BYTES,
    GiB,
    TrainingStep,
    fitting_knobs,
    forecast,
    saved_activation_bytes,
)


def mlp_step(micro_batch: int = 32, **changes: object) -> TrainingStep:
    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 10))

    def make_batch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty(size, 1024), torch.zeros(size, dtype=torch.long)

    def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(model(batch[0]), batch[1])

    settings: dict[str, object] = {"grad_accum_steps": 1, "compute_dtype": torch.float32, **changes}
    return TrainingStep(
        build_model=settings.pop("build_model", build),  # type: ignore[arg-type]
        make_batch=make_batch,
        loss=loss,
        micro_batch=micro_batch,
        **settings,  # type: ignore[arg-type]
    )


def test_saved_activations_are_exactly_what_autograd_keeps() -> None:
    # The input (for the first weight's gradient), the ReLU's output (its own backward and the
    # second layer's weight gradient: one tensor, counted once), cross-entropy's log-softmax and
    # its targets, and the loss's total weight (a scalar). No parameter is counted, and nothing is
    # allocated for real.
    batch = 32
    expected = batch * 1024 * 4 + batch * 4096 * 4 + batch * 10 * 4 + batch * 8 + 4
    assert saved_activation_bytes(mlp_step(), batch, checkpointed=False) == expected
    assert saved_activation_bytes(mlp_step(), 64, checkpointed=False) == 2 * expected - 4
    half = saved_activation_bytes(mlp_step(compute_dtype=torch.bfloat16), batch, checkpointed=False)
    assert half == batch * (1024 + 4096 + 10) * 2 + batch * 8 + 2


def test_states_follow_the_optimizer_and_the_sharding() -> None:
    parameters = 1024 * 4096 + 4096 + 4096 * 10 + 10
    plain = forecast(mlp_step())
    assert plain.parameters == parameters
    assert plain.parameter_bytes == plain.gradient_bytes == parameters * 4
    assert plain.optimizer_bytes == parameters * 8  # AdamW's two moments
    sharded = forecast(
        mlp_step(shard_states_over=4, compute_copy_of_params=True, compute_dtype=torch.bfloat16)
    )
    assert sharded.optimizer_bytes == parameters * 8 // 4
    assert (
        sharded.parameter_bytes == parameters * 4 // 4 + parameters * 2
    )  # + the gathered bf16 copy
    assert plain.total_bytes > plain.state_bytes + plain.activation_bytes + FIXED_OVERHEAD_BYTES - 1


def test_frozen_parameters_have_no_gradients_and_no_optimizer_state() -> None:
    """A frozen base (LoRA's): its weights are held, but neither gradients nor AdamW's moments, and
    the input of a frozen first layer is not kept for a weight gradient that is never formed."""

    def frozen_first() -> nn.Module:
        model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 10))
        model[0].requires_grad_(False)
        return model

    step = mlp_step(build_model=frozen_first)
    result = forecast(step)
    trained = 4096 * 10 + 10
    assert result.parameters == 1024 * 4096 + 4096 + trained
    assert result.parameter_bytes == result.parameters * 4
    assert result.gradient_bytes == trained * 4 and result.optimizer_bytes == trained * 8
    batch = 32
    assert result.activation_bytes == batch * 4096 * 4 + batch * 10 * 4 + batch * 8 + 4


def test_zero_shards_states_over_the_ranks_and_offload_moves_them_to_host_memory() -> None:
    """ZeRO-2: gradients and optimizer state ÷ ranks; ZeRO-3: parameters too; offload: none of
    the optimizer state (and with params, none of the parameters) on the device. Past the limit, the
    first of DeepSpeed's steps that fits is named with its forecast; on a CPU no offload is."""
    parameters = 1024 * 4096 + 4096 + 4096 * 10 + 10
    zero2 = forecast(mlp_step(zero_stage=2, ranks=4))
    assert zero2.parameter_bytes == parameters * 4
    assert (zero2.gradient_bytes, zero2.optimizer_bytes) == (parameters, parameters * 2)
    zero3 = forecast(mlp_step(zero_stage=3, ranks=4, offload="optimizer"))
    assert (zero3.parameter_bytes, zero3.optimizer_bytes) == (parameters, 0)
    both = forecast(mlp_step(zero_stage=3, ranks=4, offload="optimizer+params"))
    assert both.parameter_bytes == both.optimizer_bytes == 0
    step = mlp_step(ranks=4)
    result = forecast(step)
    offloaded = forecast(mlp_step(zero_stage=2, ranks=4, offload="optimizer")).total_bytes
    limit = offloaded + 1  # ZeRO-2 alone does not fit; ZeRO-3 (smaller still) comes after
    assert forecast(mlp_step(zero_stage=2, ranks=4)).total_bytes > limit
    knobs = fitting_knobs(step, result, limit, fsdp=False, deepspeed=True)
    assert [k for k in knobs if k.startswith("--deepspeed")] == [
        f"--deepspeed zero2 --offload optimizer: ~{offloaded / GiB:.1f} GiB"
    ]
    on_cpu = fitting_knobs(step, result, limit, fsdp=False, deepspeed=True, on_gpu=False)
    assert [k.split(":")[0] for k in on_cpu if k.startswith("--deepspeed")] == ["--deepspeed zero3"]


def test_each_knob_fits_the_limit_it_was_asked_for() -> None:
    step = mlp_step(micro_batch=4096)
    result = forecast(step)
    limit = int(result.total_bytes - result.activation_bytes * 0.6)
    knobs = fitting_knobs(step, result, limit, fsdp=True)
    accumulation = next(knob for knob in knobs if knob.startswith("--grad-accum-steps"))
    assert "same global batch" in accumulation
    split = int(accumulation.split()[1])
    assert forecast(step, micro_batch=4096 // split).total_bytes <= limit
    assert float(accumulation.rsplit("~", 1)[1].split()[0]) <= limit / GiB
    hopeless = fitting_knobs(step, result, FIXED_OVERHEAD_BYTES // 2, fsdp=False)
    assert hopeless == [
        "none of micro-batch 1, activation checkpointing or sharding fits: a GPU with more memory, "
        "or a smaller model"
    ]
