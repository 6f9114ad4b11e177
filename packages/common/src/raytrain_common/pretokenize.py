"""Parquet pre-tokenisation: tokenise a text column once, with Ray Data, and keep the ids as
Parquet.

Training then reads token ids instead of re-tokenising every epoch on every worker. The output
folder holds `part-*.parquet` (columns `input_ids` list<int32>, `length` = untruncated token count,
and any kept columns) and `stats.json` (rows, token-length percentiles, truncated share), written
last, so it marks a complete folder.

For causal LMs, `pretokenize(..., max_length=None, eos_id=...)` keeps whole EOS-ended documents,
whose concatenation a pipeline then cuts into fixed blocks.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute
import pyarrow.parquet as pq
import ray.data

from raytrain_common.storage import StoragePath, restart_marked_folder

STATS_FILE = "stats.json"


class TokenizeError(ValueError):
    """Input that cannot be tokenised; the message names the column, the row and the fix."""


@dataclass(frozen=True)
class TokenStats:
    rows: int
    max_length: int | None  # None: not truncated (documents for packing)
    truncated_rows: int
    truncated_share: float
    length_mean: float
    length_p50: int
    length_p90: int
    length_p99: int
    length_max: int


def load_fast_tokenizer_json(tokenizer_path: str) -> str:
    """The Rust tokenizer behind a Hugging Face fast tokenizer, serialised (special tokens
    included).

    Actors rebuild it with the small `tokenizers` library instead of importing transformers: that
    import costs each actor seconds, which is most of the work for a few hundred thousand rows.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    if not tokenizer.is_fast:
        raise TokenizeError(f"{tokenizer_path!r} has no fast (Rust) tokenizer; give one that does")
    return tokenizer.backend_tokenizer.to_str()


class TokenizeBatch:
    """A Ray Data callable class: builds the fast tokenizer once per actor, tokenises Arrow
    batches."""

    def __init__(
        self,
        tokenizer_json: str,
        text_column: str,
        max_length: int | None,
        keep_columns: Sequence[str] = (),
        eos_id: int | None = None,
    ) -> None:
        from tokenizers import Tokenizer

        # One Rust thread per actor: the actors are the parallelism; more threads would
        # oversubscribe the cores. (Read by the library at each call, so it holds in a reused worker
        # process too.)
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        self.tokenizer = Tokenizer.from_str(tokenizer_json)
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self.truncating = Tokenizer.from_str(tokenizer_json)
        self.truncating.no_padding()
        # Truncation that accounts for the special tokens the post-processor adds.
        if max_length is not None:
            self.truncating.enable_truncation(max_length)
        self.eos_id = eos_id
        self.text_column = text_column
        self.max_length = max_length
        self.keep_columns = list(keep_columns)

    def __call__(self, batch: pa.Table) -> pa.Table:
        column = batch.column(self.text_column)
        texts = column.to_pylist()
        # Arrow's type answers for the whole batch; rows are looked at only to name the bad one.
        if column.null_count or not (
            pa.types.is_string(column.type) or pa.types.is_large_string(column.type)
        ):
            bad = next(((i, t) for i, t in enumerate(texts) if not isinstance(t, str)), None)
        else:
            bad = None
        if bad is not None:  # (a dictionary-encoded text column is text, and passes)
            index, text = bad
            raise TokenizeError(
                f"column {self.text_column!r} holds {type(text).__name__} "
                f"({text!r:.40}) at batch row {index}, not text: choose "
                "the text column with --text-column, or clean the data"
            )
        ids = [encoding.ids for encoding in self.tokenizer.encode_batch_fast(texts)]
        if self.eos_id is not None:  # documents for packing: each ends with EOS
            ids = [[*row, self.eos_id] for row in ids]
        lengths = np.array([len(row) for row in ids], dtype=np.int32)
        too_long = np.flatnonzero(lengths > (self.max_length or np.iinfo(np.int32).max))
        if len(too_long):  # re-encode the few long rows with truncation, so special tokens stay
            cut = self.truncating.encode_batch_fast([texts[i] for i in too_long])
            for i, encoding in zip(too_long, cut, strict=True):
                ids[i] = encoding.ids
        columns = {
            "input_ids": pa.array(ids, type=pa.list_(pa.int32())),
            "length": pa.array(lengths),
        }
        columns |= {name: batch.column(name) for name in self.keep_columns}
        return pa.table(columns)


def pretokenize(
    dataset: ray.data.Dataset,
    output: StoragePath,
    *,
    tokenizer_path: str,
    text_column: str,
    max_length: int | None,
    keep_columns: Sequence[str] = (),
    eos_id: int | None = None,
    actors: int = 2,
    batch_size: int = 1024,
) -> TokenStats:
    """Tokenise `text_column` of `dataset` into Parquet under `output`; return and write the stats.

    `max_length=None` keeps whole documents; `eos_id` ends each with that token (for packing).
    """
    missing = [c for c in [text_column, *keep_columns] if c not in dataset.schema().names]
    if missing:
        raise TokenizeError(
            f"column(s) {missing} not in the data (it has {dataset.schema().names}): "
            "set --text-column / --label-column to the data's names"
        )
    if max_length is not None and max_length < 2:
        raise TokenizeError(f"max_length={max_length}: it must leave room for special tokens")
    marker = restart_marked_folder(output, STATS_FILE)
    tokenizer_json = load_fast_tokenizer_json(tokenizer_path)
    tokenized = dataset.map_batches(
        TokenizeBatch,
        fn_constructor_args=(tokenizer_json, text_column, max_length, list(keep_columns), eos_id),
        batch_format="pyarrow",
        batch_size=batch_size,
        # Fractional CPUs: the actors must not take every slot from the read and write tasks. One
        # at least, `actors` at most: a small file is one block, and a fixed pool larger than the
        # blocks warns on the console that it cannot be used.
        compute=ray.data.ActorPoolStrategy(min_size=1, max_size=actors),
        num_cpus=0.5,
    )
    tokenized.write_parquet(output.path, filesystem=output.filesystem)
    stats = compute_stats(output, max_length)
    marker.write_text(json.dumps(asdict(stats), indent=2) + "\n")
    return stats


def compute_stats(folder: StoragePath, max_length: int | None) -> TokenStats:
    """Token-length statistics from the `length` column of a tokenised folder."""
    lengths = []
    for file in folder.list_files(".parquet"):
        with file.filesystem.open_input_file(file.path) as stream:
            lengths.append(pq.read_table(stream, columns=["length"])["length"].to_numpy())
    if not lengths or not sum(len(part) for part in lengths):
        raise TokenizeError(f"no rows were tokenised into {folder}: is the input empty?")
    values = np.concatenate(lengths)
    truncated = int((values > max_length).sum()) if max_length is not None else 0
    p50, p90, p99 = (int(np.percentile(values, q)) for q in (50, 90, 99))
    return TokenStats(
        rows=len(values),
        max_length=max_length,
        truncated_rows=truncated,
        truncated_share=round(truncated / len(values), 6),
        length_mean=round(float(values.mean()), 3),
        length_p50=p50,
        length_p90=p90,
        length_p99=p99,
        length_max=int(values.max()),
    )


def read_stats(folder: StoragePath) -> TokenStats:
    marker = folder.join(STATS_FILE)
    if not marker.exists():
        raise FileNotFoundError(
            f"{folder} has no {STATS_FILE}: it was not pre-tokenised completely"
        )
    return TokenStats(**json.loads(marker.read_text()))
