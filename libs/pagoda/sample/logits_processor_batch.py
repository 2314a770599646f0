"""The worker's persistent batch as custom logits processors see it.

The model runner rebuilds its sampling rows every step; processors written for vLLM
keep per-index state and expect vLLM's persistent-batch updates instead. `CustomLogitsProcessors`
keeps that view: each step it diffs the requests that sample now against the previous
step's and reports the change as one `BatchUpdate`:

  * removed: a request that no longer samples (finished, preempted, or not sampling
    this step), or whose state object was replaced (resumed after a preemption: its
    output list is a new object, so it is reported removed and added again);
  * added: new requests take the lowest free indices first, then go on the end;
  * moved: holes left are filled from the end (UNIDIRECTIONAL, vLLM's condense), then
    SWAPs put index i on the request of logits row i.

Invariant after `update`: persistent index i == the step's sampling row i, so `apply`
passes the sampler's logits as they are. A processor's `apply` runs only when it can
matter: an argmax-invariant one is skipped when every row is greedy (vLLM's rule).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pagoda.sample.logits_processor import BatchUpdate, MoveDirectionality


class CustomLogitsProcessors:
    def __init__(self, classes: Sequence[type], config: Any, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.processors = [cls(config, device, pin) for cls in classes]
        self.rows: list[str | None] = []  # persistent index -> request id
        self._states: dict[str, Any] = {}  # request id -> the state object it was added with

    def __bool__(self) -> bool:
        return bool(self.processors)

    def update(self, states: Sequence[Any]) -> None:
        """`states[i]`: the request of sampling row i this step (a `CachedRequestState`)."""
        wanted = {s.req_id: s for s in states}
        rows = self.rows
        removed = []
        for index, req_id in enumerate(rows):
            if req_id is not None and wanted.get(req_id) is not self._states.get(req_id):
                removed.append(index)
                del self._states[req_id]
                rows[index] = None
        added = []
        holes = [i for i, r in enumerate(rows) if r is None]
        for state in states:
            if state.req_id in self._states:
                continue
            if holes:
                index = holes.pop(0)
                rows[index] = state.req_id
            else:
                index = len(rows)
                rows.append(state.req_id)
            self._states[state.req_id] = state
            added.append((index, state.sampling_params, state.prompt_token_ids,
                          state.output_token_ids))
        moved = self._condense(holes)
        moved += self._order_as(states)
        update = None
        if removed or added or moved:
            update = BatchUpdate(len(rows), removed, added, moved)
        for processor in self.processors:
            processor.update_state(update)

    def _condense(self, holes: list[int]) -> list[tuple[int, int, MoveDirectionality]]:
        rows, moved = self.rows, []
        for hole in sorted(holes):
            while rows and rows[-1] is None:
                rows.pop()
            if hole >= len(rows):
                break
            last = len(rows) - 1
            rows[hole] = rows.pop()
            moved.append((last, hole, MoveDirectionality.UNIDIRECTIONAL))
        while rows and rows[-1] is None:
            rows.pop()
        return moved

    def _order_as(self, states: Sequence[Any]) -> list[tuple[int, int, MoveDirectionality]]:
        rows, moved = self.rows, []
        position = {r: i for i, r in enumerate(rows)}
        for i, state in enumerate(states):
            if rows[i] != state.req_id:
                j = position[state.req_id]
                position[rows[i]], position[rows[j]] = j, i
                rows[i], rows[j] = rows[j], rows[i]
                moved.append((i, j, MoveDirectionality.SWAP))
        return moved

    def apply(self, logits: torch.Tensor, all_greedy: bool) -> torch.Tensor:
        for processor in self.processors:
            if all_greedy and processor.is_argmax_invariant():
                continue
            logits = processor.apply(logits)
        return logits
