"""Gemma 2: Llama's shape with Gemma's numerics and alternating local/global attention.

What differs from Llama, each as in transformers' `modeling_gemma2.py`:
- embeddings scaled by sqrt(hidden_size) (rounded to the model dtype first, as HF);
- RMSNorm scales by `1 + weight` in fp32 (`GemmaRMSNorm`), and each block has four
  norms: before and after attention, before and after the MLP ("sandwich");
- GeGLU MLP (`gelu_pytorch_tanh`);
- attention scale `query_pre_attn_scalar ** -0.5`, scores soft-capped as
  `50 * tanh(s / 50)` (`attn_logit_softcapping`), logits as `30 * tanh(l / 30)`
  (these three are `GemmaSettings`);
- even layers attend to a sliding window (4096), odd layers to everything
  (`layer_types`). Since the global layers read every block, the KV cache keeps
  them all (`ModelArchConfig.kv_cache_sliding_window` is None).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from pagoda.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelArchConfig
from pagoda.model.arch_spec import ModelArchitecture, family_settings
from pagoda.model.architectures.llama import LlamaForCausalLM, LlamaModel
from pagoda.model.attention_metadata import AttentionMetadata
from pagoda.model.decoder_layer import GatedMLP, KVCache, PagedSelfAttention, fused_add_norm
from pagoda.model.layers import GemmaRMSNorm


@dataclass(frozen=True)
class GemmaSettings:
    """Gemma's attention and logit numerics. `query_pre_attn_scalar`: the attention scale
    is its -1/2 power (None: head_dim's); a soft cap C bounds x as `C * tanh(x / C)`,
    on attention scores (`attn_logit_softcapping`) and logits (`final_logit_softcapping`);
    None: no cap."""

    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None

    @classmethod
    def from_hf_config(cls, hf_config: dict, arch: ModelArchConfig) -> GemmaSettings:
        return cls(float(hf_config.get("query_pre_attn_scalar") or arch.head_dim),
                   hf_config.get("attn_logit_softcapping"),
                   hf_config.get("final_logit_softcapping"))

    def attention_scale(self, head_dim: int) -> float:
        return (self.query_pre_attn_scalar or head_dim) ** -0.5


class GemmaModel(LlamaModel):
    """Llama's stack with scaled embeddings and a Gemma final norm."""

    norm_cls = GemmaRMSNorm

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        # HF rounds the scale to the model dtype (sqrt(3072) = 55.43 is 55.5 in bf16).
        return hidden * torch.tensor(self.embed_tokens.weight.shape[1] ** 0.5, dtype=hidden.dtype)


class GemmaDecoderLayer(nn.Module):
    """Norms before and after both attention and MLP:

        residual ─┬────────────────────────────────────┬──(+)─┬─ ...
                  └─ norm ─ attention ─ post-norm ──────┘      └─ pre-norm ─ MLP ─ post-norm ─►

    As in `DecoderLayer`, the residual adds are fused into the next norm, so the layer
    returns (post-normed MLP output, residual stream before it).
    """

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, arch: ModelArchConfig,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        size, eps = arch.hidden_size, arch.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, kv_cache: KVCache,
                md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = fused_add_norm(self.input_layernorm, hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, kv_cache, md)
        hidden, _ = fused_add_norm(self.post_attention_layernorm, hidden, None)
        hidden, residual = fused_add_norm(self.pre_feedforward_layernorm, hidden, residual)
        hidden, _ = fused_add_norm(self.post_feedforward_layernorm, self.mlp(hidden), None)
        return hidden, residual


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2 (see the module doc); Gemma 3 subclasses it."""

    model_cls = GemmaModel

    def make_attention(self, layer_idx: int) -> nn.Module:
        arch, settings = self.arch, family_settings(self.arch, GemmaSettings)
        return PagedSelfAttention(arch, self.dtype, arch.attention_bias, arch.attention_bias,
                                  self.parallel, scale=settings.attention_scale(arch.head_dim),
                                  sliding_window=arch.layer_sliding_window(layer_idx),
                                  logits_soft_cap=settings.attn_logit_softcapping)

    def make_decoder_layer(self, layer_idx: int) -> nn.Module:
        arch = self.arch
        mlp = GatedMLP(arch.hidden_size, arch.intermediate_size, self.dtype, self.parallel,
                       arch.hidden_act)
        return GemmaDecoderLayer(self.make_attention(layer_idx), mlp, arch, self.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)
        cap = family_settings(self.arch, GemmaSettings).final_logit_softcapping
        if logits is None or cap is None:
            return logits
        return torch.tanh(logits / cap) * cap


def gemma_arch_config(hf_config: dict, arch: ModelArchConfig,
                      sliding_window_pattern: int) -> ModelArchConfig:
    """The common fields Gemma configs leave implicit or spell their own way. Without
    `layer_types`, every `sliding_window_pattern`-th layer is global, the others slide."""
    sliding = arch.sliding_window
    if sliding is not None and sliding.layer_types is None:
        sliding = dataclasses.replace(sliding, layer_types=tuple(
            SLIDING_ATTENTION if (i + 1) % sliding_window_pattern else FULL_ATTENTION
            for i in range(arch.num_hidden_layers)))
    if hf_config.get("use_bidirectional_attention"):
        raise ValueError("Gemma with use_bidirectional_attention (an embedding model) is not "
                         "supported: Pagoda serves causal language models")
    return dataclasses.replace(
        arch, sliding_window=sliding,
        hidden_act=hf_config.get("hidden_activation") or arch.hidden_act,
        tie_word_embeddings=hf_config.get("tie_word_embeddings", True))


def gemma2_arch_config(hf_config: dict, arch: ModelArchConfig) -> ModelArchConfig:
    return gemma_arch_config(hf_config, arch, sliding_window_pattern=2)


ARCHITECTURES = (
    ModelArchitecture("Gemma2ForCausalLM", Gemma2ForCausalLM,
                      update_arch_config=gemma2_arch_config, settings=GemmaSettings),
)
