"""The worker's encoder cache: a media item's encoder output, keyed by its identifier.

A prompt's image is encoded (vision tower + projector) once, when the first chunk that
covers part of its placeholder run is scheduled; later chunks of the same run, other
requests with the same image (same content hash and processor kwargs), and a request
recomputed after preemption read the cached rows instead.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import torch


class EncoderCache:
    """identifier -> encoder output [rows, hidden] (vLLM's encoder cache).

    Invariants: an entry a running request still needs (its placeholder run is not yet
    fully computed) is never evicted, so a run split across chunks reads the rows it
    was encoded with; entries nobody needs are kept, least recently used first out,
    while the cached rows exceed `capacity_rows` (vLLM's `encoder_cache_size`, counted
    in embedding rows). A miss is never an error: the caller encodes the item again.
    `num_queries`/`num_hits` count lookups since the counters were last taken.
    """

    def __init__(self, capacity_rows: int) -> None:
        self.capacity_rows = capacity_rows
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.num_rows = 0
        self.num_queries = 0
        self.num_hits = 0

    def __contains__(self, identifier: str) -> bool:
        return identifier in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, identifier: str) -> torch.Tensor | None:
        """A counted lookup (one per request and item, where the item is first needed)."""
        self.num_queries += 1
        rows = self.get(identifier)
        if rows is not None:
            self.num_hits += 1
        return rows

    def get(self, identifier: str) -> torch.Tensor | None:
        rows = self._entries.get(identifier)
        if rows is not None:
            self._entries.move_to_end(identifier)
        return rows

    def put(self, identifier: str, rows: torch.Tensor) -> None:
        if identifier in self._entries:
            return
        self._entries[identifier] = rows
        self.num_rows += rows.shape[0]

    def evict(self, needed: Iterable[str]) -> None:
        """Drop unneeded entries, oldest first, until the rows fit the capacity."""
        if self.num_rows <= self.capacity_rows:
            return
        keep = set(needed)
        for identifier in [i for i in self._entries if i not in keep]:
            if self.num_rows <= self.capacity_rows:
                break
            self.num_rows -= self._entries.pop(identifier).shape[0]

    def take_counts(self) -> tuple[int, int]:
        """(queries, hits) since the last call."""
        counts = (self.num_queries, self.num_hits)
        self.num_queries = self.num_hits = 0
        return counts

    def clear(self) -> None:
        self._entries.clear()
        self.num_rows = 0
