"""What the scheduler does when a step fails midway, and how it finds the request at fault.

The worker's plan checks (pagoda.worker.plan_checks) refuse what they can see is bad
before a step runs (core/step_recovery.py). A step can still fail while it runs,
because of one request (an adapter whose tensors do not fit, a kernel bug on one
shape) or none. Then the worker has dropped every request and the KV cache's contents
are lost, but it is alive. So (`recover`):

  * every running request is preempted (it recomputes from its tokens: greedy and
    seeded outputs continue exactly), and every cached hash is forgotten;
  * every request of the failed step becomes a suspect: it must run its next
    ISOLATED_STEPS steps alone (`alone`: a step with a suspect holds nothing else);
  * a suspect that fails a step alone is the request at fault, and so is any request
    in MAX_FAILED_STEPS failed steps: it ends (ABORT; its client gets an error);
  * the engine then sets the worker's KV cache up again and goes on.

So a request that breaks every step it is in fails alone after at most two failed
steps, and the others lose only time. A fault that is no request's (the device
itself) fails at most MAX_FAILED_STEPS steps' requests before the operator sees it.
"""

from __future__ import annotations

import contextlib

from pagoda.core.request import Request, RequestStatus
from pagoda.core.request_queue import FCFSRequestQueue
from pagoda.messages import FinishReason, SchedulerOutput

ISOLATED_STEPS = 2  # a recompute prefill, then one decode step
MAX_FAILED_STEPS = 3


def recover(scheduler, plan: SchedulerOutput) -> list[str]:
    """Undo a step that failed midway; the ids of the requests found at fault (ended)."""
    ids = list(plan.num_scheduled_tokens)
    culprits = []
    for request_id in ids:
        request = scheduler.requests.get(request_id)
        if request is None or request.is_finished:
            continue
        request.num_failed_steps += 1
        if (len(ids) == 1 and request.num_isolated_steps) \
                or request.num_failed_steps >= MAX_FAILED_STEPS:
            culprits.append(request_id)
        else:
            request.num_isolated_steps = ISOLATED_STEPS
    forget = scheduler._finished_req_ids  # the worker holds nothing: nothing to forget
    forget.clear()
    for request in list(scheduler.running):
        if request.status == RequestStatus.RUNNING:
            scheduler._preempt(request)
    scheduler.finish_requests(culprits, FinishReason.ABORT)
    scheduler.kv_cache_manager.pool.forget_contents()
    scheduler.void_onloads()  # the cache they copy into is set up again
    return culprits


def next_suspect(scheduler) -> Request | None:
    """The suspect to run now, alone: a running one first, else the first waiting one."""
    for request in scheduler.running:
        if request.num_isolated_steps:
            return request
    for request in scheduler.waiting:
        if request.num_isolated_steps:
            return request
    return None


@contextlib.contextmanager
def alone(scheduler, suspect: Request):
    """Within: the scheduler sees only `suspect` (running, or alone in its queue), so
    the step it plans holds nothing else; afterwards every request is back in place."""
    others = [r for r in scheduler.running if r is not suspect]
    real_waiting = scheduler.waiting
    queue = FCFSRequestQueue()
    if suspect in scheduler.running:
        scheduler.running = [suspect]
    else:
        real_waiting.remove_request(suspect)
        queue.add_request(suspect)
        scheduler.running = []
    scheduler.waiting = queue
    try:
        yield
    finally:
        scheduler.running = others + scheduler.running
        scheduler.waiting = real_waiting
        real_waiting.prepend_requests(list(queue))


def after_step(scheduler, plan: SchedulerOutput) -> None:
    """A step ran: its suspects are one isolated step closer to being trusted."""
    for request_id in plan.num_scheduled_tokens:
        request = scheduler.requests.get(request_id)
        if request is not None and request.num_isolated_steps:
            request.num_isolated_steps -= 1
