"""Mistral: Llama's network with sliding-window attention.

Mistral 7B v0.1 attends to the last `sliding_window` (4096) tokens in every layer;
later versions set no window and are Llama exactly. The window comes from config.json
(`ModelArchConfig.layer_sliding_window`), so the Llama model class runs both; since
every layer slides, the KV cache frees blocks that fall out of the window
(`CacheConfig.sliding_window`). llama.cpp writes Mistral GGUFs as "llama" and keeps
no window, so a GGUF Mistral attends to its whole context.
"""

from __future__ import annotations

from pagoda.model.arch_spec import ModelArchitecture
from pagoda.model.architectures.llama import LLAMA_GGUF_LAYOUT, LlamaForCausalLM

ARCHITECTURES = (
    ModelArchitecture("MistralForCausalLM", LlamaForCausalLM,
                      gguf_layouts={"llama": LLAMA_GGUF_LAYOUT}),
)
