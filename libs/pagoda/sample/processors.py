"""Logits processors that can change the argmax: allowed_token_ids, bad_words,
logit_bias and min_tokens.

Most edit a handful of (row, token) entries, so they index those entries directly
instead of building [B, V] masks (allowed_token_ids masks its rows: it forbids almost
everything). They modify `logits` in place; the sampler hands them its own copy, never
the model's output.
"""

from __future__ import annotations

import torch

from pagoda.sample.metadata import SamplingMetadata


def apply_allowed_token_ids(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """-inf for every token outside a row's `allowed_token_ids` (vLLM's rule)."""
    if not metadata.allowed_token_ids:
        return logits
    rows = list(metadata.allowed_token_ids)
    allowed = torch.zeros(len(rows), logits.shape[-1], dtype=torch.bool, device=logits.device)
    for i, row in enumerate(rows):
        allowed[i, torch.tensor(metadata.allowed_token_ids[row], device=logits.device)] = True
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return logits


def apply_bad_words(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """-inf for the last token of each bad word whose other tokens end the row's output
    so far (vLLM's bad_words: a one-token word is always banned; a longer one only
    where it would complete). Only the output is matched, not the prompt, as in vLLM."""
    outputs = metadata.output_token_ids
    rows: list[int] = []
    token_ids: list[int] = []
    for row, words in metadata.bad_words_token_ids.items():
        past = outputs[row] if row < len(outputs) else []
        for word in words:
            prefix = word[:-1]
            if len(prefix) <= len(past) and (not prefix or past[-len(prefix):] == prefix):
                rows.append(row)
                token_ids.append(word[-1])
    if rows:
        logits[_index(rows, token_ids, logits.device)] = -float("inf")
    return logits


def apply_logit_bias(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Add `logit_bias[row][token]` to `logits[row, token]` (OpenAI's logit_bias)."""
    if not metadata.logit_bias:
        return logits
    rows: list[int] = []
    token_ids: list[int] = []
    biases: list[float] = []
    for row, bias in metadata.logit_bias.items():
        rows.extend([row] * len(bias))
        token_ids.extend(bias.keys())
        biases.extend(bias.values())
    index = _index(rows, token_ids, logits.device)
    values = torch.tensor(biases, dtype=logits.dtype, device=logits.device)
    logits.index_put_(index, values, accumulate=True)
    return logits


def apply_min_tokens(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Forbid stop/EOS ids in rows that have fewer than min_tokens output tokens.

    The output length is re-checked here (not only in the builder) so metadata whose
    `output_token_ids` lists grow in place stays correct from step to step.
    """
    outputs = metadata.output_token_ids
    rows: list[int] = []
    token_ids: list[int] = []
    for row, (min_tokens, stop_ids) in metadata.min_tokens.items():
        if row < len(outputs) and len(outputs[row]) >= min_tokens:
            continue
        rows.extend([row] * len(stop_ids))
        token_ids.extend(stop_ids)
    if rows:
        logits[_index(rows, token_ids, logits.device)] = -float("inf")
    return logits


def _index(rows: list[int], token_ids: list[int], device: torch.device) -> tuple[torch.Tensor, ...]:
    return (
        torch.tensor(rows, dtype=torch.long, device=device),
        torch.tensor(token_ids, dtype=torch.long, device=device),
    )
