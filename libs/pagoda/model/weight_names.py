"""Loads HF-named weights into a model whose projections may be fused.

The model class says which HF tensors it fuses in its `packed_modules_mapping`
(vLLM's name): fused parameter -> HF shard names in row order. Llama's
`...self_attn.qkv_proj.weight` is the row-wise concatenation [q_proj; k_proj; v_proj]
and `...mlp.gate_up_proj.weight` is [gate_proj; up_proj] (biases likewise), so each
HF tensor lands in a row range of its fused parameter; the fused layer knows the
ranges, and under tensor parallelism takes only its rank's slice of each
(`pagoda.model.parallel_layers`).

Two kinds of parameter are not named after checkpoint tensors:
- a module with `checkpoint_tensors()` (the MoE experts: one stacked parameter fed by
  one checkpoint tensor per expert) lists the names under its prefix it reads, with
  their shapes (None: another rank's, skipped), and loads each itself
  (`load_checkpoint_tensor`);
- a parameter flagged `computed_at_load` (the scales of weights quantized while
  loading) is filled from another tensor, so no checkpoint tensor is expected for it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

# Buffers some checkpoints carry that we recompute instead.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

PackedModules = Mapping[str, tuple[str, ...]]


def packed_modules(model: nn.Module) -> PackedModules:
    """The model class's fused parameter -> HF shards table (empty: nothing fused)."""
    return getattr(model, "packed_modules_mapping", {})


def split_packed_name(name: str, packed: PackedModules) -> tuple[str, str | None]:
    """HF name -> (our parameter name, shard name or None when not fused)."""
    for fused, shards in packed.items():
        for shard in shards:
            token = f".{shard}."
            if token in name:
                return name.replace(token, f".{fused}."), shard
    return name, None


def checkpoint_routes(model: nn.Module) -> dict[str, tuple[nn.Module, str, tuple | None]]:
    """HF name -> (module, name under its prefix, shape or None) for every module that
    reads its own checkpoint tensors (`checkpoint_tensors`)."""
    routes = {}
    for prefix, module in model.named_modules():
        if hasattr(module, "checkpoint_tensors"):
            for suffix, shape in module.checkpoint_tensors().items():
                routes[f"{prefix}.{suffix}"] = (module, suffix, shape)
    return routes


def expected_hf_names(model: nn.Module) -> set[str]:
    """The HF names a checkpoint must provide to fill every parameter of `model`."""
    routes = checkpoint_routes(model)
    names = {name for name, (_, _, shape) in routes.items() if shape is not None}
    routed = {prefix for prefix, module in model.named_modules()
              if hasattr(module, "checkpoint_tensors")}
    packed = packed_modules(model)
    for pname, param in model.named_parameters():
        if getattr(param, "computed_at_load", False) or pname.rpartition(".")[0] in routed:
            continue
        for fused, shards in packed.items():
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
    packed = packed_modules(model)
    routes = checkpoint_routes(model)
    loaded: set[str] = set()
    for name, tensor in weights:
        if name.endswith(IGNORED_SUFFIXES) or (skip_lm_head and name == "lm_head.weight"):
            continue
        if name in routes:
            _load_routed(name, tensor, *routes[name])
            loaded.add(name)
            continue
        pname, shard = split_packed_name(name, packed)
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


def _load_routed(name: str, tensor: torch.Tensor, module: nn.Module, suffix: str,
                 shape: tuple | None) -> None:
    if shape is None:  # another rank's share (an expert placed elsewhere)
        return
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"Weight {name!r} has shape {tuple(tensor.shape)}, "
                         f"expected {tuple(shape)}")
    module.load_checkpoint_tensor(suffix, tensor)


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
