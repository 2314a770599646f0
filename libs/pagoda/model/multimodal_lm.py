"""What a vision-language model adds to its text model for the model runner.

`MultiModalLM` is mixed in before a decoder family's `*ForCausalLM` (LLaVA and Idefics3
over Llama, Qwen2-VL over Qwen2). The family class keeps its own `embed_multimodal`
(the encoder) and weight loading; this mixin gives the two calls every such model answers
the same way:

* `forward(..., inputs_embeds=)`: the text stack over the given embeddings (the text
  embeddings with the encoder rows scattered into the placeholder positions) instead of
  looking `input_ids` up;
* `embed_input_ids(input_ids)`: the text model's own embedding lookup.

Invariant: a model with `supports_multimodal` runs on a single device. The vision encoders
are not split across ranks and a worker group's step wire does not carry image tensors, so
`single_device_only` refuses a tensor- or pipeline-parallel group by name.
"""

from __future__ import annotations

import torch

from pagoda.config import ModelArchConfig
from pagoda.distributed.parallel_state import SINGLE, ParallelContext
from pagoda.model.attention_metadata import AttentionMetadata
from pagoda.model.decoder_layer import KVCache
from pagoda.model.intermediate_tensors import IntermediateTensors


def single_device_only(arch: ModelArchConfig, parallel: ParallelContext | None
                       ) -> ParallelContext:
    """`parallel` (SINGLE for None); ValueError naming the architecture for a group."""
    parallel = parallel or SINGLE
    if parallel.world_size > 1:
        raise ValueError(f"{arch.architecture} is not supported with tensor or pipeline "
                         "parallelism (single device only)")
    return parallel


class MultiModalLM:
    """The model runner's multi-modal calls on a `*ForCausalLM` whose text model is
    `self.model` (see the module docstring)."""

    supports_multimodal = True

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], attn_metadata: AttentionMetadata,
                intermediate: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None
                ) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, kv_caches, attn_metadata, intermediate,
                          inputs_embeds=inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(input_ids)
