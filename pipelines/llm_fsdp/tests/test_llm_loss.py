"""The chunked loss equals the plain one (value and gradients) and never holds every logit at
once."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as functional
from transformers import LlamaConfig, LlamaForCausalLM

from llm_fsdp.loss import NextTokenLoss, chunked_cross_entropy_sum
from llm_fsdp.task import flops_per_token
from raytrain_common.hardware import peak_bf16_flops

TOLERANCE = 1e-5


def plain_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """What the pipeline computed before: every logit, upcast, then cross-entropy."""
    return functional.cross_entropy((hidden @ weight.T).float(), targets, reduction="sum")


def gradients_of(loss_fn, hidden, weight, targets):  # type: ignore[no-untyped-def]
    hidden = hidden.detach().clone().requires_grad_(True)
    weight = weight.detach().clone().requires_grad_(True)
    loss = loss_fn(hidden, weight, targets)
    (loss * 0.37).backward()  # a scale other than 1 exercises the backward's scaling
    return loss.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("chunk_tokens", [1, 7, 64, 1000])
def test_chunked_loss_matches_the_plain_one_in_value_and_gradients(chunk_tokens: int) -> None:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(150, 48, generator=generator, dtype=torch.float64).float()
    weight = torch.randn(500, 48, generator=generator) * 0.2
    targets = torch.randint(0, 500, (150,), generator=generator)
    expected = gradients_of(plain_loss, hidden, weight, targets)
    got = gradients_of(
        lambda h, w, t: chunked_cross_entropy_sum(h, w, t, chunk_tokens=chunk_tokens),
        hidden,
        weight,
        targets,
    )
    for name, want, have in zip(("loss", "hidden grad", "weight grad"), expected, got, strict=True):
        assert torch.allclose(have, want, rtol=TOLERANCE, atol=TOLERANCE * want.abs().max()), name


def test_a_frozen_output_layer_gets_no_gradient_and_the_hidden_states_the_same_one() -> None:
    """LoRA freezes the output layer: its weight gradient is never formed (a third of the head's
    work), and the hidden states' gradient, which reaches the adapters, is unchanged."""
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(60, 24, generator=generator)
    weight = torch.randn(200, 24, generator=generator) * 0.2
    targets = torch.randint(0, 200, (60,), generator=generator)
    _, want_hidden, _ = gradients_of(plain_loss, hidden, weight, targets)
    trained = hidden.clone().requires_grad_(True)
    frozen = weight.clone()  # requires_grad False, as a frozen parameter
    (chunked_cross_entropy_sum(trained, frozen, targets, chunk_tokens=16) * 0.37).backward()
    assert frozen.grad is None
    assert torch.allclose(trained.grad, want_hidden, rtol=TOLERANCE, atol=TOLERANCE)


def test_without_gradients_the_loss_is_the_same_and_builds_no_graph() -> None:
    generator = torch.Generator().manual_seed(1)
    hidden, weight = (
        torch.randn(40, 16, generator=generator),
        torch.randn(90, 16, generator=generator),
    )
    targets = torch.randint(0, 90, (40,), generator=generator)
    with torch.no_grad():
        loss = chunked_cross_entropy_sum(hidden, weight, targets, chunk_tokens=9)
    assert not loss.requires_grad
    assert loss.item() == pytest.approx(plain_loss(hidden, weight, targets).item(), rel=TOLERANCE)


def test_next_token_loss_equals_the_hugging_face_loss_of_a_tied_llama() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    lm = LlamaForCausalLM(config)
    blocks = torch.randint(0, 300, (3, 17))
    ours = NextTokenLoss(lm, chunk_tokens=10)(blocks) / (3 * 16)
    ours.backward()
    ours_grad = lm.model.embed_tokens.weight.grad.clone()
    lm.zero_grad()
    theirs = lm(input_ids=blocks, labels=blocks).loss  # transformers shifts the labels itself
    theirs.backward()
    assert ours.item() == pytest.approx(theirs.item(), rel=TOLERANCE)
    # The tied weight gets both contributions (input embedding and output layer) in both paths.
    assert torch.allclose(ours_grad, lm.model.embed_tokens.weight.grad, atol=1e-6)


PEAK_SCRIPT = textwrap.dedent(
    """
    import re, sys, torch, torch.nn.functional as F
    from llm_fsdp.loss import chunked_cross_entropy_sum

    def kib(field):
        return int(re.search(field + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1))

    tokens, vocab, width = 4096, 32768, 64
    hidden = torch.randn(tokens, width, requires_grad=True)
    weight = torch.randn(vocab, width, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,))
    warm_up = chunked_cross_entropy_sum(hidden[:8], weight, targets[:8], chunk_tokens=8)
    F.cross_entropy(hidden[:8] @ weight.T, targets[:8]).backward()  # libraries loaded, buffers made
    warm_up.backward()
    open("/proc/self/clear_refs", "w").write("5")  # the high-water mark restarts from here
    before = kib("VmRSS")
    if sys.argv[1] == "plain":
        loss = F.cross_entropy((hidden @ weight.T).float(), targets, reduction="sum")
    else:
        loss = chunked_cross_entropy_sum(hidden, weight, targets, chunk_tokens=128)
    loss.backward()
    print((kib("VmHWM") - before) * 1024)
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_the_chunked_loss_needs_a_fraction_of_the_plain_peak_memory() -> None:
    """Peak resident memory of one loss and backward, in fresh processes: the logits of 4,096 tokens
    × 32,768 entries are 512 MiB in fp32; one chunk of 128 tokens is 16 MiB."""
    peaks = {}
    for kind in ("plain", "chunked"):
        done = subprocess.run(
            [sys.executable, "-c", PEAK_SCRIPT, kind],
            capture_output=True,
            text=True,
            check=True,
            # One thread: one malloc arena. Every block of 64 KiB or more mapped and unmapped on
            # its own: glibc otherwise raises that threshold as large blocks are freed and keeps
            # the later 16-MiB chunks in its heap, a peak of up to 200 MB on a busy box (measured)
            # that is the allocator's, not the loss's.
            env={**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"},
        )
        peaks[kind] = int(done.stdout.split()[-1])
    logits_bytes = 4096 * 32768 * 4
    assert peaks["plain"] > logits_bytes, peaks  # the plain path holds at least the fp32 logits
    # Never the logits.
    assert peaks["chunked"] < logits_bytes / 2, peaks
    assert peaks["chunked"] * 8 < peaks["plain"], peaks


def test_flops_per_token_match_what_torch_counts_in_a_training_step() -> None:
    """6N + 12·L·H·T per token, the figure MFU is computed from, against torch's FLOP counter on a
    real forward and backward of a tied Llama through the chunked loss (eager attention, so every
    attention matmul is counted)."""
    from torch.utils.flop_counter import FlopCounterMode

    from llm_fsdp.model import parameter_count

    config = LlamaConfig(
        vocab_size=2048,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        attn_implementation="eager",
    )
    lm = LlamaForCausalLM(config)
    blocks = torch.randint(0, 2048, (2, 257))
    counter = FlopCounterMode(display=False)
    with counter:
        NextTokenLoss(lm, chunk_tokens=128)(blocks).backward()
    expected = flops_per_token(parameter_count(lm), 3, 128, 256) * 2 * 256
    # Norm weights are counted in N but do no matmuls: a fraction of a percent.
    assert counter.get_total_flops() == pytest.approx(expected, rel=0.01)
    assert flops_per_token(134_515_008, 30, 576, 1024) == 1_019_426_688  # SmolLM2-135M
    assert (
        peak_bf16_flops(torch.device("cpu")) is None
    )  # no MFU on CPUs: no bf16 peak to compare with
