"""Repetition, frequency and presence penalties.

Definitions (vLLM's, which follow HF for repetition and OpenAI for the other two):

- repetition_penalty r, for every token seen in the prompt or the output so far:
  logit / r if logit > 0 else logit * r.
- frequency_penalty f and presence_penalty p, over the output tokens only:
  logit - f * count(token) - p * (count(token) > 0).

Applied in that order. Only the (row, token) entries that were seen are touched, so
the cost scales with the number of tokens, not with batch x vocabulary.
"""

from __future__ import annotations

from itertools import chain

import torch

from pagoda.sample.metadata import SamplingMetadata


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Penalise `logits` [B, V] (contiguous) in place and return it."""
    if metadata.no_penalties:
        return logits
    flat = logits.view(-1)
    vocab_size = logits.shape[1]
    repetition = metadata.repetition_penalties
    frequency = metadata.frequency_penalties
    presence = metadata.presence_penalties
    rep_rows = [row for row, r in enumerate(repetition.tolist()) if r != 1.0]
    if rep_rows:
        seen = torch.cat((
            _flat_ids(metadata.prompt_token_ids, rep_rows, vocab_size, logits.device),
            _flat_ids(metadata.output_token_ids, rep_rows, vocab_size, logits.device),
        )).unique()
        values = flat[seen]
        penalty = repetition[seen // vocab_size]
        flat[seen] = torch.where(values > 0, values / penalty, values * penalty)
    output_rows = [
        row for row, (f, p) in enumerate(zip(frequency.tolist(), presence.tolist()))
        if f != 0.0 or p != 0.0
    ]
    if output_rows:
        ids = _flat_ids(metadata.output_token_ids, output_rows, vocab_size, logits.device)
        ids, counts = ids.unique(return_counts=True)
        rows = ids // vocab_size
        values = flat[ids] - frequency[rows] * counts
        flat[ids] = values - presence[rows]
    return logits


def _flat_ids(token_lists: list[list[int]], rows: list[int], vocab_size: int,
              device: torch.device) -> torch.Tensor:
    """`row * vocab_size + token` for every token of the given rows (duplicates kept)."""
    lengths = [len(token_lists[row]) for row in rows]
    tokens = torch.tensor(list(chain.from_iterable(token_lists[row] for row in rows)),
                          dtype=torch.long)
    offsets = torch.repeat_interleave(torch.tensor(rows, dtype=torch.long) * vocab_size,
                                      torch.tensor(lengths, dtype=torch.long))
    return (tokens + offsets).to(device)
