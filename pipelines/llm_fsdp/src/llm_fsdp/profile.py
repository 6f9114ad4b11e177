"""What `raytrain-doctor --pipeline llm_fsdp` checks for this pipeline (registered in
pyproject.toml under `raytrain.pipelines`): the train flags, the workers' imports and the training
step whose memory it forecasts (parameters, gradients and AdamW state sharded by FSDP)."""

from __future__ import annotations

import json
from typing import Any

from llm_fsdp.cli import build_parser
from raytrain_common.pipeline_profiles import PipelineProfile

# SmolLM2-135M's published shape, for a forecast before `prepare --tokenizer smollm2` has converted
# it, and the sequence length and vocabulary assumed before `prepare` has written the dataset's own.
SMOLLM2_SHAPE = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
}
DEFAULT_DATA = {"seq_len": 256, "vocab_size": 49152, "eos_id": 0}
SMOLLM2_SEQ_LEN = 1024


def profile() -> PipelineProfile:
    return PipelineProfile(
        name="llm_fsdp",
        distribution="llm-fsdp",
        worker_imports=(
            "llm_fsdp.train",
            "transformers",
            "torch.distributed.fsdp",
            "torch.distributed.checkpoint",
            "ray.train.torch",
        ),
        build_parser=build_parser,
        training_step=training_step,
        fsdp=True,
    )


def data_shape(config: Any) -> dict[str, int]:
    from raytrain_common.storage import resolve_storage
    from raytrain_common.tokens.corpus import DATASET_FILE

    marker = resolve_storage(config.resolved_data_dir()).join(DATASET_FILE)
    if marker.exists():
        info = json.loads(marker.read_text())
        return {key: int(info[key]) for key in DEFAULT_DATA}
    seq_len = SMOLLM2_SEQ_LEN if config.model == "smollm2" else DEFAULT_DATA["seq_len"]
    return {**DEFAULT_DATA, "seq_len": seq_len}


def build_language_model(config: Any, data: dict[str, int]) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from llm_fsdp.model import SIZE_PRESETS, ModelError, resolve_model

    if config.model in SIZE_PRESETS:
        shape = SIZE_PRESETS[config.model]
    elif config.model == "smollm2":
        try:
            spec = resolve_model(config.model, config.storage_path)
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(spec.path))
        except ModelError:
            shape = SMOLLM2_SHAPE
    else:
        spec = resolve_model(config.model, config.storage_path)
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(spec.path))
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=data["vocab_size"],
            max_position_embeddings=data["seq_len"],
            tie_word_embeddings=True,
            **shape,
        )
    )


def training_step(config: Any) -> Any:
    import torch

    from llm_fsdp.parallelize import decoder_blocks
    from llm_fsdp.task import with_loss
    from raytrain_common.configs import per_worker_batch_size
    from raytrain_common.memory_forecast import TrainingStep

    data = data_shape(config)

    def build() -> torch.nn.Module:
        lm = build_language_model(config, data)
        return with_loss(lm, config.loss_chunk_tokens)

    return TrainingStep(
        build_model=build,
        make_batch=lambda size: torch.zeros(size, data["seq_len"] + 1, dtype=torch.long),
        loss=lambda model, blocks: model(blocks),
        micro_batch=per_worker_batch_size(
            config.global_batch_size, config.num_workers, config.grad_accum_steps
        ),
        grad_accum_steps=config.grad_accum_steps,
        compute_dtype=torch.bfloat16 if config.bf16 else torch.float32,
        optimizer_bytes_per_param=8,  # AdamW: two fp32 moments
        shard_states_over=config.num_workers,
        compute_copy_of_params=config.bf16,  # FSDP's bf16 copy of the gathered parameters
        activation_checkpointing=config.activation_checkpointing,
        blocks=lambda model: decoder_blocks(model.lm),
        description=(
            "eager execution; --compile fuses kernels and "
            "keeps fewer activations, so an upper bound"
            if config.compile
            else ""
        ),
    )
