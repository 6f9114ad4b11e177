"""The model written in task.py is torchvision's ResNet18, without torchvision's import on the
path to the first step."""

from __future__ import annotations

import subprocess
import sys

import torch
import torchvision

from mnist_resnet.task import build_model


def test_the_model_is_torchvisions_resnet18_so_a_state_dict_moves_between_them() -> None:
    torch.manual_seed(0)
    reference = torchvision.models.resnet18(num_classes=10)
    reference.conv1 = torch.nn.Conv2d(1, 64, kernel_size=7, stride=2, padding=3, bias=False)
    ours = build_model(num_classes=10, channels=1)
    theirs = reference.state_dict()
    assert {k: v.shape for k, v in ours.state_dict().items()} == {
        k: v.shape for k, v in theirs.items()
    }
    ours.load_state_dict(theirs)
    images = torch.randn(8, 1, 28, 28)
    ours.eval(), reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(images), reference(images))
    # Trained layers too: batch norm in training mode, a 3-channel input of another side.
    rgb, reference_rgb = build_model(5, 3), torchvision.models.resnet18(num_classes=5)
    rgb.load_state_dict(reference_rgb.state_dict())
    photos = torch.randn(4, 3, 64, 64)
    torch.testing.assert_close(rgb.train()(photos), reference_rgb.train()(photos))


def test_the_training_loop_imports_without_torchvision() -> None:
    """Every process that unpickles the loop imports it: torchvision would add ~1.4 s to each."""
    probe = "import sys, mnist_resnet.train; print('torchvision' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
