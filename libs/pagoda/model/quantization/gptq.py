"""GPTQ int4 checkpoints (`"quant_method": "gptq"`, AutoGPTQ / GPTQModel format).

On disk, for K inputs, N outputs and groups of `group_size` input rows:

    qweight  int32 [K/8, N]     8 input rows per word, nibble j = row 8r + j
    qzeros   int32 [G, N/8]     zero points packed along the output, minus 1 in the
                                original ("gptq", v1) format, as stored in "gptq_v2"
    scales   fp16  [G, N]
    g_idx    int32 [K]          the group of each input row; with act-order
                                (`desc_act`) rows are quantized in another order, so
                                the groups are not contiguous

    W[n, k] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]

With act-order under row parallelism each rank keeps all groups' scales and zeros
(its input rows may belong to any group) and the global `g_idx`; otherwise the
groups are sliced with the rows and the group of row k is k // group_size.
"""

from __future__ import annotations

import torch

from pagoda.model.quantization.base import (LinearMethodBase, QuantizationConfig,
                                            narrow_all, new_parameter, shard_attrs)
from pagoda.model.quantization.int4 import (SEQUENTIAL_ORDER, apply_int4, dequantize_int4,
                                            groups_of_rows, new_int32, set_int4_weights,
                                            unpack_columns)


class GPTQConfig(QuantizationConfig):
    """`{"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": false,
    "sym": true, "checkpoint_format": "gptq"}`."""

    name = "gptq"

    def __init__(self, group_size: int, desc_act: bool, zero_offset: int) -> None:
        self.group_size, self.desc_act, self.zero_offset = group_size, desc_act, zero_offset

    @classmethod
    def from_config(cls, config: dict) -> GPTQConfig:
        bits = config.get("bits", 4)
        if bits != 4:
            raise ValueError(f"GPTQ with {bits} bits is not supported: only 4-bit GPTQ")
        if config.get("dynamic"):
            raise ValueError("GPTQ with per-module overrides (dynamic) is not supported")
        fmt = config.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint format {fmt!r} is not supported")
        return cls(int(config.get("group_size", 128)), bool(config.get("desc_act", False)),
                   1 if fmt == "gptq" else 0)

    def get_linear_method(self) -> LinearMethodBase:
        return GPTQLinearMethod(self)


class GPTQLinearMethod(LinearMethodBase):
    """GPTQ's tensors while loading; `int4`'s packed form from then on."""

    def __init__(self, config: GPTQConfig) -> None:
        self.config = config

    def create_weights(self, layer, input_size, output_size, full_input_size, params_dtype):
        config = self.config
        group = full_input_size if config.group_size == -1 else config.group_size
        row_split = input_size != full_input_size
        # Act-order rows of a rank may belong to any group: keep every group's scales.
        replicate = group > input_size or (config.desc_act and row_split)
        num_groups = -(-full_input_size // group) if replicate else input_size // group
        group_dim = None if replicate else 0
        if input_size % 8 or output_size % 8:
            raise ValueError(f"GPTQ: a [{output_size}, {input_size}] share is not a multiple "
                             "of the 8 int4 values packed in each int32")
        layer.qweight = shard_attrs(new_int32(input_size // 8, output_size), 1, 0, input_pack=8)
        layer.qzeros = shard_attrs(new_int32(num_groups, output_size // 8), 1, group_dim,
                                   output_pack=8, input_pack=group)
        layer.scales = shard_attrs(new_parameter(num_groups, output_size, dtype=torch.float32),
                                   1, group_dim, input_pack=group)
        layer.g_idx = shard_attrs(new_int32(input_size), None, 0)
        layer.gptq_group = group

    @torch.no_grad()
    def load_weight(self, layer, attr, full, src, dst):
        if attr != "g_idx":
            return super().load_weight(layer, attr, full, src, dst)
        # Fused projections (q/k/v, gate/up) share one g_idx: GPTQ's act-order comes from
        # the layer input's statistics, which they share. Check rather than assume.
        rows = narrow_all(full, src).to(torch.int32)
        if getattr(layer, "g_idx_loaded", False) and not torch.equal(layer.g_idx, rows):
            raise ValueError("GPTQ act-order: the g_idx of fused projections differ; they "
                             "cannot share one layer")
        layer.g_idx.copy_(rows)
        layer.g_idx_loaded = True

    def process_weights_after_loading(self, layer):
        zeros = unpack_columns(layer.qzeros.data, SEQUENTIAL_ORDER) + self.config.zero_offset
        num_rows = layer.qweight.shape[0] * 8
        group = min(layer.gptq_group, num_rows)
        g_idx = layer.g_idx.data if self.config.desc_act else None
        g_idx = groups_of_rows(g_idx, num_rows, group, zeros.device)
        set_int4_weights(layer, layer.qweight.data, layer.scales.data, zeros, g_idx, group)

    def apply(self, layer, x, bias=None):
        return apply_int4(layer, x, bias)

    def dequantize(self, layer, dtype):
        return dequantize_int4(layer, 0, layer.qweight.shape[1], dtype)
