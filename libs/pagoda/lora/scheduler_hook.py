"""The LoRA gate: multi-LoRA's part in the scheduler's step.

vLLM's rule: the running requests use at most `max_loras` distinct adapters, so every
step's adapters fit the worker's device slots (`LoRAModelManager`). A waiting request
with another adapter waits (the requests behind it go ahead) until a running
adapter's last request finishes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Sequence

from pagoda.core.request import Request
from pagoda.core.scheduler_hook import SchedulerHook

if TYPE_CHECKING:
    from pagoda.core.scheduler import SchedulerStats


class LoRAGate(SchedulerHook):
    """Invariant: the adapters of the running requests number at most `max_loras`."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras

    def admit(self, request: Request, running: Sequence[Request]) -> bool:
        lora = request.lora_request
        if lora is None:
            return True
        held = {r.lora_request.lora_int_id for r in running if r.lora_request}
        return lora.lora_int_id in held or len(held) < self.max_loras

    def add_stats(self, stats: SchedulerStats, running: Sequence[Request],
                  waiting: Iterable[Request]) -> None:
        """vLLM's: adapter name -> running / waiting requests with it."""
        stats.running_lora_adapters = count_adapters(running)
        stats.waiting_lora_adapters = count_adapters(waiting)


def count_adapters(requests: Iterable[Request]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for request in requests:
        if request.lora_request is not None:
            name = request.lora_request.lora_name
            counts[name] = counts.get(name, 0) + 1
    return counts
