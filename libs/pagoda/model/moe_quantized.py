"""Quantized MoE experts: read in the checkpoint's quantized form, dequantized on load.

A quantized MoE checkpoint stores each expert projection as a quantized linear layer
does (`<prefix>.<e>.gate_proj.weight` + `weight_scale` for FP8, `qweight`/`qzeros`/
`scales`(/`g_idx`) for AWQ and GPTQ). `ExpertDequantizer` reads one projection's
tensors into a throw-away linear layer of the checkpoint's method (the same
`create_weights` / `load_weight` / `process_weights_after_loading` as a dense layer, so
every scale layout the dense path reads is read here too), then asks the method for
the weight it stands for (`LinearMethodBase.dequantize`), on the CPU, in the model
dtype. `FusedMoE` keeps that dense weight: the experts run as unquantized experts do.

This is the simplest correct path, not a memory saving: the experts take the model
dtype's memory (the dense layers of the checkpoint stay quantized). Invariant: the
expert weight equals the checkpoint's dequantized weight exactly (fp32 arithmetic,
then one cast to the model dtype), whichever method stored it.

Refused, by name, at construction: `--quantization fp8` on an unquantized MoE
checkpoint (online FP8), since dequantizing what was just quantized would only add
rounding error; serve an FP8-serialized checkpoint instead.
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.model.parallel_layers import ColumnParallelLinear
from pagoda.model.quantization import QuantizationConfig, quantized_construction
from pagoda.model.quantization.fp8 import Fp8Config


def refuse_unsupported_expert_quantization(config: QuantizationConfig,
                                           architecture: str = "this model") -> None:
    """ValueError for a quantization whose experts Pagoda cannot read (online FP8)."""
    if isinstance(config, Fp8Config) and config.scheme == "online":
        raise ValueError(
            f"--quantization fp8 on an unquantized checkpoint (online FP8) is not supported "
            f"for the mixture-of-experts layers of {architecture}: Pagoda reads quantized "
            "experts from FP8-serialized checkpoints (quant_method fp8 or "
            "compressed-tensors), AWQ or GPTQ; serve such a checkpoint, or drop --quantization")


class ExpertDequantizer:
    """Turns the quantized checkpoint tensors of expert projections into dense weights.

    `tensor_shapes(rows, cols)` lists the tensors one [rows, cols] projection reads
    (suffix -> checkpoint shape); `add(key, suffix, tensor, rows, cols)` takes them one
    by one, in any order, and returns the dense weight [rows, cols] once the
    projection `key` has all of them (None before).
    """

    def __init__(self, config: QuantizationConfig, dtype: torch.dtype) -> None:
        refuse_unsupported_expert_quantization(config)
        self.config, self.dtype = config, dtype
        self._shapes: dict[tuple[int, int], dict[str, tuple[int, ...]]] = {}
        self._pending: dict[object, tuple[nn.Module, set[str]]] = {}

    def _layer(self, rows: int, cols: int, device: str) -> ColumnParallelLinear:
        with torch.device(device), quantized_construction(self.config):
            return ColumnParallelLinear.split(cols, rows, False, torch.float32)

    def tensor_shapes(self, rows: int, cols: int) -> dict[str, tuple[int, ...]]:
        if (rows, cols) not in self._shapes:
            layer = self._layer(rows, cols, "meta")
            self._shapes[rows, cols] = {
                name: tuple(layer.checkpoint_shape(name, None))
                for name, param in layer.named_parameters(recurse=False)
                if not getattr(param, "computed_at_load", False)}
        return self._shapes[rows, cols]

    @torch.no_grad()
    def add(self, key: object, suffix: str, tensor: torch.Tensor, rows: int,
            cols: int) -> torch.Tensor | None:
        layer, loaded = self._pending.get(key) or (self._layer(rows, cols, "cpu"), set())
        layer.load_weight(suffix, None, tensor.to("cpu"))
        loaded.add(suffix)
        if loaded != set(self.tensor_shapes(rows, cols)):
            self._pending[key] = (layer, loaded)
            return None
        self._pending.pop(key, None)
        layer.quant_method.process_weights_after_loading(layer)
        return layer.quant_method.dequantize(layer, self.dtype)
