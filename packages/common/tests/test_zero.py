"""The DeepSpeed config a run's flags make, and the resumes a ZeRO checkpoint cannot take, refused
with their fix before any worker starts (the runs themselves: hf_finetune's test_hf_deepspeed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from raytrain_common.configs import ConfigError
from raytrain_common.zero import (
    DeepSpeedSettings,
    UnsafeCheckpointError,
    check_resume,
    check_zero_pickles,
    deepspeed_config,
    trainer_arguments,
)

EXPORT = "hf-finetune export --checkpoint ckpt"


def test_the_config_leaves_to_the_trainer_what_it_knows_and_sets_zeros_own() -> None:
    zero3 = deepspeed_config(3, "optimizer+params", use_gpu=False)
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_clipping"):
        assert zero3[key] == "auto"
    assert zero3["bf16"] == {"enabled": "auto"} and "optimizer" not in zero3
    zero = zero3["zero_optimization"]
    assert zero["stage"] == 3 and zero["stage3_gather_16bit_weights_on_model_save"] is False
    assert (
        zero["offload_optimizer"] == zero["offload_param"] == {"device": "cpu", "pin_memory": False}
    )
    zero2 = deepspeed_config(2, "none", use_gpu=True)["zero_optimization"]
    assert zero2 == {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                     "reduce_bucket_size": "auto"}  # fmt: skip
    # On CPU the Trainer must reuse the gloo state join_ray_world set up; DDP gets nothing.
    cpu = trainer_arguments(DeepSpeedSettings(deepspeed="zero2"), use_gpu=False)
    assert cpu["accelerator_config"] == {"use_configured_state": True} and not cpu["use_cpu"]
    assert trainer_arguments(DeepSpeedSettings(), use_gpu=False) == {}


def record(version: str, stage: str = "zero3", world_size: int = 2) -> dict[str, object]:
    return {"version": version, "stage": stage, "offload": "optimizer", "world_size": world_size}


def test_a_resume_its_shards_cannot_take_is_refused_naming_the_fix() -> None:
    import deepspeed

    here = deepspeed.__version__
    zero3 = DeepSpeedSettings(deepspeed="zero3", offload="optimizer")
    check_resume(record(here), zero3, 2, "ckpt", EXPORT)  # the same engine: resumes
    check_resume(None, DeepSpeedSettings(), 2, "ckpt", EXPORT)  # DDP after DDP
    with pytest.raises(ConfigError, match=r"written by a DDP run: resume it without --deepspeed"):
        check_resume(None, zero3, 2, "ckpt", EXPORT)
    with pytest.raises(ConfigError, match=r"holds DeepSpeed zero3 shards: resume it with "):
        check_resume(record(here), DeepSpeedSettings(deepspeed="zero2"), 2, "ckpt", EXPORT)
    with pytest.raises(ConfigError, match=r"split over 2 workers by ZeRO.*--num-workers 2"):
        check_resume(record(here), zero3, 4, "ckpt", EXPORT)
    with pytest.raises(ConfigError) as refused:
        check_resume(record("0.14.0"), zero3, 2, "ckpt", EXPORT)
    message = str(refused.value)
    assert f"written by DeepSpeed 0.14.0 and this environment has {here}" in message
    assert "install deepspeed==0.14.0 to resume it" in message and EXPORT in message


class Payload:
    """Stands for what a crafted file could name: any global beyond DeepSpeed's own."""


def test_shards_are_read_by_the_restricted_unpickler_before_deepspeed_reads_them(
    tmp_path: Path,
) -> None:
    """DeepSpeed unpickles its shards with weights_only=False; `check_zero_pickles` lets through
    what its files hold (tensors, the stage enum, the loss scaler) and refuses any other global."""
    import torch
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    step = tmp_path / "global_step8"
    step.mkdir()
    shard = {"zero_stage": ZeroStageEnum.weights, "loss_scaler": LossScaler(1.0)}
    own = step / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": shard, "flat": torch.zeros(4)}, own)
    check_zero_pickles(tmp_path)
    torch.save({"payload": Payload()}, step / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    check_zero_pickles(tmp_path, rank=0)  # rank 0 reads its own shard only
    with pytest.raises(UnsafeCheckpointError, match=r"zero_pp_rank_1_.*restricted unpickler"):
        check_zero_pickles(tmp_path)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"offload": "optimizer"}, "without --deepspeed"),
        ({"deepspeed": "zero2", "offload": "optimizer+params"}, "only ZeRO-3 shards"),
        ({"deepspeed": "zero4"}, "choose none, zero2 or zero3"),
    ],
)
def test_settings_that_cannot_work_are_refused(flags: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        DeepSpeedSettings(**flags).validate_deepspeed()  # type: ignore[arg-type]
