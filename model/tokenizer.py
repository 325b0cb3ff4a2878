"""Text <-> token ids: the checkpoint's ``tokenizer.json`` when it has one, else a byte-level fallback.

The fallback exists so that the tiny model (and any checkpoint shipped without a ``tokenizers`` file, e.g.
Kimi's tiktoken-based one) still has a deterministic, reversible text interface: byte ``b`` is id
``b + BYTE_OFFSET``; ids below the offset are specials (0 pad, 1 bos, 2 eos in the tiny model) and ids past
the byte range decode to nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from .config import ModelConfig
from .errors import ModelInputError

BYTE_OFFSET = 3


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """``[bos] + [byte + 3 for byte in utf8(text)]``; decode keeps byte ids only (invalid UTF-8 replaced)."""

    def __init__(self, vocab_size: int, bos_id: int | None = 1) -> None:
        if vocab_size < 256 + BYTE_OFFSET:
            raise ModelInputError(
                f"byte-level fallback needs vocab >= {256 + BYTE_OFFSET}, model has {vocab_size}"
            )
        self.vocab_size = vocab_size
        self.bos_id = bos_id

    def encode(self, text: str) -> list[int]:
        head = [self.bos_id] if self.bos_id is not None else []
        return head + [b + BYTE_OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        data = bytes(
            i - BYTE_OFFSET for i in ids if BYTE_OFFSET <= i < 256 + BYTE_OFFSET and i != self.bos_id
        )
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``tokenizers`` ``tokenizer.json`` (special tokens added on encode, skipped on decode)."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text).ids)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(model_dir: str | Path | None, config: ModelConfig) -> Tokenizer:
    """``model_dir/tokenizer.json`` if present, else the byte fallback sized to ``config``."""
    if model_dir is not None:
        p = Path(model_dir) / "tokenizer.json"
        if p.is_file():
            return HFTokenizer(p)
    return ByteTokenizer(config.vocab_size, config.bos_token_id)
