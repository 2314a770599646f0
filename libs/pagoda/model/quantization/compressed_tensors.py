"""compressed-tensors checkpoints (`"quant_method": "compressed-tensors"`, llm-compressor's
format): the FP8 weight schemes (`float-quantized`).

    "quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"group_0": {"targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "symmetric": true,
                    "strategy": "tensor" | "channel" | "block", "block_structure": [128, 128]},
        "input_activations": {...} | null}},
      "ignore": ["lm_head", "re:.*mlp.gate$"]}

The tensors are `weight` (fp8) and `weight_scale` ([1], [N, 1] or [N/bn, K/bk]), which
`fp8.Fp8LinearMethod` runs; `input_scale` (static activation scales) is dropped, as
activations stay in the model dtype. Integer (`pack-quantized`) and other schemes are
refused by name.
"""

from __future__ import annotations

import torch

from pagoda.model.quantization.base import LinearMethodBase, QuantizationConfig
from pagoda.model.quantization.fp8 import Fp8Config

_FP8_FORMATS = ("float-quantized", "naive-quantized")


class CompressedTensorsConfig(QuantizationConfig):
    """One FP8 weight scheme for every targeted `Linear`, minus `ignore`."""

    name = "compressed-tensors"

    def __init__(self, fp8: Fp8Config) -> None:
        self.fp8 = fp8

    @classmethod
    def from_config(cls, config: dict) -> CompressedTensorsConfig:
        groups = list((config.get("config_groups") or {}).values())
        if len(groups) != 1:
            raise ValueError("compressed-tensors checkpoints with "
                             f"{len(groups)} config groups are not supported (one expected)")
        group = groups[0]
        weights = group.get("weights") or {}
        fmt = group.get("format") or config.get("format")
        if weights.get("type") != "float" or weights.get("num_bits") != 8 or \
                fmt not in _FP8_FORMATS:
            raise ValueError(
                f"compressed-tensors format {fmt!r} with {weights.get('num_bits')}-bit "
                f"{weights.get('type')} weights is not supported: only FP8 weights "
                "(float-quantized)")
        if not weights.get("symmetric", True):
            raise ValueError("asymmetric FP8 weights (a zero point) are not supported")
        if "Linear" not in (group.get("targets") or ["Linear"]):
            raise ValueError(f"compressed-tensors targets {group.get('targets')} are not "
                             "supported: only Linear")
        strategy = weights.get("strategy", "tensor")
        ignored = list(config.get("ignore") or [])
        if strategy == "block":
            block = weights.get("block_structure") or [128, 128]
            return cls(Fp8Config("block", (int(block[0]), int(block[1])), ignored,
                                 block_scale_name="weight_scale"))
        if strategy not in ("tensor", "channel"):
            raise ValueError(f"compressed-tensors FP8 strategy {strategy!r} is not supported: "
                             "tensor, channel or block")
        return cls(Fp8Config(strategy, None, ignored))

    def get_linear_method(self) -> LinearMethodBase:
        return self.fp8.get_linear_method()

    def checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor | None:
        return self.fp8.checkpoint_tensor(name, tensor)

    def ignored_modules(self) -> list[str]:
        return self.fp8.ignored_modules()
