"""DeepSeek-V3's multi-token-prediction (MTP) layer, run as a draft head (vLLM's
`{"method": "mtp"}`, model `DeepSeekMTP`).

The checkpoint stores it after the decoder's layers, as `model.layers.<N>.*` with
N = num_hidden_layers: a decoder layer of the model's own kind (MLA, and MoE or a
dense MLP as layer N's index says) plus

    enorm, hnorm        RMSNorms of the token embedding and of the previous hidden state
    eh_proj             [hidden, 2 * hidden], no bias
    shared_head.norm    the final norm of the head
    shared_head.head    its vocabulary projection (absent: the model's lm_head)
    embed_tokens        its token embedding (absent: the model's)

For position t, with h_t the target's last hidden state *before* the final norm and
x the token at t + 1:

    h' = eh_proj([enorm(embed(x)) ; hnorm(h_t)])      (the embedding zeroed at position 0)
    h'' = decoder_layer(h') + its residual             (attention over the MTP layer's
                                                         own cache, at position t)
    logits = shared_head.head(shared_head.norm(h''))   -> the token at t + 2

Invariant: parameter names are the checkpoint's (this layer sits at index N of
`model.layers`), so every MTP tensor loads by name like a decoder layer's.
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.config import ModelArchConfig
from pagoda.model.attention_metadata import AttentionMetadata
from pagoda.model.decoder_layer import DecoderLayer, KVCache, fused_add_norm
from pagoda.model.layers import Linear, RMSNorm
from pagoda.model.parallel_layers import ParallelLMHead, VocabParallelEmbedding

# The checkpoint tensors of an MTP layer that are not its decoder layer's.
MTP_OWN_TENSORS = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")


class SharedHead(nn.Module):
    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype, parallel) -> None:
        super().__init__()
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.head = ParallelLMHead(arch.vocab_size, arch.hidden_size, dtype, parallel)


class DeepseekMTPLayer(DecoderLayer):
    """One MTP layer: the decoder layer it extends plus its input and output heads."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, arch: ModelArchConfig,
                 dtype: torch.dtype, parallel) -> None:
        super().__init__(self_attn, mlp, arch, dtype)
        hidden = arch.hidden_size
        self.enorm = RMSNorm(hidden, arch.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(hidden, arch.rms_norm_eps, dtype)
        self.eh_proj = Linear(2 * hidden, hidden, False, dtype)
        self.shared_head = SharedHead(arch, dtype, parallel)
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, hidden, dtype, parallel)

    def predict(self, input_ids: torch.Tensor, positions: torch.Tensor,
                previous_hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: KVCache, md: AttentionMetadata) -> torch.Tensor:
        """input_ids [T] (the token after each position), positions [T], previous_hidden
        [T, hidden] -> this layer's hidden state [T, hidden] (before shared_head.norm:
        what the next draft step takes as its previous hidden state)."""
        embeds = self.embed_tokens(input_ids)
        # As vLLM: the embedding at position 0 is masked (MTP does not need it there).
        embeds = embeds.masked_fill((positions == 0)[:, None], 0)
        embeds, _ = fused_add_norm(self.enorm, embeds, None)
        previous, _ = fused_add_norm(self.hnorm, previous_hidden, None)
        hidden = self.eh_proj(torch.cat([embeds, previous], dim=-1))
        out, residual = self(hidden, None, cos, sin, kv_cache, md)
        return out + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This layer's hidden state [N, hidden] -> logits [N, vocab] in fp32."""
        normed, _ = fused_add_norm(self.shared_head.norm, hidden, None)
        return self.shared_head.head.compute_logits(normed)
