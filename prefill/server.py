"""gRPC servicer of the Prefill contract: request validation, deadlines, typed errors -> status codes."""

from __future__ import annotations

import asyncio

import grpc
import torch
from kvpool.model.errors import ModelInputError
from kvpool.prefill.engine import PrefillEngine, PrefillOutcome
from kvpool.prefill.metrics import PrefillMetrics
from kvpool.proto import prefill_pb2, prefill_pb2_grpc
from kvpool.worker.errors import BadRequestError, CacheFetchError
from kvpool.worker.process import request_deadline
from kvpool.worker.wire import handoff_to_pb, request_from_pb

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


def outcome_to_reply(o: PrefillOutcome, return_logits: bool = False) -> prefill_pb2.PrefillReply:
    usage = prefill_pb2.PrefillUsage(
        prompt_tokens=o.handoff.prompt_tokens,
        cached_tokens=o.cached_tokens,
        computed_tokens=o.computed_tokens,
        lost_to_checkpoint_tokens=o.lost_to_checkpoint,
        recomputed_tokens=o.recomputed_tokens,
        bytes_fetched=o.fetch.bytes_fetched,
        bytes_pushed=o.push.bytes_pushed,
        checkpoints_pushed=o.checkpoints_pushed,
        ttft_s=o.ttft_s,
        total_s=o.total_s,
        cache_error=o.fetch.error or "",
        fetch_s=o.fetch.seconds,
        compute_s=o.compute_s,
        push_s=o.push.seconds,
        retained_tokens=o.retained.tokens,
        retention_refused=o.retained.refused,
    )
    logits = b""
    if return_logits:
        logits = o.logits.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
    return prefill_pb2.PrefillReply(
        handoff=handoff_to_pb(o.handoff),
        first_token=o.first_token,
        usage=usage,
        first_logits=logits,
        first_text=o.first_text,
    )
