"""A decode step's decoder layers in one C++ call on the bf16 CPU path (issue 28).

At one row a decode step of SmolLM2-135M is 30 layers of ~10 small kernels each, and
the Python around them (module calls, the `ops` kernel switches, views, the int4
method's checks: ~70 interpreter-level calls a layer) cost about as much as the
kernels themselves. `pagoda_cpu::decode_layers` runs the same kernels in the same order
on tensors of the same shapes and strides from one loop in C++, so the hidden states it
returns are bit-equal to the Python loop's (`tests/model/test_cpu_decode_stack.py`
compares them with `torch.equal`, and greedy tokens against transformers).

It applies to a step only when the Python loop would run exactly that chain:
- the model: every layer of the stage a plain `DecoderLayer` of `PagedSelfAttention`
  (no q/k norm, window, soft-cap, sinks or biases) and a SiLU `GatedMLP`, Llama's
  `RMSNorm` with one eps throughout, every linear on GGUF 4-bit weights
  (`gguf_int4.SmallBatchInt4Method`), no LoRA, one TP rank, one RoPE for all layers
  (checked once per model, `FusedDecodeStack.for_model`);
- the step: bf16 on the CPU with the fused kernels loaded, decodes only (one token per
  sequence), no more rows than the int4 product takes, a bf16 KV cache (not fp8), not
  batch-invariant mode, no recurrent state (checked every step, `applies`).
Anything else takes the Python loop. PAGODA_CPU_FUSED_DECODE=0 turns it off.

Invariant: the structure check is made once, on the model's first forward; the model
runner packs the int4 weights and attaches LoRA in `load_model`, before any forward.
The weight tensors themselves are read from the modules at every step (their
`_parameters` / `_buffers` dicts), so reloaded or re-packed weights are always the ones
used.
"""

from __future__ import annotations

import torch

import pagoda.envs as envs
from pagoda.kernels import cpu as cpu_kernels
from pagoda.model import ops
from pagoda.model.attention_metadata import AttentionMetadata
from pagoda.model.decoder_layer import DecoderLayer, GatedMLP, PagedSelfAttention
from pagoda.model.layers import RMSNorm
from pagoda.model.quantization.gguf_int4 import GROUP_SIZE, SmallBatchInt4Method

# A packed layer's (weight, scales) buffers: the skinny GEMV's layout, or torch's int4pack
# (PAGODA_CPU_GEMV=0); `int4_linear` in the C++ file tells them apart by the weight's rank.
_INT4_FORMS = (("gemv_int4_weight", "gemv_int4_scales"), ("int4_weight", "int4_scales_zeros"))


def _int4_buffers(linear) -> tuple[str, str] | None:
    for names in _INT4_FORMS:
        if all(name in linear._buffers for name in names):
            return names
    return None


def _int4_linear_ok(linear) -> bool:
    # Row-parallel layers hold their ParallelContext (they all-reduce under TP).
    parallel = getattr(linear, "parallel", None)
    return (type(linear.quant_method) is SmallBatchInt4Method and linear.bias is None
            and linear.lora is None and (parallel is None or parallel.tp_size == 1)
            and _int4_buffers(linear) is not None)


def _layer_ok(layer) -> bool:
    if type(layer) is not DecoderLayer:
        return False
    attn, mlp = layer.self_attn, layer.mlp
    return (type(attn) is PagedSelfAttention and attn.q_norm is None and attn.sinks is None
            and attn.sliding_window is None and attn.logits_soft_cap is None
            and type(mlp) is GatedMLP and mlp.act_and_mul is ops.silu_and_mul
            and type(layer.input_layernorm) is RMSNorm
            and type(layer.post_attention_layernorm) is RMSNorm
            and all(_int4_linear_ok(linear) for linear in (
                attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)))


class FusedDecodeStack:
    """The stage's layers as `decode_layers` reads them (see the module doc)."""

    def __init__(self, layers: list[DecoderLayer]) -> None:
        first = layers[0].self_attn
        self.num_heads, self.num_kv_heads = first.num_heads, first.num_kv_heads
        self.head_dim, self.scale = first.head_dim, first.scale
        self.eps = layers[0].input_layernorm.eps
        self.max_rows = min(min(layer.self_attn.qkv_proj.quant_method.max_rows,
                                layer.self_attn.o_proj.quant_method.max_rows,
                                layer.mlp.gate_up_proj.quant_method.max_rows,
                                layer.mlp.down_proj.quant_method.max_rows)
                            for layer in layers)
        # Per layer the dicts its tensors live in, in the C++ op's order (kLayerTensors):
        # (dict, key) pairs, read at every step.
        self._sources = []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            self._sources.append((layer.input_layernorm._parameters, "weight"))
            for linear in (attn.qkv_proj, attn.o_proj):
                self._sources.extend((linear._buffers, name) for name in _int4_buffers(linear))
            self._sources.append((layer.post_attention_layernorm._parameters, "weight"))
            for linear in (mlp.gate_up_proj, mlp.down_proj):
                self._sources.extend((linear._buffers, name) for name in _int4_buffers(linear))

    @classmethod
    def for_model(cls, layers: list, uses_local_rope: list[bool]) -> FusedDecodeStack | None:
        """The stack for a stage's `layers`, or None when its Python loop is anything but
        the chain `decode_layers` runs."""
        if not layers or any(uses_local_rope) or not all(_layer_ok(layer) for layer in layers):
            return None
        first = layers[0].self_attn
        same = all(layer.self_attn.num_heads == first.num_heads
                   and layer.self_attn.num_kv_heads == first.num_kv_heads
                   and layer.self_attn.head_dim == first.head_dim
                   and layer.self_attn.scale == first.scale
                   and layer.input_layernorm.eps == layers[0].input_layernorm.eps
                   and layer.post_attention_layernorm.eps == layers[0].input_layernorm.eps
                   for layer in layers)
        return cls(layers) if same else None

    def applies(self, hidden: torch.Tensor, cos: torch.Tensor, md: AttentionMetadata,
                kv_caches: list) -> bool:
        """Whether this step runs through `run` (see the module doc)."""
        rows = hidden.shape[0]
        return (hidden.dim() == 2 and rows <= self.max_rows and md.num_decodes == rows
                and md.num_reqs == rows and not md.batch_invariant and md.state_slots is None
                and cos.dtype == torch.bfloat16 and cpu_kernels.applies(hidden)
                and kv_caches[0][0].dtype == torch.bfloat16
                and md.block_tables.dtype == torch.int32 and md.seq_lens.dtype == torch.int32)

    def run(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
            sin: torch.Tensor, kv_caches: list, md: AttentionMetadata
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """(last MLP output, residual before it): `DecoderLayer.forward` over every layer."""
        weights = [source[key] for source, key in self._sources]
        return cpu_kernels.decode_layers(
            hidden, residual, cos, sin, weights, [kv[0] for kv in kv_caches],
            [kv[1] for kv in kv_caches], md.slot_mapping, md.block_tables, md.seq_lens,
            self.num_heads, self.num_kv_heads, self.head_dim, self.eps, self.scale, GROUP_SIZE)


def enabled() -> bool:
    return bool(envs.get("PAGODA_CPU_FUSED_DECODE"))
