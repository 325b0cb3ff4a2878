"""`DisaggClient`: one completion through a prefill worker then a decode worker (what a gateway does).

Used by ``kvpool verify``, the integration tests and the TTFT bench. Every call carries a deadline.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc
import torch
from kvpool.proto import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from kvpool.worker.handoff import PrefillRequest
from kvpool.worker.wire import logits_from_reply, request_to_pb


@dataclass
class RemoteCompletion:
    tokens: list[int]
    text: str
    finish_reason: str
    first_logits: torch.Tensor | None
    prefill: prefill_pb2.PrefillUsage
    decode: decode_pb2.DecodeUsage
    ttft_s: float = 0.0  # client-observed: request sent -> first token received
    e2e_s: float = 0.0
    chunks: list[decode_pb2.GenerateChunk] = field(default_factory=list)


class DisaggClient:
    def __init__(self, prefill: str, decode: str, timeout_s: float = 60.0) -> None:
        self._channels = [grpc.aio.insecure_channel(prefill), grpc.aio.insecure_channel(decode)]
        self.prefill_stub = prefill_pb2_grpc.PrefillStub(self._channels[0])
        self.decode_stub = decode_pb2_grpc.DecodeStub(self._channels[1])
        self.timeout_s = timeout_s

    async def prefill(self, request: PrefillRequest, return_logits: bool = True) -> prefill_pb2.PrefillReply:
        return await self.prefill_stub.Prefill(request_to_pb(request, return_logits), timeout=self.timeout_s)

    async def complete(self, request: PrefillRequest, return_logits: bool = True) -> RemoteCompletion:
        t0 = time.perf_counter()
        reply = await self.prefill(request, return_logits)
        ttft = time.perf_counter() - t0
        chunks = []
        call = self.decode_stub.Generate(
            decode_pb2.GenerateRequest(handoff=reply.handoff), timeout=self.timeout_s
        )
        async for chunk in call:
            chunks.append(chunk)
        final = chunks[-1]
        if not final.final:
            raise RuntimeError("decode stream ended without a final chunk")
        return RemoteCompletion(
            tokens=[c.token_id for c in chunks[:-1]],
            text=final.text,
            finish_reason=final.finish_reason,
            first_logits=logits_from_reply(reply) if return_logits else None,
            prefill=reply.usage,
            decode=final.usage,
            ttft_s=ttft,
            e2e_s=time.perf_counter() - t0,
            chunks=chunks,
        )

    async def close(self) -> None:
        for ch in self._channels:
            await ch.close()
