"""Byte-level tokenizer: UTF-8 bytes are token ids 0..255, then BOS (256) and EOS (257).

The tiny model's vocabulary (``--vocab_size`` >= 258) starts with these ids; any id above EOS
is a valid model output that has no text and decodes to nothing.
"""

from __future__ import annotations

BOS_ID = 256
EOS_ID = 257


def encode(text: str, *, add_bos: bool = True) -> list[int]:
    """Text -> token ids ``[BOS] + utf8 bytes``."""
    ids = list(text.encode("utf-8"))
    return [BOS_ID] + ids if add_bos else ids


def decode(ids: list[int]) -> str:
    """Token ids -> text: bytes are joined, special and out-of-byte-range ids dropped,
    invalid UTF-8 replaced (a random model emits arbitrary bytes)."""
    return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
