"""The scheduler's spans: each request's queue/prefill/decode phases and each step's batch.

A request's `Generate` handler runs inside the SERVER span that the gRPC
interceptor opened from the gateway's trace context; the handler registers that
span's context here under the request id. Then:
  * when the request finishes, `record_phases` adds child spans `scheduler.queue`,
    `scheduler.prefill` and `scheduler.decode` with the engine's own timestamps;
  * each step's `ExecuteModel` call runs inside a `scheduler.step` span whose parent
    is the first request of the batch that has a trace (the oldest running one)
    and which links every other traced request of the batch. So a request served
    alone has the whole path, down to the worker, in its one trace; a batch shared
    by many requests appears in the first one's trace and is linked from the rest.
Nothing here runs while tracing is off.
"""

from __future__ import annotations

import contextlib

from opentelemetry import trace
from opentelemetry.trace import Link, SpanContext

import pagoda.tracing as tracing
from pagoda.messages import SchedulerOutput
from pagoda.metrics.stats import FinishedRequestStats


class RequestSpans:
    """request id -> the span context of its `Generate` call. Written by gRPC
    handlers (event loop), read by the engine thread: single dict operations."""

    def __init__(self) -> None:
        self._contexts: dict[str, SpanContext] = {}

    def register_current(self, request_id: str) -> None:
        if tracing.is_enabled():
            context = trace.get_current_span().get_span_context()
            if context.is_valid:
                self._contexts[request_id] = context

    def unregister(self, request_id: str) -> None:
        self._contexts.pop(request_id, None)

    def get(self, request_id: str) -> SpanContext | None:
        return self._contexts.get(request_id)


REQUEST_SPANS = RequestSpans()


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def record_phases(finished: list[FinishedRequestStats], spans: RequestSpans = REQUEST_SPANS
                  ) -> None:
    """Child spans for the phases of each finished, traced request."""
    if not tracing.is_enabled():
        return
    tracer = tracing.get_tracer()
    for req in finished:
        parent = spans.get(req.request_id)
        if parent is None:
            continue
        ctx = trace.set_span_in_context(trace.NonRecordingSpan(parent))
        for name, start, end in (("scheduler.queue", req.queued_ts, req.scheduled_ts),
                                 ("scheduler.prefill", req.scheduled_ts, req.first_token_ts),
                                 ("scheduler.decode", req.first_token_ts, req.last_token_ts)):
            span = tracer.start_span(name, context=ctx, start_time=_ns(start),
                                     attributes={"pagoda.request_id": req.request_id})
            span.end(end_time=_ns(max(end, start)))


def step_span(scheduler_output: SchedulerOutput, step_id: int,
              spans: RequestSpans = REQUEST_SPANS):
    """A context manager: the span of one step's batch (a no-op while tracing is off)."""
    if not tracing.is_enabled():
        return contextlib.nullcontext()
    contexts = [c for c in map(spans.get, scheduler_output.num_scheduled_tokens) if c is not None]
    parent = (trace.set_span_in_context(trace.NonRecordingSpan(contexts[0])) if contexts
              else None)
    attributes = {
        "pagoda.step_id": step_id,
        "pagoda.num_requests": len(scheduler_output.num_scheduled_tokens),
        "pagoda.num_new_requests": len(scheduler_output.scheduled_new_reqs),
        "pagoda.num_scheduled_tokens": scheduler_output.total_num_scheduled_tokens,
        "pagoda.num_preempted": len(scheduler_output.preempted_req_ids),
    }
    return tracing.get_tracer().start_as_current_span(
        "scheduler.step", context=parent, links=[Link(c) for c in contexts[1:]],
        attributes=attributes)
