"""(HF name, tensor) pairs from the *.safetensors files of an HF model directory."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable, Iterator

import torch
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(model_dir: str) -> list[str]:
    """The weight files of `model_dir`, sorted.

    With a sharded checkpoint only the files its index names count: some repos
    also ship a `consolidated.safetensors` with the same weights under other names.
    """
    index_path = os.path.join(model_dir, INDEX_FILE)
    if os.path.exists(index_path):
        with open(index_path, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        return sorted(os.path.join(model_dir, name) for name in set(weight_map.values()))
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    hf_files = [f for f in files if not os.path.basename(f).startswith("consolidated")]
    return hf_files or files


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
