"""What the scheduler does when its worker refuses a step because of one request.

The worker checks each plan before it applies any of it (`pagoda.worker.plan_checks`)
and, when one request makes the plan unrunnable, refuses the whole step naming that
request (`StepRejected`). Nothing of the plan ran, but the scheduler already counted
its tokens as computed. So:

  * the request at fault ends (ABORT here; the engine reports the failure to its caller);
  * every other request of the plan is preempted: its blocks freed, its computed
    tokens zero, back at the head of the queue; it is sent again as new (prompt +
    outputs), and recomputes;
  * the blocks the plan would have written are taken out of the prefix cache (they
    were offered as cached when allocated, but their KV was never written), the
    targets of its host-tier onloads too (the copies never ran);
  * the worker is told to drop what it holds of them, and of what the refused plan
    would have told it (its finished and preempted ids), with the next plan.

The replica goes on; one request fails, the others lose only time.
"""

from __future__ import annotations

from pagoda.core.request import RequestStatus
from pagoda.messages import FinishReason, SchedulerOutput


def reject_step(scheduler, plan: SchedulerOutput, request_id: str) -> None:
    """Undo `plan` (refused by the worker because of `request_id`) in `scheduler`."""
    unwritten = _unwritten_blocks(scheduler, plan)
    scheduler.abandon_onloads(plan)  # the copies it would have started never did
    forget = scheduler._finished_req_ids
    forget |= plan.finished_req_ids | plan.preempted_req_ids
    for req_id in plan.num_scheduled_tokens:
        request = scheduler.requests.get(req_id)
        if req_id == request_id or request is None or request.status != RequestStatus.RUNNING:
            continue
        scheduler._preempt(request)
        forget.add(req_id)  # the worker drops its copy; it comes back as new
    scheduler.finish_requests([request_id], FinishReason.ABORT)
    scheduler.kv_cache_manager.pool.uncache_blocks(unwritten)


def _unwritten_blocks(scheduler, plan: SchedulerOutput) -> list:
    """The blocks holding the positions the plan would have computed."""
    computed = {d.req_id: d.num_computed_tokens for d in plan.scheduled_new_reqs}
    cached = plan.scheduled_cached_reqs
    computed.update(zip(cached.req_ids, cached.num_computed_tokens))
    manager, size = scheduler.kv_cache_manager, scheduler.block_size
    blocks = []
    for req_id, n in plan.num_scheduled_tokens.items():
        start = computed.get(req_id, 0)
        held = manager.req_blocks.get(req_id, [])
        blocks += [b for b in held[start // size:-(-(start + n) // size)] if b is not None]
    pool = manager.pool
    blocks += [pool.blocks[op.block_id] for op in plan.kv_onloads]
    return blocks
