"""Per-step and per-request statistics, computed from what the engine core reports.

Plain Python (no Prometheus): `RequestStatsTracker` is fed from the thread that
drives the `EngineCore` (the scheduler service's engine loop, or an offline
loop) and returns one `IterationStats` per step, shaped like vLLM v1's, which
`EngineMetrics` records and `StatLogger` summarises.

Timestamps follow vLLM's definitions:
  * arrival: when the request entered the system (`EngineCoreRequest.arrival_time`,
    stamped by the gateway), so TTFT and E2E latency include tokenization and
    the hops before the scheduler;
  * queued: when the engine core accepted it; scheduled: the start of the first
    step that scheduled it (re-scheduling after a preemption does not move it);
  * first/last token: the end of the step that produced the first/last token.
So queue time = scheduled - queued, prefill time = first token - scheduled,
decode time = last token - first token, inference time = last token - scheduled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.messages import EngineCoreOutput, EngineCoreRequest, SchedulerOutput


@dataclass
class FinishedRequestStats:
    """One request's totals, reported once, in the step it finished. Absolute
    times are `time.time()` values (for spans); phases that never happened
    (aborted while waiting) are zero-length at the finish time."""

    request_id: str
    finish_reason: str  # "stop" | "length" | "abort" | "repetition"
    e2e_latency: float
    queued_time: float
    prefill_time: float
    inference_time: float
    decode_time: float
    num_prompt_tokens: int
    num_generation_tokens: int
    max_tokens_param: int | None
    queued_ts: float
    scheduled_ts: float
    first_token_ts: float
    last_token_ts: float
    finished_ts: float


@dataclass
class IterationStats:
    """What one engine step did."""

    iteration_timestamp: float
    num_scheduled_tokens: int = 0  # tokens the step ran through the model
    num_prompt_tokens: int = 0  # prompt lengths of requests that got their first token
    num_generation_tokens: int = 0
    num_preempted_reqs: int = 0
    time_to_first_tokens_iter: list[float] = field(default_factory=list)
    inter_token_latencies_iter: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)


@dataclass(slots=True)  # touched for every request every step: one compact object
class _RequestState:
    arrival_time: float
    queued_ts: float
    num_prompt_tokens: int
    max_tokens_param: int | None
    scheduled_ts: float | None = None
    first_token_ts: float | None = None
    last_token_ts: float | None = None
    num_generation_tokens: int = 0


class RequestStatsTracker:
    """Invariant: a request is tracked from `add_request` until the step whose
    outputs finish it; every tracked request that finishes is reported once."""

    def __init__(self) -> None:
        self._requests: dict[str, _RequestState] = {}
        # Tracked requests not scheduled yet (their `scheduled_ts` is None): a step
        # looks them up, not every request it planned (256 lookups a step at batch 256
        # that found a timestamp already set).
        self._unscheduled: set[str] = set()

    @property
    def num_tracked(self) -> int:
        return len(self._requests)

    def add_request(self, request: EngineCoreRequest, queued_ts: float) -> None:
        """Call once the engine core accepted `request` (not for rejected ones)."""
        self._requests[request.request_id] = _RequestState(
            request.arrival_time, queued_ts, len(request.prompt_token_ids),
            request.sampling_params.max_tokens)
        self._unscheduled.add(request.request_id)

    def on_step(self, step_start: float, step_end: float,
                scheduler_output: SchedulerOutput | None,
                outputs: list[EngineCoreOutput]) -> IterationStats:
        """Account one `EngineCore.step()` that ran from `step_start` to `step_end`;
        `scheduler_output` is its plan (None when it scheduled nothing)."""
        stats = IterationStats(step_end)
        requests = self._requests
        unscheduled = self._unscheduled
        if scheduler_output is not None:
            stats.num_scheduled_tokens = scheduler_output.total_num_scheduled_tokens
            stats.num_preempted_reqs = len(scheduler_output.preempted_req_ids)
            planned = scheduler_output.num_scheduled_tokens
            if unscheduled:  # whichever side is smaller is walked
                newly = (unscheduled & planned.keys() if len(unscheduled) < len(planned)
                         else [r for r in planned if r in unscheduled])
                for request_id in newly:
                    requests[request_id].scheduled_ts = step_start
                    unscheduled.discard(request_id)
        # Every request's output every step: locals and one counter, no helper calls.
        num_generation = 0
        itls = stats.inter_token_latencies_iter
        for output in outputs:
            state = requests.get(output.request_id)
            if state is None:
                continue
            num_new = len(output.new_token_ids)
            if num_new:
                num_generation += num_new
                state.num_generation_tokens += num_new
                if state.first_token_ts is None:
                    stats.num_prompt_tokens += state.num_prompt_tokens
                    stats.time_to_first_tokens_iter.append(step_end - state.arrival_time)
                    state.first_token_ts = step_end
                else:
                    itls.append(step_end - state.last_token_ts)
                state.last_token_ts = step_end
            if output.finish_reason is not None:
                del requests[output.request_id]
                unscheduled.discard(output.request_id)
                stats.finished_requests.append(
                    _finished(output.request_id, state, str(output.finish_reason), step_end))
        stats.num_generation_tokens += num_generation
        return stats


def _finished(request_id: str, state: _RequestState, reason: str, now: float
              ) -> FinishedRequestStats:
    scheduled = state.scheduled_ts if state.scheduled_ts is not None else now
    first = state.first_token_ts if state.first_token_ts is not None else scheduled
    last = state.last_token_ts if state.last_token_ts is not None else first
    return FinishedRequestStats(
        request_id=request_id, finish_reason=reason, e2e_latency=now - state.arrival_time,
        queued_time=max(scheduled - state.queued_ts, 0.0), prefill_time=first - scheduled,
        inference_time=last - scheduled, decode_time=last - first,
        num_prompt_tokens=state.num_prompt_tokens,
        num_generation_tokens=state.num_generation_tokens,
        max_tokens_param=state.max_tokens_param, queued_ts=state.queued_ts,
        scheduled_ts=scheduled, first_token_ts=first, last_token_ts=last, finished_ts=now)
