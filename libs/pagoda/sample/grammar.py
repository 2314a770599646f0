"""Structured outputs on the worker: the scheduler's packed bitmask applied to the logits.

Applied before the sampler (as vLLM does), so every later step (penalties,
temperature, top-k/p, the race) only ever sees allowed tokens, and the logprobs the
sampler reports are those of the constrained distribution (a forbidden token: -inf).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

# Bit j of a word -> token offset j (xgrammar's little-endian packing).
_SHIFTS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [R, ceil(V / 32)] -> bool [R, vocab_size], True = allowed."""
    shifts = _SHIFTS.to(bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: np.ndarray,
                          rows: Sequence[int]) -> None:
    """In place: logits[rows[i], t] = -inf for every token t that row i of `bitmask`
    forbids. Logit columns past the bitmask's vocabulary (padding) are forbidden too."""
    if not len(rows):
        return
    mask = torch.from_numpy(np.ascontiguousarray(bitmask)).to(logits.device, non_blocking=True)
    if logits.is_cuda and _apply_with_xgrammar(logits, mask, rows):
        return
    vocab = logits.shape[-1]
    allowed = unpack_bitmask(mask, min(vocab, mask.shape[1] * 32))
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    index = torch.as_tensor(list(rows), dtype=torch.long, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def _apply_with_xgrammar(logits: torch.Tensor, mask: torch.Tensor, rows: Sequence[int]) -> bool:
    """On CUDA, xgrammar's fused kernel (one launch, no unpacked mask in memory)."""
    try:
        import xgrammar
    except ImportError:
        return False
    full = torch.full((logits.shape[0], mask.shape[1]), -1, dtype=torch.int32,
                      device=logits.device)
    full[torch.as_tensor(list(rows), dtype=torch.long, device=logits.device)] = mask
    xgrammar.apply_token_bitmask_inplace(logits, full, indices=list(rows))
    return True
