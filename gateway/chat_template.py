"""The chat template of the embedded tiny model, and the answer memo that makes turn 2 hit turn 1's cache.

Template (documented in docs/design/gateway.md), applied message by message::

    [bos] <|system|>{content}<|end|>\n <|user|>{content}<|end|>\n ... <|assistant|>

Why this shape: every message renders to a fixed string that depends on that message only, so the prompt of
turn N+1 literally starts with turn N's prompt followed by turn N's answer, and the chained block hashes of
that prefix are the ones prefill and decode already pushed. An assistant message renders as
``{answer}<|end|>\n`` right after the ``<|assistant|>`` tag that ended the previous prompt.

Why the memo: text is a lossy view of tokens (the byte tokenizer drops ids past the byte range, a stop string
cuts the text). Re-encoding an answer's text would change its tokens and lose every block after the first
mismatch. The gateway remembers, per tenant, the exact token ids it streamed for an answer text (bounded LRU)
and reuses them when that text comes back as an assistant message. A miss only costs cache hits, never
correctness: the ids then come from encoding the text, as any server would do.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence

from kvpool.gateway.errors import InvalidRequest
from kvpool.gateway.schemas import ChatMessage
from kvpool.model.tokenizer import Tokenizer

ROLE_TAG = "<|{role}|>"
END_TAG = "<|end|>\n"
GENERATION_TAG = "<|assistant|>"


class TextCodec:
    """Tokenizer wrapper: pieces without the BOS (so pieces concatenate), typed errors for bad text."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.bos_id: int | None = getattr(tokenizer, "bos_id", None)
        self.eos_ids = frozenset(eos_ids)

    def encode(self, text: str, bos: bool = True) -> list[int]:
        try:
            ids = self.tokenizer.encode(text)
        except UnicodeError as exc:  # lone surrogates in JSON strings, say
            raise InvalidRequest(f"text is not valid Unicode: {exc.reason}", param="prompt") from None
        if not bos and self.bos_id is not None and ids[:1] == [self.bos_id]:
            return ids[1:]
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def check_ids(self, ids: Sequence[int], param: str = "prompt") -> list[int]:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(
                f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", param=param
            )
        return list(ids)


class AnswerMemo:
    """Bounded LRU: (tenant, answer text) -> the token ids generated for it. Thread-safe, O(1)."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._items: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def _key(tenant: str, text: str) -> bytes:
        return hashlib.sha256(f"{tenant}\0{text}".encode("utf-8", "surrogatepass")).digest()

    def put(self, tenant: str, text: str, ids: Sequence[int]) -> None:
        if self.capacity <= 0 or not ids:
            return
        key = self._key(tenant, text)
        with self._lock:
            self._items[key] = tuple(ids)
            self._items.move_to_end(key)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, tenant: str, text: str) -> list[int] | None:
        key = self._key(tenant, text)
        with self._lock:
            ids = self._items.get(key)
            if ids is not None:
                self._items.move_to_end(key)
        return list(ids) if ids is not None else None

    def __len__(self) -> int:
        return len(self._items)


def render_chat(
    codec: TextCodec,
    messages: Sequence[ChatMessage],
    tenant: str,
    memo: AnswerMemo | None = None,
    ends: list[list[int]] | None = None,
) -> list[int]:
    """Token ids of ``messages`` under the template, ending with the generation tag. ``ends``, when given,
    receives per message the end positions (tokens) of its text parts, then of the message itself: where a
    ``cache_control`` breakpoint falls. A part's end is exact when the tokens of the message up to that
    part are a prefix of the message's tokens, else it is the message's end (a tokenizer merging across
    the boundary)."""
    ids: list[int] = [codec.bos_id] if codec.bos_id is not None else []
    after_generation_tag = False
    for i, m in enumerate(messages):
        text = m.text()
        start = len(ids)
        parts: list[int] = []
        if m.role == "assistant" and after_generation_tag:
            remembered = memo.get(tenant, text) if memo is not None else None
            ids += remembered if remembered is not None else codec.encode(text, bos=False)
            ids += codec.encode(END_TAG, bos=False)
        else:
            rendered = codec.encode(ROLE_TAG.format(role=m.role) + text + END_TAG, bos=False)
            ids += rendered
            if ends is not None and isinstance(m.content, list):
                upto = ROLE_TAG.format(role=m.role)
                for part in m.content:
                    upto += part.text
                    head = codec.encode(upto, bos=False)
                    parts.append(start + (len(head) if rendered[: len(head)] == head else len(rendered)))
        if ends is not None:
            if isinstance(m.content, list) and len(parts) < len(m.content):
                parts = [len(ids)] * len(m.content)
            ends.append([*parts, len(ids)])
        after_generation_tag = False
        if i + 1 < len(messages) and messages[i + 1].role == "assistant":
            ids += codec.encode(GENERATION_TAG, bos=False)
            after_generation_tag = True
    # an assistant message last is answered with another assistant turn, as OpenAI does
    return ids + codec.encode(GENERATION_TAG, bos=False)
