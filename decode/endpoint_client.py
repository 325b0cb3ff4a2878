"""`EndpointClient`: one greedy completion through an OpenAI-compatible server (the kvpool gateway).

Used by ``kvpool verify --endpoint``: prompts go as token ids (``/v1/completions`` accepts a list of ints),
so the server tokenizes nothing and the comparison with the in-process reference is on the same prompt.
Every call has a deadline (httpx timeout).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx


class EndpointError(RuntimeError):
    """The server answered with an error status or an unexpected body."""


@dataclass
class EndpointCompletion:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    extra: dict = field(default_factory=dict)  # the gateway's "kvpool" section (workers, lost tokens, ...)


class EndpointClient:
    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 120.0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s)
        self._model: str | None = None

    async def model_id(self) -> str:
        """The first model the server lists (``GET /models``)."""
        if self._model is None:
            body = self._json(await self._http.get("/models"))
            try:
                self._model = str(body["data"][0]["id"])
            except (KeyError, IndexError, TypeError) as exc:
                raise EndpointError(f"/models: no model listed: {body!r:.300}") from exc
        return self._model

    async def complete(
        self, prompt_ids: list[int], max_tokens: int, cache_salt: str = ""
    ) -> EndpointCompletion:
        payload = {
            "model": await self.model_id(),
            "prompt": prompt_ids,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "cache_salt": cache_salt or None,
        }
        body = self._json(await self._http.post("/completions", json=payload))
        try:
            choice, usage = body["choices"][0], body["usage"]
            details = usage.get("prompt_tokens_details") or {}
            return EndpointCompletion(
                text=choice["text"],
                finish_reason=choice.get("finish_reason") or "",
                prompt_tokens=int(usage["prompt_tokens"]),
                completion_tokens=int(usage["completion_tokens"]),
                cached_tokens=int(details.get("cached_tokens") or 0),
                extra=body.get("kvpool") or {},
            )
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise EndpointError(f"/completions: unexpected body {body!r:.300}") from exc

    @staticmethod
    def _json(resp: httpx.Response) -> dict:
        if resp.status_code != 200:
            raise EndpointError(f"{resp.request.url.path}: HTTP {resp.status_code}: {resp.text[:300]}")
        return resp.json()

    async def close(self) -> None:
        await self._http.aclose()
