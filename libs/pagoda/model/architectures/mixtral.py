"""Mixtral: Mistral's attention with a sparse mixture-of-experts MLP in every layer.

Each layer's MLP is `pagoda.model.moe.SparseMoeBlock`: a router over
`num_local_experts` experts and the top `num_experts_per_tok` of them per token, their
weights always renormalised to sum to 1 (the shared `MoEConfig`). Checkpoints name the block
`block_sparse_moe` and an expert's projections `w1` (gate), `w3` (up), `w2` (down);
the module is called `mlp` here (as in transformers >= 5), so names are mapped on load.
Under tensor parallelism the experts are split like a dense MLP, or placed whole on
the ranks with `enable_expert_parallel` (see `moe.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pagoda.config import ModelArchConfig, MoEConfig
from pagoda.model.arch_spec import ModelArchitecture
from pagoda.model.architectures.llama import LlamaForCausalLM
from pagoda.model.decoder_layer import DecoderLayer
from pagoda.model.moe import SparseMoeBlock, expert_held_elsewhere


class MixtralForCausalLM(LlamaForCausalLM):
    """Llama's stack whose MLPs are `SparseMoeBlock`s (w1/w3/w2 expert tensors).

    Invariant: a rank reads only the expert tensors it holds (under expert
    parallelism the others are skipped unread).
    """

    def make_decoder_layer(self, layer_idx: int) -> nn.Module:
        arch, moe = self.arch, self.arch.moe
        mlp = SparseMoeBlock(moe.num_experts, moe.num_experts_per_tok, arch.hidden_size,
                             moe.intermediate_size, moe.norm_topk_prob, self.dtype,
                             self.parallel, checkpoint_names=("w1", "w3", "w2"))
        return DecoderLayer(self.make_attention(layer_idx), mlp, arch, self.dtype)

    def held_elsewhere(self, name: str) -> bool:
        return super().held_elsewhere(name) or expert_held_elsewhere(self, name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_moe_block_as_mlp(weights))


def _moe_block_as_mlp(weights: Iterable[tuple[str, torch.Tensor]]
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        yield name.replace(".block_sparse_moe.", ".mlp."), tensor


def mixtral_arch_config(hf_config: dict, arch: ModelArchConfig) -> ModelArchConfig:
    """Every layer routes; each expert is as wide as the model's dense MLP."""
    return dataclasses.replace(arch, moe=MoEConfig(
        num_experts=hf_config["num_local_experts"],
        num_experts_per_tok=hf_config["num_experts_per_tok"],
        intermediate_size=arch.intermediate_size, norm_topk_prob=True))


ARCHITECTURES = (
    ModelArchitecture("MixtralForCausalLM", MixtralForCausalLM,
                      update_arch_config=mixtral_arch_config),
)
