"""One request's grammar state in the scheduler, and the reasoning gate in front of it."""

from __future__ import annotations

import enum
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Sequence

from pagoda.sampling_params import StructuredOutputsParams
from pagoda.structured_output.backend import StructuredOutputGrammar


class GateState(enum.Enum):
    UNDECIDED = enum.auto()  # the answer may open a thinking block (Qwen3): not yet known
    REASONING = enum.auto()  # inside the thinking block: the grammar waits
    ENDED = enum.auto()  # the answer proper: the grammar applies


@dataclass(frozen=True)
class GateMarkers:
    """A reasoning parser's markers as token-id sequences (one token each for the
    `<think>` families; several for gpt-oss's harmony headers).

    The reasoning ends when `end` is followed by `end_suffix` with fewer than `end_gap`
    tokens between them (empty suffix: at `end` itself). gpt-oss: `end` is
    `<|channel|>final`, `end_suffix` `<|message|>`, gap 20, so
    `<|channel|>final <|constrain|>json<|message|>` ends it too (vLLM's
    GptOssReasoningParser.is_reasoning_end, `reasoning_max_num_between_tokens`).
    `turn_start`: the prompt decides the start state only from its tokens after the last
    one of these (harmony's `<|start|>`: a previous turn's final answer in a multi-turn
    prompt does not count, vLLM's fix of the same bug); empty: the whole prompt.
    """

    start: tuple[int, ...]
    end: tuple[int, ...]
    starts_in_reasoning: bool
    end_suffix: tuple[int, ...] = ()
    end_gap: int = 0
    turn_start: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.start or not self.end:
            raise ValueError("reasoning markers must be at least one token each")


def _ends_with(tokens: Sequence[int], end_at: int, marker: Sequence[int]) -> bool:
    """Whether `tokens[:end_at + 1]` ends with `marker` (non-empty)."""
    n = len(marker)
    return end_at + 1 >= n and all(tokens[end_at - n + 1 + k] == marker[k] for k in range(n))


class _EndMatcher:
    """Token-by-token search for the end marker (its `end` part, then `end_suffix`
    within the gap). Invariant: `_recent` holds the last tokens fed (enough for the
    longest part) and `_since` counts the tokens after the latest `end` still waiting
    for its suffix (None: none is)."""

    def __init__(self, markers: GateMarkers) -> None:
        self.m = markers
        self._recent: list[int] = []
        self._keep = max(len(markers.end), len(markers.end_suffix))
        self._since: int | None = None

    def feed(self, token_id: int) -> bool:
        """True when this token completes the end marker."""
        m, recent = self.m, self._recent
        recent.append(token_id)
        if len(recent) > self._keep:
            del recent[0]
        last = len(recent) - 1
        if self._since is not None:
            self._since += 1
            between = self._since - len(m.end_suffix)
            if between >= m.end_gap:
                self._since = None
            elif between >= 0 and _ends_with(recent, last, m.end_suffix):
                self._since = None
                return True
        if _ends_with(recent, last, m.end):
            if not m.end_suffix:
                return True
            self._since = 0  # the latest header: its suffix may follow
        return False


def _prompt_state(markers: GateMarkers, prompt_token_ids: Sequence[int],
                  matcher: _EndMatcher) -> GateState | None:
    """The state the prompt leaves: ENDED or REASONING after its last complete marker
    (in the current turn), None without one. `matcher` is fed the turn's tokens, so an
    end marker the prompt began (`<|channel|>final` prefilled) completes in the output,
    as vLLM's search over prompt and output ids finds it."""
    begin = 0
    if markers.turn_start:
        for i in range(len(prompt_token_ids) - 1, -1, -1):
            if _ends_with(prompt_token_ids, i, markers.turn_start):
                begin = i + 1
                break
    turn = prompt_token_ids[begin:]
    if not markers.end_suffix and len(markers.start) == len(markers.end) == 1:
        # One token each (the <think> families): the last marker token, found from the
        # end (no pass over a long prompt).
        start, end = markers.start[0], markers.end[0]
        last = next((t for t in reversed(turn) if t in (start, end)), None)
        return None if last is None else (GateState.ENDED if last == end else
                                          GateState.REASONING)
    state = None
    for i, token_id in enumerate(turn):
        if matcher.feed(token_id):
            state = GateState.ENDED
        elif _ends_with(turn, i, markers.start):
            state = GateState.REASONING
    return state


class ReasoningGate:
    """Token-level twin of `pagoda.reasoning.ReasoningStream`: the grammar applies only
    to the tokens after the reasoning ends (vLLM's rule), and the marker tokens
    themselves are never fed to it.

    The prompt decides the start: a prompt (its current turn, `GateMarkers.turn_start`)
    whose last complete marker is the end (a template that closed the block, Qwen3 with
    thinking off; a harmony prompt prefilled up to `<|channel|>final<|message|>`) starts
    ENDED; one whose last is the start starts REASONING; otherwise the parser's
    `starts_in_reasoning` says (gpt-oss: True, so the grammar waits for the final header).

    REASONING is everything before the end marker completes, whatever it holds: for
    gpt-oss the analysis and commentary messages, and a partial end marker followed by
    something else (vLLM's gpt-oss rule: the grammar starts after the first
    `<|channel|>final...<|message|>` of the answer). UNDECIDED (the answer may open a
    block) is decided by the first output token: the start marker's FIRST token opens the
    reasoning (the bitmask lets only that token through besides the grammar's:
    `StructuredOutputManager.grammar_bitmask`), any other token is the answer's first.
    Every output token must be observed once, in order (the caller feeds each accepted
    token once: preemption keeps them, migration replays them all from the first).
    """

    def __init__(self, markers: GateMarkers, prompt_token_ids: Sequence[int]) -> None:
        self.markers = markers
        self._end = _EndMatcher(markers)
        state = _prompt_state(markers, prompt_token_ids, self._end)
        if state is None:
            state = GateState.REASONING if markers.starts_in_reasoning else GateState.UNDECIDED
        self.state = state

    @property
    def start_id(self) -> int:
        """The token that opens a thinking block from UNDECIDED."""
        return self.markers.start[0]

    def observe(self, token_id: int) -> bool:
        """Move past one output token; True if it belongs to the answer (feed the grammar)."""
        if self.state == GateState.ENDED:
            return True
        if self.state == GateState.UNDECIDED:
            if token_id == self.start_id:
                self.state = GateState.REASONING
                self._end.feed(token_id)  # it may also begin the end marker (harmony's)
                return False
            self.state = GateState.ENDED
            return True
        if self._end.feed(token_id):
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
