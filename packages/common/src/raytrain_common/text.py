"""Users' text files in the encoding they were written in, or a one-line refusal that says which
encoding to pass: a Latin-1 CSV must never reach a parser as 'binary' data."""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Iterator
from pathlib import Path

UTF8 = "utf-8"
_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32"),
    (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
)


class TextEncodingError(ValueError):
    """A file whose bytes are not text in the encoding asked for; names the place and the fix."""


def check_encoding(name: str) -> str:
    """The codec's canonical name, or an error listing common ones (at start, before any work)."""
    try:
        return codecs.lookup(name).name
    except LookupError:
        raise TextEncodingError(
            f"--encoding {name!r} is not an encoding Python knows: give e.g. utf-8, latin-1, "
            "cp1252, utf-16, shift_jis or gb18030"
        ) from None


def decode_text(data: bytes, encoding: str, where: str) -> str:
    """`data` decoded as `encoding` (a UTF-8 byte-order mark accepted and dropped)."""
    codec = check_encoding(encoding)
    if codec == UTF8:
        codec = "utf-8-sig"
    try:
        return data.decode(codec)
    except UnicodeDecodeError as error:
        raise TextEncodingError(describe_decode_error(data, error, encoding, where)) from None


def describe_decode_error(data: bytes, error: UnicodeDecodeError, encoding: str, where: str) -> str:
    offset = error.start
    line = data.count(b"\n", 0, offset) + 1
    line_start = data.rfind(b"\n", 0, offset) + 1
    excerpt = data[max(line_start, offset - 30) : offset + 10]
    return (
        f"{where} is not valid {encoding} text: byte {offset} (line {line}, "
        f"{excerpt!r}) cannot be decoded. {suggest_encoding(data, encoding)}"
    )


def suggest_encoding(data: bytes, tried: str) -> str:
    """The fix: the encoding the bytes most likely are, from a byte-order mark or a trial decode."""
    for bom, name in _BOMS:
        if data.startswith(bom):
            return f"The file starts with a {name} byte-order mark: pass --encoding {name}."
    for candidate, label in (
        (UTF8, "UTF-8"),
        ("cp1252", "Windows-1252 (what Excel and many Western exports write)"),
    ):
        if codecs.lookup(candidate).name == codecs.lookup(tried).name:
            continue
        try:
            data.decode(candidate)
        except UnicodeDecodeError:
            continue
        return (
            f"It decodes as {label}: pass --encoding {candidate}, or re-encode the file as UTF-8."
        )
    return (
        "Pass the encoding it was written in (--encoding latin-1 reads any bytes, cp1252, "
        "shift_jis, …), or re-encode the file as UTF-8."
    )


def iter_decoded(chunks: Iterable[bytes], encoding: str, where: str) -> Iterator[tuple[str, bytes]]:
    """Decode a file read a chunk of bytes at a time (characters split across chunks, and UTF-16
    or UTF-32, are whole): each chunk's text with its bytes. A decode error is reported as
    `decode_text` reports it, with the byte and line counted from the file's start."""
    codec = check_encoding(encoding)
    decoder = codecs.getincrementaldecoder("utf-8-sig" if codec == UTF8 else codec)("strict")
    offset = lines = 0
    for chunk in chunks:
        try:
            text = decoder.decode(chunk)
        except UnicodeDecodeError as error:
            # The decoder's position counts from its buffered bytes (≤ 3) plus this chunk.
            at = max(0, error.start - (len(error.object) - len(chunk)))
            line = lines + chunk.count(b"\n", 0, at) + 1
            line_start = chunk.rfind(b"\n", 0, at) + 1
            excerpt = chunk[max(line_start, at - 30) : at + 10]
            raise TextEncodingError(
                f"{where} is not valid {encoding} text: byte {offset + at} (line {line}, "
                f"{excerpt!r}) cannot be decoded. {suggest_encoding(chunk, encoding)}"
            ) from None
        offset += len(chunk)
        lines += chunk.count(b"\n")
        yield text, chunk
    tail = decoder.decode(b"", final=True)
    if tail:
        yield tail, b""


READ_CHUNK_BYTES = 1 << 20


def read_lines(path: str | Path, encoding: str) -> Iterator[str]:
    """A local text file's lines, without their ends, decoded a MiB at a time: a file of any size
    in bounded memory, and a byte that is not `encoding` refused with its place in the file
    (TextEncodingError)."""

    def chunks() -> Iterator[bytes]:
        with Path(path).expanduser().open("rb") as stream:
            while chunk := stream.read(READ_CHUNK_BYTES):
                yield chunk

    pending = ""
    for text, _ in iter_decoded(chunks(), encoding, str(path)):
        *complete, pending = (pending + text).split("\n")
        yield from complete
    if pending:
        yield pending
