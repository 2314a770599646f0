"""Prompt-lookup drafts: continue the sequence the way it continued after the last
earlier occurrence of its final n tokens (vLLM's `"method": "ngram"`).

Free to compute (no model), so it pays off wherever text repeats its context:
code edits, summaries quoting the source, extraction, repetitive formats.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    """Invariant: `propose` is a pure function of its arguments (drafts depend only on
    the request's tokens), so a request's drafts never depend on the batch."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int,
                 prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: list[int], max_drafts: int | None = None) -> list[int]:
        """Up to min(k, max_drafts) draft tokens to follow `token_ids`; [] when its last
        n tokens (n from prompt_lookup_max down to prompt_lookup_min) never occurred
        before. The longest n wins; among its matches, the latest.

        A match close to the end has fewer known followers than k: the continuation
        is then extended periodically (a sequence equal to itself shifted by p keeps
        repeating with period p), which is what a repeating pattern does next.
        """
        k = self.k if max_drafts is None else min(self.k, max_drafts)
        length = len(token_ids)
        if k <= 0 or length <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # Windows tokens[i:i + n] for i + n <= length - 1: each has a follower.
            windows = sliding_window_view(tokens[:length - 1], n)
            matches = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
            if matches.size:
                start = int(matches[-1]) + n
                period = length - start
                return [int(tokens[start + j % period]) for j in range(k)]
        return []
