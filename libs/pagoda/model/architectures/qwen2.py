"""Qwen2: a Llama whose q/k/v projections always carry biases and whose o_proj has none.

Its config.json has no flag for the biases, so `update_arch_config` sets
`attention_bias`; llama.cpp stores Q/K unpermuted for "qwen2". A bare `Qwen2Model`
checkpoint (gte-Qwen2) is the stack without LM head: an embedding model.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from pagoda.config import ModelArchConfig
from pagoda.model.arch_spec import ModelArchitecture
from pagoda.model.architectures.llama import LLAMA_GGUF_LAYOUT, LlamaForCausalLM
from pagoda.model.decoder_layer import PagedSelfAttention
from pagoda.model.pooling_model import as_pooling_model


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama's stack with Qwen2's attention biases (q/k/v yes, o_proj no)."""

    def make_attention(self, layer_idx: int) -> nn.Module:
        return PagedSelfAttention(self.arch, self.dtype, qkv_bias=True, o_proj_bias=False,
                                  parallel=self.parallel,
                                  sliding_window=self.arch.layer_sliding_window(layer_idx))


def qwen2_arch_config(hf_config: dict, arch: ModelArchConfig) -> ModelArchConfig:
    return dataclasses.replace(arch, attention_bias=True)


QWEN2_GGUF_LAYOUT = dataclasses.replace(LLAMA_GGUF_LAYOUT, rotary_rows_permuted=False)

ARCHITECTURES = (
    ModelArchitecture("Qwen2ForCausalLM", Qwen2ForCausalLM, update_arch_config=qwen2_arch_config,
                      gguf_layouts={"qwen2": QWEN2_GGUF_LAYOUT}),
    ModelArchitecture("Qwen2Model", as_pooling_model(Qwen2ForCausalLM),
                      update_arch_config=qwen2_arch_config),
)
