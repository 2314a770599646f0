"""(HF name, tensor) pairs from the PyTorch pickles (`*.bin`/`*.pt`) of an HF model directory.

Checkpoints without safetensors are read this way, as in vLLM. The pickles are opened with
`weights_only=True`: torch then refuses anything but tensors and plain containers, so a
checkpoint cannot run code at load time. Each file is memory-mapped where torch can.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import torch

from pagoda.model.weight_files import local_weight_files


def iter_pt_weights(model_dir: str, include: Callable[[str], bool] | None = None
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every tensor of the checkpoint's pickles (those `include` accepts)."""
    files = local_weight_files(model_dir)
    if files is None or files.format != "pt":
        raise FileNotFoundError(f"No *.bin or *.pt weight files in {model_dir}")
    for name in files.shards:
        path = os.path.join(model_dir, name)
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # the old (pre-zip) pickle format cannot be memory-mapped
            state = torch.load(path, map_location="cpu", weights_only=True)
        for tensor_name, tensor in state.items():
            if include is None or include(tensor_name):
                yield tensor_name, tensor
