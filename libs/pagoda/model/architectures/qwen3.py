"""Qwen3 (dense): Llama's network with an RMSNorm on every query and key head.

The norms (`self_attn.q_norm`, `self_attn.k_norm`, one weight of `head_dim` each)
run after the q/k projection and before RoPE, as in transformers' `Qwen3Attention`.
Unlike Qwen2 there are no q/k/v biases unless config.json's `attention_bias` says
so. Long-context checkpoints use yarn RoPE scaling (`rotary.py`); `use_sliding_window`
is read by the common parser like any other window. A bare `Qwen3Model` checkpoint is
the stack without LM head: an embedding model (Qwen3-Embedding's layout).
"""

from __future__ import annotations

from torch import nn

from pagoda.model.arch_spec import ModelArchitecture
from pagoda.model.architectures.llama import LlamaForCausalLM
from pagoda.model.decoder_layer import PagedSelfAttention
from pagoda.model.layers import RMSNorm
from pagoda.model.pooling_model import as_pooling_model


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Llama's stack whose attention normalises each q and k head before RoPE."""

    def make_attention(self, layer_idx: int) -> nn.Module:
        bias = self.arch.attention_bias
        return PagedSelfAttention(self.arch, self.dtype, bias, bias, self.parallel,
                                  sliding_window=self.arch.layer_sliding_window(layer_idx),
                                  qk_norm=RMSNorm)


ARCHITECTURES = (
    ModelArchitecture("Qwen3ForCausalLM", Qwen3ForCausalLM),
    ModelArchitecture("Qwen3Model", as_pooling_model(Qwen3ForCausalLM)),
)
