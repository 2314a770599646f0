"""GGUF files (llama.cpp's format): architecture config and HF-named weights.

`general.architecture` picks the registry entry and its `GGUFLayout` (tensor names).
Weights are dequantized to fp32 with `gguf.quants.dequantize` and renamed to HF
names, so they go through the same `load_weights` as safetensors checkpoints.
llama.cpp's converter permutes the rows of Q and K of "llama" models (it uses the
interleaved rotary layout, HF the rotate-half one); where the layout says so we undo
it exactly as transformers does, so the loaded weights equal transformers' GGUF load
bit for bit.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable, Iterator

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

from pagoda.config import ModelArchConfig
from pagoda.model.arch_spec import GGUFLayout, ModelArchitecture
from pagoda.model.gguf_metadata import GGUFMetadata
from pagoda.model.registry import MODEL_REGISTRY
from pagoda.model.rope_scaling import normalize_rope_scaling

# Llama 3 rope scaling as per-frequency divisors (read into the config, not the model).
_ROPE_FREQS = "rope_freqs.weight"


@functools.lru_cache(maxsize=2)
def gguf_reader(path: str) -> GGUFReader:
    """gguf's own reader: parsing the metadata (vocabulary included) takes seconds; used
    only where `GGUFMetadata` does not read the file."""
    return GGUFReader(path)


@functools.lru_cache(maxsize=4)
def gguf_metadata(path: str) -> GGUFMetadata | GGUFReader:
    """The metadata, tensor directory and (memory-mapped) tensors without building the
    vocabulary's items (milliseconds; `gguf_metadata.py`), or gguf's whole reader for a
    file that one does not take (big-endian, GGUF v1, a header over 64 MiB). Config and
    weights share it."""
    try:
        return GGUFMetadata(path)
    except (ValueError, EOFError, struct.error):
        return gguf_reader(path)


def _field(reader: GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def resolve_gguf_architecture(reader: GGUFReader,
                              path: str) -> tuple[ModelArchitecture, GGUFLayout]:
    """The registry entry running this file, and its tensor names; ValueError naming
    the file for an architecture we cannot run."""
    try:
        return MODEL_REGISTRY.resolve_gguf(_field(reader, "general.architecture"),
                                           str(_field(reader, "general.name", "")))
    except ValueError as e:
        raise ValueError(f"{e} (in {path})") from None


def unpermute_rotary_rows(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute` on Q/K rows (weights or biases), per head."""
    half = weights.shape[0] // num_heads // 2
    w = weights.reshape(num_heads, half, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


def iter_gguf_weights(path: str, arch: ModelArchConfig,
                      include: Callable[[str], bool] | None = None
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, fp32 tensor) for every weight of the file (that `include`
    accepts: the rest are never dequantized), one at a time."""
    # lazy: reading a GGUF's architecture (arch_config_from_gguf, the tokenizer
    # service's) needs no torch, seconds of CPU at a cluster's start
    import torch

    reader = gguf_metadata(path)
    _, layout = resolve_gguf_architecture(reader, path)
    permuted = layout.rotary_rows_permuted
    for tensor in reader.tensors:
        if tensor.name == _ROPE_FREQS:
            continue
        name = layout.hf_tensor_name(tensor.name)
        if include is not None and not include(name):
            continue
        weights = dequantize(tensor.data, tensor.tensor_type)
        if permuted and ".attn_q." in tensor.name:
            weights = unpermute_rotary_rows(weights, arch.num_attention_heads)
        elif permuted and ".attn_k." in tensor.name:
            weights = unpermute_rotary_rows(weights, arch.num_key_value_heads)
        # Copy: the data may be a read-only view of the memory-mapped file.
        yield name, torch.from_numpy(np.array(weights, dtype=np.float32, copy=True))


def _rope_scaling(reader, prefix: str, tensors: dict) -> dict | None:
    if _ROPE_FREQS in tensors:
        t = tensors[_ROPE_FREQS]
        factors = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(-1)
        return {"rope_type": "freq_factors", "freq_factors": factors.tolist()}
    kind = _field(reader, prefix + "rope.scaling.type")
    factor = _field(reader, prefix + "rope.scaling.factor")
    legacy_linear = _field(reader, prefix + "rope.scale_linear")
    if kind in (None, "none") and legacy_linear not in (None, 1.0):
        kind, factor = "linear", legacy_linear
    if kind in (None, "none"):
        return None
    scaling = {"rope_type": kind, "factor": factor}
    original = _field(reader, prefix + "rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = original
    return normalize_rope_scaling(scaling)


def _eos_token_ids(reader: GGUFReader) -> int | list[int] | None:
    # llama.cpp stops on any end-of-generation token: eos, end-of-turn, end-of-message.
    ids = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = _field(reader, f"tokenizer.ggml.{key}")
        if value is not None and value not in ids:
            ids.append(int(value))
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else ids


def gguf_eos_token_ids(path: str) -> list[int]:
    """`arch_config_from_gguf(path).eos_token_ids` from the metadata alone: no
    architecture lookup (the registry imports every model class, and torch)."""
    ids = _eos_token_ids(gguf_metadata(path))
    return [] if ids is None else [ids] if isinstance(ids, int) else list(ids)


def arch_config_from_gguf(path: str) -> ModelArchConfig:
    """ModelArchConfig from GGUF metadata; ValueError for an architecture we cannot run."""
    reader = gguf_metadata(path)
    spec, _ = resolve_gguf_architecture(reader, path)
    p = _field(reader, "general.architecture") + "."
    tensors = {t.name: t for t in reader.tensors}
    hidden = int(_field(reader, p + "embedding_length"))
    num_heads = int(_field(reader, p + "attention.head_count"))
    head_dim = (_field(reader, p + "attention.key_length")
                or _field(reader, p + "rope.dimension_count") or hidden // num_heads)
    vocab = _field(reader, p + "vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    return ModelArchConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, p + "feed_forward_length")),
        num_hidden_layers=int(_field(reader, p + "block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(_field(reader, p + "attention.head_count_kv", num_heads)),
        head_dim=int(head_dim),
        rms_norm_eps=float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(_field(reader, p + "rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(reader, p, tensors),
        max_position_embeddings=int(_field(reader, p + "context_length", 2048)),
        # llama.cpp drops the LM head of tied models; the embedding matrix serves as both.
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        bos_token_id=None if bos is None else int(bos),
        eos_token_id=_eos_token_ids(reader),
        architecture=spec.hf_name,
    )


def gguf_matrix_types(path: str) -> set[str]:
    """The GGUF tensor types (e.g. "Q4_1", "Q6_K") of the file's 2-D weights."""
    return {t.tensor_type.name for t in gguf_metadata(path).tensors if len(t.shape) == 2}
