"""BERT: a bidirectional encoder, served as a pooling model (embeddings, cross-encoders).

    tokens ─ word + position + token-type embeddings ─ LayerNorm
           ─ N x [ attention ─(+)─ LayerNorm ─ GELU MLP ─(+)─ LayerNorm ]  (post-norm)
           ─ hidden states [T, hidden] ─► the engine's pooler (CLS / MEAN)

`BertModel` is the encoder whose hidden states are pooled into an embedding
(sentence-transformers checkpoints such as all-MiniLM-L6-v2); the checkpoint's own
pooler layer is not used for embeddings. `BertForSequenceClassification` adds that
pooler (dense + tanh on [CLS]) and a linear classifier: a cross-encoder's
`classify` turns the pooled [CLS] state into label logits.

Attention is `encoder_attention`: each request's tokens see all of its tokens and no
KV cache is kept (`is_encoder`), so a request's prompt must run whole in one step.
Parameter names follow the checkpoint's, except q/k/v, fused into `qkv_proj`
(`attention.self.query` -> `attention.q_proj`, see `_our_name`). Under tensor
parallelism heads and MLP columns are split like a decoder's (`parallel_layers`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.config import ModelArchConfig
from pagoda.distributed.parallel_state import SINGLE, ParallelContext
from pagoda.model.arch_spec import ModelArchitecture, family_settings
from pagoda.model.attention_metadata import AttentionMetadata
from pagoda.model.encoder_attention import check_whole_prompts, encoder_attention
from pagoda.model.layers import Embedding, Linear, empty_parameter
from pagoda.model.parallel_layers import (ColumnParallelLinear, QKVParallelLinear,
                                          RowParallelLinear, VocabParallelEmbedding)
from pagoda.model.weight_names import load_named_weights

_ACTIVATIONS = {"gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}
# Checkpoint tensors computed rather than loaded (transformers saves the position ids).
_IGNORED = ("embeddings.position_ids",)


@dataclass(frozen=True)
class BertSettings:
    """`type_vocab_size`: segment (token type) embeddings; `layer_norm_eps`: the epsilon of
    every LayerNorm; `position_offset`: the position-embedding row of a prompt's first
    token (0 for BERT; RoBERTa's rows start after its padding index, `xlm_roberta.py`).
    The position table then has `max_position_embeddings + position_offset` rows."""

    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    position_offset: int = 0

    @classmethod
    def from_hf_config(cls, hf_config: dict, arch: ModelArchConfig) -> BertSettings:
        return cls(hf_config.get("type_vocab_size", 2), hf_config.get("layer_norm_eps", 1e-12))


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias (BERT's); statistics in fp32."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = empty_parameter(hidden_size, dtype=dtype)
        self.bias = empty_parameter(hidden_size, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), (x.shape[-1],), self.weight.float(), self.bias.float(),
                            self.eps).to(x.dtype)


class BertEmbeddings(nn.Module):
    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype, parallel: ParallelContext) -> None:
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, dtype,
                                                      parallel)
        settings = family_settings(arch, BertSettings)
        self.position_offset = settings.position_offset
        self.position_embeddings = Embedding(arch.max_position_embeddings + self.position_offset,
                                             arch.hidden_size, dtype)
        self.token_type_embeddings = Embedding(max(settings.type_vocab_size, 1), arch.hidden_size,
                                               dtype)
        self.LayerNorm = LayerNorm(arch.hidden_size, settings.layer_norm_eps, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor) -> torch.Tensor:
        hidden = (self.word_embeddings(input_ids)
                  + self.position_embeddings(positions + self.position_offset)
                  + self.token_type_embeddings(token_type_ids))
        return self.LayerNorm(hidden)


class BertOutput(nn.Module):
    """dense, then LayerNorm of it plus the residual (HF's BertSelfOutput / BertOutput)."""

    def __init__(self, in_features: int, hidden_size: int, eps: float, dtype: torch.dtype,
                 parallel: ParallelContext) -> None:
        super().__init__()
        self.dense = RowParallelLinear(in_features, hidden_size, True, dtype, parallel)
        self.LayerNorm = LayerNorm(hidden_size, eps, dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    """This rank's heads of bidirectional self-attention, then the output block."""

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype, parallel: ParallelContext) -> None:
        super().__init__()
        self.head_dim = arch.head_dim
        self.scale = arch.head_dim ** -0.5
        heads = arch.num_attention_heads
        self.qkv_proj = QKVParallelLinear(arch.hidden_size, arch.head_dim, heads, heads, True,
                                          dtype, parallel)
        self.num_heads = self.qkv_proj.num_local_heads
        self.output = BertOutput(heads * arch.head_dim, arch.hidden_size,
                                 family_settings(arch, BertSettings).layer_norm_eps, dtype,
                                 parallel)

    def forward(self, hidden: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).view(num_tokens, 3 * self.num_heads, self.head_dim) \
            .split(self.num_heads, dim=1)
        out = encoder_attention(q, k, v, md, self.scale)
        return self.output(out.reshape(num_tokens, -1), hidden)


class BertIntermediate(nn.Module):
    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype, parallel: ParallelContext) -> None:
        super().__init__()
        if arch.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"Unsupported hidden_act {arch.hidden_act!r} for BERT; supported: "
                             f"{', '.join(_ACTIVATIONS)}")
        self.act = _ACTIVATIONS[arch.hidden_act]
        self.dense = ColumnParallelLinear.split(arch.hidden_size, arch.intermediate_size, True,
                                                dtype, parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype, parallel: ParallelContext) -> None:
        super().__init__()
        self.attention = BertAttention(arch, dtype, parallel)
        self.intermediate = BertIntermediate(arch, dtype, parallel)
        self.output = BertOutput(arch.intermediate_size, arch.hidden_size,
                                 family_settings(arch, BertSettings).layer_norm_eps, dtype,
                                 parallel)

    def forward(self, hidden: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        attended = self.attention(hidden, md)
        return self.output(self.intermediate(attended), attended)


class BertEncoder(nn.Module):
    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype, parallel: ParallelContext) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(arch, dtype, parallel)
                                   for _ in range(arch.num_hidden_layers))


class BertPooler(nn.Module):
    """tanh(dense(h)) of the [CLS] state: the sentence vector a classifier reads."""

    def __init__(self, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = Linear(hidden_size, hidden_size, True, dtype)

    def forward(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(cls_hidden))


class BertModel(nn.Module):
    """The encoder: input ids -> last hidden states [T, hidden] (no final pooling).

    Invariant: it reads no KV cache and needs each request's whole prompt in the step
    (checked); token types are 0 unless `token_type_ids` says otherwise. With
    `add_pooling_layer` it also holds the checkpoint's pooler (`pooler`).
    """

    is_pooling_model = True
    is_encoder = True
    default_pooling_type = "CLS"
    packed_modules_mapping = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype,
                 parallel: ParallelContext | None = None, add_pooling_layer: bool = False) -> None:
        super().__init__()
        parallel = parallel or SINGLE
        if parallel.pp_size > 1:
            raise ValueError("BERT runs without pipeline parallelism (--pipeline-parallel-size 1)")
        self.arch = arch
        self.embeddings = BertEmbeddings(arch, dtype, parallel)
        self.encoder = BertEncoder(arch, dtype, parallel)
        self.pooler = BertPooler(arch.hidden_size, dtype) if add_pooling_layer else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                attn_metadata: AttentionMetadata, intermediate=None,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        check_whole_prompts(attn_metadata)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        hidden = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.encoder.layer:
            hidden = layer(hidden, attn_metadata)
        return hidden

    def needs_checkpoint_tensor(self, name: str) -> bool:
        return True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill parameters from HF-named tensors (with or without a `bert.` prefix); the
        checkpoint's pooler is skipped unless this model holds one."""
        renamed = ((_our_name(name.removeprefix("bert.")), tensor)
                   for name, tensor in _without_ignored(weights))
        load_named_weights(self, (item for item in renamed
                                  if self.pooler is not None or not item[0].startswith("pooler.")),
                           skip_lm_head=False)


class BertForSequenceClassification(nn.Module):
    """A BERT cross-encoder / classifier: `classify(cls_hidden)` -> logits [B, num_labels]."""

    is_pooling_model = True
    is_encoder = True
    default_pooling_type = "CLS"
    packed_modules_mapping = BertModel.packed_modules_mapping

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype,
                 parallel: ParallelContext | None = None) -> None:
        super().__init__()
        self.arch = arch
        self.bert = BertModel(arch, dtype, parallel, add_pooling_layer=True)
        self.classifier = Linear(arch.hidden_size, arch.num_labels, True, dtype)

    def forward(self, input_ids, positions, kv_caches, attn_metadata, intermediate=None,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.bert(input_ids, positions, kv_caches, attn_metadata,
                         token_type_ids=token_type_ids)

    def classify(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.bert.pooler(cls_hidden))

    def classify_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """The linear head on every token (vLLM's token_classify: no BERT pooler)."""
        return self.classifier(hidden)

    def needs_checkpoint_tensor(self, name: str) -> bool:
        return True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_named_weights(self, ((_our_name(n), t) for n, t in _without_ignored(weights)),
                           skip_lm_head=False)


def _our_name(hf_name: str) -> str:
    """HF's `attention.self.query` -> our `attention.q_proj` (fused into qkv_proj on load)."""
    for hf, ours in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj")):
        hf_name = hf_name.replace(f".attention.self.{hf}.", f".attention.{ours}.")
    return hf_name


def _without_ignored(weights: Iterable[tuple[str, torch.Tensor]]
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    return ((n, t) for n, t in weights if not n.endswith(_IGNORED))


def bert_arch_config(config: dict, arch: ModelArchConfig) -> ModelArchConfig:
    """BERT's activation (GELU unless named); only absolute position embeddings are
    supported."""
    kind = config.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise ValueError(f"BERT with position_embedding_type={kind!r} is not supported "
                         "(only 'absolute')")
    return dataclasses.replace(arch, hidden_act=config.get("hidden_act", "gelu"))


def bert_classifier_arch_config(config: dict, arch: ModelArchConfig) -> ModelArchConfig:
    """A classifier's outputs: `num_labels`, else one per `id2label` entry."""
    num_labels = config.get("num_labels") or len(config.get("id2label") or {}) or 2
    return dataclasses.replace(bert_arch_config(config, arch), num_labels=num_labels)


ARCHITECTURES = (
    ModelArchitecture("BertModel", BertModel, update_arch_config=bert_arch_config,
                      settings=BertSettings),
    ModelArchitecture("BertForSequenceClassification", BertForSequenceClassification,
                      update_arch_config=bert_classifier_arch_config, settings=BertSettings),
)
