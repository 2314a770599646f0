"""Logprobs as the OpenAI API shows them, from the engine's `LogprobsLists` rows.

The engine sends, per position, `[chosen, top-1, ..., top-k]` token ids with their
logprobs and ranks (`pagoda.messages.LogprobsLists`). The tokenizer
decodes every candidate id on its own (`DecodeInput.decode_token_ids`, vLLM's
`decode([id])` rule). This module joins the two into `TokenLogprob`s and renders
them in the three shapes clients expect:

- chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`;
- completions (OpenAI's legacy shape): `{"tokens", "token_logprobs",
  "top_logprobs", "text_offset"}`, where each `top_logprobs` dict holds the chosen
  token plus the top k (so up to k + 1 entries, as OpenAI and vLLM do);
- `prompt_logprobs` (vLLM's extension): `[None, {"<id>": {"logprob", "rank",
  "decoded_token"}}, ...]`, the first prompt token having nothing to score it.

-inf is clamped to -9999.0 (what OpenAI returns; JSON has no infinity).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from pagoda.messages import LogprobsLists

MIN_LOGPROB = -9999.0


@dataclass(slots=True)
class Candidate:
    """One of a position's top-k tokens."""

    token_id: int
    text: str
    logprob: float
    rank: int


@dataclass(slots=True)
class TokenLogprob:
    """One token of the text and how likely it was.

    `logprob` and `rank` are None for a prompt's first token (no prefix scores it);
    `top` lists the k most likely tokens at the position, best first.
    """

    token_id: int
    text: str
    logprob: float | None = None
    rank: int | None = None
    top: list[Candidate] = field(default_factory=list)


def candidate_ids(lists: LogprobsLists | None) -> list[int]:
    """Every token id of `lists`, row by row: what the tokenizer must decode."""
    if lists is None:
        return []
    return [token_id for row in lists.token_ids for token_id in row]


def token_logprobs(lists: LogprobsLists | None, texts: Iterator[str]) -> list[TokenLogprob]:
    """Join rows with their candidates' texts (consumed from `texts` in
    `candidate_ids` order)."""
    if lists is None:
        return []
    out = []
    for ids, lps, ranks in zip(lists.token_ids, lists.logprobs, lists.ranks):
        row_texts = [next(texts, "") for _ in ids]
        top = [Candidate(t, s, lp, r)
               for t, s, lp, r in zip(ids[1:], row_texts[1:], lps[1:], ranks[1:])]
        out.append(TokenLogprob(ids[0], row_texts[0], lps[0], ranks[0], top))
    return out


def _clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def _token_text(token_id: int, text: str, as_token_ids: bool) -> str:
    return f"token_id:{token_id}" if as_token_ids else text


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def chat_logprobs(tokens: Sequence[TokenLogprob], num_top: int, as_token_ids: bool = False
                  ) -> dict:
    """OpenAI's chat `logprobs` object for `tokens` (each with its `num_top` best)."""
    content = []
    for t in tokens:
        text = _token_text(t.token_id, t.text, as_token_ids)
        top = []
        for c in t.top[:num_top]:
            c_text = _token_text(c.token_id, c.text, as_token_ids)
            top.append({"token": c_text, "logprob": _clamp(c.logprob), "bytes": _utf8(c_text)})
        content.append({"token": text, "logprob": _clamp(t.logprob), "bytes": _utf8(text),
                        "top_logprobs": top})
    return {"content": content}


def completion_logprobs(tokens: Sequence[TokenLogprob], num_top: int, initial_offset: int = 0,
                        as_token_ids: bool = False) -> dict:
    """OpenAI's legacy completions `logprobs` object; `initial_offset` is the length
    of the choice's text before these tokens (streamed chunks continue it)."""
    out = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    offset = initial_offset
    for t in tokens:
        text = _token_text(t.token_id, t.text, as_token_ids)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if t.logprob is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_clamp(t.logprob))
        top = {text: _clamp(t.logprob)}
        for c in t.top[:num_top]:
            top[_token_text(c.token_id, c.text, as_token_ids)] = _clamp(c.logprob)
        out["top_logprobs"].append(top)
    return out


def prompt_logprobs_json(tokens: Sequence[TokenLogprob]) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token, token id -> its logprob, rank and
    text, for the prompt token itself and the top k."""
    out: list[dict | None] = []
    for t in tokens:
        if t.logprob is None:
            out.append(None)
            continue
        entry = {str(t.token_id): {"logprob": _clamp(t.logprob), "rank": t.rank,
                                   "decoded_token": t.text}}
        for c in t.top:
            entry.setdefault(str(c.token_id), {"logprob": _clamp(c.logprob), "rank": c.rank,
                                               "decoded_token": c.text})
        out.append(entry)
    return out
