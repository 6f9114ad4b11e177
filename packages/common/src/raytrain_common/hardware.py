"""What the benchmarks and training logs need to know about the accelerator: its bf16 peak (for MFU)
and the memory a run has used at most."""

from __future__ import annotations

import torch

# Dense bf16 peak FLOP/s by device-name fragment (NVIDIA data sheets; SXM parts, no sparsity).
# Order matters: the first fragment found in the name wins ("H100" before "A100" is irrelevant,
# but "L40S" must come before "L4").
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10": 125e12,
}


def peak_bf16_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak, or None for CPUs and GPUs not in the table (no MFU then)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


def peak_memory_gb(device: torch.device) -> float | None:
    """GiB the caching allocator has handed out at most on a GPU since start (or the last reset)."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30


def mfu(flops_per_s: float, device: torch.device, devices: int = 1) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s ÷ the bf16 peak of `devices` such devices."""
    peak = peak_bf16_flops(device)
    return None if peak is None else flops_per_s / (peak * devices)


def peak_rss_mb() -> float:
    """The most host memory (resident set, MiB) this process has held since it started."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def workers_peak_rss_mb() -> float:
    """The largest `peak_rss_mb` over the workers of the process group (a collective: every rank
    calls it at the same point); this process's own when there is no group."""
    import torch.distributed as dist

    mine = peak_rss_mb()
    if not (dist.is_available() and dist.is_initialized()):
        return mine
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
    peak = torch.tensor([mine], dtype=torch.float64, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return float(peak.item())
