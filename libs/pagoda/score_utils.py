"""Scoring text pairs, shared by `LLM.score` and the gateway's /score and /rerank
(vLLM's `score_utils`): how texts pair up, where a pair's second text starts, the
cosine similarity an embedding model scores a pair with, and the MaxSim a
late-interaction model (ColBERT) scores one with. Plain Python: no torch."""

from __future__ import annotations

import math
from collections.abc import Sequence


def score_pairs(data_1: str | Sequence[str], data_2: str | Sequence[str]
                ) -> tuple[list[str], list[str]]:
    """vLLM's pairing: 1 -> 1, 1 -> N (the one text repeated) or N -> N.
    ValueError for an empty side or N -> M with N != M."""
    left = [data_1] if isinstance(data_1, str) else list(data_1)
    right = [data_2] if isinstance(data_2, str) else list(data_2)
    if not left or not right:
        raise ValueError("Scoring needs at least one text on each side.")
    if len(left) == 1:
        left = left * len(right)
    if len(left) != len(right):
        raise ValueError(f"Texts are scored 1 -> N or N -> N; got {len(left)} and "
                         f"{len(right)}.")
    return left, right


def token_type_split(token_type_ids: Sequence[int] | None) -> int | None:
    """Where a pair's second text starts: its first token type 1 (vLLM's
    `compress_token_type_ids`); None without types or without a second segment.
    ValueError unless the types are zeros then ones."""
    if not token_type_ids:
        return None
    types = list(token_type_ids)
    split = types.index(1) if 1 in types else len(types)
    if any(t != 0 for t in types[:split]) or any(t != 1 for t in types[split:]):
        raise ValueError("Token type ids are expected to be a sequence of zeros followed by "
                         "a sequence of ones")
    return split if split < len(types) else None


def maxsim(query: Sequence[float], document: Sequence[float], dim: int) -> float:
    """ColBERT's late-interaction score (vLLM's `compute_maxsim_score`): for each query
    token, the largest dot product with any document token, summed over the query
    tokens. The inputs are token embeddings flattened token-major, `dim` values each
    (L2-normalised by the model, so each dot product is a cosine)."""
    if dim < 1 or len(query) % dim or len(document) % dim or not document:
        raise ValueError(f"Token embeddings of {len(query)} and {len(document)} values do not "
                         f"split into tokens of {dim}.")
    q = [query[i:i + dim] for i in range(0, len(query), dim)]
    d = [document[j:j + dim] for j in range(0, len(document), dim)]
    return math.fsum(max(math.fsum(x * y for x, y in zip(qt, dt)) for dt in d) for qt in q)


def cosine_similarity(a: Sequence[float], b: Sequence[float]) -> float:
    """cos(a, b) in double precision; 0 when either vector is zero."""
    norm = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return math.fsum(x * y for x, y in zip(a, b)) / norm if norm else 0.0
