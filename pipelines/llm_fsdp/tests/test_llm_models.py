"""Which models the pipeline can shard, decided on the driver before Ray starts: a GPT-2-shaped
model (blocks at transformer.h) trains with FSDP2 as Llama-shaped ones do; a model whose blocks it
cannot find is refused in one line naming what it needs."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, XLNetConfig

from llm_fsdp.loss import NextTokenLoss
from llm_fsdp.model import ModelError, resolve_model
from llm_fsdp.parallelize import parallelize
from llm_fsdp.train import check_model_fits_data
from raytrain_common.tokens.corpus import DatasetInfo


def dataset(vocab_size: int = 512, seq_len: int = 32) -> DatasetInfo:
    return DatasetInfo(
        source="test",
        seq_len=seq_len,
        tokenizer="t",
        tokenizer_name="t",
        vocab_size=vocab_size,
        eos_id=0,
        documents={},
        packing={},
        seed=0,
    )


def tiny_gpt2() -> GPT2Config:
    return GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=2,
        vocab_size=512,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    )


def test_a_gpt2_model_folder_passes_the_driver_checks_and_trains_sharded(tmp_path: Path) -> None:
    folder = tmp_path / "gpt2"
    torch.manual_seed(0)
    GPT2LMHeadModel(tiny_gpt2()).save_pretrained(folder)
    spec = resolve_model(str(folder), str(tmp_path))
    check_model_fits_data(spec, dataset())  # no error: blocks, decoder and head found

    # FSDP2 over a real (one-process) gloo group: the loss falls over a few steps on one batch.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        model = NextTokenLoss(GPT2LMHeadModel.from_pretrained(folder), chunk_tokens=64)
        parallelize(
            model,
            device_type="cpu",
            world_size=1,
            bf16=False,
            activation_checkpointing=True,
            compile=False,
        )
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        blocks = torch.randint(1, 512, (4, 33))
        losses = []
        for _ in range(5):
            loss = model(blocks) / blocks[:, 1:].numel()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        assert losses[-1] < losses[0] - 0.5, losses
    finally:
        dist.destroy_process_group()


def test_a_model_whose_blocks_cannot_be_found_is_refused_before_ray(tmp_path: Path) -> None:
    folder = tmp_path / "xlnet"
    XLNetConfig(n_layer=2, d_model=64, n_head=2, vocab_size=512).save_pretrained(folder)
    spec = resolve_model(str(folder), str(tmp_path))  # a causal LM by transformers' mapping
    with pytest.raises(ModelError) as refused:
        check_model_fits_data(spec, dataset())
    message = str(refused.value)
    assert (
        "XLNetLMHeadModel keeps its decoder blocks at none of model.layers, transformer.h"
        in message
    )
    assert "BLOCK_PATHS in llm_fsdp/parallelize.py" in message
