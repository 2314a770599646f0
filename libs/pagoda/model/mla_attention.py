"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged cache of latents.

Per token, MLA compresses keys and values into one latent vector shared by every head:

    kv_a_proj_with_mqa(x) = [c (kv_lora_rank) | k_pe (qk_rope_head_dim)]
    c <- kv_a_layernorm(c);  k_pe <- RoPE(k_pe)          (one "head", shared)
    kv_b_proj: c -> per head h [k_nope_h (qk_nope_head_dim) | v_h (v_head_dim)]
    q_h = [q_nope_h | RoPE(q_pe_h)]   (from q_proj, or q_a_proj -> q_a_layernorm -> q_b_proj)
    score(h, t, s) = scale * (q_nope_h(t) . k_nope_h(s) + q_pe_h(t) . k_pe(s))

The cache holds `[c | k_pe]` per token and layer (width kv_lora_rank + qk_rope_head_dim,
`ModelArchConfig.kv_latent_dim`), never the expanded keys and values: for DeepSeek-V3
576 values per token and layer instead of 128 heads x (192 + 128) = 40960.

How attention runs: the "absorbed" form (vLLM's, the DeepSeek-V2 paper's). Writing
kv_b_proj's weight as W_UK_h [nope, R] and W_UV_h [v, R] per head,

    q_nope_h . (W_UK_h c) = (W_UK_h^T q_nope_h) . c
    sum_s p(s) (W_UV_h c_s) = W_UV_h (sum_s p(s) c_s)

so the query becomes `[W_UK_h^T q_nope_h | q_pe_h]` (width R + P) and attention is
plain multi-query attention over the cached `[c | k_pe]` with one KV head, whose
values are the same cached rows (only their first R columns are kept). It goes through
the same `ops.paged_attention` as every other model (torch path, CPU kernels, Triton,
prefix caching, chunked prefill, sliding of decodes and prefills alike) and costs
nothing per cached token beyond the attention itself. The "naive" form (expand every
cached latent with kv_b_proj, then attend per head) would redo that expansion over the
whole context at every step and layer.

Why not the naive form for exactness: neither form reproduces transformers bit for
bit, since transformers' dense eager attention already sums in another order than
paged attention does (as for every model here). Both are the same arithmetic up to
float associativity: in float32 the logprobs of the tiny parity models differ from
transformers' by at most 1.0e-5 (V3) and 5e-6 (V2) over 64 greedy tokens
(`tests/model/architectures/test_deepseek.py` holds them to 1e-4, the other
architectures' tolerance, and greedy tokens equal). The absorbed form is chosen because
it is as exact as the naive one and costs no work per cached token.

Tensor parallelism: query heads, kv_b_proj's rows and o_proj's columns split by head;
q_a_proj, kv_a_proj_with_mqa and the latent cache are replicated on every rank (the
latent has no head axis to split).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagoda.config import ModelArchConfig
from pagoda.distributed.parallel_state import SINGLE, ParallelContext
from pagoda.model import ops
from pagoda.model.attention_metadata import AttentionMetadata
from pagoda.model.decoder_layer import KVCache, fused_add_norm
from pagoda.model.layers import Linear, RMSNorm
from pagoda.model.parallel_layers import ColumnParallelLinear, RowParallelLinear

# transformers builds q_a_layernorm and kv_a_layernorm with its RMSNorm's default
# epsilon, not config.rms_norm_eps (the released checkpoints use 1e-6 for both).
LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True)
class MLADims:
    """The sizes of one MLA layer (DeepSeek config.json names)."""

    q_lora_rank: int | None  # None: a plain q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token and layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
                       ) -> torch.Tensor:
    """RoPE on interleaved pairs (x0, x1), (x2, x3), ... of x [T, heads, R], DeepSeek's
    layout, from `RotaryEmbedding`'s tables (cos = cat(c, c), signed_sin = cat(-s, s)).

    The result is de-interleaved ([even outputs | odd outputs]), as transformers'
    `apply_rotary_pos_emb_interleave` returns it; queries and keys get the same
    permutation, so their dot products are those of the interleaved rotation.
    """
    half = cos.shape[-1] // 2
    c, s = cos[:, None, :half], signed_sin[:, None, half:]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


class MultiHeadLatentAttention(nn.Module):
    """One layer's MLA over this TP rank's query heads (HF parameter names).

    `kv_cache` is the layer's (latent cache [blocks, block_size, 1, R + P], empty
    value tensor) pair from `kv_cache.allocate_kv_caches` under `kv_latent_dim`.
    `scale` is the softmax scale (qk_head_dim ** -0.5, times yarn's mscale squared);
    `rope_interleave` picks DeepSeek's pairwise RoPE layout (else rotate-half).
    """

    def __init__(self, arch: ModelArchConfig, dims: MLADims, dtype: torch.dtype,
                 parallel: ParallelContext = SINGLE, *, scale: float,
                 rope_interleave: bool = True) -> None:
        super().__init__()
        self.dims, self.scale, self.rope_interleave = dims, scale, rope_interleave
        heads, hidden, bias = arch.num_attention_heads, arch.hidden_size, arch.attention_bias
        if heads % parallel.tp_size:
            raise ValueError(f"{heads} attention heads do not split over tensor parallel size "
                             f"{parallel.tp_size}")
        self.num_heads = heads // parallel.tp_size
        if dims.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear.split(hidden, heads * dims.qk_head_dim, False,
                                                     dtype, parallel)
        else:
            self.q_a_proj = Linear(hidden, dims.q_lora_rank, bias, dtype)
            self.q_a_layernorm = RMSNorm(dims.q_lora_rank, LATENT_NORM_EPS, dtype)
            self.q_b_proj = ColumnParallelLinear.split(dims.q_lora_rank,
                                                       heads * dims.qk_head_dim, False, dtype,
                                                       parallel)
        self.kv_a_proj_with_mqa = Linear(hidden, dims.latent_dim, bias, dtype)
        self.kv_a_layernorm = RMSNorm(dims.kv_lora_rank, LATENT_NORM_EPS, dtype)
        self.kv_b_proj = ColumnParallelLinear.split(
            dims.kv_lora_rank, heads * (dims.qk_nope_head_dim + dims.v_head_dim), False, dtype,
            parallel)
        self.o_proj = RowParallelLinear(heads * dims.v_head_dim, hidden, bias, dtype, parallel)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.rope_interleave:
            return rotate_interleaved(x, cos, sin)
        return ops.rotary_embedding(x, cos, sin)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: KVCache, md: AttentionMetadata) -> torch.Tensor:
        d, num_tokens = self.dims, hidden.shape[0]
        if d.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(fused_add_norm(self.q_a_layernorm, self.q_a_proj(hidden), None)[0])
        q_nope, q_pe = q.view(num_tokens, self.num_heads, d.qk_head_dim).split(
            [d.qk_nope_head_dim, d.qk_rope_head_dim], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(hidden).split([d.kv_lora_rank, d.qk_rope_head_dim],
                                                        dim=-1)
        c = fused_add_norm(self.kv_a_layernorm, c.contiguous(), None)[0]
        q_pe = self._rope(q_pe, cos, sin)
        k_pe = self._rope(k_pe.reshape(num_tokens, 1, d.qk_rope_head_dim), cos, sin)
        # kv_b_proj's rows are per head [k_nope rows | v rows]: W_UK [h, nope, R], W_UV [h, v, R].
        w_kv = self.kv_b_proj.weight.view(self.num_heads, -1, d.kv_lora_rank)
        w_uk, w_uv = w_kv.split([d.qk_nope_head_dim, d.v_head_dim], dim=1)
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, h, R]
        query = torch.cat((q_latent, q_pe), dim=-1)
        entry = torch.cat((c[:, None, :], k_pe), dim=-1)  # [T, 1, R + P]
        latent_cache = kv_cache[0]
        # The cached row is both key and value: written (twice, identically) and read
        # through the shared ops, so every backend and the fp8 cache apply as they are.
        ops.write_kv_cache(entry, entry, latent_cache, latent_cache, md.slot_mapping)
        out = ops.paged_attention(query, latent_cache, latent_cache, md, self.scale)
        out_latent = out[..., :d.kv_lora_rank]  # [T, h, R]; the k_pe columns are not values
        out = torch.bmm(out_latent.transpose(0, 1), w_uv.transpose(1, 2))  # [h, T, v]
        return self.o_proj(out.transpose(0, 1).reshape(num_tokens, -1))
