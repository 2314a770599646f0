"""Loads HF-named weights into a model whose q/k/v and gate/up projections are fused.

The fused parameter `...self_attn.qkv_proj.weight` is the row-wise concatenation
[q_proj; k_proj; v_proj] and `...mlp.gate_up_proj.weight` is [gate_proj; up_proj]
(biases likewise), so each HF tensor lands in a row range of its fused parameter
(`_shard_rows` gives the ranges of an unsharded model; a tensor-parallel layer
takes only its rank's slice of each, see `pagoda.model.parallel_layers`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from pagoda.config import ModelArchConfig

# fused name -> the HF names of its shards, in row order.
FUSED_SHARDS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
# Buffers some checkpoints carry that we recompute instead.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _shard_rows(arch: ModelArchConfig) -> dict[str, tuple[int, int]]:
    """HF shard name -> (first row, number of rows) inside its fused parameter."""
    q = arch.num_attention_heads * arch.head_dim
    kv = arch.num_key_value_heads * arch.head_dim
    inter = arch.intermediate_size
    return {"q_proj": (0, q), "k_proj": (q, kv), "v_proj": (q + kv, kv),
            "gate_proj": (0, inter), "up_proj": (inter, inter)}


def _split_name(name: str) -> tuple[str, str | None]:
    """HF name -> (our parameter name, shard name or None when not fused)."""
    for fused, shards in FUSED_SHARDS.items():
        for shard in shards:
            token = f".{shard}."
            if token in name:
                return name.replace(token, f".{fused}."), shard
    return name, None


def expected_hf_names(model: nn.Module) -> set[str]:
    """The HF names a checkpoint must provide to fill every parameter of `model`."""
    names = set()
    for pname, _ in model.named_parameters():
        for fused, shards in FUSED_SHARDS.items():
            if f".{fused}." in pname:
                names.update(pname.replace(f".{fused}.", f".{s}.") for s in shards)
                break
        else:
            names.add(pname)
    return names


@torch.no_grad()
def load_named_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                       skip_lm_head: bool,
                       held_elsewhere: Callable[[str], bool] | None = None) -> None:
    """Copy each (HF name, tensor) into `model`, converting dtype and device.

    A module with `checkpoint_shape`/`load_weight` (the tensor-parallel layers) takes
    its own slice of the full tensor; any other parameter takes the tensor whole.
    Raises ValueError naming the weight on an unknown name, a shape mismatch, or
    (after the iterable is exhausted) any parameter left unfilled. `lm_head.weight`
    is skipped when embeddings are tied (some checkpoints store the duplicate), and
    so is any name `held_elsewhere` claims (another pipeline stage's weights).
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        if name.endswith(IGNORED_SUFFIXES) or (skip_lm_head and name == "lm_head.weight"):
            continue
        pname, shard = _split_name(name)
        if pname not in params:
            if held_elsewhere is not None and held_elsewhere(pname):
                continue
            raise ValueError(f"Unexpected weight {name!r} in checkpoint: the "
                             f"{model.arch.architecture} model has no such parameter")
        _load_one(model, params[pname], pname, shard, name, tensor)
        loaded.add(name)
    missing = expected_hf_names(model) - loaded
    if missing:
        shown = ", ".join(sorted(missing)[:5])
        raise ValueError(f"Checkpoint is missing {len(missing)} weight(s): {shown}")


def _load_one(model: nn.Module, param: nn.Parameter, pname: str, shard: str | None,
              name: str, tensor: torch.Tensor) -> None:
    module_name, _, attr = pname.rpartition(".")
    module = model.get_submodule(module_name)
    if hasattr(module, "load_weight"):
        expected = module.checkpoint_shape(attr, shard)
    else:
        expected = tuple(param.shape)
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"Weight {name!r} has shape {tuple(tensor.shape)}, "
                         f"expected {tuple(expected)}")
    if hasattr(module, "load_weight"):
        module.load_weight(attr, shard, tensor)
    else:
        param.copy_(tensor)
