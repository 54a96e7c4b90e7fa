"""Tokenizers the engine serves with, behind one small interface.

``Tokenizer`` is what the scheduler, the workload and the HTTP API use: ``encode(text)``,
``decode(ids)``, ``bos_id`` (or None), ``eos_ids`` (a frozenset; generation stops on any),
``has_text`` (False: the checkpoint ships no tokenizer, only token-id prompts are served) and
``apply_chat_template(messages)`` (raises ``TokenizerError`` when there is no template).

``ByteTokenizer``: UTF-8 bytes are token ids 0..255, then BOS (256) and EOS (257); any id above
EOS is a valid model output that has no text and decodes to nothing.
"""

from __future__ import annotations

BOS_ID = 256
EOS_ID = 257


class TokenizerError(ValueError):
    """A tokenizer cannot do what was asked (no tokenizer files, no chat template, bad file)."""


class Tokenizer:
    """Interface (see the module docstring)."""

    bos_id: int | None = None
    eos_ids: frozenset[int] = frozenset()
    has_text: bool = True
    name: str = "tokenizer"

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def apply_chat_template(self, messages: list[dict], *,
                            add_generation_prompt: bool = True) -> str:
        raise TokenizerError(f"{self.name}: this tokenizer has no chat template")


class ByteTokenizer(Tokenizer):
    """The byte-level tokenizer (see the module docstring)."""

    bos_id = BOS_ID
    eos_ids = frozenset({EOS_ID})
    name = "byte"

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return encode(text, add_bos=add_special_tokens)

    def decode(self, ids: list[int]) -> str:
        return decode(ids)


def encode(text: str, *, add_bos: bool = True) -> list[int]:
    """Text -> token ids ``[BOS] + utf8 bytes``."""
    ids = list(text.encode("utf-8"))
    return [BOS_ID] + ids if add_bos else ids


def decode(ids: list[int]) -> str:
    """Token ids -> text: bytes are joined, special and out-of-byte-range ids dropped,
    invalid UTF-8 replaced (a random model emits arbitrary bytes)."""
    return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
