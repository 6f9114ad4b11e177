"""What `raytrain-doctor --pipeline NAME` needs to know about a pipeline, found without naming any.

Each pipeline registers a profile under the entry-point group `raytrain.pipelines` in its own
pyproject.toml (a copied pipeline registers its own under its new name): how to read its `train`
flags into its config, which modules its workers import, and its training step for the memory
forecast. This package only reads the group.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from raytrain_common.cli import config_from_args
from raytrain_common.configs import ConfigError, RayTrainSettings
from raytrain_common.memory_forecast import TrainingStep

ENTRY_POINT_GROUP = "raytrain.pipelines"


@dataclass(frozen=True)
class PipelineProfile:
    name: str  # the import package, e.g. the folder name under pipelines/
    distribution: str  # the installed distribution, whose version every node must agree on
    worker_imports: tuple[str, ...]  # modules a training worker imports
    build_parser: Callable[[], argparse.ArgumentParser]  # the pipeline's, from cli.command_parser
    training_step: Callable[[Any], TrainingStep]  # the config → its step, for the memory forecast
    fsdp: bool = False  # shards parameters, gradients and optimizer state over the workers
    deepspeed: bool = False  # has --deepspeed (ZeRO stages and offload) for the forecast's knobs

    def train_config(self, argv: Sequence[str]) -> RayTrainSettings:
        """`train`'s flags → the run's config, as the pipeline's own `train` reads them."""
        args = self.build_parser().parse_args(["train", *argv])
        config: RayTrainSettings = config_from_args(args, *args.config_source)
        return config


def installed_profiles() -> dict[str, Callable[[], Any]]:
    """{pipeline name: what loads its profile factory}, from the installed distributions."""
    return {point.name: point.load for point in entry_points(group=ENTRY_POINT_GROUP)}


def load_profile(name: str) -> PipelineProfile:
    profiles = installed_profiles()
    if name not in profiles:
        known = ", ".join(sorted(profiles)) or "none"
        raise ConfigError(
            f"no pipeline {name!r} is installed (installed: {known}); install it, e.g. "
            f"`pip install -e pipelines/{name}`, or leave --pipeline out and give the shape with "
            "--num-workers / --gpus-per-worker"
        )
    factory: Callable[[], PipelineProfile] = profiles[name]()
    return factory()
