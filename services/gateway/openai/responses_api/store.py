"""The Responses API's memory: stored responses for `previous_response_id` and retrieval.

Bounded and in process: at most `capacity` responses, the least recently used one
dropped first (a lookup counts as a use), so a chain of turns that keeps being
continued stays while abandoned ones age out. `capacity` 0 stores nothing (each
request's `store` is then ignored, as vLLM does without its store switch).
Invariant: `len(store) <= capacity`. Only the event loop touches it, so it needs no
lock; it is per gateway process (a follow-up must reach the gateway that answered),
except that the API servers of one gateway (`--api-server-count`) share one store
(shared_store.py).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

# `--max-stored-responses`'s default: a few thousand short conversations in memory.
DEFAULT_MAX_STORED_RESPONSES = 1000


@dataclass
class StoredResponse:
    """A finished response and the conversation that continues from it: the messages
    it was generated from (without its instructions, which a follow-up does not
    inherit, as in OpenAI's API) followed by its own answer."""

    response: dict[str, Any]
    messages: list[dict[str, Any]]


class ResponseStore:
    def __init__(self, capacity: int = DEFAULT_MAX_STORED_RESPONSES) -> None:
        if capacity < 0:
            raise ValueError(f"--max-stored-responses must be 0 or more, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def put(self, response_id: str, item: StoredResponse) -> None:
        if not self.enabled:
            return
        self._items[response_id] = item
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        item = self._items.get(response_id)
        if item is not None:
            self._items.move_to_end(response_id)
        return item

    def __len__(self) -> int:
        return len(self._items)
