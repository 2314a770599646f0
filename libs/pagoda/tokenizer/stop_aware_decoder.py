"""One completion's output text, step by step: incremental detokenization plus stop strings.

The one decoder of both paths: the offline engine's output processor keeps one per
completion, and the tokenizer service keeps one per completion streamed over
`DecodeStream`. So a request's text, its `stop_reason` and how many of its tokens count
are the same whichever path served it, however its tokens were batched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from pagoda.tokenizer.detokenizer import IncrementalDetokenizer
from pagoda.tokenizer.stop_checker import StopChecker

if TYPE_CHECKING:
    from pagoda.sampling_params import SamplingParams


@dataclass(slots=True)
class DecodeStep:
    """What one `StopAwareDecoder.update` produced."""

    # New text; final (no later step takes it back).
    text: str
    # How many of the update's token ids belong to the completion: all of them, unless a
    # stop string matched; then up to the token whose text completed it (the caller drops
    # the rest and aborts the request).
    num_tokens_used: int
    # The stop string that ended the completion (vLLM's `stop_reason`), else None.
    stop_str: str | None = None
    # The completion's text is complete: a stop string matched or the request finished.
    finished: bool = False


class StopAwareDecoder:
    """Turns one completion's output token ids into text deltas, honouring stop strings.

    Invariants (tested in tests/tokenizer/test_stop_aware_decoder.py), for any batching of
    the same tokens into `update` calls:
      * The concatenation of the step texts is the completion's text: the one-shot decode
        of its output tokens, cut before the first stop string to complete (after it with
        `include_stop_str_in_output`). When the request ended on a stop token or EOS
        (`stop_terminated`), that last token's text is left out unless
        `include_stop_str_in_output`, and no stop string is looked for in it (vLLM's rule).
      * `min_tokens`: a stop string only matches if it ends in text that output tokens
        past the first `min_tokens` produced (vLLM skips the stop check while the output
        has at most `min_tokens` tokens); it may begin in earlier text.
      * A step's text never contains characters that a later match would remove: a suffix
        that could still grow into a stop string is held back until it cannot, or until
        the request finishes and it is flushed.
      * `num_tokens_used` names the same token whatever the batching: with stop strings
        the tokens are decoded one at a time.
      * The stop search keeps only a tail of at most the held-back text plus
        ``len(longest stop) - 1`` characters; the full text lives once, in the detokenizer.

    After a step with `finished` set, further `update` calls are errors.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, skip_special_tokens, spaces_between_special_tokens)
        self.stop_checker = StopChecker(stop, include_stop_str_in_output)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        self.num_output_tokens = 0
        self.finished = False
        self.stop_reason: str | None = None
        # The detokenizer's text from absolute char `_tail_offset` on: the held-back chars
        # plus the context a match completed by the next chars can start in.
        self._tail = ""
        self._tail_offset = 0
        self._num_emitted = 0  # chars of the detokenizer's text returned so far

    @classmethod
    def from_sampling_params(cls, tokenizer: Any, prompt_token_ids: Sequence[int],
                             params: "SamplingParams") -> "StopAwareDecoder":
        return cls(tokenizer, prompt_token_ids, stop=params.stop or (),
                   include_stop_str_in_output=params.include_stop_str_in_output,
                   min_tokens=params.min_tokens,
                   skip_special_tokens=params.skip_special_tokens,
                   spaces_between_special_tokens=params.spaces_between_special_tokens)

    @property
    def output_text(self) -> str:
        """The text returned so far: the concatenation of every step's text."""
        return self.detokenizer.output_text[: self._num_emitted]

    def update(self, new_token_ids: Sequence[int], finished: bool = False,
               stop_terminated: bool = False) -> DecodeStep:
        """Add the next output tokens. `finished`: the request ended (EOS, stop token,
        length, abort); held-back text is flushed. `stop_terminated` (implies `finished`):
        it ended because its last token is EOS or a stop token id."""
        if self.finished:
            raise RuntimeError("StopAwareDecoder.update() called after the completion finished.")
        finished = finished or stop_terminated
        num_given = len(new_token_ids)
        if not finished and not self.stop_checker.stop:
            # The common step, cut short: with no stop string nothing is held back, so the
            # detokenizer's text is the step's text (the tail below stays empty).
            text = self.detokenizer.update(new_token_ids)
            self.num_output_tokens += num_given
            self._num_emitted += len(text)
            self._tail_offset = self._num_emitted
            return DecodeStep(text, num_given)
        token_ids = list(new_token_ids)
        # The token that ended the request (EOS or a stop token id) is counted, but its text
        # is shown only with include_stop_str_in_output and never searched (vLLM's rule).
        num_searched = num_given
        if stop_terminated and token_ids:
            num_searched -= 1
            if not self.include_stop_str_in_output:
                token_ids.pop()
        if not self.stop_checker.stop:  # nothing to match: one decode call for the batch
            self._append(self.detokenizer.update(token_ids), check=False)
        else:  # one token at a time, so a match names the token that completed it
            for i, token_id in enumerate(token_ids):
                check = i < num_searched and self.num_output_tokens + i + 1 > self.min_tokens
                stop_str = self._append(self.detokenizer.update([token_id]), check)
                if stop_str is not None:
                    self.num_output_tokens += i + 1
                    return self._finish(stop_str, i + 1)
        self.num_output_tokens += num_given
        if finished:
            check = not stop_terminated and self.num_output_tokens > self.min_tokens
            stop_str = self._append(self.detokenizer.flush(), check)
            return self._finish(stop_str, num_given)
        held = self.stop_checker.partial_match_len(self._tail)
        return DecodeStep(self._emit(len(self._tail) - held), num_given)

    # ------------------------------------------------------------------ internals
    def _append(self, text: str, check: bool) -> str | None:
        """Add detokenized text; return the stop string it completes (if `check`)."""
        if not text:
            return None
        self._tail += text
        if not check:
            return None
        stop_str, end = self.stop_checker.check(self._tail, len(text))
        if stop_str is not None:
            # Cut the text at the match; nothing after it is ever shown.
            self._tail = self._tail[:end]
        return stop_str

    def _finish(self, stop_str: str | None, num_tokens_used: int) -> DecodeStep:
        self.finished = True
        self.stop_reason = stop_str
        return DecodeStep(self._emit(len(self._tail)), num_tokens_used, stop_str, finished=True)

    def _emit(self, visible_len: int) -> str:
        """Return tail[emitted:visible_len], mark it emitted and trim the tail."""
        start = self._num_emitted - self._tail_offset
        # A match can only start in held-back text, never in text already returned.
        assert visible_len >= start, "stop match overlaps text already returned"
        delta = self._tail[start:visible_len]
        self._num_emitted += len(delta)
        tail_end = self._tail_offset + len(self._tail)
        keep_from = min(self._num_emitted, tail_end - self.stop_checker.max_stop_len + 1)
        if keep_from > self._tail_offset:
            self._tail = self._tail[keep_from - self._tail_offset:]
            self._tail_offset = keep_from
        return delta
