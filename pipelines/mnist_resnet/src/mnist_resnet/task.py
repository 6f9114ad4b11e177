"""The task, in one file: the model's input, the model, the loss and the metrics. train, baseline,
bench, profile and predict all import them from here, so changing the model or the loss here
changes every command.

The model knows nothing about how it is parallelised: train.py wraps it in DDP, in one place.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch import nn

from raytrain_common.checkpoint import unwrap
from raytrain_common.images.decode import SKIPPED_LABEL

if TYPE_CHECKING:
    from raytrain_common.images.dataset import DatasetInfo


class BasicBlock(nn.Module):
    """Two 3×3 convolutions with batch norm and a shortcut; the shortcut is a strided 1×1
    convolution where the block halves the side or changes the width."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + shortcut)


def stage(in_channels: int, out_channels: int, stride: int) -> nn.Sequential:
    """Two basic blocks, the first changing the width (and the side, at stride 2)."""
    return nn.Sequential(
        BasicBlock(in_channels, out_channels, stride), BasicBlock(out_channels, out_channels, 1)
    )


class ResNet18(nn.Module):
    """ResNet18 (He et al., 2015) for `channels`-channel images of any size.

    Written here rather than imported from torchvision: importing torchvision costs ~1.4 s in every
    process that unpickles the training loop (the driver, Ray Train's controller, each worker), on
    the path to the first step. Its parameters carry torchvision's names and shapes, so a state
    dict moves between the two (tests/test_model.py checks it).

    The stem keeps ResNet's 7×7 stride-2 convolution and max-pool: 28×28 shrinks to 7×7 before the
    residual stages, which keeps a CPU epoch of 60k images near three minutes and still reaches
    ≥ 99 % on MNIST; the adaptive pooling at the end takes any input size.

    `width` is the first stage's channels; each later stage doubles them. 64 is the published
    ResNet18 (11.2 M parameters). 16 has 0.7 M and trains ~11× the images a second on a 2-core
    CPU (`python -m benchmarks.mnist_resnet.baseline`, docs/benchmarks.md): for smoke runs, and for the tests, whose
    runs check the pipeline (every row once, resumes, faults), not the network.
    """

    def __init__(self, num_classes: int, channels: int = 3, width: int = 64) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, width, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = stage(width, width, stride=1)
        self.layer2 = stage(width, 2 * width, stride=2)  # each later stage halves the side
        self.layer3 = stage(2 * width, 4 * width, stride=2)
        self.layer4 = stage(4 * width, 8 * width, stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(8 * width, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def build_model(num_classes: int, channels: int = 1, width: int = 64) -> nn.Module:
    """ResNet18 for `channels`-channel images (1: grey, 3: RGB), `width` channels in its first
    stage (--model-width), randomly initialised."""
    return ResNet18(num_classes, channels, width)


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


# ---------------------------------------------------------------------------------------------
# Pixels → the model's input (here, not in data.py: prepare's Ray Data tasks import data.py, and
# torch's import would cost each of their processes ~2 CPU-seconds and ~250 MB)
# ---------------------------------------------------------------------------------------------


def on_device(
    batch: dict[str, torch.Tensor], info: DatasetInfo, device: torch.device
) -> dict[str, torch.Tensor]:
    """A Ray Data batch as the model takes it: uint8 images cross to `device` (a quarter of the
    bytes of float) and are normalised there; labels alongside."""
    images = batch["image"].to(device, non_blocking=True)
    labels = batch["label"].to(device, non_blocking=True)
    return {"image": normalise(images, info.mean, info.std), "label": labels}


def as_nchw(images: np.ndarray) -> torch.Tensor:
    """In-memory images (N, H, W) or (N, H, W, C) as the model's (N, C, H, W) layout."""
    tensor = torch.from_numpy(np.ascontiguousarray(images))
    return tensor.unsqueeze(1) if tensor.ndim == 3 else tensor.permute(0, 3, 1, 2).contiguous()


def normalise(
    images: torch.Tensor, mean: float | list[float], std: float | list[float]
) -> torch.Tensor:
    """uint8 (N, C, H, W) → float, standardised per channel."""
    shape = (-1, 1, 1)
    mean_t = torch.as_tensor(mean, dtype=torch.float32, device=images.device).reshape(shape)
    std_t = torch.as_tensor(std, dtype=torch.float32, device=images.device).reshape(shape)
    return (images.float() / 255.0 - mean_t) / std_t
