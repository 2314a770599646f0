"""AWQ int4 checkpoints (`"quant_method": "awq"`, AutoAWQ's GEMM format).

On disk, for a linear layer with K inputs and N outputs and groups of `group_size`
input rows:

    qweight  int32 [K, N/8]      8 output columns per word, in AWQ_PACK_ORDER
    qzeros   int32 [K/g, N/8]    zero points, packed the same way
    scales   fp16  [K/g, N]

    W[n, k] = (q[k, n] - z[k // g, n]) * s[k // g, n]

Loaded in that form (tensor-parallel slices cut through the packing: 8 output columns
per word, g input rows per group), then repacked once into `int4`'s layout.
"""

from __future__ import annotations

import torch

from pagoda.model.quantization.base import (LinearMethodBase, QuantizationConfig,
                                            new_parameter, shard_attrs)
from pagoda.model.quantization.int4 import (AWQ_PACK_ORDER, apply_int4, dequantize_int4,
                                            groups_of_rows, new_int32, pack_rows,
                                            set_int4_weights, unpack_columns)


class AWQConfig(QuantizationConfig):
    """`{"quant_method": "awq", "bits"|"w_bit": 4, "group_size"|"q_group_size": 128,
    "zero_point": true, "version": "gemm"}`."""

    name = "awq"

    def __init__(self, group_size: int, modules_to_not_convert: list[str]) -> None:
        self.group_size = group_size
        self.modules_to_not_convert = modules_to_not_convert

    @classmethod
    def from_config(cls, config: dict) -> AWQConfig:
        bits = config.get("bits", config.get("w_bit", 4))
        if bits != 4:
            raise ValueError(f"AWQ with {bits} bits is not supported: only 4-bit AWQ")
        if not config.get("zero_point", True):
            raise ValueError("AWQ without zero points (zero_point: false) is not supported")
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ version {version!r} is not supported: only the GEMM packing")
        group_size = config.get("group_size", config.get("q_group_size", 128))
        return cls(int(group_size), list(config.get("modules_to_not_convert") or []))

    def get_linear_method(self) -> LinearMethodBase:
        return AWQLinearMethod(self.group_size)

    def ignored_modules(self) -> list[str]:
        return self.modules_to_not_convert


class AWQLinearMethod(LinearMethodBase):
    """AWQ's tensors while loading; `int4`'s packed form from then on."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    def create_weights(self, layer, input_size, output_size, full_input_size, params_dtype):
        group = full_input_size if self.group_size == -1 else self.group_size
        # One group spanning a row-parallel split is replicated, not cut.
        group_dim = 0 if group <= input_size else None
        num_groups = max(1, input_size // group) if group_dim == 0 else 1
        if output_size % 8:
            raise ValueError(f"AWQ: {output_size} output rows per rank are not a multiple "
                             "of the 8 packed in each int32")
        layer.qweight = shard_attrs(new_int32(input_size, output_size // 8), 1, 0, output_pack=8)
        layer.qzeros = shard_attrs(new_int32(num_groups, output_size // 8), 1, group_dim,
                                   output_pack=8, input_pack=group)
        layer.scales = shard_attrs(new_parameter(num_groups, output_size, dtype=torch.float32),
                                   1, group_dim, input_pack=group)
        layer.awq_group = group

    def process_weights_after_loading(self, layer):
        q = unpack_columns(layer.qweight.data, AWQ_PACK_ORDER)  # [K, N]
        if q.shape[0] % 8:
            raise ValueError(f"AWQ: {q.shape[0]} input rows are not a multiple of 8")
        zeros = unpack_columns(layer.qzeros.data, AWQ_PACK_ORDER)
        group = min(layer.awq_group, q.shape[0])
        g_idx = groups_of_rows(None, q.shape[0], group, q.device)
        set_int4_weights(layer, pack_rows(q), layer.scales.data, zeros, g_idx, group)

    def apply(self, layer, x, bias=None):
        return apply_int4(layer, x, bias)

    def dequantize(self, layer, dtype):
        return dequantize_int4(layer, 0, layer.qweight.shape[1], dtype)
