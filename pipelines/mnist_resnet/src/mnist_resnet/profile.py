"""What `raytrain-doctor --pipeline mnist_resnet` checks for this pipeline (registered in
pyproject.toml under `raytrain.pipelines`): the train flags, the workers' imports and the training
step whose memory it forecasts."""

from __future__ import annotations

import json
from typing import Any

from mnist_resnet.cli import build_parser
from raytrain_common.pipeline_profiles import PipelineProfile

# MNIST's shape, for a forecast before `prepare` has written the dataset's own.
DEFAULT_IMAGE = {"channels": 1, "height": 28, "width": 28, "num_classes": 10}


def profile() -> PipelineProfile:
    return PipelineProfile(
        name="mnist_resnet",
        distribution="mnist-resnet",
        worker_imports=("mnist_resnet.train", "torchvision", "ray.train.torch", "ray.data"),
        build_parser=build_parser,
        training_step=training_step,
    )


def image_shape(config: Any) -> dict[str, int]:
    from raytrain_common.images.dataset import DATASET_FILE
    from raytrain_common.storage import resolve_storage

    marker = resolve_storage(config.resolved_data_dir()).join(DATASET_FILE)
    if not marker.exists():
        return DEFAULT_IMAGE
    info = json.loads(marker.read_text())
    return {key: int(info[key]) for key in DEFAULT_IMAGE}


def training_step(config: Any) -> Any:
    import torch

    from mnist_resnet.task import build_model, loss_fn
    from raytrain_common.configs import per_worker_batch_size
    from raytrain_common.memory_forecast import TrainingStep

    shape = image_shape(config)

    def make_batch(size: int) -> dict[str, torch.Tensor]:
        image = torch.empty(size, shape["channels"], shape["height"], shape["width"])
        return {"image": image, "label": torch.zeros(size, dtype=torch.long)}

    def loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        image = batch["image"].to(next(model.parameters()).dtype)
        return loss_fn(model(image), batch["label"])

    return TrainingStep(
        build_model=lambda: build_model(
            shape["num_classes"], shape["channels"], config.model_width
        ),
        make_batch=make_batch,
        loss=loss,
        micro_batch=per_worker_batch_size(
            config.global_batch_size, config.num_workers, config.grad_accum_steps
        ),
        grad_accum_steps=config.grad_accum_steps,
        compute_dtype=torch.bfloat16 if config.bf16 else torch.float32,
        optimizer_bytes_per_param=4,  # SGD's momentum buffer
    )
