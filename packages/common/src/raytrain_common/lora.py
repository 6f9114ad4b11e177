"""LoRA fine-tuning flags every pipeline shares (`LoraSettings`), and the PEFT wrap they ask for.

A pretrained model is fine-tuned through low-rank adapters beside chosen linear layers (PEFT's
`LoraConfig`): only the adapters (and the layers a task names, such as a classifier's new head)
train, the base stays frozen, and a checkpoint holds what trains. The defaults are PEFT 0.21's own:
alpha 8, no dropout, and the target modules PEFT lists for the model's family.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from raytrain_common.configs import ConfigError
from raytrain_common.options import option

if TYPE_CHECKING:
    import torch


class LoraError(ConfigError):
    """A LoRA setting the model cannot take (no such layers, a family without defaults): bad
    input, one line (`cli.user_errors`)."""


@dataclass(kw_only=True)
class LoraSettings:
    """`--lora-rank R` and the adapters' shape; rank 0 is full fine-tuning."""

    lora_rank: int = option(
        0,
        "Fine-tune through LoRA adapters of this rank (PEFT), the pretrained weights frozen; "
        "checkpoints hold what trains (0: full fine-tuning).",
    )
    lora_alpha: float = option(8.0, "LoRA's scale: the adapters' output × alpha / rank (PEFT's).")
    lora_dropout: float = option(0.0, "Dropout on the adapters' input (PEFT's default: none).")
    lora_target_modules: str | None = option(
        None,
        "Comma-separated names of the linear layers that get adapters (none: PEFT's for the "
        "model family; q_proj,v_proj for Llama, SmolLM2, Qwen, Mistral; query,value for BERT).",
    )

    def validate_lora(self) -> None:
        if self.lora_rank < 0 or self.lora_alpha <= 0 or not 0 <= self.lora_dropout < 1:
            raise ConfigError(
                f"lora_rank={self.lora_rank}, lora_alpha={self.lora_alpha}, lora_dropout="
                f"{self.lora_dropout}: give a rank of 0 (no LoRA) or more, an alpha above 0 and "
                "a dropout in [0, 1)"
            )
        if self.lora_target_modules is not None and not self.lora_targets():
            raise ConfigError("--lora-target-modules is empty: name layers, or leave it out")

    def lora_targets(self) -> list[str] | None:
        if self.lora_target_modules is None:
            return None
        return [name.strip() for name in self.lora_target_modules.split(",") if name.strip()]


def with_lora(
    model: torch.nn.Module,
    *,
    rank: int,
    alpha: float,
    dropout: float,
    targets: Sequence[str] | None,
    task_type: str,
    name: str,
    modules_to_save: Sequence[str] | None = None,
) -> Any:
    """`model` wrapped by PEFT: a low-rank pair (A: rank × in, B: out × rank, B zero at the start)
    beside each target linear layer, its output scaled by alpha / rank; only the pairs (and
    `modules_to_save`, e.g. a new classifier head) train. `task_type`: PEFT's, such as CAUSAL_LM
    or SEQ_CLS (which keeps the classifier head trainable on its own)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=list(targets) if targets else None,
        modules_to_save=list(modules_to_save) if modules_to_save else None,
        task_type=task_type,
    )
    try:
        with warnings.catch_warnings():  # PEFT 0.21 asks transformers 5 a deprecated property
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated")
            return get_peft_model(model, config)  # type: ignore[arg-type]
    except ValueError as error:  # no such modules, or a family PEFT has no default for
        raise LoraError(
            f"LoRA on {name}: {str(error).splitlines()[0][:300]}. Name the linear layers to "
            "adapt with --lora-target-modules (e.g. q_proj,v_proj)"
        ) from error


def merged(model: torch.nn.Module) -> Any:
    """A plain model: LoRA's pairs added into the weights they adapt (W + B·A·alpha/rank), or
    the model itself when it has none."""
    merge = getattr(model, "merge_and_unload", None)
    return merge() if merge is not None else model


def trainable_parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
