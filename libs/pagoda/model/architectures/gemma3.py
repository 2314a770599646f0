"""Gemma 3 (text, `Gemma3ForCausalLM`): Gemma 2 plus q/k norms and a local RoPE base.

Changes from Gemma 2, as in transformers' `modeling_gemma3.py`:
- each query and key head is normalised (`GemmaRMSNorm`, `self_attn.q_norm`/`k_norm`)
  before RoPE;
- five sliding-window layers to each global one (`sliding_window_pattern` 6);
- the sliding layers rotate with their own base (`rope_local_base_freq`, 10 000) and
  no scaling (`Gemma3Settings`), the global ones with `rope_theta` (1 000 000) and
  `rope_scaling` (linear x8 on the 4B+ checkpoints);
- no attention soft-capping (transformers ignores `attn_logit_softcapping` here too)
  and, by default, no final-logit soft-capping.
The multimodal `Gemma3ForConditionalGeneration` checkpoints are not served.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import nn

from pagoda.config import ModelArchConfig
from pagoda.model.arch_spec import ModelArchitecture, family_settings
from pagoda.model.architectures.gemma2 import Gemma2ForCausalLM, GemmaSettings, gemma_arch_config
from pagoda.model.architectures.llama import rotary_embedding
from pagoda.model.decoder_layer import PagedSelfAttention
from pagoda.model.layers import GemmaRMSNorm
from pagoda.model.rotary import RotaryEmbedding, normalize_rope_scaling


@dataclass(frozen=True)
class Gemma3Settings(GemmaSettings):
    """Gemma's settings (never an attention soft cap) plus the RoPE of the sliding
    layers: base `local_rope_theta`, scaling `local_rope_scaling` (None: plain)."""

    local_rope_theta: float = 1e4
    local_rope_scaling: dict | None = None

    @classmethod
    def from_hf_config(cls, hf_config: dict, arch: ModelArchConfig) -> Gemma3Settings:
        gemma = GemmaSettings.from_hf_config(hf_config, arch)
        _, _, local_theta, local_scaling = _rope_per_layer_type(hf_config)
        # transformers ignores `attn_logit_softcapping` in Gemma 3 too.
        return cls(query_pre_attn_scalar=gemma.query_pre_attn_scalar,
                   final_logit_softcapping=gemma.final_logit_softcapping,
                   local_rope_theta=local_theta, local_rope_scaling=local_scaling)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 2's network with per-head q/k norms and a local RoPE base for its sliding
    layers (`LlamaModel` picks each layer's)."""

    def make_rotary_embeddings(self) -> tuple[RotaryEmbedding, RotaryEmbedding | None]:
        arch, settings = self.arch, family_settings(self.arch, Gemma3Settings)
        local = RotaryEmbedding(arch.head_dim, settings.local_rope_theta,
                                settings.local_rope_scaling, arch.max_position_embeddings,
                                max_model_len=arch.max_model_len)
        return rotary_embedding(arch), local

    def make_attention(self, layer_idx: int) -> nn.Module:
        arch, settings = self.arch, family_settings(self.arch, Gemma3Settings)
        return PagedSelfAttention(arch, self.dtype, arch.attention_bias, arch.attention_bias,
                                  self.parallel, scale=settings.attention_scale(arch.head_dim),
                                  sliding_window=arch.layer_sliding_window(layer_idx),
                                  qk_norm=GemmaRMSNorm)


def _rope_per_layer_type(hf_config: dict) -> tuple[float, dict | None, float, dict | None]:
    """(global theta, global scaling, local theta, local scaling) from either spelling:
    transformers 5's `rope_parameters` keyed by layer type, or the older top-level
    `rope_theta` / `rope_scaling` / `rope_local_base_freq`."""
    params = hf_config.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = params.get("full_attention") or {}
        local = params.get("sliding_attention") or {}
        return (float(full.get("rope_theta", 1e6)), normalize_rope_scaling(full),
                float(local.get("rope_theta", 1e4)), normalize_rope_scaling(local))
    return (float(hf_config.get("rope_theta", 1e6)),
            normalize_rope_scaling(hf_config.get("rope_scaling")),
            float(hf_config.get("rope_local_base_freq", 1e4)), None)


def gemma3_arch_config(hf_config: dict, arch: ModelArchConfig) -> ModelArchConfig:
    """Gemma's common fields, and the global layers' RoPE as the common one."""
    arch = gemma_arch_config(hf_config, arch, hf_config.get("sliding_window_pattern", 6))
    theta, scaling, _, _ = _rope_per_layer_type(hf_config)
    return dataclasses.replace(arch, rope_theta=theta, rope_scaling=scaling)


ARCHITECTURES = (
    ModelArchitecture("Gemma3ForCausalLM", Gemma3ForCausalLM,
                      update_arch_config=gemma3_arch_config, settings=Gemma3Settings),
)
