"""Which files of an HF checkpoint hold its weights: one rule for a local folder and a hub repo.

The same choice decides what `pagoda.model.hub` downloads and what the loader reads, so a
download never fetches a file the loader ignores, nor misses one it needs:

  1. safetensors when the checkpoint has any: the shards its index names (repos such as
     Mistral's also ship a `consolidated.safetensors` holding the same weights under other
     names), else every root-level `*.safetensors` except `consolidated*` ones (unless those
     are all there is);
  2. otherwise PyTorch pickles (`*.bin`, then `*.pt`), chosen the same way, without the
     training leftovers (`training_args.bin`, optimizer and scheduler states) vLLM skips.

Only root-level files count: subfolders (`original/`, `onnx/`, ...) hold other formats.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

SAFETENSORS_INDEX = "model.safetensors.index.json"
PT_INDEX = "pytorch_model.bin.index.json"
# Pickles in model repos that are not weights (vLLM's list).
NOT_WEIGHTS = frozenset({"training_args.bin", "optimizer.bin", "optimizer.pt", "scheduler.pt",
                         "scaler.pt"})
# (format, file suffix, index file) in order of preference.
_FORMATS = (("safetensors", ".safetensors", SAFETENSORS_INDEX), ("pt", ".bin", PT_INDEX),
            ("pt", ".pt", None))


@dataclass(frozen=True)
class WeightFiles:
    """The weight files of one checkpoint, names relative to its root.

    Invariant: `shards` is non-empty, sorted, and all of one `format`; `index`, when set,
    is the index file that names exactly those shards."""

    format: str  # "safetensors" or "pt"
    shards: tuple[str, ...]
    index: str | None = None

    def names(self) -> list[str]:
        """Every file to fetch: the index (if any) and the shards."""
        return ([self.index] if self.index else []) + list(self.shards)


def select_weight_files(names: Iterable[str],
                        read_index: Callable[[str], Iterable[str]]) -> WeightFiles | None:
    """The weight files among `names` (a checkpoint's file names), or None if it has none.

    `read_index(index_name)` returns the shard names an index file maps weights to; it
    is only called when the index is among `names`.
    """
    root = {n for n in names if "/" not in n}
    for fmt, suffix, index in _FORMATS:
        files = sorted(n for n in root if n.endswith(suffix) and n not in NOT_WEIGHTS)
        if not files:
            continue
        if index is not None and index in root:
            return WeightFiles(fmt, tuple(sorted(set(read_index(index)))), index)
        hf_files = [f for f in files if not f.startswith("consolidated")]
        return WeightFiles(fmt, tuple(hf_files or files))
    return None


def local_weight_files(model_dir: str) -> WeightFiles | None:
    """`select_weight_files` over a local folder."""
    try:
        names = os.listdir(model_dir)
    except OSError:
        return None
    return select_weight_files(names, lambda index: read_index(os.path.join(model_dir, index)))


def read_index(path: str) -> list[str]:
    """The shard names of an HF index file (`{"weight_map": {tensor: shard}}`)."""
    with open(path, encoding="utf-8") as f:
        return list(json.load(f)["weight_map"].values())
