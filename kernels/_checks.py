"""Argument checks shared by the launchers (no triton import here).

A launcher that accepts a wrong shape, stride or dtype writes out of bounds or
silently reads garbage on the GPU; these checks turn that into a clear error at the
call site instead.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

# Dtypes the kernels are written and tested for.
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_tensor(
    name: str,
    t: torch.Tensor,
    shape: tuple[int | None, ...],
    dtypes: tuple[torch.dtype, ...],
    last_dim_contiguous: bool = True,
) -> None:
    """Assert rank, the given sizes (None = any), dtype and a unit last stride."""
    assert isinstance(t, torch.Tensor), f"{name}: expected a tensor, got {type(t).__name__}"
    assert t.dim() == len(shape), f"{name}: expected {len(shape)} dims, got shape {tuple(t.shape)}"
    for i, (got, want) in enumerate(zip(t.shape, shape)):
        assert want is None or got == want, (
            f"{name}: dim {i} is {got}, expected {want} (shape {tuple(t.shape)})"
        )
    assert t.dtype in dtypes, f"{name}: dtype {t.dtype} not in {dtypes}"
    if last_dim_contiguous and t.numel() > 0:
        assert t.stride(-1) == 1, f"{name}: last dim must be contiguous, strides {t.stride()}"


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    assert len(set(devices.values())) == 1, f"tensors on different devices: {devices}"


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 dots must not silently drop to TF32 (which would break fp32 greedy
    equivalence with HF); bf16/fp16 dots are exact products accumulated in fp32."""
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device`; a small fixed number off-GPU (the
    Triton interpreter), so split-K paths are still exercised there."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _num_sms(index)


class TileConfig(NamedTuple):
    """Key tile, query tile (prefill) and launch options of the attention kernels."""

    block_n: int
    block_m: int
    num_warps: int
    num_stages: int | None  # None: triton's default

    def launch_options(self) -> dict:
        """num_warps (and num_stages when set) for a kernel launch."""
        opts = {"num_warps": self.num_warps}
        if self.num_stages is not None:
            opts["num_stages"] = self.num_stages
        return opts


def tile_config(block_d: int, on_gpu: bool) -> TileConfig:
    """Tiles for a head padded to `block_d` lanes. Up to 256 (every MHA/GQA model here)
    the tiles the kernels have always used on the GPU. Wider heads (MLA's 576 -> 1024)
    would need 64 x 1024 fp32 K and V tiles, several times a GPU's shared memory once
    pipelined, and a 64 x 1024 fp32 accumulator per prefill program: narrower tiles,
    more warps, no multi-buffering. Not measured for speed; the interpreter ignores
    warps and stages, so correctness there says nothing about fitting a GPU
    (benchmarks/gpu_check.py runs an MLA shape where a device is lent)."""
    if not on_gpu:
        return TileConfig(16, 16, 4, None)
    if block_d <= 256:
        return TileConfig(64, 64, 4, None)
    return TileConfig(16, 16, 8, 1)
