"""Linear products whose rows do not depend on the step's row count (batch-invariant mode).

oneDNN's bf16 GEMM on the CPU (`F.linear` and the prepacked `cpu_packed_weights.linear`
alike: the same kernel) picks its blocking, and with it the order in which it adds up
the K products of an output element, from the number of rows M. Measured on this
2-core Zen 5 (tests/model/test_batch_invariant_linear.py): SmolLM2-135M's down
projection (K = 1,536) gives a row other bits at M = 2..33 than at M = 64, and its
49,152-row LM head at every M below 33. A served request's rows are multiplied in steps
whose M is set by whatever else runs, so its greedy text changed with the batch
(`--batch-invariant` held offline only because the tiny test model's K is too small for
oneDNN to block differently).

For one M, though, a row's result depends on that row alone: not on its position in
the call nor on the other rows. So in batch-invariant mode every product of a linear
layer and of the LM head runs in calls of exactly `FIXED_ROWS` rows: the step's rows
are cut into consecutive chunks and the last is padded with zero rows. Each output
element's reduction is then the one oneDNN does at M = FIXED_ROWS, whatever the batch,
the chunking of a prompt or a prefix-cache hit. (The other per-token operations, the
fused RMSNorm / rotary / SiLU kernels, the embedding and the greedy sampler, already
work row by row in a fixed order; attention is made invariant in `model.attention`.)

Cost: a step of fewer than FIXED_ROWS rows pays for FIXED_ROWS (32 rows take about
three times one row's time here), a larger one one call per chunk. 32 is the
concurrency the serving benchmarks run at, where nothing is padded.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from pagoda.model.quantization.base import LinearMethodBase

logger = logging.getLogger(__name__)
FIXED_ROWS = 32


def in_fixed_rows(product: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                  rows: int = FIXED_ROWS) -> torch.Tensor:
    """`product(x)` for x [..., K], calling `product` only on dense [rows, K] tensors."""
    flat = x.reshape(-1, x.shape[-1])
    num_rows = flat.shape[0]
    padded_rows = max(-(-num_rows // rows), 1) * rows
    if padded_rows != num_rows:
        padded = flat.new_zeros(padded_rows, flat.shape[-1])
        padded[:num_rows] = flat
        flat = padded
    else:
        flat = flat.contiguous()
    chunks = [product(flat[start:start + rows]) for start in range(0, padded_rows, rows)]
    out = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
    return out[:num_rows].reshape(*x.shape[:-1], out.shape[-1])


class FixedRowsLinearMethod(LinearMethodBase):
    """Wraps a loaded layer's method: `apply` multiplies in calls of `FIXED_ROWS` rows,
    so a row's output depends on that row only (the module docstring)."""

    def __init__(self, base: LinearMethodBase) -> None:
        self.base = base

    def create_weights(self, layer, input_size, output_size, full_input_size, params_dtype):
        self.base.create_weights(layer, input_size, output_size, full_input_size, params_dtype)

    def checkpoint_shape(self, layer, attr, shape):
        return self.base.checkpoint_shape(layer, attr, shape)

    def load_weight(self, layer, attr, full, src, dst):
        self.base.load_weight(layer, attr, full, src, dst)

    def process_weights_after_loading(self, layer):
        self.base.process_weights_after_loading(layer)

    def apply(self, layer, x, bias=None):
        return in_fixed_rows(lambda rows: self.base.apply(layer, rows, bias), x)


def fix_linear_rows(model: nn.Module, logits_head: nn.Module | None) -> int:
    """Switch every linear layer of a loaded `model` to `FixedRowsLinearMethod` and make
    `logits_head.compute_logits` multiply in fixed-size calls too; returns the number
    of layers switched. Runs after loading (the weights stay as they are) and works
    before or after `prepack_cpu_weights.pack_linear_weights`."""
    switched = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, LinearMethodBase) and not isinstance(method, FixedRowsLinearMethod):
            # Not set_quant_method: that makes new (empty) weights; these stay.
            module.quant_method = FixedRowsLinearMethod(method)
            switched += 1
    if logits_head is not None:
        logits_head.fixed_rows = FIXED_ROWS
    logger.info("batch-invariant: %d linear layers and the LM head multiply in calls of %d "
                "rows", switched, FIXED_ROWS)
    return switched
