"""Text <-> token ids: the checkpoint's ``tokenizer.json`` when it has one, else a byte-level fallback.

The embedded ``tiny`` ships its own byte-level BPE (``data/tiny_tokenizer.json``, trained with its weights
by ``scripts/train_tiny.py``). The fallback exists so that the seeded tiny models (and any checkpoint
shipped without a ``tokenizers`` file, e.g. Kimi's tiktoken-based one) still have a deterministic,
reversible text interface: byte ``b`` is id ``b + BYTE_OFFSET``; ids below the offset are specials (0 pad,
1 bos, 2 eos in the tiny model) and ids past the byte range decode to nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from .config import ModelConfig
from .errors import ModelInputError

BYTE_OFFSET = 3
TINY_TOKENIZER = Path(__file__).resolve().parent / "data" / "tiny_tokenizer.json"


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
    """A ``tokenizers`` ``tokenizer.json`` (special tokens added on encode, skipped on decode).

    ``bos_id`` is the one token its post-processor puts before every text (None if it adds none), so the
    gateway can encode pieces without it. A byte-level BPE decodes an incomplete multi-byte character to
    U+FFFD, which the streamer holds back until the next token completes it."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(str(path))
        empty = self._tok.encode("").ids
        self.bos_id: int | None = empty[0] if len(empty) == 1 else None

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text).ids)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(model: str | Path | None, config: ModelConfig) -> Tokenizer:
    """The tokenizer of ``model``: an embedded model's name (``tiny``: its BPE; the seeded ones: bytes), or
    a checkpoint directory (its ``tokenizer.json`` if present); else the byte fallback sized to ``config``."""
    from .loader import TINY_MODELS

    if model == "tiny":
        return HFTokenizer(TINY_TOKENIZER)
    if model is not None and str(model) not in TINY_MODELS:
        p = Path(model) / "tokenizer.json"
        if p.is_file():
            return HFTokenizer(p)
    return ByteTokenizer(config.vocab_size, config.bos_token_id)
