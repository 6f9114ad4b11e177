"""ResNet18 on MNIST with Ray Train: data-parallel training, checkpoints, resume, predict."""

__version__ = "0.20.3"
