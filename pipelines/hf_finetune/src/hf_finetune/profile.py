"""What `raytrain-doctor --pipeline hf_finetune` checks for this pipeline (registered in
pyproject.toml under `raytrain.pipelines`): the train flags, the workers' imports and the training
step whose memory it forecasts."""

from __future__ import annotations

import json
from typing import Any

from hf_finetune.cli import build_parser
from raytrain_common.pipeline_profiles import PipelineProfile

# Before `prepare` has written the dataset's own: prepare's default length and two labels.
DEFAULT_TEXT = {"max_length": 128, "labels": 2}


def profile() -> PipelineProfile:
    return PipelineProfile(
        name="hf_finetune",
        distribution="hf-finetune",
        worker_imports=(
            "hf_finetune.train",
            "transformers",
            "accelerate",
            "ray.train.huggingface.transformers",
        ),
        build_parser=build_parser,
        training_step=training_step,
        deepspeed=True,
    )


def text_shape(config: Any) -> dict[str, int]:
    from raytrain_common.labelled.prepare import DATASET_FILE
    from raytrain_common.storage import resolve_storage

    marker = resolve_storage(config.resolved_data_dir()).join(DATASET_FILE)
    if not marker.exists():
        return DEFAULT_TEXT
    info = json.loads(marker.read_text())
    return {"max_length": int(info["max_length"]), "labels": len(info["labels"])}


def training_step(config: Any) -> Any:
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from hf_finetune.model import resolve_model
    from raytrain_common.configs import per_worker_batch_size
    from raytrain_common.memory_forecast import TrainingStep

    shape = text_shape(config)
    model_config = AutoConfig.from_pretrained(resolve_model(config.model))
    model_config.num_labels = shape["labels"]

    def make_batch(size: int) -> dict[str, torch.Tensor]:
        ids = torch.zeros(size, shape["max_length"], dtype=torch.long)
        return {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "labels": torch.zeros(size, dtype=torch.long),
        }

    def loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(**batch).loss

    return TrainingStep(
        build_model=lambda: AutoModelForSequenceClassification.from_config(model_config),
        make_batch=make_batch,
        loss=loss,
        micro_batch=per_worker_batch_size(
            config.global_batch_size, config.num_workers, config.grad_accum_steps
        ),
        grad_accum_steps=config.grad_accum_steps,
        compute_dtype=torch.bfloat16 if config.bf16 else torch.float32,
        optimizer_bytes_per_param=8,  # the Trainer's AdamW: two fp32 moments
        zero_stage=config.zero_stage,
        offload=config.offload,
        ranks=config.num_workers,
    )
