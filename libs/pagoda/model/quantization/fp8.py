"""FP8 weights: float8_e4m3fn values times fp32 scales, kept in that form in memory.

Checkpoint forms read (vLLM's `fp8` method; compressed-tensors' `float-quantized`
maps onto the same schemes, `compressed_tensors.py`):

    scheme    weight          scale tensor                      checkpoints
    tensor    fp8 [N, K]      weight_scale [] (one per tensor)  vLLM/AutoFP8 "fp8"
    channel   fp8 [N, K]      weight_scale [N, 1]               compressed-tensors
    block     fp8 [N, K]      weight_scale_inv [N/bn, K/bk]     HF/DeepSeek "fp8" with
                                                                weight_block_size
    online    bf16/fp16/fp32  (none: computed while loading)    `--quantization fp8` on
                                                                an unquantized model

In memory every scheme is `weight` fp8 [N, K] with one fp32 scale per output row and
column block, `[N, ceil(K / bk)]` (bk = K for tensor/channel/online): a per-tensor
scale is repeated over its rows, so fused q/k/v keep their own scales with no
requantization; a block scale is repeated over its bn rows. W = weight * scale.
`online` quantizes each output row with scale max|w| / 448 (per channel).
Activations are not quantized (static `input_scale`s are dropped): the product runs
in the model dtype, which is what the CPU path and the Triton kernel compute.
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.model.ops import use_triton
from pagoda.model.quantization.base import (LinearMethodBase, QuantizationConfig,
                                            narrow_all, new_parameter, shard_attrs,
                                            tiled_linear)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCHEMES = ("tensor", "channel", "block", "online")
# Static activation scales (activations stay in the model dtype here) and calibrated KV
# cache scales (the fp8 KV cache uses 1.0): read past, not used.
_UNUSED_SCALES = (".input_scale", ".k_scale", ".v_scale", ".kv_scale")


class Fp8Config(QuantizationConfig):
    """vLLM's `fp8`: `{"quant_method": "fp8", "activation_scheme": "static"|"dynamic",
    "weight_block_size": [bn, bk] (optional)}`; `online` when the checkpoint is not FP8."""

    name = "fp8"

    def __init__(self, scheme: str, block: tuple[int, int] | None = None,
                 ignored: list[str] | None = None,
                 block_scale_name: str = "weight_scale_inv") -> None:
        assert scheme in SCHEMES, scheme
        self.scheme, self.block, self.ignored = scheme, block, ignored or []
        # HF names a block scale `weight_scale_inv`, compressed-tensors `weight_scale`.
        self.scale_name = block_scale_name if scheme == "block" else "weight_scale"

    @classmethod
    def from_config(cls, config: dict) -> Fp8Config:
        if not config.get("is_checkpoint_fp8_serialized", True):
            return cls("online")
        block = config.get("weight_block_size")
        ignored = list(config.get("ignored_layers") or config.get("modules_to_not_convert")
                       or [])
        if block is not None:
            if len(block) != 2:
                raise ValueError(f"fp8 weight_block_size must be [rows, columns], got {block}")
            return cls("block", (int(block[0]), int(block[1])), ignored)
        return cls("tensor", None, ignored)

    def get_linear_method(self) -> LinearMethodBase:
        return Fp8LinearMethod(self.scheme, self.block, self.scale_name)

    def checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor | None:
        if name.endswith(_UNUSED_SCALES):
            return None
        if name.endswith(".weight_scale") and self.scheme == "tensor":
            return tensor.reshape(())  # stored as [] or [1]
        if name.endswith(".weight_scale") and self.scheme == "channel":
            return tensor.reshape(-1, 1)  # stored as [N] or [N, 1]
        return tensor

    def ignored_modules(self) -> list[str]:
        return self.ignored


class Fp8LinearMethod(LinearMethodBase):
    """`weight` fp8 [N, K] and an fp32 scale per output row and column block."""

    def __init__(self, scheme: str, block: tuple[int, int] | None, scale_name: str) -> None:
        self.scheme, self.block, self.scale_name = scheme, block, scale_name

    def create_weights(self, layer, input_size, output_size, full_input_size, params_dtype):
        layer.weight = shard_attrs(new_parameter(output_size, input_size, dtype=FP8_DTYPE), 0, 1)
        block_k = self.block[1] if self.block else input_size
        scale = new_parameter(output_size, -(-input_size // block_k), dtype=torch.float32)
        shard_attrs(scale, 0, 1 if self.block else None, input_pack=block_k)
        scale.computed_at_load = self.scheme == "online"
        setattr(layer, self.scale_name, scale)
        layer.fp8_block_k = block_k

    def checkpoint_shape(self, layer, attr, shape):
        if attr != self.scale_name:
            return shape
        if self.scheme == "tensor":
            return ()
        if self.scheme == "block":
            return (-(-shape[0] // self.block[0]), shape[1])
        return shape

    @torch.no_grad()
    def load_weight(self, layer, attr, full, src, dst):
        param = getattr(layer, attr)
        if attr == "weight" and self.scheme == "online":
            w = narrow_all(full, src).float()
            scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
            narrow_all(param, dst).copy_((w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE))
            rows = [s for s in dst if s[0] == 0]
            narrow_all(getattr(layer, self.scale_name), rows).copy_(scale)
            return
        if attr == self.scale_name:
            full = self._scale_rows(full, param, src)
        narrow_all(param, dst).copy_(narrow_all(full, src))

    def _scale_rows(self, full: torch.Tensor, param: nn.Parameter, src) -> torch.Tensor:
        """The checkpoint scale repeated to one row per output row of its tensor (as
        far as this rank's slice `src` reaches)."""
        num_rows = next((start + length for dim, start, length in src if dim == 0),
                        param.shape[0])
        if self.scheme == "tensor":
            return full.float().reshape(1, 1).expand(num_rows, 1)
        if self.scheme == "block":
            return full.float().repeat_interleave(self.block[0], dim=0)[:num_rows]
        return full.float()

    def apply(self, layer, x, bias=None):
        scale = getattr(layer, self.scale_name)
        if use_triton(x):
            from pagoda.kernels.quant_matmul import fp8_matmul  # lazy: triton, CUDA only

            out = fp8_matmul(x.reshape(-1, x.shape[-1]), layer.weight, scale, layer.fp8_block_k)
            out = out.view(*x.shape[:-1], layer.weight.shape[0])
            return out if bias is None else out + bias
        return tiled_linear(x, layer.weight.shape[0],
                            lambda s, e: dequantize_fp8(layer.weight[s:e], scale[s:e],
                                                        layer.fp8_block_k, x.dtype),
                            bias, rows_per_column=layer.weight.shape[1])

    def dequantize(self, layer, dtype):
        return dequantize_fp8(layer.weight, getattr(layer, self.scale_name), layer.fp8_block_k,
                              dtype)


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block_k: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """weight fp8 [n, K] * scale [n, ceil(K / block_k)] in fp32, cast to `dtype`."""
    w = weight.to(torch.float32)
    if scale.shape[1] == 1:
        return (w * scale).to(dtype)
    s = scale.repeat_interleave(block_k, dim=1)[:, :w.shape[1]]
    return (w * s).to(dtype)
