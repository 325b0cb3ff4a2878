"""OpenAI response bodies for one request: the whole ``chat.completion`` / ``text_completion`` object, or
its stream of chunks (a role head for chat, text deltas, the finish chunk, the usage chunk when
``stream_options.include_usage`` asks), each as one SSE ``data:`` line. ``usage`` always carries
``prompt_tokens_details.cached_tokens``; the extra top-level ``kvpool`` field carries the routing facts.
"""

from __future__ import annotations

import json
import time
import uuid

from kvpool.gateway.service import Generation


def sse_data(obj: dict) -> str:
    """One Server-Sent Event carrying ``obj`` as compact JSON."""
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class Formatter:
    """OpenAI response bodies for one request (completions or chat)."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"

    def _envelope(self, obj: str, choices: list, usage: object = None, with_usage: bool = False) -> dict:
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if with_usage:
            out["usage"] = usage
        return out

    def full(self, text: str, gen: Generation) -> dict:
        u = gen.usage
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": u.finish_reason,
                "logprobs": None,
            }
        else:
            choice = {"index": 0, "text": text, "finish_reason": u.finish_reason, "logprobs": None}
        out = self._envelope(self.object, [choice], u.openai(), True)
        out["kvpool"] = u.extra
        return out

    def _choice(self, text: str | None, finish: str | None, role: bool = False) -> dict:
        if self.chat:
            delta: dict = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}

    def head(self, include_usage: bool) -> list[dict]:
        if not self.chat:
            return []
        return [self._envelope(self.chunk_object, [self._choice("", None, role=True)], None, include_usage)]

    def delta(self, text: str, include_usage: bool) -> dict:
        return self._envelope(self.chunk_object, [self._choice(text, None)], None, include_usage)

    def last(self, finish: str, include_usage: bool) -> dict:
        return self._envelope(
            self.chunk_object, [self._choice(None if self.chat else "", finish)], None, include_usage
        )

    def usage_chunk(self, gen: Generation) -> dict:
        out = self._envelope(self.chunk_object, [], gen.usage.openai(), True)
        out["kvpool"] = gen.usage.extra
        return out
