"""Reads a PEFT LoRA adapter into per-module (A, B) pairs named like our model's modules.

PEFT stores, for every adapted projection `P` of the HF model,

    base_model.model.<P>.lora_A.weight   [r, in]
    base_model.model.<P>.lora_B.weight   [out, r]

and applies `y = x W^T + scaling * (x A^T) B^T` with scaling = alpha / r (alpha / sqrt(r)
under rsLoRA). We fold the scaling into B once, at load, so the batched op is a plain
shrink-then-expand. HF projection names become ours through the model's
`packed_modules_mapping` (q_proj -> qkv_proj part "q_proj"), the same table the base
weights load through.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

import torch
from safetensors.torch import load_file

from pagoda.model.weight_names import PackedModules, split_packed_name

_PREFIX = "base_model.model."
# PEFT features this loader does not implement: refused rather than silently ignored.
_UNSUPPORTED = {"use_dora": "DoRA", "modules_to_save": "modules_to_save",
                "rank_pattern": "rank_pattern", "alpha_pattern": "alpha_pattern"}


@dataclass
class LoRAModel:
    """One adapter in host memory. `weights[module][part] = (A [r, in], B [out, r] * scaling)`
    for full (unsharded) tensors; `part` is the HF shard name inside a fused module
    ("q_proj" in qkv_proj) or None. Invariant: every A has `rank` rows."""

    lora_int_id: int
    rank: int
    weights: dict[str, dict[str | None, tuple[torch.Tensor, torch.Tensor]]] = field(
        default_factory=dict)


def read_adapter_config(path: str) -> dict:
    if not path:
        raise ValueError("the LoRA adapter has no path")
    config_file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_file):
        raise ValueError(f"No adapter_config.json in LoRA adapter directory {path!r}")
    try:
        with open(config_file) as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: adapter_config.json cannot be read ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: adapter_config.json is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type {config.get('peft_type')!r} is not LORA")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise ValueError(f"{path}: LoRA adapters with {what} are not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{path}: LoRA adapters with trained biases are not supported")
    return config


def check_adapter(path: str, max_rank: int) -> int:
    """What can be told without loading the tensors: `path` holds a PEFT LoRA config
    we apply, of a rank within `max_rank`, and a weights file. The adapter's rank;
    ValueError naming the problem otherwise. Cheap (one small JSON file): callers run
    it per request, so an unreadable adapter fails that request, not a step."""
    config = read_adapter_config(path)
    try:
        rank = int(config["r"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{path}: adapter_config.json has no integer rank 'r'") from None
    if not 1 <= rank <= max_rank:
        raise ValueError(f"LoRA rank {rank} of {path} is greater than max_lora_rank "
                         f"{max_rank}" if rank > max_rank else f"{path}: rank {rank} < 1")
    if not any(os.path.isfile(os.path.join(path, f))
               for f in ("adapter_model.safetensors", "adapter_model.bin")):
        raise ValueError(f"No adapter_model.safetensors in LoRA adapter directory {path!r}")
    return rank


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    st = os.path.join(path, "adapter_model.safetensors")
    if os.path.isfile(st):
        return load_file(st)
    pt = os.path.join(path, "adapter_model.bin")
    if os.path.isfile(pt):
        return torch.load(pt, map_location="cpu", weights_only=True)
    raise ValueError(f"No adapter_model.safetensors in LoRA adapter directory {path!r}")


def load_lora_model(lora_int_id: int, path: str, packed: PackedModules, max_rank: int,
                    dtype: torch.dtype) -> LoRAModel:
    """Load an adapter directory; ValueError for a rank above `max_rank`, a module other
    than a linear projection, or a PEFT feature we do not apply."""
    config = read_adapter_config(path)
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    if rank > max_rank:
        raise ValueError(f"LoRA rank {rank} of {path} is greater than max_lora_rank {max_rank}")
    scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in _read_tensors(path).items():
        name = key[len(_PREFIX):] if key.startswith(_PREFIX) else key
        for which in ("lora_A", "lora_B"):
            marker = f".{which}."
            if marker in name:
                module = name.split(marker)[0]
                pairs.setdefault(module, {})[which] = tensor
                break
        else:
            raise ValueError(f"{path}: unsupported LoRA tensor {key!r} (only lora_A/lora_B "
                             f"of linear projections are supported)")
    model = LoRAModel(lora_int_id, rank)
    for hf_module, pair in pairs.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise ValueError(f"{path}: {hf_module} has only {', '.join(pair)}")
        a, b = pair["lora_A"], pair["lora_B"]
        if a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(f"{path}: {hf_module} has rank {a.shape[0]}, config says {rank}")
        ours, part = split_packed_name(hf_module + ".weight", packed)
        module = ours[:-len(".weight")]
        model.weights.setdefault(module, {})[part] = (
            a.to(dtype), (b.float() * scaling).to(dtype))
    return model
