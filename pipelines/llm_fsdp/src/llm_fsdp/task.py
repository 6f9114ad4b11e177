"""The task, in one file: the language model with its loss, the validation metrics, and what a
token costs in FLOPs. train, bench, profile and export import them from here.

Which models can be trained is model.py's business (presets, SmolLM2, a local Hugging Face folder);
the chunked loss that never materialises every logit is loss.py's; how the model is sharded is
parallelize.py's. This file puts them together into what one training step computes.
"""

from __future__ import annotations

import math

from torch import nn

from llm_fsdp.loss import NextTokenLoss
from llm_fsdp.model import ModelSpec, build_lm, parameter_count
from raytrain_common.tokens.corpus import DatasetInfo


def with_loss(lm: nn.Module, chunk_tokens: int) -> NextTokenLoss:
    """The LM and its training loss as one module: forward(blocks) → summed next-token loss."""
    return NextTokenLoss(lm, chunk_tokens=chunk_tokens)


def build_model(spec: ModelSpec, info: DatasetInfo, chunk_tokens: int) -> NextTokenLoss:
    """The model a run trains, in fp32 on the CPU (seeded by the caller), sized to the data."""
    lm = build_lm(spec, vocab_size=info.vocab_size, seq_len=info.seq_len, eos_id=info.eos_id)
    return with_loss(lm, chunk_tokens)


def val_metrics(loss_sum: float, tokens: float) -> dict[str, float]:
    """`val_loss` (mean per token) and `val_perplexity` from a summed loss over `tokens` tokens."""
    loss = loss_sum / tokens
    return {"val_loss": loss, "val_perplexity": math.exp(min(loss, 50))}


def flops_per_token(parameters: int, layers: int, hidden: int, seq_len: int) -> float:
    """Training FLOPs per token: 6N for the matmuls of weights, plus 12·L·H·T for attention."""
    return 6 * parameters + 12 * layers * hidden * seq_len


def model_flops_per_token(model: NextTokenLoss, seq_len: int) -> float:
    config = model.lm.config
    return flops_per_token(
        parameter_count(model.lm), config.num_hidden_layers, config.hidden_size, seq_len
    )
