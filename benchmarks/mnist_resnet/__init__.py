"""mnist_resnet's benchmarks, run by its nox sessions (pipelines/mnist_resnet/sessions.py)."""
