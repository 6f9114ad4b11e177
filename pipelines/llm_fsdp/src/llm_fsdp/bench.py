"""Training tokens/s: 2-worker FSDP2 on Ray Train ÷ one plain process, same model, data and cores.

Both run the same steps (same blocks, batch and optimiser) after a few warm-up steps; FSDP's numbers
are the pipeline's own steady-state tokens/s windows. Ray's start-up is left out (it is paid once per
job). On a GPU machine the FSDP run's MFU is printed too.

    python -m llm_fsdp.bench [--steps 30] [--warm-up 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import tempfile
import time

import numpy as np
import torch

from llm_fsdp.config import cpu_preset
from llm_fsdp.data import inspect_dataset, read_blocks
from llm_fsdp.model import build_model, resolve_model
from llm_fsdp.train import build_optimizer, global_batch_indices, run, token_loss_sum
from raytrain_common.metrics import read_metrics_csv
from raytrain_common.storage import resolve_storage

log = logging.getLogger("llm_fsdp.bench")


def single_process_tokens_per_s(data_dir: str, model_name: str, steps: int, warm_up: int) -> float:
    """The same training steps in one process using every core (torch's intra-op threads)."""
    config = cpu_preset()
    storage = resolve_storage(data_dir)
    info = inspect_dataset(storage)
    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(config.seed)
    spec = resolve_model(model_name, "")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(
        spec, vocab_size=info.vocab_size, seq_len=info.seq_len, eos_id=info.eos_id
    ).to(device)
    optimizer = build_optimizer(model, config)
    blocks = read_blocks(storage, "train")
    started = 0.0
    for step in range(warm_up + steps):
        if step == warm_up:
            if device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
        batch = torch.from_numpy(
            blocks[global_batch_indices(step, config.global_batch_size, len(blocks), config.seed)]
        ).to(device)
        tokens = batch.shape[0] * (batch.shape[1] - 1)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss_sum = token_loss_sum(model, batch)
        (loss_sum / tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return steps * config.global_batch_size * info.seq_len / (time.perf_counter() - started)


def fsdp_tokens_per_s(
    data_dir: str, model_name: str, steps: int, warm_up: int, workers: int
) -> tuple[float, float | None]:
    """Steady-state tokens/s (and MFU on GPU) of the pipeline itself, from its metrics windows."""
    with tempfile.TemporaryDirectory(prefix="llm-bench-") as storage:
        config = dataclasses.replace(
            cpu_preset(),
            storage_path=storage,
            data_dir=data_dir,
            model=model_name,
            num_workers=workers,
            max_steps=warm_up + steps,
            warmup_steps=1,
            log_every_steps=warm_up,
            eval_every_steps=warm_up + steps,
            checkpoint_every_steps=warm_up + steps,
            use_gpu=torch.cuda.is_available(),
            bf16=torch.cuda.is_available(),
        )
        summary = run(config)
        rows = [
            r
            for r in read_metrics_csv(resolve_storage(summary["metrics_csv"]))
            if "tokens_per_s" in r
        ]
    steady = rows[1:] or rows  # the first window holds the warm-up steps
    mfu = [r["mfu"] for r in steady if "mfu" in r]
    return float(np.mean([r["tokens_per_s"] for r in steady])), (
        float(np.mean(mfu)) if mfu else None
    )


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="python -m llm_fsdp.bench", description=__doc__)
    parser.add_argument("--storage-path", default="./runs")
    parser.add_argument("--data-dir", default=None, help="(default: <storage-path>/data/llm)")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warm-up", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    data_dir = args.data_dir or resolve_storage(args.storage_path).join("data/llm").uri

    single = single_process_tokens_per_s(data_dir, args.model, args.steps, args.warm_up)
    fsdp, mfu = fsdp_tokens_per_s(data_dir, args.model, args.steps, args.warm_up, args.workers)
    print(
        f"\n{args.model}, {args.steps} steps after {args.warm_up} warm-up, {os.cpu_count()} cores"
    )
    print("| single process tokens/s | FSDP2 on Ray Train tokens/s | ratio (FSDP ÷ single) |")
    print("| --- | --- | --- |")
    print(f"| {single:,.0f} | {fsdp:,.0f} ({args.workers} workers) | {fsdp / single:.3f} |")
    if mfu is not None:
        print(f"MFU of the FSDP run: {mfu:.1%}")
    print("target ≥ 0.9")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
