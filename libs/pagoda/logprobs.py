"""vLLM's `FlatLogprobs` (`vllm.logprobs`): a request's logprobs in a few flat lists.

`SamplingParams(flat_logprobs=True)` makes `CompletionOutput.logprobs` and
`RequestOutput.prompt_logprobs` this container instead of a list of dicts. It holds
one entry per (position, candidate) in parallel lists, so a long completion with many
top logprobs costs a constant number of Python objects instead of one dict per
position and one `Logprob` per candidate. It reads like the list it replaces:
`len()`, `flat[i]` -> {token_id: Logprob} (None's position reads as {}), iteration,
and slices (another FlatLogprobs). Positions are appended, never edited.

Invariant: position i's entries are `start_indices[i]:end_indices[i]` of
`token_ids`, `logprobs`, `ranks` and `decoded_tokens`; `end_indices[i] ==
start_indices[i + 1]`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, MutableSequence
from dataclasses import dataclass, field

from pagoda.outputs import Logprob, PositionLogprobs


@dataclass
class FlatLogprobs(MutableSequence):
    start_indices: list[int] = field(default_factory=list)
    end_indices: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)
    decoded_tokens: list[str | None] = field(default_factory=list)

    def append(self, position: PositionLogprobs | None) -> None:
        """Add the next position (None: a position without logprobs, the prompt's first)."""
        self.start_indices.append(len(self.token_ids))
        for token_id, entry in (position or {}).items():
            self.token_ids.append(token_id)
            self.logprobs.append(entry.logprob)
            self.ranks.append(entry.rank)
            self.decoded_tokens.append(entry.decoded_token)
        self.end_indices.append(len(self.token_ids))

    def extend(self, positions: Iterable[PositionLogprobs | None]) -> None:
        for position in positions:
            self.append(position)

    def __len__(self) -> int:
        return len(self.start_indices)

    def __getitem__(self, index):
        if isinstance(index, slice):
            starts, ends = self.start_indices[index], self.end_indices[index]
            if not starts:
                return FlatLogprobs()
            if index.step not in (None, 1):
                return FlatLogprobs._from_positions(self[i] for i in range(len(self))[index])
            lo, hi = starts[0], ends[-1]
            return FlatLogprobs([s - lo for s in starts], [e - lo for e in ends],
                                self.token_ids[lo:hi], self.logprobs[lo:hi], self.ranks[lo:hi],
                                self.decoded_tokens[lo:hi])
        if not isinstance(index, int):
            raise TypeError(f"FlatLogprobs indices must be integers or slices, not "
                            f"{type(index).__name__}")
        return {self.token_ids[i]: Logprob(self.logprobs[i], self.ranks[i], self.decoded_tokens[i])
                for i in range(self.start_indices[index], self.end_indices[index])}

    def __iter__(self) -> Iterator[PositionLogprobs]:
        for i in range(len(self)):
            yield self[i]

    @classmethod
    def _from_positions(cls, positions: Iterable[PositionLogprobs]) -> "FlatLogprobs":
        flat = cls()
        flat.extend(positions)
        return flat

    # Positions are appended only (as in vLLM): no edits.
    def __setitem__(self, index, value) -> None:
        raise TypeError("Cannot set logprobs in FlatLogprobs")

    def __delitem__(self, index) -> None:
        raise TypeError("Cannot delete logprobs from FlatLogprobs")

    def insert(self, index: int, value) -> None:
        raise TypeError("Cannot insert logprobs to FlatLogprobs")


def new_logprobs_container(flat: bool, prompt: bool = False):
    """The container one request's (prompt) logprobs accumulate in; prompt logprobs
    start with None for the first prompt token, which has no prefix to score it."""
    container = FlatLogprobs() if flat else []
    if prompt:
        container.append(None)
    return container
