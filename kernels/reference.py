"""Torch references for every kernel: the test oracle.

Written for obviousness, not speed: per-request loops, dense gathers, fp32 math.
Each function has the same signature and result as its Triton launcher. Rounding
follows HF transformers' Llama (round to the activation dtype where HF does), so the
references also document what "correct" means in bf16.
"""

from __future__ import annotations

import torch

from pagoda.kernels.attention_metadata import AttentionMetadata


def write_kv_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T]; negative = padding token, not written
) -> None:
    block_size = key_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        key_cache[slot // block_size, slot % block_size] = key[t]
        value_cache[slot // block_size, slot % block_size] = value[t]


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first `seq_len` positions of one request, as a dense [seq_len, Hkv, D]."""
    block_size = cache.shape[1]
    pos = torch.arange(seq_len, device=cache.device)
    blocks = block_table.long()[pos // block_size]
    return cache[blocks, pos % block_size]


def paged_attention(
    query: torch.Tensor,  # [T, H, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,
    attn_metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each request's query tokens over its whole context in the
    cache (cached prefix + this step's tokens, already written). A request with
    `seq_len == 0` (padding) yields zeros. `sliding_window` W: query p sees keys
    p - W < k <= p only (transformers' mask); `logits_soft_cap` c: each score s is
    replaced by c * tanh(s / c) before masking (Gemma 2); `sinks` [H]: head h's softmax
    gains one more term exp(sinks[h]) in its denominator with no value (gpt-oss), so a
    row's weights sum to less than one. Query head h reads KV head h // (H / Hkv)."""
    out = torch.zeros_like(query)
    num_heads = query.shape[1]
    num_kv_heads = key_cache.shape[2]
    qsl = attn_metadata.query_start_loc_cpu
    for i, seq_len in enumerate(attn_metadata.seq_lens_cpu):
        start, end = qsl[i], qsl[i + 1]
        q_len = end - start
        if q_len == 0 or seq_len == 0:
            continue
        table = attn_metadata.block_tables[i]
        k = gather_kv(key_cache, table, seq_len).float()  # [S, Hkv, D]
        v = gather_kv(value_cache, table, seq_len).float()
        group = num_heads // num_kv_heads
        k = k.repeat_interleave(group, dim=1)  # [S, H, D]
        v = v.repeat_interleave(group, dim=1)
        q = query[start:end].float()  # [Q, H, D]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if logits_soft_cap is not None:
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        causal = k_pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            causal &= k_pos[None, :] > q_pos[:, None] - sliding_window
        scores = scores.masked_fill(~causal[None], float("-inf"))
        if sinks is not None:  # an extra key column per head, dropped after the softmax
            sink_col = sinks.float()[:, None, None].expand(num_heads, q_len, 1)
            probs = torch.softmax(torch.cat([scores, sink_col], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out


def rms_norm(
    x: torch.Tensor,  # [N, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """HF LlamaRMSNorm; with `residual`, first `residual = x + residual` (rounded to
    the activation dtype, as HF's separate add is) and returns (normed, residual)."""
    if residual is not None:
        x = x + residual
        residual = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)
    return out if residual is None else (out, residual)


def rotary_embedding(
    x: torch.Tensor,  # [T, num_heads, head_dim]
    cos: torch.Tensor,  # [rows, rot_dim // 2]
    sin: torch.Tensor,
    positions: torch.Tensor | None = None,  # [T]; None = row t for token t
    is_neox_style: bool = True,
) -> torch.Tensor:
    """Rotate the first `rot_dim` dims of each head; the rest pass through.
    NeoX style (HF Llama) pairs dim i with i + rot_dim/2; GPT-J style pairs 2i, 2i+1.
    Math in fp32, one rounding at the end."""
    if positions is not None:
        cos, sin = cos[positions.long()], sin[positions.long()]
    rot_dim = 2 * cos.shape[1]
    c, s = cos.float()[:, None, :], sin.float()[:, None, :]
    rot, rest = x[..., :rot_dim].float(), x[..., rot_dim:]
    if is_neox_style:
        x1, x2 = rot.chunk(2, dim=-1)
        out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)
    return torch.cat([out.to(x.dtype), rest], dim=-1)


def gemma_rms_norm(
    x: torch.Tensor,  # [N, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """HF Gemma2RMSNorm: `norm(x) * (1 + weight)` all in fp32, one rounding at the end;
    the residual add as in `rms_norm`."""
    if residual is not None:
        x = x + residual
        residual = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = (h * (1.0 + weight.float())).to(x.dtype)
    return out if residual is None else (out, residual)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[N, 2I] -> [N, I]: gelu_tanh(x[:, :I]) * x[:, I:], as HF's GeGLU MLP rounds."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[N, 2I] -> [N, I]: silu(x[:, :I]) * x[:, I:], each op rounded like HF's MLP."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
