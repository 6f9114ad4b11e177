"""DeepSpeed ZeRO-3 with the optimiser offloaded, and LoRA adapters, through the Hugging Face
Trainer in 2 Ray Train workers on CPU (gloo): what a user runs, by the command line, on VADER."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from hf_finetune.cli import main
from hf_finetune.task import load_trained
from raytrain_common.checkpoint import write_manifest
from raytrain_common.storage import StoragePath
from raytrain_testkit.console import console_noise

pytestmark = pytest.mark.ray

SENTENCES = ["what a wonderful, kind and generous host", "the worst film I have ever seen"]


def train_command(tmp_path: Path, data_dir: StoragePath, *flags: str) -> list[str]:
    """256 VADER sentences, batches of 32 over 2 workers: 8 steps, every step's loss logged."""
    return [
        *("train", "--data-dir", data_dir.uri, "--storage-path", str(tmp_path)),
        *("--epochs", "1", "--global-batch-size", "32", "--lr", "2e-4"),
        *("--limit-train-rows", "256", "--limit-val-rows", "128", "--limit-test-rows", "128"),
        *("--log-every-steps", "1", "--tracking", "none"),
        *flags,
    ]


def summary_of(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())


def step_losses(summary: dict[str, Any]) -> dict[int, float]:
    """Every logged step's training loss, from the run's latest checkpoint's Trainer state."""
    state = json.loads((Path(summary["latest_checkpoint"]) / "trainer_state.json").read_text())
    return {row["step"]: row["loss"] for row in state["log_history"] if "loss" in row}


def logits(folder: Path | str, model: Any = None) -> torch.Tensor:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = model if model is not None else load_trained(folder)
    with torch.inference_mode():
        return model(**tokenizer(SENTENCES, return_tensors="pt", padding=True)).logits


def test_zero3_with_offload_stops_mid_epoch_resumes_exactly_and_exports_one_safetensors_file(
    ray_cluster: None, vader_dir: StoragePath, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """ZeRO-3 shards the parameters, gradients and optimiser state over the 2 workers, the
    optimiser state offloaded to host memory (DeepSpeed's CPU Adam), checkpointed at step 5 of 8
    and at the end. The run copied with its last checkpoint torn is a run stopped mid-epoch after
    step 5: rerun, the Trainer loads every worker's shard and skips the batches seen, and each
    step's loss matches the uninterrupted run's to 1e-5 relative (measured: identical). A resume on
    another worker count, or by another DeepSpeed version, is refused before Ray starts; the export
    gathers the shards into one file."""
    zero3 = ("--deepspeed", "zero3", "--offload", "optimizer", "--checkpoint-every-steps", "5")
    assert main(train_command(tmp_path, vader_dir, *zero3, "--run-name", "whole")) == 0
    whole = summary_of(tmp_path / "whole")
    assert whole["steps_done"] == 8
    assert whole["deepspeed"] == {
        "version": whole["versions"]["deepspeed"],
        "stage": "zero3",
        "offload": "optimizer",
        "world_size": 2,
    }
    # The config as the Trainer filled it, beside the run: the pipeline's batch, clipping, no
    # 16-bit gather at saves (checkpoints hold shards; export gathers them in fp32).
    written = json.loads((tmp_path / "whole" / "deepspeed_config.json").read_text())
    assert written["train_batch_size"] == 32 and written["train_micro_batch_size_per_gpu"] == 16
    assert written["gradient_clipping"] == 1.0
    assert written["zero_optimization"]["stage"] == 3
    assert written["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    # A checkpoint holds each worker's shard of the weights and of Adam's state, and no weights
    # file: ZeRO-3 never holds the whole model in one place.
    latest = Path(whole["latest_checkpoint"])
    (step_folder,) = latest.glob("global_step*")
    assert len(list(step_folder.glob("zero_pp_rank_*_mp_rank_00_optim_states.pt"))) == 2
    assert len(list(step_folder.glob("zero_pp_rank_*_mp_rank_00_model_states.pt"))) == 2
    assert not list(latest.glob("*.safetensors"))
    assert whole["parameters"] == 22_713_986 and whole["trainable_parameters"] == 22_713_986

    # Stopped after step 5: the copy's step-8 checkpoint torn (one worker's shard cut short).
    shutil.copytree(tmp_path / "whole", tmp_path / "cut")
    folders = sorted(f for f in (tmp_path / "cut").glob("checkpoint_*") if f.is_dir())
    assert len(folders) == 2  # step 5 and the epoch's end, 8
    (shard, *_) = (folders[1] / "checkpoint").glob("global_step8/zero_pp_rank_0_*_optim_states.pt")
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    cut = ["--run-name", "cut"]
    capfd.readouterr()
    # Another worker count cannot read the shards: refused in one line, naming the fix.
    other = train_command(tmp_path, vader_dir, *zero3, *cut, "--num-workers", "1")
    assert main(other) == 2
    error = capfd.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "is split over 2 workers by ZeRO" in error[0]
    assert "resume with --num-workers 2" in error[0] and "hf-finetune export" in error[0]
    # A checkpoint written by another DeepSpeed version: refused, naming it and the fix.
    shutil.copytree(tmp_path / "cut", tmp_path / "old")
    folder = sorted((tmp_path / "old").glob("checkpoint_*/checkpoint"))[0]
    record = json.loads((folder / "run_record.json").read_text())
    record["deepspeed"]["version"] = "0.14.0"
    (folder / "run_record.json").write_text(json.dumps(record))
    write_manifest(folder)  # a whole checkpoint, as that version would have left it
    assert main(train_command(tmp_path, vader_dir, *zero3, "--run-name", "old")) == 2
    error = capfd.readouterr().err.strip().splitlines()[-1]
    assert "was written by DeepSpeed 0.14.0 and this environment has" in error
    assert "install deepspeed==0.14.0 to resume it" in error
    assert main(train_command(tmp_path, vader_dir, *zero3, *cut)) == 0
    resumed = summary_of(tmp_path / "cut")
    assert resumed["steps_done"] == 8
    assert resumed["restarts"][-1]["resumed_at_step"] == 5
    expected, got = step_losses(whole), step_losses(resumed)
    assert sorted(got) == list(range(1, 9))
    for step in range(1, 9):
        assert got[step] == pytest.approx(expected[step], rel=1e-5), step

    # The best checkpoint (shards, no weights file) evaluated and predicted with as it is; one
    # safetensors file that transformers loads: the same logits as the shards gathered.
    assert main(["export", "--run-name", "cut", "--storage-path", str(tmp_path)]) == 0
    assert main(["evaluate", "--run-name", "cut", "--storage-path", str(tmp_path)]) == 0
    assert console_noise("".join(capfd.readouterr())) == []
    (tmp_path / "new.txt").write_text("\n".join(SENTENCES) + "\n")
    assert (
        main(
            [
                "predict",
                "--run-name",
                "cut",
                "--storage-path",
                str(tmp_path),
                str(tmp_path / "new.txt"),
            ]
        )
        == 0
    )
    out, err = capfd.readouterr()
    assert console_noise(out + err) == []
    assert [line.split("\t")[2] for line in out.splitlines()] == SENTENCES
    exported = tmp_path / "cut" / "export"
    assert [f.name for f in exported.glob("*.safetensors")] == ["model.safetensors"]
    plain = AutoModelForSequenceClassification.from_pretrained(exported).eval()
    best = resumed["best_checkpoint"]
    assert torch.allclose(logits(exported, plain), logits(best), atol=1e-5)


def test_lora_trains_adapters_and_head_resumes_exactly_and_exports_merged_or_alone(
    ray_cluster: None, vader_dir: StoragePath, tmp_path: Path, minilm: str
) -> None:
    """--lora-rank 8: PEFT's adapters beside MiniLM's query and value layers (its defaults for
    BERT) and the new classifier head train, the encoder stays frozen; checkpoints hold those
    alone. The run copied with its last checkpoint torn resumes from step 4 and repeats the
    whole run's losses; export merges the adapters into one plain model, or writes them alone."""
    from peft import PeftModel

    lora = ("--lora-rank", "8", "--lr", "1e-3", "--checkpoint-every-steps", "4")
    assert main(train_command(tmp_path, vader_dir, *lora, "--run-name", "lora")) == 0
    whole = summary_of(tmp_path / "lora")
    # 6 layers × (query + value: 384 → 384 each) × rank 8 × (A + B), and the head (384 × 2 + 2).
    head = 384 * 2 + 2
    assert whole["trainable_parameters"] == 6 * 2 * 8 * (384 + 384) + head
    base = AutoModelForSequenceClassification.from_pretrained(minilm, num_labels=2)
    base_count = sum(p.numel() for p in base.parameters())
    # PEFT keeps the trained head beside a frozen copy of the original one.
    assert whole["parameters"] == base_count + whole["trainable_parameters"]
    # A checkpoint: the adapters and head, and their two AdamW moments, in fp32: ~1 MB against
    # ~270 MB for a full fine-tune's weights and moments.
    latest = Path(whole["latest_checkpoint"])
    held = sum(f.stat().st_size for f in latest.iterdir() if f.suffix in (".safetensors", ".pt"))
    assert held < 3 * 4 * whole["trainable_parameters"] * 1.1
    assert not (latest / "model.safetensors").exists()

    # Resumed from step 4 (the later checkpoint torn): adapters, head, moments as saved.
    shutil.copytree(tmp_path / "lora", tmp_path / "lora-resumed")
    folders = sorted(f for f in (tmp_path / "lora-resumed").glob("checkpoint_*") if f.is_dir())
    assert len(folders) == 2  # step 4 and the epoch's end, 8
    for folder in folders[1:]:
        adapter = folder / "checkpoint" / "adapter_model.safetensors"
        adapter.write_bytes(adapter.read_bytes()[:100])
    assert main(train_command(tmp_path, vader_dir, *lora, "--run-name", "lora-resumed")) == 0
    resumed = summary_of(tmp_path / "lora-resumed")
    assert resumed["restarts"][-1]["resumed_at_step"] == 4
    expected, got = step_losses(whole), step_losses(resumed)
    for step in range(5, 9):
        assert got[step] == pytest.approx(expected[step], rel=1e-5), step

    storage = ["--storage-path", str(tmp_path), "--run-name", "lora"]
    assert main(["export", *storage]) == 0
    adapter_dir = tmp_path / "adapter"
    assert main(["export", *storage, "--adapter-only", "--output", str(adapter_dir)]) == 0
    plain = AutoModelForSequenceClassification.from_pretrained(tmp_path / "lora" / "export").eval()
    assert not hasattr(plain, "peft_config") and plain.config.id2label[1] == "positive"
    adapted = PeftModel.from_pretrained(
        AutoModelForSequenceClassification.from_pretrained(minilm, config=plain.config),
        str(adapter_dir),
    ).eval()
    assert torch.allclose(logits(adapter_dir, plain), logits(adapter_dir, adapted), atol=1e-5)
