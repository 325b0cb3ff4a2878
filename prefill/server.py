"""gRPC servicer of the Prefill contract: request validation, deadlines, typed errors -> status codes."""

from __future__ import annotations

import asyncio

import grpc
from kvpool.model.errors import ModelInputError
from kvpool.prefill.engine import PrefillEngine
from kvpool.prefill.errors import BadRequestError, CacheFetchError
from kvpool.prefill.metrics import PrefillMetrics
from kvpool.prefill.wire import outcome_to_reply, request_from_pb
from kvpool.prefill.worker import request_deadline
from kvpool.proto import prefill_pb2, prefill_pb2_grpc

SERVICE_NAME = "kvpool.v1.Prefill"


class PrefillService(prefill_pb2_grpc.PrefillServicer):
    def __init__(
        self, engine: PrefillEngine, request_timeout_s: float = 120.0, metrics: PrefillMetrics | None = None
    ) -> None:
        self.engine = engine
        self.request_timeout_s = request_timeout_s
        self.metrics = metrics

    def _count(self, status: str) -> None:
        if self.metrics is not None:
            self.metrics.requests.labels(status).inc()

    async def Prefill(
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.PrefillReply:
        if self.metrics is not None:
            self.metrics.queue_depth.inc()
        try:
            async with asyncio.timeout(request_deadline(context, self.request_timeout_s)):
                outcome = await self.engine.run(request_from_pb(request))
        except (BadRequestError, ModelInputError) as exc:
            self._count("bad_request")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{type(exc).__name__}: {exc}")
        except CacheFetchError as exc:
            self._count("cache_fetch_failed")
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"CacheFetchError: {exc}")
        except TimeoutError:
            self._count("timeout")
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "prefill did not finish in time")
        except Exception:
            self._count("error")
            raise
        finally:
            if self.metrics is not None:
                self.metrics.queue_depth.dec()
        if self.metrics is not None:
            self.metrics.observe(outcome)
        return outcome_to_reply(outcome, request.return_logits)
