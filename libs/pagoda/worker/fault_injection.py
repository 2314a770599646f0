"""Test-only: make one rank of a worker group raise in its step. Inert unless
`PAGODA_FAULT_INJECTION` is set; this module is the only place a fault is injected.

    PAGODA_FAULT_INJECTION="rank=1,step=3"                 rank 1 raises in its 3rd step,
                                                           in the group's first life only
    PAGODA_FAULT_INJECTION="rank=1,step=1,generation=any"  ... in every life: a crash loop

`step` counts the rank's `execute_model` calls since it joined its group;
`generation` is the group's life (`GroupInit.generation`: 0 at start-up, one more
per rebuild), so a one-off fault stays one-off after the rebuild it causes. The
variable is read by every rank's process (mp followers inherit the driver's
environment), each at the moment it joins.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

ENV = "PAGODA_FAULT_INJECTION"


class InjectedFault(RuntimeError):
    """The fault a test asked for (never raised unless `ENV` is set)."""


@dataclass
class StepFault:
    """Invariant: raises in exactly one step of this rank's life, or never."""

    rank: int
    step: int
    generation: int | None  # None: every generation
    steps_seen: int = 0

    def before_step(self, rank: int, generation: int) -> None:
        if rank != self.rank or self.generation not in (None, generation):
            return
        self.steps_seen += 1
        if self.steps_seen == self.step:
            raise InjectedFault(f"injected fault in rank {rank}'s step {self.step} "
                                f"(generation {generation}, {ENV})")


def from_env() -> StepFault | None:
    """The fault `ENV` describes, or None (the normal case). ValueError for a value
    that does not parse, so a typo in a test fails loudly instead of injecting nothing."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return None
    try:
        fields = dict(item.split("=", 1) for item in raw.split(","))
        generation = fields.pop("generation", "0")
        fault = StepFault(int(fields.pop("rank")), int(fields.pop("step", "1")),
                          None if generation == "any" else int(generation))
    except (KeyError, ValueError) as exc:
        raise ValueError(f"{ENV}={raw!r}: expected rank=R[,step=S][,generation=G|any]") from exc
    if fields:
        raise ValueError(f"{ENV}={raw!r}: unknown fields {sorted(fields)}")
    return fault
