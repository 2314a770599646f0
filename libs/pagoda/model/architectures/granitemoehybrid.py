"""GraniteMoeHybrid (IBM Granite-4.0-H): Mamba2 layers between attention layers.

Why this hybrid family: transformers 5 implements both GraniteMoeHybrid and NemotronH
with the same pure-torch Mamba2 path (`mamba2_chunk_scan` / `selective_state_update`),
but Granite's block is the Llama-shaped pre-norm pair every Pagoda decoder already has
(a mixer, then an MLP, `input_layernorm` / `post_attention_layernorm`), with one mixer
kind per layer (`layer_types`: "mamba"/"linear_attention" or "attention"/
"full_attention"), where NemotronH's blocks are single-op (mixer *or* MLP *or* MoE,
each with its own norm) and its experts use relu². Granite's fused expert tensors
also load as stored, no per-expert renaming.

The network, as transformers' `GraniteMoeHybridForCausalLM`:
- embeddings times `embedding_multiplier`; every mixer and MLP output times
  `residual_multiplier` before the residual add; logits divided by `logits_scaling`;
- attention: softmax scale `attention_multiplier` (not head_dim^-0.5); RoPE when
  `position_embedding_type == "rope"`, no positional encoding otherwise (Granite-4.0-H
  is NoPE: the Mamba layers carry position);
- Mamba layers: `mamba2.Mamba2Mixer`, their state per request in the worker's state
  pool (`kv_cache.recurrent_state_shapes`, slots from the model runner);
- MLP: a top-k MoE (`block_sparse_moe`: router `router.layer`, fused experts
  `input_linear` [E, 2I, H] (gate rows then up rows) and `output_linear` [E, H, I];
  softmax over the top-k logits) plus an always-on `shared_mlp`
  (`input_linear` [2S, H], `output_linear` [H, S]); `num_local_experts == 0`: the
  shared MLP alone.

Speculative decoding (n-gram, draft model) runs exactly: verification rewinds the
Mamba state to the last accepted draft (`mamba2.py`). Refused at start-up
(`engine.hybrid_limits`): tensor/pipeline parallelism, LoRA, fp8 KV cache,
quantization and a hybrid draft model; prefix caching is turned off with a logged
reason (a cached prefix would skip the Mamba layers' pass over it); P/D and the prefix
pull are refused by the worker (`kv_transfer.block_shares`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.config import MambaConfig, ModelArchConfig
from pagoda.model.arch_spec import ModelArchitecture, family_settings
from pagoda.model.architectures.llama import LlamaForCausalLM, LlamaModel
from pagoda.model.attention_metadata import AttentionMetadata
from pagoda.model.decoder_layer import PagedSelfAttention, fused_add_norm
from pagoda.model.layers import RMSNorm
from pagoda.model.mamba2 import Mamba2Mixer
from pagoda.model import ops

NOT_QUANTIZABLE = "its Mamba2 layers and fused experts run unquantized"
_MAMBA_TYPES = ("mamba", "linear_attention")


@dataclass(frozen=True)
class GraniteHybridSettings:
    """Granite's µP multipliers and positional encoding (transformers' names)."""

    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    attention_multiplier: float = 1.0
    rope: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 1
    shared_intermediate_size: int = 0

    @classmethod
    def from_hf_config(cls, hf_config: dict, arch: ModelArchConfig) -> GraniteHybridSettings:
        return cls(embedding_multiplier=float(hf_config.get("embedding_multiplier", 1.0)),
                   residual_multiplier=float(hf_config.get("residual_multiplier", 1.0)),
                   logits_scaling=float(hf_config.get("logits_scaling", 1.0)),
                   attention_multiplier=float(hf_config.get("attention_multiplier", 1.0)),
                   rope=hf_config.get("position_embedding_type") == "rope",
                   num_experts=hf_config.get("num_local_experts") or 0,
                   num_experts_per_tok=hf_config.get("num_experts_per_tok") or 1,
                   shared_intermediate_size=hf_config.get("shared_intermediate_size") or 0)


class _NoRope(nn.Module):
    """Stands in for the rotary embedding of a NoPE model: no cos/sin."""

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        return None, None


class GraniteAttention(PagedSelfAttention):
    """Paged attention that rotates only when the model has RoPE (cos given)."""

    def forward(self, hidden, cos, sin, kv_cache, md):
        if cos is not None:
            return super().forward(hidden, cos, sin, kv_cache, md)
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden).view(num_tokens, -1, self.head_dim)
        query, key, value = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads],
                                      dim=1)
        key_cache, value_cache = kv_cache
        ops.write_kv_cache(key.contiguous(), value.contiguous(), key_cache, value_cache,
                           md.slot_mapping)
        out = ops.paged_attention(query.contiguous(), key_cache, value_cache, md, self.scale,
                                  None, None, None)
        return self.o_proj(out.view(num_tokens, -1))


class _Linear(nn.Module):
    """A bare weight under HF's `<name>.weight` (Granite's fused MLP tensors)."""

    def __init__(self, *shape: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape, dtype=dtype))


class SharedMLP(nn.Module):
    """silu(gate) * up from one fused `input_linear` [2S, H], then `output_linear`."""

    def __init__(self, hidden: int, size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_linear = _Linear(2 * size, hidden, dtype=dtype)
        self.output_linear = _Linear(hidden, size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.input_linear.weight).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.output_linear.weight)


class GraniteMoE(nn.Module):
    """Top-k experts, softmax over the chosen logits (HF's `GraniteMoeHybridMoE`)."""

    def __init__(self, num_experts: int, top_k: int, hidden: int, size: int,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Module()
        self.router.layer = _Linear(num_experts, hidden, dtype=dtype)
        self.input_linear = _Linear(num_experts, 2 * size, hidden, dtype=dtype)
        self.output_linear = _Linear(num_experts, hidden, size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.router.layer.weight).float()
        top_logits, top_index = logits.topk(self.top_k, dim=-1)
        weights = torch.softmax(top_logits, dim=-1).type_as(x)
        out = torch.zeros_like(x)
        for expert in top_index.unique().tolist():
            token, k = torch.where(top_index == expert)
            gate, up = F.linear(x[token], self.input_linear.weight[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.output_linear.weight[expert])
            out.index_add_(0, token, y * weights[token, k, None])
        return out


class GraniteHybridMLP(nn.Module):
    """The MoE (when the model has experts) plus the shared MLP."""

    def __init__(self, arch: ModelArchConfig, s: GraniteHybridSettings, dtype: torch.dtype):
        super().__init__()
        self.block_sparse_moe = (GraniteMoE(s.num_experts, s.num_experts_per_tok,
                                            arch.hidden_size, arch.intermediate_size, dtype)
                                 if s.num_experts else None)
        self.shared_mlp = SharedMLP(arch.hidden_size, s.shared_intermediate_size, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.block_sparse_moe is None:
            return self.shared_mlp(x)
        return self.block_sparse_moe(x) + self.shared_mlp(x)


class GraniteHybridDecoderLayer(nn.Module):
    """Pre-norm block: a Mamba2 mixer (`mamba`) or attention (`self_attn`), then the
    MLP; both outputs scaled by `residual_multiplier` (the next norm adds the residual)."""

    def __init__(self, mixer: nn.Module, is_mamba: bool, arch: ModelArchConfig,
                 settings: GraniteHybridSettings, dtype: torch.dtype) -> None:
        super().__init__()
        self.is_mamba = is_mamba
        if is_mamba:
            self.mamba = mixer
        else:
            self.self_attn = mixer
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.mlp = GraniteHybridMLP(arch, settings, dtype)
        self.residual_multiplier = settings.residual_multiplier

    def forward(self, hidden, residual, cos, sin, kv_cache, md: AttentionMetadata):
        hidden, residual = fused_add_norm(self.input_layernorm, hidden, residual)
        if self.is_mamba:
            hidden = self.mamba(hidden, kv_cache, md)
        else:
            hidden = self.self_attn(hidden, cos, sin, kv_cache, md)
        hidden, residual = fused_add_norm(self.post_attention_layernorm,
                                          hidden * self.residual_multiplier, residual)
        return self.mlp(hidden) * self.residual_multiplier, residual


class GraniteHybridModel(LlamaModel):
    """Llama's stack with embeddings scaled by `embedding_multiplier`."""

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier


class GraniteMoeHybridForCausalLM(LlamaForCausalLM):
    """Granite-4.0-H on Llama's stack; the checkpoint's MLP names are mapped onto
    `mlp.` (`load_weights`). Invariant: every checkpoint tensor is consumed."""

    packed_modules_mapping = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}
    model_cls = GraniteHybridModel

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype, parallel=None) -> None:
        self.settings = family_settings(arch, GraniteHybridSettings)
        super().__init__(arch, dtype, parallel)
        self.model.embedding_multiplier = self.settings.embedding_multiplier

    def make_rotary_embeddings(self):
        if self.settings.rope:
            return super().make_rotary_embeddings()
        return _NoRope(), None

    def make_decoder_layer(self, layer_idx: int) -> nn.Module:
        arch, s = self.arch, self.settings
        is_mamba = layer_idx in arch.mamba.layers
        if is_mamba:
            mixer = Mamba2Mixer(arch.hidden_size, arch.mamba, arch.rms_norm_eps, self.dtype)
        else:
            mixer = GraniteAttention(arch, self.dtype, arch.attention_bias, arch.attention_bias,
                                     self.parallel, scale=s.attention_multiplier)
        return GraniteHybridDecoderLayer(mixer, is_mamba, arch, s, self.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        return logits / self.settings.logits_scaling if logits is not None else None

    def load_weights(self, weights) -> None:
        super().load_weights((_mlp_name(name), tensor) for name, tensor in weights)


def _mlp_name(name: str) -> str:
    """`...layers.N.block_sparse_moe.x` / `shared_mlp.x` -> under the layer's `mlp.`."""
    for part in (".block_sparse_moe.", ".shared_mlp."):
        if part in name:
            return name.replace(part, ".mlp" + part, 1)
    return name


def granite_hybrid_arch_config(hf_config: dict, arch: ModelArchConfig) -> ModelArchConfig:
    """The Mamba layers (`layer_types`) and their shapes; the experts' size."""
    layer_types = hf_config.get("layer_types") or hf_config.get("layers_block_type") \
        or ["mamba"] * arch.num_hidden_layers
    hidden = arch.hidden_size
    heads = hf_config.get("mamba_n_heads", 128)
    head_dim = hf_config.get("mamba_d_head", "auto")
    if head_dim in (None, "auto"):
        head_dim = hf_config.get("mamba_expand", 2) * hidden // heads
    limit = hf_config.get("time_step_limit") or (0.0, float("inf"))
    limit = tuple(float(v["__float__"]) if isinstance(v, dict) else float(v) for v in limit)
    mamba = MambaConfig(
        layers=tuple(i for i, t in enumerate(layer_types) if t in _MAMBA_TYPES),
        num_heads=heads, head_dim=head_dim, state_size=hf_config.get("mamba_d_state", 256),
        n_groups=hf_config.get("mamba_n_groups", 1), conv_kernel=hf_config.get("mamba_d_conv", 4),
        chunk_size=hf_config.get("mamba_chunk_size", 256),
        conv_bias=bool(hf_config.get("mamba_conv_bias", True)),
        proj_bias=bool(hf_config.get("mamba_proj_bias", False)), time_step_limit=limit)
    return dataclasses.replace(arch, mamba=mamba)


ARCHITECTURES = (
    ModelArchitecture("GraniteMoeHybridForCausalLM", GraniteMoeHybridForCausalLM,
                      update_arch_config=granite_hybrid_arch_config,
                      settings=GraniteHybridSettings, refuse_quantization=NOT_QUANTIZABLE),
)
