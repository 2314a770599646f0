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

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagoda.model.attention_metadata import AttentionMetadata

_PLAN_ATTR = "_encoder_padding_plan"


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
    must hold). The requests are padded to the longest into one [B, H, L, D] batch, so a
    layer is one SDPA call whatever the batch size; padded keys are masked out, padded
    queries dropped.
    """
    if md.num_reqs == 1:
        out = F.scaled_dot_product_attention(query.transpose(0, 1), key.transpose(0, 1),
                                             value.transpose(0, 1), scale=scale)
        return out.transpose(0, 1)
    plan = _padding_plan(md, query.device)
    num_tokens, num_heads, head_dim = query.shape

    def padded(x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(md.num_reqs, plan.max_len, num_heads, head_dim)
        out[plan.batch, plan.position] = x
        return out.transpose(1, 2)

    out = F.scaled_dot_product_attention(padded(query), padded(key), padded(value),
                                         attn_mask=plan.key_mask, scale=scale)
    return out.transpose(1, 2)[plan.batch, plan.position]


@dataclass
class _PaddingPlan:
    """Where token t sits in the padded batch: request `batch[t]`, row `position[t]`."""

    batch: torch.Tensor  # [T] int64
    position: torch.Tensor  # [T] int64
    key_mask: torch.Tensor  # [B, 1, 1, L] bool: True for a request's real keys
    max_len: int


def _padding_plan(md: AttentionMetadata, device: torch.device) -> _PaddingPlan:
    # Memoised on the step's metadata: every layer of the step shares it.
    plan = getattr(md, _PLAN_ATTR, None)
    if plan is None:
        qsl = md.query_start_loc_cpu
        lengths = torch.tensor([qsl[i + 1] - qsl[i] for i in range(md.num_reqs)])
        batch = torch.repeat_interleave(torch.arange(md.num_reqs), lengths)
        position = torch.arange(qsl[-1]) - torch.tensor(qsl[:-1]).repeat_interleave(lengths)
        max_len = int(lengths.max())
        key_mask = torch.arange(max_len)[None, :] < lengths[:, None]
        plan = _PaddingPlan(batch.to(device), position.to(device),
                            key_mask[:, None, None, :].to(device), max_len)
        setattr(md, _PLAN_ATTR, plan)
    return plan
