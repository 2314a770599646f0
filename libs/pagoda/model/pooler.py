"""The pooler: a step's last hidden states -> one vector per pooling request.

    hidden [T, H] ─ pool each request's rows ─► [B, H] ─┬─ embed:    first `dimensions`,
      (LAST: its last row, MEAN: the mean of     │       then L2-normalised if asked
       its rows, CLS: its first row)             └─ classify / score: the model's
                                                     `classify` head -> logits, then
                                                     softmax (sigmoid for one label)
    token_embed (ALL): every row of a request, through the model's `project_tokens`
      (ColBERT's linear), each L2-normalised, flattened token-major [T * D]

Pooling is computed in float32 whatever the model dtype. MEAN and CLS read every
row of a request, so they need its whole prompt in the step (the engine gives a
pooling request its whole prompt at once and turns prefix caching off for them);
LAST reads only the last row, which the engine always computes, prefix hit or not.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.config import PoolerConfig
from pagoda.pooling_params import TOKEN_TASKS, PoolingParams


def _pool_rows(rows: torch.Tensor, pooling_type: str) -> torch.Tensor:
    if pooling_type == "LAST":
        return rows[-1]
    if pooling_type == "CLS":
        return rows[0]
    return rows.float().mean(dim=0)


class Pooler:
    """Applies one model's `PoolerConfig`; `classify` is the model's classification
    head (None for an embedding model).

    Invariant: the i-th result belongs to the i-th span and is a 1-D float32 tensor:
    an embedding of `dimensions` (else hidden) size, or one value per label.
    """

    def __init__(self, config: PoolerConfig, model: nn.Module) -> None:
        self.config = config
        self.classify = getattr(model, "classify", None)
        # The classification head on each token's hidden state (token_classify, `LLM.reward`).
        self.classify_tokens = getattr(model, "classify_tokens", None)
        self.project_tokens = getattr(model, "project_tokens", None)
        if config.task == "classify" and self.classify is None:
            raise ValueError(f"{type(model).__name__} has no classification head")

    def __call__(self, hidden: torch.Tensor, spans: Sequence[tuple[int, int, bool]],
                 params: Sequence[PoolingParams]) -> list[torch.Tensor]:
        """`spans[i]` = (first row, end row, whether the rows are the whole prompt) of
        request i in `hidden`; `params[i]` its verified pooling params."""
        if any(p.task in TOKEN_TASKS for p in params):
            return self._per_request(hidden, spans, params)
        if self.config.pooling_type != "LAST" and not all(whole for _, _, whole in spans):
            raise ValueError(f"{self.config.pooling_type} pooling needs each prompt whole in "
                             "one step")
        if self.config.task == "token_embed":
            return [self._token_embedding(hidden[start:end], p)
                    for (start, end, _), p in zip(spans, params)]
        pooled = torch.stack([_pool_rows(hidden[start:end], self.config.pooling_type)
                              for start, end, _ in spans])
        if self.config.task == "embed":
            return [_embedding(row.float(), p) for row, p in zip(pooled, params)]
        logits = self.classify(pooled.to(hidden.dtype)).float()
        return [_activate(row, p) for row, p in zip(logits, params)]


    def _per_request(self, hidden: torch.Tensor, spans, params) -> list[torch.Tensor]:
        """A step with a token-level request: each request pooled on its own (a
        token_classify result is its [L, labels] probabilities, flattened)."""
        results = []
        for span, p in zip(spans, params):
            if p.task not in TOKEN_TASKS:
                results += self(hidden, [span], [p])
                continue
            start, end, whole = span
            if not whole or self.classify_tokens is None:
                raise ValueError("token_classify needs a classification head and each prompt "
                                 "whole in one step")
            logits = self.classify_tokens(hidden[start:end]).float()
            results.append(torch.stack([_activate(row, p) for row in logits]).reshape(-1))
        return results

    def _token_embedding(self, rows: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        """Every token's embedding (projected when the model projects them, e.g.
        ColBERT's linear), each L2-normalised if asked, flattened token-major."""
        if self.project_tokens is not None:
            rows = self.project_tokens(rows)
        rows = rows.float()
        return (F.normalize(rows, dim=-1) if params.normalize else rows).reshape(-1)


def _embedding(vector: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    if params.dimensions is not None:  # matryoshka: the leading dimensions, renormalised
        vector = vector[:params.dimensions]
    return F.normalize(vector, dim=-1) if params.normalize else vector


def _activate(logits: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    """Softmax over the labels, or a sigmoid for a one-label head (a cross-encoder's
    score, as sentence-transformers' CrossEncoder applies it)."""
    if not params.use_activation:
        return logits
    return torch.sigmoid(logits) if logits.numel() == 1 else torch.softmax(logits, dim=-1)
