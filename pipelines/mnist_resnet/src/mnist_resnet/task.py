"""The task, in one file: the model, the loss and the metrics. train, baseline, bench, profile and
predict all import them from here, so changing the model or the loss here changes every command.

The model knows nothing about how it is parallelised: train.py wraps it in DDP, in one place.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torchvision.models import resnet18

from mnist_resnet.transforms import SKIPPED_LABEL
from raytrain_common.checkpoint import unwrap


def build_model(num_classes: int, channels: int = 1) -> nn.Module:
    """ResNet18 for `channels`-channel images (1: grey, 3: RGB) of any size, randomly initialised.

    The stem keeps ResNet's 7×7 stride-2 convolution and max-pool: 28×28 shrinks to 7×7 before the
    residual stages, which keeps a CPU epoch of 60k images near three minutes and still reaches
    ≥ 99 % on MNIST; the adaptive pooling at the end takes any input size.
    """
    model = resnet18(num_classes=num_classes)
    if channels != 3:
        model.conv1 = nn.Conv2d(channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    return model


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The training loss: mean cross-entropy over the batch's usable rows (a row whose file could
    not be decoded carries SKIPPED_LABEL and adds nothing; a batch of none gives 0, not NaN, and
    still takes part in DDP's all-reduce)."""
    summed = F.cross_entropy(logits, labels, ignore_index=SKIPPED_LABEL, reduction="sum")
    return summed / usable(labels).sum().clamp(min=1)


def usable(labels: torch.Tensor) -> torch.Tensor:
    """Which rows of a batch hold a decoded image (the others carry SKIPPED_LABEL)."""
    return labels != SKIPPED_LABEL


def autocast(device: torch.device, enabled: bool) -> contextlib.AbstractContextManager[Any]:
    """bfloat16 autocast for the forward pass when `enabled` (--bf16)."""
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=enabled)


def batch_scores(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[summed loss, correct predictions, images] of one batch's usable rows, in float32: sums add
    up over batches and ranks into the metrics of `scores`."""
    return torch.stack(
        [
            F.cross_entropy(logits.float(), labels, ignore_index=SKIPPED_LABEL, reduction="sum"),
            (logits.argmax(dim=1) == labels).sum().float(),
            usable(labels).sum().float(),
        ]
    )


def scores(totals: torch.Tensor, split: str) -> dict[str, float]:
    """`<split>_loss` and `<split>_accuracy` from summed `batch_scores`."""
    loss_sum, correct, seen = totals.tolist()
    return {f"{split}_loss": loss_sum / seen, f"{split}_accuracy": correct / seen}


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[dict[str, torch.Tensor]],
    device: torch.device,
    bf16: bool,
    split: str,
) -> dict[str, float]:
    """`<split>_loss` and `<split>_accuracy` over every rank's batches (summed across ranks)."""
    plain = unwrap(model)  # the DDP wrapper's forward would issue collectives; shards may be uneven
    plain.eval()
    totals = torch.zeros(3, device=device)
    for batch in batches:
        with autocast(device, bf16):
            logits = plain(batch["image"])
        totals += batch_scores(logits, batch["label"])
    if dist.is_initialized():
        dist.all_reduce(totals)
    return scores(totals, split)
