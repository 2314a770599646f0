"""The scheduler's encoder budget (vLLM's `max_num_encoder_input_tokens`).

A media item is encoded in the step that first schedules part of its placeholder run;
the rows of the items that start in one step may not exceed the budget. The rule for a
run that does not fit:

    computed ─┐            ┌─ the step would end here
    tokens  ..│ t t t [<im> <im> <im> ...] t t
              └ planned ─┘ cut here: the request stops before the run
                           and encodes it in a later step

An item that cannot start this step cuts the request's tokens at the item's offset (or
plans none, if the request is already past it: a prefix hit that ended inside the run).
A run may still be split by the token budget after its item started: its encoder
output stays in the worker's encoder cache until the run is computed
(`pagoda.worker.encoder_cache`), so later chunks read the same rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagoda.core.scheduler_hook import SchedulerHook

if TYPE_CHECKING:
    from pagoda.core.request import Request
    from pagoda.messages import SchedulerOutput


class EncoderBudget(SchedulerHook):
    """Caps each step's newly started media items at `max_rows` encoder rows.

    Invariants: `request.num_started_mm_items` counts the request's leading items
    (sorted by offset) whose runs start inside its computed tokens: it is set only for
    the requests a plan kept (`on_planned`), so a request whose blocks could not be
    allocated starts its items again next step; it goes back to 0 on preemption (the
    request recomputes, its items are encoded again or read from the encoder cache).
    The budget is spent while a step is planned and restored after every plan.
    """

    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        self.remaining = max_rows

    def on_add(self, request: Request) -> None:
        request.num_started_mm_items = 0
        for feature in request.mm_features:
            if feature.num_embeds > self.max_rows:
                raise ValueError(
                    f"a {feature.modality} of this prompt takes {feature.num_embeds} encoder "
                    f"tokens, more than max_num_encoder_input_tokens ({self.max_rows})")

    def limit_tokens(self, request: Request, start: int, num_new: int) -> int:
        features = request.mm_features
        k = request.num_started_mm_items
        while k < len(features):
            feature = features[k]
            if feature.end <= start:  # computed already (a prefix hit covered it)
                k += 1
                continue
            if feature.offset >= start + num_new:
                break  # beyond this step's tokens
            if feature.num_embeds > self.remaining:
                num_new = max(feature.offset - start, 0)
                break
            self.remaining -= feature.num_embeds
            k += 1
        return num_new

    def on_preempted(self, request: Request) -> None:
        request.num_started_mm_items = 0

    def on_planned(self, output: SchedulerOutput, planned) -> None:
        self.remaining = self.max_rows
        for request in planned:
            features = request.mm_features
            k = request.num_started_mm_items
            while k < len(features) and features[k].offset < request.num_computed_tokens:
                k += 1
            request.num_started_mm_items = k
