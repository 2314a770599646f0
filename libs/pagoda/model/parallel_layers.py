"""Tensor-parallel layers: each rank holds a slice of a weight, and the collectives
make the slices add up to the whole layer (Megatron's split, vLLM's names).

    ColumnParallelLinear       W_r = rows of W          y_r = x W_r^T      (stays sharded)
      QKVParallelLinear        [q_r; k_r; v_r]: H/T query heads, Hkv/T KV heads (or one
                               KV head, replicated, when Hkv < T)
      MergedColumnParallelLinear  [gate_r; up_r]
    RowParallelLinear          W_r = columns of W      y = sum_r x_r W_r^T (+ b once)
    VocabParallelEmbedding     vocab rows [r V', (r+1) V'), V' = ceil(V / T); masked
                               lookup, then all-reduce (a sum with zeros: exact)
    ParallelLMHead             the same rows; logits gathered at TP rank 0, cut to V

A column-parallel output feeds a row-parallel input directly (attention heads,
SwiGLU), so a decoder layer costs two all-reduces. With T = 1 every layer is the
plain one: same parameter shapes and names, no collective.

Weights load from the full checkpoint tensor: `checkpoint_shape(attr, shard)` is the
shape it must have, `load_weight(attr, shard, full)` copies this rank's slice.
`shard` is the HF name of one part of a fused parameter ("q_proj", "up_proj") or None.
The linear layers keep their weights in whatever form their quantization method
chooses (`LinearBase`); each parameter says which of its axes run along the output
rows and input columns, and how many of them one element packs, so the same slicing
serves a plain weight, packed int4 words and per-group scales.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.distributed.communication import all_reduce, gather
from pagoda.distributed.parallel_state import SINGLE, ParallelContext, kv_head_start
from pagoda.model import cpu_packed_weights
from pagoda.model.batch_invariant_linear import in_fixed_rows
from pagoda.model.layers import Embedding, empty_parameter
from pagoda.model.quantization import new_linear_method
from pagoda.model.quantization.base import LinearMethodBase, Slice, shard_attrs
from pagoda.model.quantization.gguf_int4 import int4_logits


class LinearBase(nn.Module):
    """A linear layer whose weight storage and product belong to its `quant_method`
    (vLLM's pattern): the unquantized method's `weight [out, in]`, or a quantized
    form (`pagoda.model.quantization`: packed int4, fp8, with their scales).

    The method is the one of the quantization being constructed
    (`quantization.new_linear_method`), unquantized by default. Invariant: every
    parameter but `bias` is the method's, tagged with how it shards (`shard_attrs`).
    """

    def __init__(self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype,
                 full_input_size: int | None = None) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.full_input_size = full_input_size or input_size
        self.params_dtype = dtype
        self.set_quant_method(new_linear_method())
        self.bias = (shard_attrs(empty_parameter(output_size, dtype=dtype), 0, None)
                     if bias else None)

    # A `pagoda.lora.layers.LoRALinear` when the engine serves LoRA adapters: its
    # `add_to(x, out)` adds each row's adapter delta (None: the plain layer).
    lora = None

    def _add_lora(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return out if self.lora is None else self.lora.add_to(x, out)

    def set_quant_method(self, method: LinearMethodBase) -> None:
        """Store the weight the way `method` does (dropping any other method's tensors)."""
        for name in [n for n in self._parameters if n != "bias"]:
            delattr(self, name)
        self.quant_method = method
        method.create_weights(self, self.input_size, self.output_size, self.full_input_size,
                              self.params_dtype)


class ColumnParallelLinear(LinearBase):
    """Output rows split across TP ranks; `parts` fuses several checkpoint tensors.

    `parts`: shard name -> (rows of the checkpoint tensor, first row this rank takes,
    rows it takes). The local parameter is the parts' slices stacked in that order.
    Invariant: the local output rows are exactly those slices of the unsharded output.
    """

    def __init__(self, in_features: int, parts: dict[str | None, tuple[int, int, int]],
                 bias: bool, dtype: torch.dtype, parallel: ParallelContext = SINGLE) -> None:
        super().__init__(in_features, sum(rows for _, _, rows in parts.values()), bias, dtype)
        self.in_features = in_features
        self.parts = parts
        self.offsets: dict[str | None, int] = {}
        offset = 0
        for name, (_, _, rows) in parts.items():
            self.offsets[name] = offset
            offset += rows

    @classmethod
    def split(cls, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
              parallel: ParallelContext = SINGLE) -> "ColumnParallelLinear":
        rows = out_features // parallel.tp_size
        return cls(in_features, {None: (out_features, parallel.tp_rank * rows, rows)}, bias,
                   dtype, parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._add_lora(x, self.quant_method.apply(self, x, self.bias))

    def checkpoint_shape(self, attr: str, shard: str | None) -> tuple[int, ...]:
        param = getattr(self, attr)
        shape = list(param.shape)
        if param.output_dim is not None:
            shape[param.output_dim] = -(-self._part(shard)[0] // param.output_pack)
        return self.quant_method.checkpoint_shape(self, attr, tuple(shape))

    def load_weight(self, attr: str, shard: str | None, full: torch.Tensor) -> None:
        _, start, rows = self._part(shard)
        param = getattr(self, attr)
        src: list[Slice] = []
        dst: list[Slice] = []
        if param.output_dim is not None:
            dim, pack, offset = param.output_dim, param.output_pack, self.offsets[shard]
            if start % pack or rows % pack or offset % pack:
                raise ValueError(f"{attr} of {shard or 'the layer'}: rows {start}..{start + rows} "
                                 f"do not fall on the packing of {pack} rows per element")
            src, dst = [(dim, start // pack, rows // pack)], [(dim, offset // pack, rows // pack)]
        self.quant_method.load_weight(self, attr, full, src, dst)

    def _part(self, shard: str | None) -> tuple[int, int, int]:
        if shard not in self.parts:
            raise KeyError(shard)
        return self.parts[shard]


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection: this rank's query heads, then its KV heads' keys, values."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool, dtype: torch.dtype, parallel: ParallelContext = SINGLE) -> None:
        tp, rank = parallel.tp_size, parallel.tp_rank
        self.num_local_heads = num_heads // tp
        self.num_local_kv_heads = max(1, num_kv_heads // tp)
        kv_start = kv_head_start(num_kv_heads, tp, rank)
        q_rows, kv_rows = self.num_local_heads * head_dim, self.num_local_kv_heads * head_dim
        parts = {"q_proj": (num_heads * head_dim, rank * q_rows, q_rows),
                 "k_proj": (num_kv_heads * head_dim, kv_start * head_dim, kv_rows),
                 "v_proj": (num_kv_heads * head_dim, kv_start * head_dim, kv_rows)}
        super().__init__(hidden_size, parts, bias, dtype, parallel)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several equally split projections fused along the output (gate_proj, up_proj)."""

    def __init__(self, in_features: int, out_features: dict[str, int], bias: bool,
                 dtype: torch.dtype, parallel: ParallelContext = SINGLE) -> None:
        tp, rank = parallel.tp_size, parallel.tp_rank
        parts = {name: (rows, rank * (rows // tp), rows // tp)
                 for name, rows in out_features.items()}
        super().__init__(in_features, parts, bias, dtype, parallel)


class RowParallelLinear(LinearBase):
    """Input columns split across TP ranks; partial products summed by an all-reduce.

    The bias is added once, after the sum. Invariant: every TP rank returns the same,
    full output.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 parallel: ParallelContext = SINGLE) -> None:
        super().__init__(in_features // parallel.tp_size, out_features, bias, dtype,
                         full_input_size=in_features)
        self.full_in_features = in_features
        self.parallel = parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return self._add_lora(x, self.quant_method.apply(self, x, self.bias))
        # The LoRA delta of this rank's input columns joins the partial sum.
        out = all_reduce(self._add_lora(x, self.quant_method.apply(self, x)),
                         self.parallel.tp_group)
        return out if self.bias is None else out + self.bias

    def checkpoint_shape(self, attr: str, shard: str | None) -> tuple[int, ...]:
        param = getattr(self, attr)
        shape = list(param.shape)
        if attr != "bias" and param.input_dim is not None:
            shape[param.input_dim] *= self.parallel.tp_size
        return self.quant_method.checkpoint_shape(self, attr, tuple(shape))

    def load_weight(self, attr: str, shard: str | None, full: torch.Tensor) -> None:
        param = getattr(self, attr)
        src: list[Slice] = []
        if attr != "bias" and param.input_dim is not None:
            cols = param.shape[param.input_dim]
            src = [(param.input_dim, self.parallel.tp_rank * cols, cols)]
        self.quant_method.load_weight(self, attr, full, src, [])


class VocabParallelEmbedding(Embedding):
    """Token embedding whose vocabulary rows are split across TP ranks.

    Each rank holds `ceil(V / T)` rows; rows past V (on the last rank) are zero
    padding and never looked up.
    """

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 parallel: ParallelContext = SINGLE) -> None:
        rows = -(-vocab_size // parallel.tp_size)
        super().__init__(rows, hidden_size, dtype)
        self.vocab_size = vocab_size
        self.vocab_start = parallel.tp_rank * rows
        self.parallel = parallel
        # Batch-invariant mode: the logits product runs in calls of this many rows
        # (`batch_invariant_linear.fix_linear_rows` sets it); None: one call.
        self.fixed_rows: int | None = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0)
        return all_reduce(out, self.parallel.tp_group)

    def checkpoint_shape(self, attr: str, shard: str | None) -> tuple[int, ...]:
        return (self.vocab_size, self.weight.shape[1])

    def load_weight(self, attr: str, shard: str | None, full: torch.Tensor) -> None:
        rows = max(0, min(self.weight.shape[0], self.vocab_size - self.vocab_start))
        self.weight[rows:].zero_()
        self.weight[:rows].copy_(full.narrow(0, self.vocab_start, rows))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [N, H] -> logits [N, V] in fp32 (matmul in the model dtype).

        Under TP the slices are gathered at TP rank 0, the one rank that samples;
        the others take part in the gather and get None.
        """
        logits = int4_logits(self, hidden)  # a GGUF 4-bit head in a small CPU step
        if logits is None:
            packed = self._buffers.get("packed_weight")  # a tied head's packed copy
            weight = self.weight if packed is None else packed
            if self.fixed_rows is None:
                logits = cpu_packed_weights.linear(hidden, weight)
            else:  # batch-invariant mode: see batch_invariant_linear
                logits = in_fixed_rows(lambda rows: cpu_packed_weights.linear(rows, weight),
                                       hidden, self.fixed_rows)
        parallel = self.parallel
        if parallel.tp_size > 1:
            logits = gather(logits, parallel.tp_group, parallel.tp_size, parallel.tp_rank)
            if logits is None:
                return None
            logits = logits[:, :self.vocab_size]
        return logits.float()


class ParallelLMHead(VocabParallelEmbedding):
    """The untied LM head (or, on a last pipeline stage, a copy of the tied embedding):
    split like the embedding, used only through `compute_logits`."""
