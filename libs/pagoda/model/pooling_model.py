"""A generative decoder run as a pooling model (`--runner pooling` on a *ForCausalLM).

Embedding models built on decoders (Qwen3-Embedding, e5-mistral, gte-Qwen2) keep their
base architecture's config but pool the last token's hidden state instead of
predicting the next token (vLLM's `as_embedding_model`). The adapted class is the
architecture's own class without its LM head, loading either checkpoint layout:
`*ForCausalLM` (`model.layers.0...`, and `lm_head`, which is skipped) or the bare
`*Model` one (`layers.0...`), whose names get the `model.` prefix. A bare checkpoint's
architecture name (`MistralModel`, `Qwen2Model`, ...) is registered to the adapted
class itself (its family's file), so it only pools and `--runner auto` picks pooling.

Encoders (`architectures/bert.py`) are pooling models already (`is_pooling_model`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

_ADAPTED: dict[type, type] = {}


class _PoolingDecoder:
    """Mixed in before the decoder class: no LM head, last-token pooling by default."""

    is_pooling_model = True
    is_encoder = False
    default_pooling_type = "LAST"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if hasattr(self, "lm_head"):  # a pooling model never computes logits
            del self.lm_head

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((name if name.startswith("model.") else f"model.{name}", tensor)
                             for name, tensor in weights if not name.startswith("lm_head."))


def as_pooling_model(model_cls: type) -> type:
    """`model_cls` when it pools already, else its pooling form (one class per decoder)."""
    if getattr(model_cls, "is_pooling_model", False):
        return model_cls
    if model_cls not in _ADAPTED:
        _ADAPTED[model_cls] = type(f"{model_cls.__name__}ForEmbedding",
                                   (_PoolingDecoder, model_cls), {})
    return _ADAPTED[model_cls]
