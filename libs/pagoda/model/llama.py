"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) over a paged KV cache.

q/k/v are one fused projection (`qkv_proj`) and gate/up another (`gate_up_proj`):
two matmuls per block instead of five. `load_weights` takes HF names and fills
the fused parameters shard by shard. Every non-matmul op goes through
`pagoda.model.ops`, which runs the Triton kernels on CUDA and the torch path on CPU.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.config import ModelArchConfig
from pagoda.model import ops
from pagoda.model.attention_metadata import AttentionMetadata
from pagoda.model.layers import Embedding, Linear, RMSNorm
from pagoda.model.rotary import RotaryEmbedding
from pagoda.model.weight_names import load_named_weights


def _norm(norm: RMSNorm, x: torch.Tensor,
          residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm (fused with the residual add) through the kernel switch."""
    return ops.rms_norm(x, norm.weight, norm.eps, residual)


class LlamaAttention(nn.Module):
    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = arch.num_attention_heads
        self.num_kv_heads = arch.num_key_value_heads
        self.head_dim = arch.head_dim
        self.scale = self.head_dim ** -0.5
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(arch.hidden_size, q_size + 2 * kv_size, arch.attention_bias, dtype)
        # Qwen2 biases q/k/v only; Llama's attention_bias also covers o_proj.
        o_bias = arch.attention_bias and arch.architecture != "Qwen2ForCausalLM"
        self.o_proj = Linear(q_size, arch.hidden_size, o_bias, dtype)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], md: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden).view(num_tokens, -1, self.head_dim)
        qk, value = qkv.split([self.num_heads + self.num_kv_heads, self.num_kv_heads], dim=1)
        # Rotate queries and keys in one go: they share positions.
        qk = ops.rotary_embedding(qk, cos, sin)
        query, key = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        key_cache, value_cache = kv_cache
        ops.write_kv_cache(key, value, key_cache, value_cache, md.slot_mapping)
        out = ops.paged_attention(query, key_cache, value_cache, md, self.scale)
        return self.o_proj(out.view(num_tokens, -1))


class LlamaMLP(nn.Module):
    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = Linear(arch.hidden_size, 2 * arch.intermediate_size, False, dtype)
        self.down_proj = Linear(arch.intermediate_size, arch.hidden_size, False, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(arch, dtype)
        self.mlp = LlamaMLP(arch, dtype)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (mlp output, residual stream before it); the next norm adds them."""
        hidden, residual = _norm(self.input_layernorm, hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, kv_cache, md)
        hidden, residual = _norm(self.post_attention_layernorm, hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = Embedding(arch.vocab_size, arch.hidden_size, dtype)
        self.layers = nn.ModuleList(LlamaDecoderLayer(arch, dtype)
                                    for _ in range(arch.num_hidden_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.rotary_emb = RotaryEmbedding(arch.head_dim, arch.rope_theta, arch.rope_scaling,
                                          arch.max_position_embeddings)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                md: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, hidden.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, cos, sin, kv_cache, md)
        hidden, _ = _norm(self.norm, hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM whose attention reads and writes a paged KV cache.

    Invariant: parameters are uninitialised until `load_weights` has filled every
    one of them (it raises otherwise). With tied embeddings the LM head is the
    embedding matrix itself, not a copy.
    """

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.arch = arch
        self.dtype = dtype
        self.model = LlamaModel(arch, dtype)
        if not arch.tie_word_embeddings:
            self.lm_head = Linear(arch.hidden_size, arch.vocab_size, False, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] (flattened as in AttentionMetadata) -> hidden [T, hidden]."""
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in fp32 (matmul in the model dtype)."""
        weight = (self.model.embed_tokens.weight if self.arch.tie_word_embeddings
                  else self.lm_head.weight)
        return F.linear(hidden, weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill parameters from (HF name, tensor) pairs; ValueError on a missing or unknown one."""
        load_named_weights(self, weights, skip_lm_head=self.arch.tie_word_embeddings)
