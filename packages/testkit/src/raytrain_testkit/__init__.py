"""What the pipelines' tests and benchmarks share, and their users never install: a multi-node Ray
cluster on one box, a memory cap on one node, the data-scaling measure, the shared vocabulary."""

__version__ = "0.6.2"
