"""Building blocks of a pre-norm decoder over a paged KV cache, shared by architectures.

    residual ──┬──────────────────────┬──(+)─► ...
               └─ norm ─ attention ─(+)┴─ norm ─ MLP ─►

The residual add is fused into the next norm (`ops.rms_norm(x, w, eps, residual)`),
so a layer returns (MLP output, residual before it) and never sums them itself.
q/k/v are one fused projection (`qkv_proj`) and gate/up another (`gate_up_proj`):
two matmuls per block instead of five. Given a `ParallelContext`, every matrix is
this tensor-parallel rank's slice (`parallel_layers`); with the default it is whole.
Every non-matmul op goes through `pagoda.model.ops` (Triton on CUDA, torch on CPU).
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.config import ModelArchConfig
from pagoda.distributed.parallel_state import SINGLE, ParallelContext
from pagoda.model import ops
from pagoda.model.attention_metadata import AttentionMetadata
from pagoda.model.layers import RMSNorm, empty_parameter
from pagoda.model.parallel_layers import (MergedColumnParallelLinear, QKVParallelLinear,
                                          RowParallelLinear)

KVCache = tuple[torch.Tensor, torch.Tensor]  # (key cache, value cache) of one layer


def fused_add_norm(norm: RMSNorm, x: torch.Tensor,
                   residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual) through the kernel switch; residual None: (norm(x), x)."""
    return ops.rms_norm(x, norm.weight, norm.eps, residual, unit_offset=norm.unit_offset)


class PagedSelfAttention(nn.Module):
    """Rotary self-attention over this TP rank's heads: H/T query heads and their KV heads.

    Writes this step's keys and values into the layer's paged cache, then attends over
    the cached tokens of each sequence (`AttentionMetadata` says which): all of them,
    or the last `sliding_window` with a window. The variants are constructor options:
    `scale` (default head_dim ** -0.5), `logits_soft_cap` (Gemma 2), `qk_norm` (an
    RMSNorm class normalising each query and key head before RoPE: Qwen3, Gemma 3),
    `sinks` (a learned logit per query head in every softmax's denominator, parameter
    `sinks` [this rank's heads]: gpt-oss; the torch path and the Triton kernels both
    take them, the latter verified under the Triton interpreter only).
    """

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype, qkv_bias: bool,
                 o_proj_bias: bool, parallel: ParallelContext = SINGLE, *,
                 scale: float | None = None, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None,
                 qk_norm: type[RMSNorm] | None = None, sinks: bool = False) -> None:
        super().__init__()
        self.head_dim = arch.head_dim
        self.scale = self.head_dim ** -0.5 if scale is None else scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.qkv_proj = QKVParallelLinear(arch.hidden_size, arch.head_dim, arch.num_attention_heads,
                                          arch.num_key_value_heads, qkv_bias, dtype, parallel)
        self.num_heads = self.qkv_proj.num_local_heads
        self.num_kv_heads = self.qkv_proj.num_local_kv_heads
        self.o_proj = RowParallelLinear(arch.num_attention_heads * arch.head_dim, arch.hidden_size,
                                        o_proj_bias, dtype, parallel)
        if qk_norm is not None:
            self.q_norm = qk_norm(arch.head_dim, arch.rms_norm_eps, dtype)
            self.k_norm = qk_norm(arch.head_dim, arch.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None
        self.sinks = empty_parameter(self.num_heads, dtype=dtype) if sinks else None

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: KVCache, md: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden).view(num_tokens, -1, self.head_dim)
        qk, value = qkv.split([self.num_heads + self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.q_norm is None:
            # Rotate queries and keys in one go: they share positions.
            qk = ops.rotary_embedding(qk, cos, sin)
            query, key = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        else:
            query, key = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            query = ops.rotary_embedding(fused_add_norm(self.q_norm, query, None)[0], cos, sin)
            key = ops.rotary_embedding(fused_add_norm(self.k_norm, key, None)[0], cos, sin)
        key_cache, value_cache = kv_cache
        ops.write_kv_cache(key, value, key_cache, value_cache, md.slot_mapping)
        out = ops.paged_attention(query, key_cache, value_cache, md, self.scale,
                                  self.sliding_window, self.logits_soft_cap, self.sinks)
        return self.o_proj(out.view(num_tokens, -1))


# HF `hidden_act` -> the fused "activation(gate) * up" op of `ops`.
_GATED_ACTIVATIONS = {"silu": ops.silu_and_mul, "gelu_pytorch_tanh": ops.gelu_tanh_and_mul}


class GatedMLP(nn.Module):
    """Gated feed-forward: down(act(gate(x)) * up(x)), gate and up fused, no biases.
    `act` is SiLU (SwiGLU: Llama, Qwen, Phi-3) or tanh-GELU (GeGLU: Gemma)."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 parallel: ParallelContext = SINGLE, hidden_act: str = "silu") -> None:
        super().__init__()
        if hidden_act not in _GATED_ACTIVATIONS:
            raise ValueError(f"Unsupported hidden_act {hidden_act!r}; supported: "
                             f"{', '.join(_GATED_ACTIVATIONS)}")
        self.act_and_mul = _GATED_ACTIVATIONS[hidden_act]
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, {"gate_proj": intermediate_size, "up_proj": intermediate_size}, False,
            dtype, parallel)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, False, dtype, parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """One pre-norm block around any attention and MLP module (HF parameter names:
    `self_attn`, `mlp`, `input_layernorm`, `post_attention_layernorm`)."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, arch: ModelArchConfig,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, kv_cache: KVCache,
                md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (mlp output, residual stream before it); the next norm adds them."""
        hidden, residual = fused_add_norm(self.input_layernorm, hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, kv_cache, md)
        hidden, residual = fused_add_norm(self.post_attention_layernorm, hidden, residual)
        return self.mlp(hidden), residual


class PPMissingLayer(nn.Identity):
    """Stands in for a module another pipeline stage holds (keeps layer indices global)."""
