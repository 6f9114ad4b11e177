"""Reading users' text files: any encoding, any size, a bad byte named where it is."""

from __future__ import annotations

from pathlib import Path

import pytest

from raytrain_common.text import TextEncodingError, read_lines


def test_a_text_file_is_read_line_by_line_in_any_encoding(tmp_path: Path) -> None:
    """`read_lines` (hf-finetune's `predict FILE`) reads a MiB at a time: lines and UTF-16
    characters cut by a chunk boundary come out whole, and a byte that is not the encoding is
    refused with its place."""
    lines = [f"ligne {index}: déjà vu, naïve café" for index in range(60_000)]  # ~2.3 MiB in UTF-16
    path = tmp_path / "lines.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-16")
    assert list(read_lines(path, "utf-16")) == lines
    path.write_bytes(b"fine\ncaf\xe9\n")
    with pytest.raises(TextEncodingError, match="line 2"):
        list(read_lines(str(path), "utf-8"))
