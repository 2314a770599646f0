"""Phi-3 (and Phi-3.5, Phi-4-mini): Llama's network stored with fused projections.

The checkpoint holds `self_attn.qkv_proj` ([q; k; v] rows) and `mlp.gate_up_proj`
([gate; up] rows) already fused. Our layers fuse the same way but load each part
separately (so tensor parallelism can take its slice of each), so `load_weights`
splits the fused tensors into the HF names of their parts first. RoPE may be
longrope ("su"), with `original_max_position_embeddings` beside the scaling
parameters, and partial (`partial_rotary_factor`, Phi-4-mini: `Phi3Settings`);
Phi-3-mini-4k slides a 2047-token window in every layer. The scaling and the window
are read by the common parser.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from pagoda.config import ModelArchConfig
from pagoda.model.arch_spec import ModelArchitecture, family_settings
from pagoda.model.architectures.llama import LlamaForCausalLM, rotary_embedding
from pagoda.model.rotary import RotaryEmbedding


@dataclass(frozen=True)
class Phi3Settings:
    """`partial_rotary_factor`: the fraction of each head's dims that rotate (Phi-4-mini
    0.75, the rest pass through); 1.0 rotates them all."""

    partial_rotary_factor: float = 1.0

    @classmethod
    def from_hf_config(cls, hf_config: dict, arch: ModelArchConfig) -> Phi3Settings:
        # transformers >= 5 keeps it inside `rope_parameters`.
        params = hf_config.get("rope_parameters") or {}
        return cls(float(hf_config.get("partial_rotary_factor")
                         or params.get("partial_rotary_factor") or 1.0))


class Phi3ForCausalLM(LlamaForCausalLM):
    """Llama's stack with partial rotary; the checkpoint's tensor layout differs (see the
    module doc)."""

    def make_rotary_embeddings(self) -> tuple[RotaryEmbedding, RotaryEmbedding | None]:
        factor = family_settings(self.arch, Phi3Settings).partial_rotary_factor
        return rotary_embedding(self.arch, int(self.arch.head_dim * factor)), None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._split_fused(weights))

    def _split_fused(self, weights: Iterable[tuple[str, torch.Tensor]]
                     ) -> Iterable[tuple[str, torch.Tensor]]:
        arch = self.arch
        q_rows = arch.num_attention_heads * arch.head_dim
        kv_rows = arch.num_key_value_heads * arch.head_dim
        for name, tensor in weights:
            if ".self_attn.qkv_proj." in name:
                parts = tensor.split([q_rows, kv_rows, kv_rows], dim=0)
                for shard, part in zip(("q_proj", "k_proj", "v_proj"), parts, strict=True):
                    yield name.replace(".qkv_proj.", f".{shard}."), part
            elif ".mlp.gate_up_proj." in name:
                gate, up = tensor.split([arch.intermediate_size] * 2, dim=0)
                yield name.replace(".gate_up_proj.", ".gate_proj."), gate
                yield name.replace(".gate_up_proj.", ".up_proj."), up
            else:
                yield name, tensor


ARCHITECTURES = (
    ModelArchitecture("Phi3ForCausalLM", Phi3ForCausalLM, settings=Phi3Settings),
)
