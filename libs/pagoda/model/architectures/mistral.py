"""Mistral: Llama's network with sliding-window attention.

Mistral 7B v0.1 attends to the last `sliding_window` (4096) tokens in every layer;
later versions set no window and are Llama exactly. The window comes from config.json
(`ModelArchConfig.layer_sliding_window`), so the Llama model class runs both; since
every layer slides, the KV cache frees blocks that fall out of the window
(`CacheConfig.sliding_window`). llama.cpp writes Mistral GGUFs as "llama" and keeps
no window, so a GGUF Mistral attends to its whole context.

A bare `MistralModel` checkpoint (e5-mistral-7b-instruct, vLLM's embedding example) is
the stack without LM head: an embedding model, last-token pooled unless its
sentence-transformers files say otherwise (`pooler_config`).
"""

from __future__ import annotations

from pagoda.model.arch_spec import ModelArchitecture
from pagoda.model.architectures.llama import LLAMA_GGUF_LAYOUT, LlamaForCausalLM
from pagoda.model.pooling_model import as_pooling_model

ARCHITECTURES = (
    ModelArchitecture("MistralForCausalLM", LlamaForCausalLM,
                      gguf_layouts={"llama": LLAMA_GGUF_LAYOUT}),
    ModelArchitecture("MistralModel", as_pooling_model(LlamaForCausalLM)),
)
