"""Find a model on disk, read its architecture, pick a dtype, and load its weights.

A model is an HF directory (config.json + weights: *.safetensors, or *.bin/*.pt when it
has no safetensors), a GGUF file (or a directory holding exactly one), or a Hugging Face
model id (`ORG/NAME`, not a local path), which `pagoda.model.hub` downloads into the HF
cache first. The architecture's registry entry (`pagoda.model.registry`) gives the model
class; every format feeds its `load_weights` with HF-named tensors.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from pagoda.config import ModelArchConfig
from pagoda.distributed.parallel_state import ParallelContext
from pagoda.model import quantization as quantization_methods
from pagoda.model.cpu_features import cpu_has_fast_bf16
from pagoda.model.gguf_loader import iter_gguf_weights
# Re-exported: the torch-free half (paths, architecture) lives in model_path.
from pagoda.model.model_path import (DEFAULT_MODEL_FILE, DEFAULT_MODEL_PACKAGE,  # noqa: F401
                                     default_model_path, is_gguf, load_arch_config,
                                     resolve_model_path)
from pagoda.model.moe_quantized import refuse_unsupported_expert_quantization
from pagoda.model.pooling_model import as_pooling_model
from pagoda.model.pt_loader import iter_pt_weights
from pagoda.model.registry import MODEL_REGISTRY
from pagoda.model.safetensors_loader import iter_safetensors_weights
from pagoda.model.weight_files import local_weight_files

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}


def load_model(model_path: str, arch: ModelArchConfig, dtype: torch.dtype,
               device: str | torch.device = "cpu",
               parallel: ParallelContext | None = None, runner: str = "generate") -> nn.Module:
    """Build the model class registered for `arch.architecture` directly on `device` in
    `dtype` and fill it from the checkpoint.

    With a `parallel` context, only this rank's share is built, and a pipeline stage
    reads only the checkpoint tensors it needs. `runner="pooling"` builds a generative
    decoder in its pooling form (no LM head: `pooling_model.as_pooling_model`).
    """
    model_cls = MODEL_REGISTRY.resolve(arch.architecture).model_cls
    if runner == "pooling":
        model_cls = as_pooling_model(model_cls)
    quant = quantization_methods.get_quantization_config(arch.quantization_config)
    if quant is not None and arch.moe is not None:
        refuse_unsupported_expert_quantization(quant, arch.architecture)
    with torch.device(device), quantization_methods.quantized_construction(quant):
        model = model_cls(arch, dtype, parallel)
        if quant is not None:
            quantization_methods.unquantize_ignored(model, quant)
    include = model.needs_checkpoint_tensor if parallel and parallel.world_size > 1 else None
    weights = iter_checkpoint_weights(model_path, arch, include)
    if quant is not None:
        weights = quantization_methods.checkpoint_tensors(weights, quant)
    model.load_weights(weights)
    quantization_methods.process_weights_after_loading(model)
    logger.info("Model weights take %.4f GiB (%s)",
                quantization_methods.weight_bytes(model) / 1024**3,
                f"{quant.name} quantization" if quant else f"unquantized, {dtype}")
    return model.eval()


def iter_checkpoint_weights(model_path: str, arch: ModelArchConfig, include=None):
    """(HF name, tensor) of every checkpoint tensor `include` accepts (None: all)."""
    if is_gguf(model_path):
        return iter_gguf_weights(model_path, arch, include)
    files = local_weight_files(model_path)
    if files is None:
        raise FileNotFoundError(f"no model weights at {model_path}: not a folder "
                                "or GGUF file that can be read")
    return (iter_pt_weights(model_path, include) if files.format == "pt"
            else iter_safetensors_weights(model_path, include))


def resolve_dtype(dtype: str, device: str | torch.device) -> torch.dtype:
    """vLLM's --dtype values -> a torch dtype.

    "auto" is bfloat16 on CUDA, and on CPU only where bf16 matmuls are native
    (there they run about 4x faster than fp32; elsewhere bf16 is emulated and slow).
    """
    name = dtype.lower()
    if name == "auto":
        if torch.device(device).type == "cuda" or cpu_has_fast_bf16():
            return torch.bfloat16
        return torch.float32
    if name not in _DTYPES:
        raise ValueError(f"Unknown dtype {dtype!r}; expected auto, "
                         f"{', '.join(_DTYPES)}")
    return _DTYPES[name]
