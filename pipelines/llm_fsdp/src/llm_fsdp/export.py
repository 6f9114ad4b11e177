"""A sharded (DCP) checkpoint → one Hugging Face safetensors folder; sampling text from it.

Consolidation runs in one process without a process group: DCP reads every rank's shards into the
full tensors of a plain model, whatever the number of workers that wrote them.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from transformers.utils import logging as hf_logging

from llm_fsdp import __version__
from llm_fsdp.checkpointer import STATE_FILE, trained_state
from llm_fsdp.model import ModelSpec, build_lm, merged
from raytrain_common.checkpoint import verify_checkpoint
from raytrain_common.storage import (
    OutputMarker,
    check_output_folder,
    resolve_storage,
    staged_output,
)
from raytrain_common.tokens.corpus import DataError


@dataclass(frozen=True)
class ExportRecord:
    """What an export's marker holds: the checkpoint it consolidates and the package that wrote it."""

    checkpoint: str
    llm_fsdp: str


# Written last: marks a folder as an export's own, whole (the library's one rule for outputs).
EXPORT_MARKER = OutputMarker.of("llm_fsdp_export.json", ExportRecord)


def export(
    checkpoint: str,
    output: str,
    loop_config: dict[str, Any] | None = None,
    adapter_only: bool = False,
) -> Path:
    """Consolidate `checkpoint` into `output` (model.safetensors, config, tokenizer), atomically:
    a LoRA run's adapters merged into the base weights, or with `adapter_only` the adapters alone
    (adapter_model.safetensors, adapter_config.json naming the base model).

    `output` may be absent, empty, or an earlier export (it holds EXPORT_MARKER, written last); a
    folder of anything else is refused before any work, so the user's own files are never replaced.
    """
    from transformers import AutoTokenizer

    target = resolve_storage(output)
    if not target.is_local:
        raise DataError(
            f"--output {output}: give a local or mounted folder (save_pretrained writes files)"
        )
    check_output_folder(target, EXPORT_MARKER)  # now, before the checkpoint is loaded
    folder = Path(checkpoint)
    model, config = load_consolidated(folder, loop_config)
    if adapter_only and not config["model"].get("lora_rank"):
        raise DataError(f"--adapter-only: {folder} is a full fine-tune's, it holds no adapters")
    if not adapter_only:
        model = merged(model)
    info = config["dataset"]
    hf_logging.disable_progress_bar()  # transformers' save and load bars: a console line each
    with staged_output(target, EXPORT_MARKER) as staged:
        model.save_pretrained(staged.folder.path)
        AutoTokenizer.from_pretrained(info["tokenizer"]).save_pretrained(staged.folder.path)
        staged.write_marker(asdict(ExportRecord(str(folder.resolve()), __version__)))
    return Path(target.path)


def load_consolidated(
    folder: Path, loop_config: dict[str, Any] | None = None
) -> tuple[nn.Module, dict[str, Any]]:
    """The plain LM a sharded checkpoint holds, every rank's shards read by this one process, and
    the loop config it was trained with (`loop_config` when the caller has it)."""
    if not (folder / STATE_FILE).exists() or not (folder / ".metadata").exists():
        raise DataError(
            f"{folder} is not a complete llm_fsdp checkpoint (no {STATE_FILE} / .metadata)"
        )
    verify_checkpoint(folder)  # every rank's shards as written, none cut off
    config = loop_config or json.loads((folder / STATE_FILE).read_text())["loop_config"]
    info, spec = config["dataset"], ModelSpec(**config["model"])
    model = build_lm(  # with its LoRA adapters when it trained them, over the pretrained base
        spec, vocab_size=info["vocab_size"], seq_len=info["seq_len"], eos_id=info["eos_id"]
    )
    state = {"model": trained_state(model, model.state_dict())}
    with warnings.catch_warnings():  # torch warns that one process reads every rank's shards
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    model.load_state_dict(state["model"], strict=not spec.lora_rank)
    return model, config


@torch.inference_mode()
def generate(
    folder: str,
    prompt: str,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int = 50,
    seed: int = 0,
) -> str:
    """Sample a continuation of `prompt` from an exported Hugging Face folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    torch.manual_seed(seed)
    inputs = tokenizer(prompt or tokenizer.eos_token, return_tensors="pt")
    output = model.generate(
        **inputs,
        max_new_tokens=max_new_tokens,
        do_sample=True,
        temperature=temperature,
        top_k=top_k,
        pad_token_id=tokenizer.eos_token_id,
    )
    return tokenizer.decode(output[0], skip_special_tokens=True)
