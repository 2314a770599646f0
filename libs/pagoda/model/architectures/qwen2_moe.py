"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention with a sparse
mixture-of-experts MLP that also runs a gated shared expert.

A layer's MLP is `moe_shared_expert.SharedExpertMoeBlock`: `num_experts` routed experts
of `moe_intermediate_size`, the top `num_experts_per_tok` per token, plus a shared
expert of `shared_expert_intermediate_size` (`Qwen2MoeSettings`) scaled by
sigmoid(`shared_expert_gate`(x)). Layers in `mlp_only_layers`, and all but every
`decoder_sparse_step`-th layer, run a dense `GatedMLP` of `intermediate_size` instead
(transformers' rule, shared with Qwen3-MoE). Routing as transformers does it: softmax
in fp32, renormalised only with `norm_topk_prob`, the weights rounded to the model
dtype before weighing. q/k/v carry biases unless config.json says `qkv_bias: false`.
Checkpoint names: `mlp.gate` (router), `mlp.experts.<e>.{gate,up,down}_proj`,
`mlp.shared_expert.{gate,up,down}_proj`, `mlp.shared_expert_gate`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import nn

from pagoda.config import ModelArchConfig
from pagoda.model.arch_spec import ModelArchitecture, family_settings
from pagoda.model.architectures.qwen2 import Qwen2ForCausalLM
from pagoda.model.architectures.qwen3_moe import qwen3_moe_arch_config
from pagoda.model.decoder_layer import DecoderLayer, GatedMLP, PagedSelfAttention
from pagoda.model.moe import expert_held_elsewhere
from pagoda.model.moe_shared_expert import SharedExpertMoeBlock


@dataclass(frozen=True)
class Qwen2MoeSettings:
    """`shared_expert_intermediate_size`: the shared expert's width (transformers'
    default 5632, Qwen1.5-MoE-A2.7B's)."""

    shared_expert_intermediate_size: int = 5632

    @classmethod
    def from_hf_config(cls, hf_config: dict, arch: ModelArchConfig) -> Qwen2MoeSettings:
        return cls(int(hf_config.get("shared_expert_intermediate_size", 5632)))


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    """Qwen2's stack whose MLPs are `SharedExpertMoeBlock`s, except
    `arch.moe.dense_mlp_layers`."""

    def make_attention(self, layer_idx: int) -> nn.Module:
        return PagedSelfAttention(self.arch, self.dtype, qkv_bias=self.arch.attention_bias,
                                  o_proj_bias=False, parallel=self.parallel,
                                  sliding_window=self.arch.layer_sliding_window(layer_idx))

    def make_decoder_layer(self, layer_idx: int) -> nn.Module:
        arch, moe = self.arch, self.arch.moe
        if layer_idx in moe.dense_mlp_layers:
            mlp = GatedMLP(arch.hidden_size, arch.intermediate_size, self.dtype, self.parallel,
                           arch.hidden_act)
        else:
            shared = family_settings(arch, Qwen2MoeSettings).shared_expert_intermediate_size
            mlp = SharedExpertMoeBlock(moe.num_experts, moe.num_experts_per_tok,
                                       arch.hidden_size, moe.intermediate_size, shared,
                                       moe.norm_topk_prob, self.dtype, self.parallel,
                                       hidden_act=arch.hidden_act, round_weights=True)
        return DecoderLayer(self.make_attention(layer_idx), mlp, arch, self.dtype)

    def held_elsewhere(self, name: str) -> bool:
        return super().held_elsewhere(name) or expert_held_elsewhere(self, name)


def qwen2_moe_arch_config(hf_config: dict, arch: ModelArchConfig) -> ModelArchConfig:
    arch = dataclasses.replace(arch, attention_bias=bool(hf_config.get("qkv_bias", True)))
    return qwen3_moe_arch_config(hf_config, arch)


ARCHITECTURES = (
    ModelArchitecture("Qwen2MoeForCausalLM", Qwen2MoeForCausalLM,
                      update_arch_config=qwen2_moe_arch_config, settings=Qwen2MoeSettings),
)
