"""ColBERT (`HF_ColBERT`, the architecture name Stanford's colbert checkpoints carry,
as vLLM recognises them): a BERT encoder and a bias-free linear projection of every
token's hidden state to `colbert_dim` (config.json's `colbert_dim`, `dim` or
`projection_dim`, the names vLLM reads).

It is a late-interaction model: its task is `token_embed`, one L2-normalised embedding
per prompt token (the pooler's ALL pooling); a query and a document are scored by
MaxSim (`pagoda.score_utils.maxsim`), never as a pair in one prompt.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from pagoda.config import ModelArchConfig
from pagoda.model.arch_spec import ModelArchitecture, family_settings
from pagoda.model.architectures.bert import BertModel, BertSettings, bert_arch_config
from pagoda.model.layers import Linear

_DIM_KEYS = ("colbert_dim", "dim", "projection_dim")


@dataclass(frozen=True)
class ColBERTSettings(BertSettings):
    """BERT's settings and the projection's output size."""

    colbert_dim: int = 0

    @classmethod
    def from_hf_config(cls, hf_config: dict, arch: ModelArchConfig) -> ColBERTSettings:
        dim = next((hf_config[k] for k in _DIM_KEYS if hf_config.get(k)), None)
        if dim is None:
            raise ValueError("ColBERT dimension not found in model config. Expected one of: "
                             "'colbert_dim', 'dim', or 'projection_dim'.")
        base = BertSettings.from_hf_config(hf_config, arch)
        return cls(base.type_vocab_size, base.layer_norm_eps, base.position_offset, int(dim))


class ColBERTModel(nn.Module):
    """BERT hidden states [T, hidden]; `project_tokens` maps them to [T, colbert_dim]."""

    is_pooling_model = True
    is_encoder = True
    default_pooling_type = "ALL"
    pooling_task = "token_embed"
    packed_modules_mapping = BertModel.packed_modules_mapping

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype, parallel=None) -> None:
        super().__init__()
        self.arch = arch
        self.bert = BertModel(arch, dtype, parallel)
        self.linear = Linear(arch.hidden_size, self.embedding_size(arch), False, dtype)

    @staticmethod
    def embedding_size(arch: ModelArchConfig) -> int:
        return family_settings(arch, ColBERTSettings).colbert_dim

    def forward(self, input_ids, positions, kv_caches, attn_metadata, intermediate=None,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.bert(input_ids, positions, kv_caches, attn_metadata,
                         token_type_ids=token_type_ids)

    def project_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear(hidden)

    def needs_checkpoint_tensor(self, name: str) -> bool:
        return True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """`bert.*` (or bare BERT names) to the encoder; `linear.weight` (or
        `colbert_linear.weight`) to the projection."""
        encoder = []
        for name, tensor in weights:
            bare = name.removeprefix("model.").removeprefix("bert.")
            if bare in ("linear.weight", "colbert_linear.weight"):
                with torch.no_grad():
                    self.linear.weight.copy_(tensor.to(self.linear.weight.dtype))
            else:
                encoder.append((bare, tensor))
        self.bert.load_weights(encoder)


ARCHITECTURES = (
    ModelArchitecture("HF_ColBERT", ColBERTModel, update_arch_config=bert_arch_config,
                      settings=ColBERTSettings),
)
