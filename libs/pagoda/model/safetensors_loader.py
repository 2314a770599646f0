"""(HF name, tensor) pairs from the *.safetensors files of an HF model directory."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import torch
from safetensors import safe_open

from pagoda.model.weight_files import local_weight_files


def safetensors_files(model_dir: str) -> list[str]:
    """The safetensors weight files of `model_dir`, sorted (`pagoda.model.weight_files`
    decides: with a sharded checkpoint only the files its index names count)."""
    files = local_weight_files(model_dir)
    if files is None or files.format != "safetensors":
        return []
    return [os.path.join(model_dir, name) for name in files.shards]


def iter_safetensors_weights(model_dir: str, include: Callable[[str], bool] | None = None
                             ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every tensor of the checkpoint (those `include` accepts), one at a time
    (memory-mapped reads: a tensor left out is never read)."""
    files = safetensors_files(model_dir)
    if not files:
        raise FileNotFoundError(f"No *.safetensors files in {model_dir}")
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                if include is None or include(name):
                    yield name, f.get_tensor(name)
