"""Qwen3-MoE: Qwen3's attention (q/k norms) with a sparse mixture-of-experts MLP.

A layer's MLP is `moe.SparseMoeBlock` (`num_experts` experts of
`moe_intermediate_size`, the top `num_experts_per_tok` per token) unless config.json
makes it dense: layers in `mlp_only_layers`, and all but every `decoder_sparse_step`-th
layer, run a `GatedMLP` of `intermediate_size` (transformers' rule). The routing
weights are renormalised only with `norm_topk_prob`, and rounded to the model dtype
before weighing, as transformers does. Checkpoint names: `mlp.gate` (router),
`mlp.experts.<e>.{gate,up,down}_proj`.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from pagoda.config import ModelArchConfig, MoEConfig
from pagoda.model.arch_spec import ModelArchitecture
from pagoda.model.architectures.qwen3 import Qwen3ForCausalLM
from pagoda.model.decoder_layer import DecoderLayer, GatedMLP
from pagoda.model.moe import SparseMoeBlock, expert_held_elsewhere


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3's stack whose MLPs are `SparseMoeBlock`s, except `arch.moe.dense_mlp_layers`."""

    def make_decoder_layer(self, layer_idx: int) -> nn.Module:
        arch, moe = self.arch, self.arch.moe
        if layer_idx in moe.dense_mlp_layers:
            mlp = GatedMLP(arch.hidden_size, arch.intermediate_size, self.dtype, self.parallel,
                           arch.hidden_act)
        else:
            mlp = SparseMoeBlock(moe.num_experts, moe.num_experts_per_tok, arch.hidden_size,
                                 moe.intermediate_size, moe.norm_topk_prob, self.dtype,
                                 self.parallel, round_weights=True)
        return DecoderLayer(self.make_attention(layer_idx), mlp, arch, self.dtype)

    def held_elsewhere(self, name: str) -> bool:
        return super().held_elsewhere(name) or expert_held_elsewhere(self, name)


def qwen3_moe_arch_config(hf_config: dict, arch: ModelArchConfig) -> ModelArchConfig:
    # Hub checkpoints say num_experts; transformers >= 5 saves num_local_experts.
    num_experts = hf_config.get("num_experts", hf_config.get("num_local_experts", 0))
    step = hf_config.get("decoder_sparse_step", 1)
    only_mlp = set(hf_config.get("mlp_only_layers") or [])
    dense = tuple(i for i in range(arch.num_hidden_layers)
                  if i in only_mlp or num_experts == 0 or (i + 1) % step != 0)
    return dataclasses.replace(arch, moe=MoEConfig(
        num_experts=num_experts, num_experts_per_tok=hf_config["num_experts_per_tok"],
        intermediate_size=hf_config["moe_intermediate_size"],
        norm_topk_prob=bool(hf_config.get("norm_topk_prob", False)), dense_mlp_layers=dense))


ARCHITECTURES = (
    ModelArchitecture("Qwen3MoeForCausalLM", Qwen3MoeForCausalLM,
                      update_arch_config=qwen3_moe_arch_config),
)
