"""Quantized checkpoints whose weights stay quantized in memory (vLLM's `--quantization`).

    method               file                     linear layers hold
    fp8                  fp8.py                   float8_e4m3fn weight + fp32 scales
    compressed-tensors   compressed_tensors.py    the same (its float-quantized schemes)
    awq                  awq.py  -> int4.py       packed int4 + per-group scales/zeros
    gptq                 gptq.py -> int4.py       the same, with act-order's g_idx
    mxfp4                mxfp4.py                 nothing: gpt-oss dequantizes its experts on load

How a model gets quantized: `resolve_quantization` decides once, at start-up, from
`--quantization` and config.json's `quantization_config` (vLLM's rules); the result
travels in `ModelArchConfig.quantization_config`. The loader builds the model inside
`quantized_construction(config)`, so every linear layer created there
(`parallel_layers.LinearBase`) asks `new_linear_method()` for its method, whatever the
architecture; the context is only read while layers are constructed, as
`torch.device(...)` is. Layers the checkpoint leaves unquantized are switched back
(`unquantize_ignored`), then tensors load and each method repacks
(`process_weights_after_loading`). Embeddings, the LM head, norms and MoE routers
are never quantized; MoE experts are read quantized and dequantized on load
(`pagoda.model.moe_quantized`).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pagoda.model.quantization.awq import AWQConfig
from pagoda.model.quantization.base import (LinearMethodBase, QuantizationConfig,
                                            UnquantizedLinearMethod)
from pagoda.model.quantization.compressed_tensors import CompressedTensorsConfig
from pagoda.model.quantization.fp8 import Fp8Config
from pagoda.model.quantization.gptq import GPTQConfig
from pagoda.model.quantization.mxfp4 import Mxfp4Config

logger = logging.getLogger(__name__)

QUANTIZATION_METHODS: dict[str, type[QuantizationConfig]] = {
    "fp8": Fp8Config, "awq": AWQConfig, "gptq": GPTQConfig,
    "compressed-tensors": CompressedTensorsConfig, "mxfp4": Mxfp4Config,
}

_CONSTRUCTING: contextvars.ContextVar[QuantizationConfig | None] = contextvars.ContextVar(
    "pagoda_quantization", default=None)


def read_checkpoint_quantization(model_dir: str) -> dict | None:
    """config.json's `quantization_config` (None for GGUF files and unquantized models)."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f).get("quantization_config")


def _method_name(config: dict) -> str:
    return str(config.get("quant_method", "")).lower().replace("_", "-")


def resolve_quantization(requested: str | None, checkpoint: dict | None) -> dict | None:
    """The quantization to run with, as a `quantization_config` dict (None: none).

    vLLM's rules: a quantized checkpoint runs its own method (auto-detection);
    `--quantization` must then name that method; `--quantization fp8` on an
    unquantized checkpoint quantizes its weights to FP8 while loading. Raises
    ValueError for an unknown or unsupported method, before any weight is read.
    """
    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise ValueError(f"Unknown quantization method {requested!r}; supported: "
                         f"{', '.join(QUANTIZATION_METHODS)}")
    if checkpoint is None:
        if requested is None:
            return None
        if requested == "fp8":
            return {"quant_method": "fp8", "is_checkpoint_fp8_serialized": False}
        raise ValueError(f"--quantization {requested} needs a checkpoint quantized with "
                         f"{requested}; this model's config.json has no quantization_config")
    method = _method_name(checkpoint)
    if requested is not None and requested != method:
        raise ValueError(f"Quantization method specified in the model config ({method}) does "
                         "not match the quantization method specified in the `quantization` "
                         f"argument ({requested}).")
    get_quantization_config(checkpoint)  # refuse an unsupported variant now
    return checkpoint


def get_quantization_config(config: dict | None) -> QuantizationConfig | None:
    if config is None:
        return None
    method = _method_name(config)
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"Quantization method {method!r} (config.json quantization_config) "
                         f"is not supported; supported: {', '.join(QUANTIZATION_METHODS)}")
    return QUANTIZATION_METHODS[method].from_config(config)


@contextlib.contextmanager
def quantized_construction(config: QuantizationConfig | None) -> Iterator[None]:
    """Linear layers constructed inside take `config`'s method (None: unquantized)."""
    token = _CONSTRUCTING.set(config)
    try:
        yield
    finally:
        _CONSTRUCTING.reset(token)


def current_quant_config() -> QuantizationConfig | None:
    return _CONSTRUCTING.get()


def new_linear_method() -> LinearMethodBase:
    config = _CONSTRUCTING.get()
    return config.get_linear_method() if config is not None else UnquantizedLinearMethod()


def _matches(name: str, patterns: list[str]) -> bool:
    """vLLM's matching of an ignore list: `re:` regexes, else a whole name or dotted part."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], name):
                return True
        elif f".{pattern}." in f".{name}.":
            return True
    return False


def unquantize_ignored(model: nn.Module, config: QuantizationConfig) -> None:
    """Give the layers the checkpoint left unquantized the plain method. A fused layer
    (`qkv_proj`) counts only when all its parts are ignored; some but not all is an
    error, as in vLLM (their tensors could not share one form)."""
    patterns = config.ignored_modules()
    if not patterns:
        return
    packed = getattr(model, "packed_modules_mapping", {})
    for name, module in model.named_modules():
        if getattr(module, "dequantizer", None) is not None:  # MoE experts (`moe.FusedMoE`)
            if _matches(f"{name}.0.{module.gate_name}", patterns):
                module.dequantizer = None
            continue
        if not hasattr(module, "set_quant_method"):
            continue
        prefix, _, leaf = name.rpartition(".")
        parts = [f"{prefix}.{p}" for p in packed.get(leaf, (leaf,))]
        ignored = [_matches(p, patterns) for p in parts]
        if all(ignored):
            module.set_quant_method(UnquantizedLinearMethod())
        elif any(ignored):
            raise ValueError(f"Some but not all of {parts} are unquantized in this checkpoint; "
                             "a fused layer needs them all in one form")


def checkpoint_tensors(weights: Iterable[tuple[str, torch.Tensor]],
                       config: QuantizationConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors as the methods read them (`checkpoint_tensor`)."""
    for name, tensor in weights:
        tensor = config.checkpoint_tensor(name, tensor)
        if tensor is not None:
            yield name, tensor


def process_weights_after_loading(model: nn.Module) -> None:
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer, in the form they are stored."""
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)
