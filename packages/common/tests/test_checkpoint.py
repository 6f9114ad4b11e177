from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from raytrain_common.checkpoint import (
    STATE_FILE,
    TornCheckpointError,
    load_model_weights,
    load_remote_state,
    load_state,
    new_scratch_folder,
    save_state,
    scratch_folder,
    strip_prefixes,
    unwrap,
    verify_checkpoint,
    write_manifest,
)
from raytrain_common.storage import resolve_storage


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("module.fc.weight", "fc.weight"),
        ("_orig_mod.fc.weight", "fc.weight"),
        ("_orig_mod.module.fc.weight", "fc.weight"),
        ("module._orig_mod.fc.weight", "fc.weight"),
        ("fc.weight", "fc.weight"),
        ("encoder.module.weight", "encoder.module.weight"),  # only leading prefixes go
    ],
)
def test_strip_prefixes(key: str, expected: str) -> None:
    assert list(strip_prefixes({key: 1})) == [expected]


def test_state_round_trip_and_weights_only(tmp_path: Path) -> None:
    state = {"model": nn.Linear(3, 2).state_dict(), "epochs_done": 4, "history": [{"loss": 0.5}]}
    save_state(tmp_path, state)
    write_manifest(tmp_path)
    loaded = load_state(tmp_path)
    assert loaded["epochs_done"] == 4
    assert loaded["history"] == [{"loss": 0.5}]
    assert torch.equal(loaded["model"]["weight"], state["model"]["weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "manifest-rank0.json",
        "manifest-world.json",
        STATE_FILE,
    ]
    assert load_remote_state(resolve_storage(tmp_path))["epochs_done"] == 4


@pytest.mark.parametrize("damage", ["truncate", "flip a byte", "drop the manifest", "drop a rank"])
def test_a_torn_checkpoint_is_refused_naming_the_file(tmp_path: Path, damage: str) -> None:
    save_state(tmp_path, {"model": nn.Linear(64, 64).state_dict()})
    (tmp_path / "shard-1.bin").write_bytes(b"rank 1's shard")
    write_manifest(tmp_path, rank=0, world_size=2)
    write_manifest(tmp_path, rank=1, world_size=2)
    verify_checkpoint(tmp_path)
    state_file = tmp_path / STATE_FILE
    data = state_file.read_bytes()
    expected = {
        "truncate": rf"{STATE_FILE} has {len(data) // 2} bytes, its manifest says {len(data)}",
        "flip a byte": rf"{STATE_FILE} does not match its SHA-256",
        "drop the manifest": r"has no manifest-world.json: it was cut off",
        "drop a rank": r"lacks manifest-rank1.json: rank 1's files are incomplete",
    }[damage]
    if damage == "truncate":
        state_file.write_bytes(data[: len(data) // 2])
    elif damage == "flip a byte":
        state_file.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    elif damage == "drop the manifest":
        (tmp_path / "manifest-world.json").unlink()
    else:
        (tmp_path / "manifest-rank1.json").unlink()
    with pytest.raises(TornCheckpointError, match=expected):
        load_state(tmp_path)
    if damage in ("truncate", "flip a byte"):
        with pytest.raises(TornCheckpointError, match=str(tmp_path)):
            load_remote_state(resolve_storage(tmp_path))


class Payload:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (print, ("this must never run",))


def test_loading_refuses_pickled_code(tmp_path: Path) -> None:
    torch.save({"model": {}, "evil": Payload()}, tmp_path / STATE_FILE)
    write_manifest(tmp_path)  # a complete checkpoint, so the unpickler itself is what refuses
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        load_state(tmp_path)


def test_missing_state_file_names_the_folder(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        load_state(tmp_path)


def test_ddp_weights_load_into_a_plain_model(tmp_path: Path) -> None:
    """A real DDP wrapper (gloo, one process) saves `module.` keys; a plain model loads them."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1
    )
    try:
        wrapped = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
        assert next(iter(wrapped.state_dict())).startswith("module.")
        assert unwrap(wrapped) is wrapped.module
        plain = nn.Linear(4, 2)
        load_model_weights(plain, wrapped.state_dict())
        assert torch.equal(plain.weight, wrapped.module.weight)
    finally:
        dist.destroy_process_group()


def test_load_is_strict() -> None:
    with pytest.raises(RuntimeError, match="Missing key"):
        load_model_weights(nn.Linear(4, 2), {"module.weight": torch.zeros(2, 4)})


def test_a_killed_workers_scratch_folder_is_removed_by_the_next_one_and_a_live_ones_is_kept() -> (
    None
):
    """A worker SIGKILLed while it held a checkpoint's scratch folder (a lost node, an OOM kill)
    cannot remove it; the next worker on the machine does, and leaves live workers' folders
    alone."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from raytrain_common.checkpoint import new_scratch_folder; "
            "print(new_scratch_folder('test-scratch'), flush=True); time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    killed = Path(holder.stdout.readline().strip())
    (killed / "model.safetensors").write_bytes(bytes(1 << 20))
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    live = Path(new_scratch_folder("test-scratch"))
    try:
        with scratch_folder("test-scratch") as folder:
            assert not killed.exists()
            assert live.is_dir() and Path(folder).is_dir() and f"-pid{os.getpid()}-" in folder
        assert not Path(folder).exists()
    finally:
        live.rmdir()
