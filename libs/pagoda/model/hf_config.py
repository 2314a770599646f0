"""ModelArchConfig from an HF model directory (config.json, generation_config.json).

The fields every Llama-shaped config spells the same way, and the shared features
(sliding window), are read here; the registry says whether the architecture runs at
all, its `update_arch_config` hook adds what that architecture's config leaves
implicit, and its `settings` class parses the family's own settings. Nothing here
names a family or one of its settings.
"""

from __future__ import annotations

import dataclasses
import json
import os

from pagoda.config import (FULL_ATTENTION, SLIDING_ATTENTION, ModelArchConfig,
                           SlidingWindowConfig)
from pagoda.model.registry import MODEL_REGISTRY
from pagoda.model.rope_scaling import normalize_rope_scaling


def _read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _merge_eos(config_eos, generation_eos):
    """Union of the eos ids of config.json and generation_config.json, config's first.

    Instruct checkpoints often list their end-of-turn token only in the generation
    config (Llama 3: eos 128001 in config, [128001, 128008, 128009] there).
    """
    ids: list[int] = []
    for value in (config_eos, generation_eos):
        for token in [value] if isinstance(value, int) else (value or []):
            if token not in ids:
                ids.append(token)
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else ids


def _rope(config: dict) -> tuple[float, dict | None]:
    # transformers >= 5 writes `rope_parameters` (theta inside); older configs
    # write `rope_theta` and `rope_scaling` at the top level.
    params = config.get("rope_parameters") or {}
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    scaling = normalize_rope_scaling(config.get("rope_scaling") or params)
    # Phi-3 keeps the pretraining length beside, not inside, its scaling parameters.
    if scaling and "original_max_position_embeddings" in config:
        scaling.setdefault("original_max_position_embeddings",
                           config["original_max_position_embeddings"])
    return float(theta), scaling


def _sliding_window(config: dict) -> SlidingWindowConfig | None:
    """The window and per-layer types as transformers reads them; None without a window.

    `layer_types` (transformers >= 4.53) names each layer; older configs leave it out:
    then every layer slides (Mistral, Phi-3), except Qwen2's rule (layers from
    `max_window_layers` on) and the patterns Gemma's `update_arch_config` sets.
    """
    window = config.get("sliding_window")
    if not window or config.get("use_sliding_window") is False:
        return None
    layer_types = config.get("layer_types")
    if layer_types is None and "max_window_layers" in config:
        first = config["max_window_layers"]
        layer_types = [SLIDING_ATTENTION if i >= first else FULL_ATTENTION
                       for i in range(config["num_hidden_layers"])]
    if layer_types is not None and SLIDING_ATTENTION not in layer_types:
        return None
    return SlidingWindowConfig(int(window),
                               tuple(layer_types) if layer_types is not None else None)


def arch_config_from_hf_dir(model_dir: str) -> ModelArchConfig:
    """Parse `model_dir/config.json`; ValueError for an architecture we cannot run."""
    config = _read_json(os.path.join(model_dir, "config.json"))
    architectures = config.get("architectures") or []
    if not architectures:
        raise ValueError(f"{model_dir}/config.json names no architecture")
    spec = MODEL_REGISTRY.resolve(architectures)
    full_config = config
    if spec.text_config_key:
        # A multi-modal model nests its language model's config (`text_config`); the
        # common fields are the language model's, the family settings read the rest.
        text = dict(config.get(spec.text_config_key) or {})
        # transformers v5 ties the head by the top-level flag, which the LLaVA and Qwen2-VL
        # config classes set when either level asks for it (their rule for pre-v5 saves);
        # a family whose config class has no such rule (Idefics3) reads its own.
        text["tie_word_embeddings"] = bool(config.get("tie_word_embeddings", False)
                                           or text.get("tie_word_embeddings", False))
        rope = text.get("rope_scaling") or {}
        if (rope.get("type") or rope.get("rope_type")) == "mrope":
            # Multi-axis RoPE (hub configs of Qwen2-VL): plain RoPE per position axis, its
            # sections read by the family's settings from the whole config.
            text["rope_scaling"] = None
        config = {**text, "architectures": architectures}
    generation_path = os.path.join(model_dir, "generation_config.json")
    generation = _read_json(generation_path) if os.path.exists(generation_path) else {}
    num_heads = config["num_attention_heads"]
    rope_theta, rope_scaling = _rope(config)
    arch = ModelArchConfig(
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=num_heads,
        num_key_value_heads=config.get("num_key_value_heads") or num_heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=config.get("max_position_embeddings", 2048),
        tie_word_embeddings=config.get("tie_word_embeddings", False),
        attention_bias=config.get("attention_bias", False),
        bos_token_id=config.get("bos_token_id"),
        eos_token_id=_merge_eos(config.get("eos_token_id"), generation.get("eos_token_id")),
        architecture=spec.hf_name,
        hidden_act=config.get("hidden_act") or config.get("hidden_activation") or "silu",
        sliding_window=_sliding_window(config),
    )
    if spec.update_arch_config:
        arch = spec.update_arch_config(config, arch)
    if spec.settings:
        arch = dataclasses.replace(arch, family_settings=spec.settings.from_hf_config(full_config,
                                                                                    arch))
    return arch
