from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from raytrain_common.checkpoint import (
    STATE_FILE,
    load_model_weights,
    load_state,
    save_state,
    strip_prefixes,
    unwrap,
)


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
    loaded = load_state(tmp_path)
    assert loaded["epochs_done"] == 4
    assert loaded["history"] == [{"loss": 0.5}]
    assert torch.equal(loaded["model"]["weight"], state["model"]["weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == [STATE_FILE]


class Payload:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (print, ("this must never run",))


def test_loading_refuses_pickled_code(tmp_path: Path) -> None:
    torch.save({"model": {}, "evil": Payload()}, tmp_path / STATE_FILE)
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
