"""The training objective: summed next-token cross-entropy, with the output layer applied chunk by
chunk.

A micro-batch of 64 × 1024 tokens over SmolLM2's 49,152-token vocabulary would make 3.2 G logits:
6 GiB in bf16, 12 GiB more for the fp32 copy the loss needs, and as much again for their gradients.
Here the output layer runs on `chunk_tokens` tokens at a time, and each chunk's gradient (softmax
minus one-hot) is turned into the gradients of the hidden states and of the output weight at once,
so no more than one chunk of logits ever exists. Same value and gradients as the plain computation:
the logits are formed in the compute dtype and upcast to fp32 for the softmax, exactly as
`cross_entropy(lm_head(h).float(), targets)` does. (Liger's fused linear cross-entropy and
torchtune's chunked output loss rest on the same observation; this is our own code.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as functional
from torch import nn

ChunkLoss = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def chunk_loss_and_logit_grad(
    logits: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy of one chunk of logits and its gradient w.r.t. them, in the logits'
    dtype.

    Element-wise work and reductions only, so `torch.compile` fuses it into a few passes over the
    chunk; in eager it makes one fp32 buffer besides the upcast.
    """
    upcast = logits.float()
    log_norm = torch.logsumexp(upcast, dim=-1, keepdim=True)
    target_logit = upcast.gather(-1, targets.unsqueeze(-1))
    loss = (log_norm - target_logit).sum()
    grad = (upcast - log_norm).exp_()  # softmax
    grad.scatter_add_(-1, targets.unsqueeze(-1), torch.full_like(target_logit, -1.0))  # - one-hot
    return loss, grad.to(logits.dtype)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum_i CE(hidden_i · weightᵀ, target_i); the gradients are formed in the forward pass."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        chunk_tokens: int,
        chunk_loss: ChunkLoss,
    ) -> torch.Tensor:
        grad_hidden = torch.empty_like(hidden)
        # fp32 accumulation over chunks: more exact than the plain path's single bf16 matmul. A
        # frozen output layer (LoRA) gets none: a third of the head's work saved.
        grad_weight = (
            torch.zeros_like(weight, dtype=torch.float32)
            if ctx.needs_input_grad[1]  # type: ignore[attr-defined]
            else None
        )
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_tokens):
            part = hidden[start : start + chunk_tokens]
            loss, grad_logits = chunk_loss(part @ weight.T, targets[start : start + chunk_tokens])
            total += loss
            grad_hidden[start : start + chunk_tokens] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight += grad_logits.T @ part
        ctx.save_for_backward(
            grad_hidden, grad_weight.to(weight.dtype) if grad_weight is not None else None
        )
        return total

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad_total: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        grad_hidden, grad_weight = ctx.saved_tensors  # type: ignore[attr-defined]
        scale = grad_total.to(grad_hidden.dtype)
        weight_grad = grad_weight * scale if grad_weight is not None else None
        return grad_hidden * scale, weight_grad, None, None, None


def chunked_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_tokens: int,
    chunk_loss: ChunkLoss = chunk_loss_and_logit_grad,
) -> torch.Tensor:
    """Σ cross-entropy(hidden · weightᵀ, targets) over N tokens (hidden: N × H, weight: V × H) in
    fp32."""
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _ChunkedLinearCrossEntropy.apply(hidden, weight, targets, chunk_tokens, chunk_loss)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk_tokens):
        logits = (hidden[start : start + chunk_tokens] @ weight.T).float()
        total += functional.cross_entropy(
            logits, targets[start : start + chunk_tokens], reduction="sum"
        )
    return total


class NextTokenLoss(nn.Module):
    """A Hugging Face causal LM with its training loss as one module: forward(blocks) → Σ token
    loss.

    One module, so that FSDP applied to it as the root gathers the output layer's weight around the
    loss too, and the LM's own forward (which would build every logit) is never called in training.
    Checkpoints hold `self.lm`'s state (train.py), so they load into a plain model.
    """

    def __init__(self, lm: nn.Module, *, chunk_tokens: int) -> None:
        super().__init__()
        self.lm = lm
        self.chunk_tokens = chunk_tokens
        self.chunk_loss: ChunkLoss = chunk_loss_and_logit_grad  # parallelize.py may compile it
        self.compute_dtype: torch.dtype | None = None  # the hidden states' dtype, seen in forward

    def forward(self, blocks: torch.Tensor) -> torch.Tensor:
        """Summed next-token cross-entropy of packed blocks (inputs: all but the last token)."""
        decoder = self.lm.get_decoder()
        hidden = decoder(input_ids=blocks[:, :-1], use_cache=False).last_hidden_state
        self.compute_dtype = hidden.dtype
        return chunked_cross_entropy_sum(
            hidden.flatten(0, 1),
            self.lm.get_output_embeddings().weight,
            blocks[:, 1:].flatten(),
            chunk_tokens=self.chunk_tokens,
            chunk_loss=self.chunk_loss,
        )
