"""gRPC servicer of the Decode contract: handoff validation, streaming, deadlines, typed errors."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
from kvpool.decode.engine import DecodeEngine, DecodeResult
from kvpool.decode.metrics import DecodeMetrics
from kvpool.proto import decode_pb2, decode_pb2_grpc
from kvpool.worker.errors import BadRequestError, CacheFetchError
from kvpool.worker.process import request_deadline
from kvpool.worker.wire import handoff_from_pb

SERVICE_NAME = "kvpool.v1.Decode"


def final_chunk(r: DecodeResult) -> decode_pb2.GenerateChunk:
    usage = decode_pb2.DecodeUsage(
        prompt_tokens=r.prompt_tokens,
        completion_tokens=r.completion_tokens,
        cached_tokens=r.cached_tokens,
        resume_path=r.resume.path,
        recomputed_tokens=r.resume.recomputed_tokens,
        resume_reason=r.resume.reason,
        blocks_pushed=r.blocks_pushed,
        checkpoint_pushed=r.checkpoint_pushed,
        decode_s=r.decode_s,
        retained_tokens=r.retained.tokens,
        retention_refused=r.retained.refused,
    )
    return decode_pb2.GenerateChunk(final=True, finish_reason=r.finish_reason, usage=usage, text=r.text)


class DecodeService(decode_pb2_grpc.DecodeServicer):
    def __init__(
        self, engine: DecodeEngine, request_timeout_s: float = 120.0, metrics: DecodeMetrics | None = None
    ) -> None:
        self.engine = engine
        self.request_timeout_s = request_timeout_s
        self.metrics = metrics
        if metrics is not None:
            engine.batcher.on_step = metrics.on_step

    def _count(self, status: str) -> None:
        if self.metrics is not None:
            self.metrics.requests.labels(status).inc()

    async def Generate(
        self, request: decode_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decode_pb2.GenerateChunk]:
        m = self.metrics
        if not request.HasField("handoff"):
            self._count("bad_request")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "BadRequestError: handoff is required")
        handoff = handoff_from_pb(request.handoff)
        if m is not None:
            m.active.inc()
        try:
            async with asyncio.timeout(request_deadline(context, self.request_timeout_s)):
                async for event in self.engine.generate(handoff):
                    if isinstance(event, DecodeResult):
                        if m is not None:
                            m.observe(event)
                        yield final_chunk(event)
                    else:
                        if m is not None:
                            m.output_tokens.inc()
                        if event.index:  # token 0 and its text reached the client in the prefill reply
                            yield decode_pb2.GenerateChunk(
                                index=event.index, token_id=event.token, text=event.text
                            )
        except BadRequestError as exc:
            self._count("bad_request")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"BadRequestError: {exc}")
        except CacheFetchError as exc:
            self._count("cache_fetch_failed")
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"CacheFetchError: {exc}")
        except TimeoutError:
            self._count("timeout")
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "decode did not finish in time")
        except asyncio.CancelledError:  # the client went away (the gateway cancels on disconnect)
            self._count("cancelled")
            raise
        except Exception:
            self._count("error")
            raise
        finally:
            if m is not None:
                m.active.dec()
