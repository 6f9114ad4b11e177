"""Packing EOS-ended tokenised documents into fixed blocks: every token once, in document order,
whatever order the document files were written in; a corpus too small for one block is refused."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import ray.data

from raytrain_common.pretokenize import TokenizeError, pretokenize
from raytrain_common.storage import resolve_storage
from raytrain_common.tokens.packing import pack_blocks, read_pack_stats

pytestmark = pytest.mark.ray


def test_packing_keeps_every_token_once_in_order(
    ray_cluster: None,
    tokenizer_path: str,
    tmp_path: Path,
    parquet_rows: Callable[[Path], list[dict[str, object]]],
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    eos = tokenizer.sep_token_id
    documents = [f"document {n} says " + "word " * (n % 7 * 5) for n in range(60)]
    items = [{"doc": n, "text": text} for n, text in enumerate(documents)]
    tokens = resolve_storage(tmp_path / "documents")
    pretokenize(
        ray.data.from_items(items, override_num_blocks=4),
        tokens,
        tokenizer_path=tokenizer_path,
        text_column="text",
        max_length=None,
        keep_columns=["doc"],
        eos_id=eos,
        batch_size=16,
    )
    stats = pack_blocks(
        tokens,
        resolve_storage(tmp_path / "blocks"),
        block_size=33,
        order_column="doc",
        rows_per_file=4,
    )
    expected = [t for text in documents for t in [*tokenizer(text)["input_ids"], eos]]
    blocks = [row["input_ids"] for row in parquet_rows(tmp_path / "blocks")]
    assert all(len(block) == 33 for block in blocks)
    flat = [t for block in blocks for t in block]
    assert flat == expected[: len(flat)]  # in document order, nothing lost or repeated
    assert stats.tokens == len(expected)
    assert stats.tokens_dropped == len(expected) - len(flat) < 33
    assert (stats.documents, stats.blocks) == (60, len(blocks))
    assert flat.count(eos) == sum(1 for t in expected[: len(flat)] if t == eos)
    assert read_pack_stats(resolve_storage(tmp_path / "blocks")) == stats
    assert len(list((tmp_path / "blocks").glob("*.parquet"))) == -(-len(blocks) // 4)
    with pytest.raises(TokenizeError, match=r"make no block of 100000"):
        pack_blocks(
            tokens, resolve_storage(tmp_path / "big"), block_size=100_000, order_column="doc"
        )
