"""What a quantization method is (vLLM's `QuantizationConfig` / `LinearMethodBase`) and the
unquantized method every linear layer uses by default.

A linear layer (`parallel_layers.LinearBase`) owns a `quant_method` object that decides
what it stores and how it multiplies:

    create_weights(layer, ...)      register this rank's parameters on the layer
    load_weight(layer, attr, ...)   copy one checkpoint tensor's slice into them
    process_weights_after_loading   repack once every tensor is in (AWQ -> int4 layout)
    apply(layer, x, bias)           y = x W^T (+ bias)

Every parameter a method registers carries its sharding metadata (`shard_attrs`):
`output_dim` / `input_dim`, the parameter's axes along the layer's output rows and
input columns (None: not along that axis), and `output_pack` / `input_pack`, how
many rows or columns one element of that axis stands for (8 for int4 packed in
int32, the group size for per-group scales). With them the tensor-parallel layers
cut any parameter out of its checkpoint tensor the same way they cut a plain weight.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.model import cpu_packed_weights

# One slice of a tensor: (dim, start, length), applied with `narrow`.
Slice = tuple[int, int, int]

# Elements of one dequantized weight tile on the CPU path: large enough that a tile's
# matmul is efficient, small enough that the tile stays in the cache (4 MiB in fp32).
DEQUANT_TILE_ELEMENTS = 1 << 20


def shard_attrs(param: nn.Parameter, output_dim: int | None, input_dim: int | None,
                output_pack: int = 1, input_pack: int = 1) -> nn.Parameter:
    """Tag `param` with how it is sharded (see the module docstring); returns it."""
    param.output_dim, param.input_dim = output_dim, input_dim
    param.output_pack, param.input_pack = output_pack, input_pack
    return param


def new_parameter(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def narrow_all(t: torch.Tensor, slices: list[Slice]) -> torch.Tensor:
    for dim, start, length in slices:
        t = t.narrow(dim, start, length)
    return t


class LinearMethodBase(ABC):
    """How one linear layer stores its weight and multiplies by it.

    Invariant: after `process_weights_after_loading`, `apply(layer, x)` equals
    `x @ W^T` for the weight W the checkpoint describes (up to the rounding of the
    activation dtype), whatever W's stored form.
    """

    @abstractmethod
    def create_weights(self, layer: nn.Module, input_size: int, output_size: int,
                       full_input_size: int, params_dtype: torch.dtype) -> None:
        """Register parameters for this rank's [output_size, input_size] share of a
        layer whose whole input is `full_input_size` columns."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., input_size] -> [..., output_size] in x's dtype."""

    def checkpoint_shape(self, layer: nn.Module, attr: str,
                         shape: tuple[int, ...]) -> tuple[int, ...]:
        """The checkpoint tensor's shape for `attr`, given the shape the sharding metadata
        implies (a method whose checkpoint form differs from its stored form overrides)."""
        return shape

    def load_weight(self, layer: nn.Module, attr: str, full: torch.Tensor,
                    src: list[Slice], dst: list[Slice]) -> None:
        """Copy `full[src]` (this rank's slice of the checkpoint tensor) to `attr[dst]`."""
        narrow_all(getattr(layer, attr), dst).copy_(narrow_all(full, src))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once after every checkpoint tensor is loaded; default: nothing."""

    def dequantize(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """The weight W [output_size, input_size] the layer stands for, in `dtype` (after
        `process_weights_after_loading`): how quantized MoE experts are read
        (`pagoda.model.moe_quantized`)."""
        raise NotImplementedError(f"{type(self).__name__} cannot dequantize its weight")


class UnquantizedLinearMethod(LinearMethodBase):
    """A plain `weight [out, in]` in the model dtype (on a bf16 CPU, prepacked for
    oneDNN after loading: `pagoda.model.cpu_packed_weights`); `F.linear`."""

    def create_weights(self, layer, input_size, output_size, full_input_size, params_dtype):
        layer.weight = shard_attrs(new_parameter(output_size, input_size, dtype=params_dtype), 0, 1)

    def apply(self, layer, x, bias=None):
        return cpu_packed_weights.linear(x, layer.weight, bias)

    def dequantize(self, layer, dtype):
        return layer.weight.to(dtype)


class QuantizationConfig(ABC):
    """One checkpoint's quantization (config.json's `quantization_config`, parsed).

    `name` is vLLM's `--quantization` value. `get_linear_method()` gives the method of
    each quantized linear layer; `checkpoint_tensor(name, t)` normalises a checkpoint
    tensor on its way in (None drops it: a tensor the method does not use, such as
    FP8's static activation scales, since activations are not quantized here).
    """

    name: str = ""

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict) -> QuantizationConfig:
        """Parse `quantization_config`; ValueError for a variant Pagoda cannot run."""

    @abstractmethod
    def get_linear_method(self) -> LinearMethodBase:
        ...

    def checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor | None:
        return tensor

    def ignored_modules(self) -> list[str]:
        """HF module names (or `re:` patterns) the checkpoint leaves unquantized."""
        return []

    def check_architecture(self, architecture: str) -> None:
        """ValueError, at start-up, when this method cannot quantize `architecture`
        (a method made for one family's tensors); every architecture by default."""


def tiled_linear(x: torch.Tensor, num_columns: int,
                 dequantize: Callable[[int, int], torch.Tensor],
                 bias: torch.Tensor | None, rows_per_column: int) -> torch.Tensor:
    """x @ W^T, W dequantized one tile of output columns at a time (the CPU path).

    `dequantize(start, end)` returns W[start:end] as [end - start, in] in x's dtype.
    The full-precision weight never exists at once: each tile is built, multiplied and
    dropped, so memory stays at one tile and the tile's reads stay in the cache.
    """
    tile = max(1, DEQUANT_TILE_ELEMENTS // max(1, rows_per_column))
    if tile >= num_columns:
        return F.linear(x, dequantize(0, num_columns), bias)
    out = x.new_empty(*x.shape[:-1], num_columns)
    for start in range(0, num_columns, tile):
        end = min(num_columns, start + tile)
        out[..., start:end] = F.linear(x, dequantize(start, end),
                                       None if bias is None else bias[start:end])
    return out
