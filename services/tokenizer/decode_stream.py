"""Incremental decode of one completion, with stop strings, for `DecodeStream`.

Combines the engine's `IncrementalDetokenizer` (text deltas that never split a
character) with `StopChecker` (stop strings, whichever completes first), so that
a streamed delta never contains text a later stop-string match would remove.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagoda.tokenizer.detokenizer import IncrementalDetokenizer
from pagoda.tokenizer.stop_checker import StopChecker


@dataclass
class DecodeStep:
    """What one batch of tokens produced."""

    text: str
    # The stop string that ended the completion; None while it runs.
    stop_string: str | None = None
    # Tokens of the batch that belong to the completion (all, unless it stopped).
    num_tokens_used: int = 0
    # True once the completion's text is final (stopped or flushed).
    complete: bool = False


class CompletionDecoder:
    """Text of one completion, delta by delta.

    Invariant: the concatenation of every returned `text` equals the one-shot
    decode of the tokens used, cut at the first stop string (kept only with
    include_stop_str_in_output); text that could still become a stop string is
    held back until it cannot, or until `finish`.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool,
                 spaces_between_special_tokens: bool, stop: Sequence[str],
                 include_stop_str_in_output: bool) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens,
                                             spaces_between_special_tokens)
        self._stop = StopChecker(stop, include_stop_str_in_output) if stop else None
        self._num_sent = 0  # chars of the detokenizer's output_text already returned

    def update(self, token_ids: Sequence[int]) -> DecodeStep:
        if self._stop is None:  # the common case: one decode for the whole batch
            self._detok.update(token_ids)
            return DecodeStep(self._take(len(self._detok.output_text)), None, len(token_ids))
        for i, token_id in enumerate(token_ids):
            # Token by token, so a match reports exactly which token completed it.
            delta = self._detok.update([token_id])
            step = self._check(len(delta), i + 1)
            if step is not None:
                return step
        return DecodeStep(self._take(self._safe_end()), None, len(token_ids))

    def finish(self) -> DecodeStep:
        """No more tokens: flush what the detokenizer held and end the text."""
        delta = self._detok.flush()
        if self._stop is not None:
            step = self._check(len(delta), 0)
            if step is not None:
                return step
        return DecodeStep(self._take(len(self._detok.output_text)), None, 0, complete=True)

    def _check(self, num_new_chars: int, num_tokens_used: int) -> DecodeStep | None:
        text = self._detok.output_text
        stop_string, end = self._stop.check(text, num_new_chars)
        if stop_string is None:
            return None
        return DecodeStep(self._take(max(end, self._num_sent)), stop_string, num_tokens_used,
                          complete=True)

    def _safe_end(self) -> int:
        text = self._detok.output_text
        return len(text) - self._stop.partial_match_len(text)

    def _take(self, end: int) -> str:
        """Return output_text[sent:end] and mark it sent (never moves backwards)."""
        if end <= self._num_sent:
            return ""
        text = self._detok.output_text[self._num_sent:end]
        self._num_sent = end
        return text
