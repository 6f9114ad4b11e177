"""All the parallelism and compilation in one place: activation checkpointing, torch.compile per
block, then FSDP2 per block and at the root (the order torchtitan uses).

The model file knows nothing of this; swapping FSDP for another strategy changes only this file.
`ray.train.torch.prepare_model(parallel_strategy="fsdp")` refuses CPUs, so FSDP2 is applied
directly.
"""

from __future__ import annotations

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from llm_fsdp.loss import NextTokenLoss

# Where Hugging Face causal LMs keep their repeated blocks: Llama, Mistral, Qwen, Gemma, SmolLM2
# (model.layers); GPT-2, Bloom, GPT-J (transformer.h); Pythia / GPT-NeoX; OPT.
BLOCK_PATHS = ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers")


class UnsupportedModelError(TypeError):
    """A model whose blocks this file does not know how to find: one line naming what it needs."""


def decoder_blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The repeated transformer blocks of a Hugging Face causal LM: each is sharded (and compiled,
    and checkpointed) on its own."""
    if hasattr(model, "get_base_model"):  # a PEFT model (LoRA): the blocks are its base model's
        model = model.get_base_model()
    for path in BLOCK_PATHS:
        found: object = model
        for name in path.split("."):
            found = getattr(found, name, None)
        if isinstance(found, torch.nn.ModuleList) and len(found) > 0:
            return found
    raise UnsupportedModelError(
        f"{type(model).__name__} keeps its decoder blocks at none of {', '.join(BLOCK_PATHS)}: "
        "add where they are to BLOCK_PATHS in llm_fsdp/parallelize.py (the blocks must be an "
        "nn.ModuleList), or train a model of a family listed there"
    )


def check_parallelizable(model: torch.nn.Module) -> None:
    """What the loss and the sharding need of a model, checked before any worker starts (on a
    meta-device copy): decoder blocks, a decoder that returns hidden states, an output head."""
    decoder_blocks(model)
    for method in ("get_decoder", "get_output_embeddings"):
        part = getattr(model, method, lambda: None)()
        if part is None:
            raise UnsupportedModelError(
                f"{type(model).__name__}.{method}() gives nothing: the chunked loss (llm_fsdp/"
                "loss.py) needs the decoder's hidden states and the output head's weight"
            )


def compile_model(model: NextTokenLoss) -> None:
    """torch.compile each decoder block in place and the loss's per-chunk softmax.

    In place, so state-dict keys stay unchanged; every block has the same code and shapes, so one
    compiled graph serves all of them; FSDP's hooks, added afterwards, stay outside the graphs.
    """
    for block in decoder_blocks(model.lm):
        block.compile()
    model.chunk_loss = torch.compile(model.chunk_loss)


def parallelize(
    model: NextTokenLoss,
    *,
    device_type: str,
    world_size: int,
    bf16: bool,
    activation_checkpointing: bool,
    compile: bool,
) -> NextTokenLoss:
    """Shard `model` in place over all ranks; return it (now with DTensor parameters)."""
    blocks = decoder_blocks(model.lm)
    if activation_checkpointing:
        for index, block in enumerate(blocks):
            blocks[index] = checkpoint_wrapper(block)
    if compile:
        compile_model(model)
    mesh = init_device_mesh(device_type, (world_size,))
    # bf16 compute with fp32 gradient reduction on GPUs; plain fp32 on CPUs (gloo has no bf16
    # speed).
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16
        else MixedPrecisionPolicy()
    )
    for index, block in enumerate(blocks):
        # The last block's parameters are needed again at once by the backward pass: keep them.
        # On one rank a reshard saves no memory and costs a copy: never.
        reshard = world_size > 1 and index < len(blocks) - 1
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model
