"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2) over a paged KV cache.

q/k/v are one fused projection (`qkv_proj`) and gate/up another (`gate_up_proj`):
two matmuls per block instead of five. `load_weights` takes HF names and fills
the fused parameters shard by shard. Given a `ParallelContext`, the model is one
rank's share: its slice of every matrix (tensor parallelism, `parallel_layers`)
and its stage's layers (pipeline parallelism). Every non-matmul op goes through
`pagoda.model.ops`, which runs the Triton kernels on CUDA and the torch path on CPU.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch
from torch import nn

from pagoda.config import ModelArchConfig
from pagoda.distributed.parallel_state import SINGLE, ParallelContext, stage_layer_range
from pagoda.model import ops
from pagoda.model.attention_metadata import AttentionMetadata
from pagoda.model.layers import RMSNorm
from pagoda.model.parallel_layers import (MergedColumnParallelLinear, ParallelLMHead,
                                          QKVParallelLinear, RowParallelLinear,
                                          VocabParallelEmbedding)
from pagoda.model.rotary import RotaryEmbedding
from pagoda.model.weight_names import load_named_weights


def _norm(norm: RMSNorm, x: torch.Tensor,
          residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm (fused with the residual add) through the kernel switch."""
    return ops.rms_norm(x, norm.weight, norm.eps, residual)


class LlamaAttention(nn.Module):
    """Self-attention over this TP rank's heads: H/T query heads and their KV heads."""

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype,
                 parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.head_dim = arch.head_dim
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = QKVParallelLinear(arch.hidden_size, arch.head_dim, arch.num_attention_heads,
                                          arch.num_key_value_heads, arch.attention_bias, dtype,
                                          parallel)
        self.num_heads = self.qkv_proj.num_local_heads
        self.num_kv_heads = self.qkv_proj.num_local_kv_heads
        # Qwen2 biases q/k/v only; Llama's attention_bias also covers o_proj.
        o_bias = arch.attention_bias and arch.architecture != "Qwen2ForCausalLM"
        self.o_proj = RowParallelLinear(arch.num_attention_heads * arch.head_dim, arch.hidden_size,
                                        o_bias, dtype, parallel)

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
    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype,
                 parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        inter = arch.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            arch.hidden_size, {"gate_proj": inter, "up_proj": inter}, False, dtype, parallel)
        self.down_proj = RowParallelLinear(inter, arch.hidden_size, False, dtype, parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype,
                 parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(arch, dtype, parallel)
        self.mlp = LlamaMLP(arch, dtype, parallel)
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


class IntermediateTensors(NamedTuple):
    """What a pipeline stage hands the next one: the residual stream, not yet summed."""

    hidden: torch.Tensor  # [T, hidden_size]
    residual: torch.Tensor  # [T, hidden_size]


class PPMissingLayer(nn.Identity):
    """Stands in for a module another pipeline stage holds (keeps layer indices global)."""


class LlamaModel(nn.Module):
    """The decoder stack, or one pipeline stage's contiguous slice of it.

    Invariant: the first stage holds `embed_tokens`, the last holds `norm`; a stage
    holds layers `[start_layer, end_layer)` and gets one KV cache per held layer.
    """

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype,
                 parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.start_layer, self.end_layer = stage_layer_range(
            arch.num_hidden_layers, parallel.pp_size, parallel.pp_rank)
        self.embed_tokens = (
            VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, dtype, parallel)
            if parallel.is_first_stage else None)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(arch, dtype, parallel) if self.start_layer <= i < self.end_layer
            else PPMissingLayer() for i in range(arch.num_hidden_layers))
        # A plain list: slicing the ModuleList every forward would build a new module.
        self.stage_layers = list(self.layers)[self.start_layer:self.end_layer]
        self.norm = (RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
                     if parallel.is_last_stage else None)
        self.rotary_emb = RotaryEmbedding(arch.head_dim, arch.rope_theta, arch.rope_scaling,
                                          arch.max_position_embeddings)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], md: AttentionMetadata,
                intermediate: IntermediateTensors | None = None
                ) -> torch.Tensor | IntermediateTensors:
        """hidden [T, hidden] after the final norm on the last stage; the stage's
        IntermediateTensors elsewhere. Stages after the first take `intermediate`."""
        if self.embed_tokens is not None:
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = intermediate
        cos, sin = self.rotary_emb(positions, hidden.dtype)
        for layer, kv_cache in zip(self.stage_layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, cos, sin, kv_cache, md)
        if self.norm is None:
            return IntermediateTensors(hidden, residual)
        hidden, _ = _norm(self.norm, hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM whose attention reads and writes a paged KV cache.

    Invariant: parameters are uninitialised until `load_weights` has filled every
    one of them (it raises otherwise). With tied embeddings the LM head is the
    embedding matrix itself, not a copy, except on a last pipeline stage that does
    not hold the embedding: there `lm_head` is loaded from the embedding's weights.
    Under tensor parallelism every matrix is this rank's slice (`parallel_layers`).
    """

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype,
                 parallel: ParallelContext | None = None) -> None:
        super().__init__()
        parallel = parallel or SINGLE
        self.arch = arch
        self.dtype = dtype
        self.parallel = parallel
        self.model = LlamaModel(arch, dtype, parallel)
        if parallel.is_last_stage and not (arch.tie_word_embeddings and parallel.is_first_stage):
            self.lm_head = ParallelLMHead(arch.vocab_size, arch.hidden_size, dtype, parallel)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                attn_metadata: AttentionMetadata,
                intermediate: IntermediateTensors | None = None
                ) -> torch.Tensor | IntermediateTensors:
        """input_ids, positions [T] (flattened as in AttentionMetadata) -> hidden [T, hidden]
        (IntermediateTensors on a stage before the last)."""
        return self.model(input_ids, positions, kv_caches, attn_metadata, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in fp32 (matmul in the model dtype).
        Last stage only. Under TP every rank of the stage must call it (the vocabulary
        slices are gathered); only TP rank 0 gets the logits, the others None."""
        head = self.lm_head if hasattr(self, "lm_head") else self.model.embed_tokens
        return head.compute_logits(hidden)

    def held_elsewhere(self, name: str) -> bool:
        """True for a parameter (or HF weight) name another pipeline stage holds."""
        model = self.model
        if name.startswith("model.layers."):
            index = name.split(".")[2]
            return (index.isdigit() and int(index) < self.arch.num_hidden_layers
                    and not model.start_layer <= int(index) < model.end_layer)
        if name.startswith("model.embed_tokens."):
            return model.embed_tokens is None
        if name.startswith("model.norm."):
            return model.norm is None
        return name.startswith("lm_head.") and not hasattr(self, "lm_head")

    def needs_checkpoint_tensor(self, name: str) -> bool:
        """Whether a loader should read HF weight `name` for this rank at all."""
        return name == "model.embed_tokens.weight" or not self.held_elsewhere(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill parameters from (HF name, tensor) pairs; ValueError on a missing or unknown one."""
        tied = self.arch.tie_word_embeddings
        if tied and hasattr(self, "lm_head"):
            weights = _embedding_as_lm_head(weights)
            tied = False
        load_named_weights(self, weights, skip_lm_head=tied, held_elsewhere=self.held_elsewhere)


def _embedding_as_lm_head(weights: Iterable[tuple[str, torch.Tensor]]
                          ) -> Iterable[tuple[str, torch.Tensor]]:
    """A tied last stage's LM head is a copy of the embedding (stored or not as lm_head)."""
    for name, tensor in weights:
        if name == "model.embed_tokens.weight":
            yield "lm_head.weight", tensor
        elif name != "lm_head.weight":
            yield name, tensor
