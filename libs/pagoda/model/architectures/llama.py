"""Llama over a paged KV cache; SmolLM2 is the same network (Mistral: `mistral.py`).

The decoder stack and the causal-LM wrapper here are the Llama shape that most HF
decoders share (`model.embed_tokens`, `model.layers.N`, `model.norm`, `lm_head`);
other architectures subclass `LlamaForCausalLM` and change the decoder layer
(`make_attention`, `make_decoder_layer`, both given the layer's index) or the stack
(`model_cls`). Given a `ParallelContext`, the model is one rank's share: its slice
of every matrix (tensor parallelism, `parallel_layers`) and its stage's layers
(pipeline parallelism).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch
from torch import nn

from pagoda.config import ModelArchConfig
from pagoda.distributed.parallel_state import SINGLE, ParallelContext, stage_layer_range
from pagoda.model import cpu_decode_stack
from pagoda.model.arch_spec import GGUFLayout, ModelArchitecture
from pagoda.model.attention_metadata import AttentionMetadata
from pagoda.model.cpu_decode_stack import FusedDecodeStack
from pagoda.model.decoder_layer import (DecoderLayer, GatedMLP, KVCache, PagedSelfAttention,
                                        PPMissingLayer, fused_add_norm)
from pagoda.model.intermediate_tensors import IntermediateTensors
from pagoda.model.layers import RMSNorm
from pagoda.model.parallel_layers import ParallelLMHead, VocabParallelEmbedding
from pagoda.model.pooling_model import as_pooling_model
from pagoda.model.rotary import RotaryEmbedding
from pagoda.model.weight_names import load_named_weights

logger = logging.getLogger(__name__)


class LlamaModel(nn.Module):
    """The decoder stack, or one pipeline stage's contiguous slice of it.

    Invariant: the first stage holds `embed_tokens`, the last holds `norm`; a stage
    holds layers `[start_layer, end_layer)` (built by `make_layer(index)`) and gets one
    KV cache per held layer. Every layer rotates with `rotary_emb`, except the
    sliding-window layers when the architecture gives them their own
    (`local_rotary_emb`: Gemma 3's local base).
    """

    norm_cls: type[RMSNorm] = RMSNorm  # of the final norm
    # Set by a model whose draft heads read the last hidden state before the final norm
    # (DeepSeek's MTP layer): each forward then leaves it in `pre_norm_hidden`.
    keep_pre_norm_hidden: bool = False
    _fused_decode: FusedDecodeStack | None | bool = False  # False: not decided yet

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype, parallel: ParallelContext,
                 make_layer: Callable[[int], nn.Module], rotary_emb: RotaryEmbedding,
                 local_rotary_emb: RotaryEmbedding | None = None) -> None:
        super().__init__()
        self.start_layer, self.end_layer = stage_layer_range(
            arch.num_hidden_layers, parallel.pp_size, parallel.pp_rank)
        self.embed_tokens = (
            VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, dtype, parallel)
            if parallel.is_first_stage else None)
        self.layers = nn.ModuleList(
            make_layer(i) if self.start_layer <= i < self.end_layer else PPMissingLayer()
            for i in range(arch.num_hidden_layers))
        # A plain list: slicing the ModuleList every forward would build a new module.
        self.stage_layers = list(self.layers)[self.start_layer:self.end_layer]
        self.norm = (self.norm_cls(arch.hidden_size, arch.rms_norm_eps, dtype)
                     if parallel.is_last_stage else None)
        self.rotary_emb = rotary_emb
        self.local_rotary_emb = local_rotary_emb
        self.stage_uses_local_rope = [
            local_rotary_emb is not None and arch.layer_sliding_window(i) is not None
            for i in range(self.start_layer, self.end_layer)]

    def fused_decode_stack(self) -> FusedDecodeStack | None:
        """The stage's layers as one C++ call for small decode steps on the bf16 CPU
        path (`cpu_decode_stack`), or None where the Python loop must run; decided on
        the first forward, after the model runner has packed the weights."""
        if self._fused_decode is False:
            self._fused_decode = (
                FusedDecodeStack.for_model(self.stage_layers, self.stage_uses_local_rope)
                if cpu_decode_stack.enabled() else None)
            if self._fused_decode is not None:
                # Said once per model: operators (and the matrix row) see which path decodes.
                logger.info("Decode steps of up to %d rows run the %d decoder layers as one "
                            "C++ call (PAGODA_CPU_FUSED_DECODE=0 keeps the Python loop)",
                            self._fused_decode.max_rows, len(self.stage_layers))
        return self._fused_decode

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings (first stage only); Gemma scales them."""
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], md: AttentionMetadata,
                intermediate: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None
                ) -> torch.Tensor | IntermediateTensors:
        """hidden [T, hidden] after the final norm on the last stage; the stage's
        IntermediateTensors elsewhere. Stages after the first take `intermediate`.
        `inputs_embeds` [T, hidden] replaces the embedding lookup (a multi-modal model's
        text embeddings with its encoder rows scattered in)."""
        if inputs_embeds is not None:
            hidden, residual = inputs_embeds, None
        elif self.embed_tokens is not None:
            hidden, residual = self.embed(input_ids), None
        else:
            hidden, residual = intermediate
        rope = self.rotary_emb(positions, hidden.dtype)
        local_rope = (self.local_rotary_emb(positions, hidden.dtype)
                      if self.local_rotary_emb is not None else None)
        stack = self.fused_decode_stack()
        if stack is not None and stack.applies(hidden, rope[0], md, kv_caches):
            hidden, residual = stack.run(hidden, residual, *rope, kv_caches, md)
        else:
            for layer, kv_cache, local in zip(self.stage_layers, kv_caches,
                                              self.stage_uses_local_rope, strict=True):
                cos, sin = local_rope if local else rope
                hidden, residual = layer(hidden, residual, cos, sin, kv_cache, md)
        if self.norm is None:
            return IntermediateTensors(hidden, residual)
        hidden, pre_norm = fused_add_norm(self.norm, hidden, residual)
        if self.keep_pre_norm_hidden:
            self.pre_norm_hidden = pre_norm
        return hidden


class LlamaForCausalLM(nn.Module):
    """A Llama-shaped causal LM whose attention reads and writes a paged KV cache.

    Invariant: parameters are uninitialised until `load_weights` has filled every
    one of them (it raises otherwise). With tied embeddings the LM head is the
    embedding matrix itself, not a copy, except on a last pipeline stage that does
    not hold the embedding: there `lm_head` is loaded from the embedding's weights.
    Under tensor parallelism every matrix is this rank's slice (`parallel_layers`).
    """

    # Fused parameter -> the HF tensors it stacks, in row order (`weight_names`).
    packed_modules_mapping = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                              "gate_up_proj": ("gate_proj", "up_proj")}
    model_cls: type[LlamaModel] = LlamaModel

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype,
                 parallel: ParallelContext | None = None) -> None:
        super().__init__()
        parallel = parallel or SINGLE
        self.arch = arch
        self.dtype = dtype
        self.parallel = parallel
        self.model = self.model_cls(arch, dtype, parallel, self.make_decoder_layer,
                                    *self.make_rotary_embeddings())
        if parallel.is_last_stage and not (arch.tie_word_embeddings and parallel.is_first_stage):
            self.lm_head = ParallelLMHead(arch.vocab_size, arch.hidden_size, dtype, parallel)

    def make_rotary_embeddings(self) -> tuple[RotaryEmbedding, RotaryEmbedding | None]:
        """(RoPE of every layer, RoPE of the sliding-window layers when theirs differs, else
        None); subclasses change them (Phi-3's partial rotary, Gemma 3's local base)."""
        return rotary_embedding(self.arch), None

    def make_attention(self, layer_idx: int) -> nn.Module:
        # Llama's `attention_bias` covers q/k/v and o_proj alike.
        bias = self.arch.attention_bias
        return PagedSelfAttention(self.arch, self.dtype, bias, bias, self.parallel,
                                  sliding_window=self.arch.layer_sliding_window(layer_idx))

    def make_decoder_layer(self, layer_idx: int) -> nn.Module:
        """Decoder layer `layer_idx` of this rank; subclasses change its attention or MLP."""
        arch = self.arch
        mlp = GatedMLP(arch.hidden_size, arch.intermediate_size, self.dtype, self.parallel,
                       arch.hidden_act)
        return DecoderLayer(self.make_attention(layer_idx), mlp, arch, self.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], attn_metadata: AttentionMetadata,
                intermediate: IntermediateTensors | None = None
                ) -> torch.Tensor | IntermediateTensors:
        """input_ids, positions [T] (flattened as in AttentionMetadata) -> hidden [T, hidden]
        (IntermediateTensors on a stage before the last)."""
        return self.model(input_ids, positions, kv_caches, attn_metadata, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in fp32 (matmul in the model dtype).
        Last stage only. Under TP every rank of the stage must call it (the vocabulary
        slices are gathered); only TP rank 0 gets the logits, the others None."""
        head = self.lm_head if hasattr(self, "lm_head") else self.model.embed_tokens
        return head.compute_logits(hidden)

    def held_elsewhere(self, name: str) -> bool:
        """True for a parameter (or HF weight) name another pipeline stage holds."""
        model = self.model
        if name.startswith("model.layers."):
            index = name.split(".")[2]
            return (index.isdigit() and int(index) < self.arch.num_hidden_layers
                    and not model.start_layer <= int(index) < model.end_layer)
        if name.startswith("model.embed_tokens."):
            return model.embed_tokens is None
        if name.startswith("model.norm."):
            return model.norm is None
        return name.startswith("lm_head.") and not hasattr(self, "lm_head")

    def needs_checkpoint_tensor(self, name: str) -> bool:
        """Whether a loader should read HF weight `name` for this rank at all."""
        return name == "model.embed_tokens.weight" or not self.held_elsewhere(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill parameters from (HF name, tensor) pairs; ValueError on a missing or unknown one."""
        tied = self.arch.tie_word_embeddings
        if tied and hasattr(self, "lm_head"):
            weights = _embedding_as_lm_head(weights)
            tied = False
        load_named_weights(self, weights, skip_lm_head=tied, held_elsewhere=self.held_elsewhere)


def rotary_embedding(arch: ModelArchConfig, rotary_dim: int | None = None) -> RotaryEmbedding:
    """The model's RoPE; a `rotary_dim` below head_dim rotates only the leading dims of
    each head (partial rotary)."""
    return RotaryEmbedding(arch.head_dim, arch.rope_theta, arch.rope_scaling,
                           arch.max_position_embeddings, rotary_dim, arch.max_model_len)


def _embedding_as_lm_head(weights: Iterable[tuple[str, torch.Tensor]]
                          ) -> Iterable[tuple[str, torch.Tensor]]:
    """A tied last stage's LM head is a copy of the embedding (stored or not as lm_head)."""
    for name, tensor in weights:
        if name == "model.embed_tokens.weight":
            yield "lm_head.weight", tensor
        elif name != "lm_head.weight":
            yield name, tensor


# llama.cpp's names for this network. Its "llama" converter permutes Q/K rows (it
# uses the interleaved rotary layout, HF the rotate-half one).
LLAMA_GGUF_LAYOUT = GGUFLayout(
    global_tensors={"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                    "output": "lm_head"},
    layer_tensors={
        "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    },
    rotary_rows_permuted=True,
)

# SmolLM2 checkpoints say LlamaForCausalLM. A bare `LlamaModel` checkpoint (the stack
# without LM head, saved by transformers' AutoModel) only pools: last token by default.
ARCHITECTURES = (
    ModelArchitecture("LlamaForCausalLM", LlamaForCausalLM,
                      gguf_layouts={"llama": LLAMA_GGUF_LAYOUT}),
    ModelArchitecture("LlamaModel", as_pooling_model(LlamaForCausalLM)),
)
