"""A checkpoint → one Hugging Face model folder (model.safetensors, config, tokenizer) that
`transformers` loads with `AutoModelForSequenceClassification.from_pretrained`.

Whatever trained it: a ZeRO-3 checkpoint's shards (one per worker, no weights file) are gathered
in full precision in this one process, and a LoRA run's adapters are merged into the base weights
(or, with `adapter_only`, written alone for `PeftModel.from_pretrained(base, folder)`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from transformers import AutoTokenizer
from transformers.utils import logging as hf_logging

from hf_finetune import __version__
from hf_finetune.evaluate import model_folder
from hf_finetune.task import ADAPTER_CONFIG, load_adapted, load_trained
from raytrain_common.labelled.prepare import DataError
from raytrain_common.storage import (
    OutputMarker,
    check_output_folder,
    resolve_storage,
    staged_output,
)


@dataclass(frozen=True)
class ExportRecord:
    """What an export's marker holds: the checkpoint it consolidates and the package that wrote it."""

    checkpoint: str
    hf_finetune: str


# Written last: marks a folder as an export's own, whole (the library's one rule for outputs).
EXPORT_MARKER = OutputMarker.of("hf_finetune_export.json", ExportRecord)


def export(checkpoint: str, output: str, adapter_only: bool = False) -> Path:
    """Write `checkpoint` (a run's checkpoint folder, on any storage) into `output` atomically.

    `output` may be absent, empty, or an earlier export (it holds EXPORT_MARKER, written last); a
    folder of anything else is refused before any work, so the user's own files are never replaced.
    """
    target = resolve_storage(output)
    if not target.is_local:
        raise DataError(
            f"--output {output}: give a local or mounted folder (save_pretrained writes files)"
        )
    check_output_folder(target, EXPORT_MARKER)  # now, before the checkpoint is read
    hf_logging.disable_progress_bar()  # transformers' save and load bars: a console line each
    with model_folder(checkpoint) as folder:
        if adapter_only and not (folder / ADAPTER_CONFIG).exists():
            raise DataError(
                f"--adapter-only: {checkpoint} is a full fine-tune's, it holds no adapters"
            )
        tokenizer = AutoTokenizer.from_pretrained(folder)
        with staged_output(target, EXPORT_MARKER) as staged:
            if adapter_only:
                load_adapted(folder).save_pretrained(staged.folder.path)
            else:
                # One file whatever the size: what the users load and ship.
                load_trained(folder).save_pretrained(staged.folder.path, max_shard_size="1000GB")
            tokenizer.save_pretrained(staged.folder.path)
            staged.write_marker(asdict(ExportRecord(checkpoint, __version__)))
    return Path(target.path)
