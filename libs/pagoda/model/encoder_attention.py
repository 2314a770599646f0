"""Bidirectional self-attention of an encoder (BERT): every token of a request sees every
token of the same request, before and after it, and nothing else.

An encoder keeps no KV cache: a request's whole prompt runs in one step (the engine
never chunks a pooling request, and encoders take no prefix-cache hits), so its keys
and values are this step's own and are dropped with it. The step's tokens are
flattened request by request as `AttentionMetadata` describes; each request attends
over its own slice only:

    tokens   [ a0 a1 a2 | b0 b1 ]      request a: 3 x 3 scores, request b: 2 x 2
    visible   a* <-> a*   b* <-> b*     (no mask inside a request, none across)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagoda.model.attention_metadata import AttentionMetadata


def check_whole_prompts(md: AttentionMetadata) -> None:
    """Raise unless every request of the step is its whole sequence (no cached context)."""
    qsl = md.query_start_loc_cpu
    for i, seq_len in enumerate(md.seq_lens_cpu):
        if qsl[i + 1] - qsl[i] != seq_len:
            raise ValueError(f"An encoder needs each request's whole prompt in one step; "
                             f"request {i} has {qsl[i + 1] - qsl[i]} of its {seq_len} tokens")


def encoder_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      md: AttentionMetadata, scale: float) -> torch.Tensor:
    """query, key, value [T, H, D] (as many KV heads as query heads) -> [T, H, D].

    Token t of request i attends to all tokens of request i (`check_whole_prompts`
    must hold). One SDPA per request, in [H, L, D] layout.
    """
    qsl = md.query_start_loc_cpu
    outputs = []
    for i in range(md.num_reqs):
        rows = slice(qsl[i], qsl[i + 1])
        out = F.scaled_dot_product_attention(query[rows].transpose(0, 1),
                                             key[rows].transpose(0, 1),
                                             value[rows].transpose(0, 1), scale=scale)
        outputs.append(out.transpose(0, 1))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)
