"""XLM-RoBERTa (`XLMRobertaModel`): BERT's encoder whose positions start after the
padding index, served as a pooling model (bge-m3, multilingual-e5).

The network and the checkpoint names are BERT's (`bert.py`); only the position ids
differ. transformers numbers a prompt's tokens from `padding_idx + 1`
(`create_position_ids_from_input_ids`: padding_idx = config.json's `pad_token_id`,
1 in every released checkpoint), so its table of `max_position_embeddings` rows (514)
holds `max_position_embeddings - padding_idx - 1` positions (512). The config hook
records that length as the model's `max_position_embeddings` and the offset in the
family settings; `BertEmbeddings` adds it. The pooling is the sentence-transformers
folder's (CLS for bge-m3, mean for multilingual-e5), else CLS.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pagoda.config import ModelArchConfig
from pagoda.model.arch_spec import ModelArchitecture
from pagoda.model.architectures.bert import BertModel, BertSettings, bert_arch_config

DEFAULT_PADDING_IDX = 1  # XLMRobertaConfig's pad_token_id


@dataclass(frozen=True)
class XLMRobertaSettings(BertSettings):
    """BERT's settings; `position_offset` is padding_idx + 1."""

    @classmethod
    def from_hf_config(cls, hf_config: dict, arch: ModelArchConfig) -> XLMRobertaSettings:
        return cls(hf_config.get("type_vocab_size", 2), hf_config.get("layer_norm_eps", 1e-12),
                   _position_offset(hf_config))


def _position_offset(hf_config: dict) -> int:
    padding_idx = hf_config.get("pad_token_id")
    return (DEFAULT_PADDING_IDX if padding_idx is None else int(padding_idx)) + 1


def xlm_roberta_arch_config(hf_config: dict, arch: ModelArchConfig) -> ModelArchConfig:
    """BERT's hook, and the positions a prompt can use (the rows after the offset)."""
    arch = bert_arch_config(hf_config, arch)
    positions = arch.max_position_embeddings - _position_offset(hf_config)
    if positions <= 0:
        raise ValueError(f"XLM-RoBERTa with max_position_embeddings="
                         f"{arch.max_position_embeddings} leaves no position after its "
                         f"padding index")
    return dataclasses.replace(arch, max_position_embeddings=positions)


ARCHITECTURES = (
    ModelArchitecture("XLMRobertaModel", BertModel, update_arch_config=xlm_roberta_arch_config,
                      settings=XLMRobertaSettings),
)
