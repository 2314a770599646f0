"""The reasoning-parser contract, and the one splitter both the streamed and the
non-streamed answer go through (so the two can never disagree)."""

from __future__ import annotations

from typing import ClassVar


class ReasoningParser:
    """A model family's thinking markers.

    `starts_in_reasoning`: the answer begins inside the thinking block (the chat
    template opened it, DeepSeek-R1) rather than only when the answer opens with
    `start_token` (Qwen3, whose hybrid models may answer without thinking).
    Invariant: `split(text, prompt)` equals the concatenated output of a
    `ReasoningStream(prompt)` fed `text` in any pieces.

    The prompt decides where the answer starts, by the same rule as the engine's
    token-level gate (`pagoda.structured_output.request.ReasoningGate`), so the grammar
    and the split agree: a prompt whose last marker is `start_token` (Qwen3-Thinking-2507
    and DeepSeek-R1 templates open the block for the model) starts the answer inside the
    reasoning; one whose last marker is `end_token` (a template that closed the block:
    thinking switched off) starts it in the content; a prompt with neither leaves the
    family's default.
    """

    name: ClassVar[str] = ""
    start_token: ClassVar[str] = "<think>"
    end_token: ClassVar[str] = "</think>"
    starts_in_reasoning: ClassVar[bool] = True
    # Whether the markers are special tokens the answer must be decoded with (harmony's):
    # the gateway then decodes the answer with skip_special_tokens off for this parser.
    keeps_special_tokens: ClassVar[bool] = False
    # Other spellings of the markers (Granite's "Here's my ..."), and markers that end
    # the reasoning but belong to the content (Kimi's tool-call section opener, which
    # the tool parser reads). `start_token`/`end_token` stay the primary ones: the
    # engine's grammar gate tokenizes them (`pagoda.structured_output.request.GateMarkers`).
    other_start_tokens: ClassVar[tuple[str, ...]] = ()
    other_end_tokens: ClassVar[tuple[str, ...]] = ()
    content_end_tokens: ClassVar[tuple[str, ...]] = ()
    # The grammar gate's reading where it differs from the text split's (gpt-oss):
    # `gate_end_parts` splits `end_token` into a header and its closer, which may follow
    # within `gate_end_gap` tokens; `gate_turn_start` limits the prompt's say to its
    # current turn; `gate_starts_in_reasoning` (None: `starts_in_reasoning`).
    gate_end_parts: ClassVar[tuple[str, str] | None] = None
    gate_end_gap: ClassVar[int] = 0
    gate_turn_start: ClassVar[str | None] = None
    gate_starts_in_reasoning: ClassVar[bool | None] = None

    @property
    def start_markers(self) -> tuple[str, ...]:
        return (self.start_token, *self.other_start_tokens)

    @property
    def end_markers(self) -> tuple[str, ...]:
        return (self.end_token, *self.other_end_tokens, *self.content_end_tokens)

    def stream(self, prompt: str | None = None) -> "ReasoningStream":
        return ReasoningStream(self, self.starts_in_reasoning_after(prompt))

    def starts_in_reasoning_after(self, prompt: str | None) -> bool:
        """Whether an answer to `prompt` (its rendered text; None: unknown) begins inside
        the thinking block."""
        prompt = prompt or ""
        last_start = max(prompt.rfind(m) for m in self.start_markers)
        last_end = max(prompt.rfind(m) for m in self.end_markers)
        if last_start == last_end == -1:
            return self.starts_in_reasoning
        return last_start > last_end

    def split(self, text: str, prompt: str | None = None) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole answer; None for an empty part."""
        stream = self.stream(prompt)
        reasoning, content = stream.feed(text)
        more_reasoning, more_content = stream.finish()
        return (reasoning + more_reasoning) or None, (content + more_content) or None


class ReasoningStream:
    """Splits an answer's text deltas into (reasoning, content) deltas.

    States: UNDECIDED (Qwen3: nothing seen yet; the answer may open with start_token),
    REASONING (until end_token), CONTENT. Text that might be the beginning of a marker
    is held back until the next delta decides it, so a marker split across deltas
    never leaks into either part.
    """

    UNDECIDED, REASONING, CONTENT = range(3)

    def __init__(self, parser: ReasoningParser, starts_in_reasoning: bool | None = None) -> None:
        self.parser = parser
        if starts_in_reasoning is None:
            starts_in_reasoning = parser.starts_in_reasoning
        self.state = self.REASONING if starts_in_reasoning else self.UNDECIDED
        self._opening = True  # a leading start_token is dropped (the model wrote it)
        self._held = ""

    def feed(self, delta: str) -> tuple[str, str]:
        text, self._held = self._held + delta, ""
        reasoning, content = [], []
        while text:
            if self.state == self.CONTENT:
                content.append(text)
                break
            if self._opening:
                stripped = text.lstrip()
                starts = self.parser.start_markers
                start = next((m for m in starts if stripped.startswith(m)), None)
                if start is not None:
                    text = stripped[len(start):]
                    self._opening, self.state = False, self.REASONING
                    continue
                if any(m.startswith(stripped) for m in starts):  # maybe a start marker: wait
                    self._held = text
                    break
                self._opening = False
                if self.state == self.UNDECIDED:  # an answer without thinking
                    self.state = self.CONTENT
                    continue
            ends = self.parser.end_markers
            found = [(text.find(m), m) for m in ends if m in text]
            if found:
                at, marker = min(found, key=lambda f: (f[0], -len(f[1])))
                reasoning.append(text[:at])
                kept = marker in self.parser.content_end_tokens  # it opens the content
                self.state, text = self.CONTENT, text[at if kept else at + len(marker):]
                continue
            keep = max(_partial_suffix(text, m) for m in ends)
            reasoning.append(text[:len(text) - keep])
            self._held = text[len(text) - keep:]
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What was held back, at the end of the answer."""
        held, self._held = self._held, ""
        if self.state == self.REASONING:
            return held, ""
        if self.state == self.UNDECIDED:  # only whitespace or a partial marker came
            self.state = self.CONTENT
        return "", held


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
