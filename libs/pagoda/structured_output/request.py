"""One request's grammar state in the scheduler, and the reasoning gate in front of it."""

from __future__ import annotations

import enum
from concurrent.futures import Future
from typing import Sequence

from pagoda.sampling_params import StructuredOutputsParams
from pagoda.structured_output.backend import StructuredOutputGrammar


class GateState(enum.Enum):
    UNDECIDED = enum.auto()  # the answer may open a thinking block (Qwen3): not yet known
    REASONING = enum.auto()  # inside the thinking block: the grammar waits
    ENDED = enum.auto()  # the answer proper: the grammar applies


class ReasoningGate:
    """Token-level twin of `pagoda.reasoning.ReasoningStream`: the grammar applies only
    to the tokens after the reasoning ends (vLLM's rule), and the marker tokens
    themselves are never fed to it.

    The prompt decides the start: a prompt whose last marker is `end_id` (a template
    that closed the block, Qwen3 with thinking off) starts ENDED; one whose last marker
    is `start_id` starts REASONING; otherwise the parser's `starts_in_reasoning` says.
    """

    def __init__(self, start_id: int, end_id: int, starts_in_reasoning: bool,
                 prompt_token_ids: Sequence[int]) -> None:
        self.start_id, self.end_id = start_id, end_id
        last = next((t for t in reversed(prompt_token_ids) if t in (start_id, end_id)), None)
        if last == end_id:
            self.state = GateState.ENDED
        elif last == start_id or starts_in_reasoning:
            self.state = GateState.REASONING
        else:
            self.state = GateState.UNDECIDED

    def observe(self, token_id: int) -> bool:
        """Move past one output token; True if it belongs to the answer (feed the grammar)."""
        if self.state == GateState.ENDED:
            return True
        if self.state == GateState.UNDECIDED:
            if token_id == self.start_id:
                self.state = GateState.REASONING
                return False
            self.state = GateState.ENDED
            return True
        if token_id == self.end_id:
            self.state = GateState.ENDED
        return False


class StructuredOutputRequest:
    """A constrained request's compile future, matcher and progress.

    Invariants: `grammar` is None until the compile future resolved (the request waits
    in WAITING_FOR_GRAMMAR meanwhile); after that the matcher has accepted exactly the
    answer tokens among the first `num_processed` output tokens. Output tokens only
    grow (preemption recomputes the KV of the tokens it keeps), so the matcher never
    needs to roll back; a request resumed with tokens generated elsewhere catches up in
    `advance` once its grammar is ready.
    """

    def __init__(self, params: StructuredOutputsParams, key: str, future: Future,
                 gate: ReasoningGate | None) -> None:
        self.params = params
        self.key = key
        self.future = future
        self.gate = gate
        self.grammar: StructuredOutputGrammar | None = None
        self.num_processed = 0

    @property
    def constrains_next_token(self) -> bool:
        """Whether the next token's bitmask row comes from the grammar."""
        return self.grammar is not None and (
            self.gate is None or self.gate.state != GateState.REASONING)

    @property
    def may_open_reasoning(self) -> bool:
        """The next token may also be the reasoning start marker (UNDECIDED gate)."""
        return self.gate is not None and self.gate.state == GateState.UNDECIDED

    def advance(self, output_token_ids: Sequence[int]) -> bool:
        """Feed the output tokens not seen yet; False if the grammar refused one or is
        already complete (nothing may follow a terminated grammar)."""
        assert self.grammar is not None
        for token_id in output_token_ids[self.num_processed:]:
            self.num_processed += 1
            if self.gate is not None and not self.gate.observe(token_id):
                continue
            if self.grammar.is_terminated() or not self.grammar.accept_token(token_id):
                return False
        return True

    @property
    def is_terminated(self) -> bool:
        """The grammar accepted a stop token: the answer is complete."""
        return self.grammar is not None and self.grammar.is_terminated()
