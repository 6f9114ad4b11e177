"""All the parallelism in one place: activation checkpointing, then FSDP2 per block, then the root.

The model file knows nothing of this; swapping FSDP for another strategy changes only this file.
`ray.train.torch.prepare_model(parallel_strategy="fsdp")` refuses CPUs, so FSDP2 is applied directly.
"""

from __future__ import annotations

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def decoder_blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The repeated transformer blocks of a Hugging Face causal LM (Llama, Mistral, Qwen, ...)."""
    blocks = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(blocks, torch.nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no model.layers: name its blocks here")
    return blocks


def parallelize(
    model: torch.nn.Module,
    *,
    device_type: str,
    world_size: int,
    bf16: bool,
    activation_checkpointing: bool,
) -> torch.nn.Module:
    """Shard `model` in place over all ranks; return it (now with DTensor parameters)."""
    blocks = decoder_blocks(model)
    if activation_checkpointing:
        for index, block in enumerate(blocks):
            blocks[index] = checkpoint_wrapper(block)
    mesh = init_device_mesh(device_type, (world_size,))
    # bf16 compute with fp32 gradient reduction on GPUs; plain fp32 on CPUs (gloo has no bf16 speed).
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16
        else MixedPrecisionPolicy()
    )
    for index, block in enumerate(blocks):
        # The last block's parameters are needed again at once by the backward pass: keep them.
        fully_shard(
            block, mesh=mesh, mp_policy=policy, reshard_after_forward=index < len(blocks) - 1
        )
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model
