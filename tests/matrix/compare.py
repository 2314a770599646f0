"""What "the same answer" means in the differential matrix, in one place.

An `Answer` is what one request came back with, on any path (the offline engine or a
served cluster): per choice, the token ids, each token's logprob and its top logprobs
(token id -> logprob). `first_difference` names the first way two answers differ, or
returns None. Invariants:
- token ids are compared exactly, choice by choice, in order; the first differing index
  is the one reported (with both ids and, given a decoder, both texts);
- logprobs (the chosen token's, and every top-logprob entry) may differ by at most
  `tol` absolutely; the top-logprob ids must be the same set;
- a tolerance of 0 means bit-equal logprobs (the batch-invariance row);
- vLLM's API sends a logprob of -inf (a token a constraint masks) as -9999.0, so
  both sides are clamped at API_MIN_LOGPROB before they are compared.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

# The reference and most paths run float32 on the same CPU kernels; the tolerance covers
# reductions in another order (a chunked prefill, a split over ranks, KV pulled as bytes
# is exact). Observed differences are far below it; a wrong token's logprob is not.
FP32_LOGPROB_TOL = 1e-4
API_MIN_LOGPROB = -9999.0


def _clamp(value: float) -> float:
    return max(value, API_MIN_LOGPROB)


@dataclass
class Choice:
    """One completion: `token_ids[i]` was sampled with logprob `logprobs[i]`, and
    `top[i]` holds the top logprobs at that position (empty when not asked)."""

    token_ids: list[int]
    logprobs: list[float]
    top: list[dict[int, float]] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None


@dataclass
class Answer:
    """A request's answer: its choices in index order, and how many prompt tokens the
    path counted (None where unknown)."""

    choices: list[Choice]
    prompt_tokens: int | None = None


def _token(token_id: int, decode: Callable[[list[int]], str] | None) -> str:
    return f"{token_id} {decode([token_id])!r}" if decode else str(token_id)


def first_difference(want: Answer, got: Answer, tol: float = FP32_LOGPROB_TOL,
                     decode: Callable[[list[int]], str] | None = None) -> str | None:
    """The first difference between the expected answer `want` and `got`, in words
    (None: the same answer within `tol`)."""
    if want.prompt_tokens is not None and got.prompt_tokens is not None \
            and want.prompt_tokens != got.prompt_tokens:
        return f"prompt tokens: expected {want.prompt_tokens}, got {got.prompt_tokens}"
    if len(want.choices) != len(got.choices):
        return f"choices: expected {len(want.choices)}, got {len(got.choices)}"
    for c, (w, g) in enumerate(zip(want.choices, got.choices)):
        found = _choice_difference(w, g, tol, decode)
        if found:
            return f"choice {c}: {found}"
    return None


def _choice_difference(want: Choice, got: Choice, tol: float,
                       decode: Callable[[list[int]], str] | None) -> str | None:
    for i, (w, g) in enumerate(zip(want.token_ids, got.token_ids)):
        if w != g:
            return (f"first differing token at index {i}: expected {_token(w, decode)}, "
                    f"got {_token(g, decode)}")
    if len(want.token_ids) != len(got.token_ids):
        n = min(len(want.token_ids), len(got.token_ids))
        extra = (want.token_ids if len(want.token_ids) > n else got.token_ids)[n]
        side = "expected" if len(want.token_ids) > n else "got"
        return (f"lengths differ: expected {len(want.token_ids)} tokens, got "
                f"{len(got.token_ids)} ({side} has {_token(extra, decode)} at index {n})")
    for i, (w, g) in enumerate(zip(want.logprobs, got.logprobs)):
        w, g = _clamp(w), _clamp(g)
        if not abs(w - g) <= tol:
            return (f"logprob of token {i} ({_token(want.token_ids[i], decode)}): expected "
                    f"{w:.6g}, got {g:.6g} (|diff| {abs(w - g):.3g} > tol {tol:g})")
    for i, (w, g) in enumerate(zip(want.top, got.top)):
        if set(w) != set(g):
            return f"top logprobs at token {i}: expected ids {sorted(w)}, got {sorted(g)}"
        for token_id, value in w.items():
            value, other = _clamp(value), _clamp(g[token_id])
            if not abs(value - other) <= tol:
                return (f"top logprob of {_token(token_id, decode)} at token {i}: expected "
                        f"{value:.6g}, got {other:.6g} (|diff| {abs(value - other):.3g} > "
                        f"tol {tol:g})")
    return None
