"""The engine's multi-modal settings (vLLM's names) and the combinations refused with
them.

    --limit-mm-per-prompt '{"image": N}'   at most N images per prompt (999 if unset)
    --mm-processor-kwargs '{...}'          HF processor kwargs for every item
    --mm-processor-cache-gb G              LRU of processor outputs by content hash (0: off)
    max_num_encoder_input_tokens / encoder_cache_size (EngineArgs only): the scheduler's
        per-step encoder budget and the worker's encoder cache, in embedding rows;
        default max(max_num_batched_tokens, the largest item's rows), as vLLM's

A model whose architecture takes no media gets no `MultiModalConfig`, and every request
with media is refused by name (`pagoda.multimodal.checks`).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from pagoda.config import MultiModalConfig
from pagoda.json_flag import json_object
from pagoda.multimodal.processing import is_multimodal_architecture, parse_limit_mm_per_prompt


def add_multimodal_cli_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's multi-modal engine flags (each skipped if the parser already has it: a
    service may register the same flag for its own part of the work)."""
    flags = {
        "--limit-mm-per-prompt": dict(default=None, metavar="JSON",
                                      help='Most media items per prompt by modality, e.g. '
                                           '\'{"image": 2}\' (a modality left out: 999).'),
        "--mm-processor-kwargs": dict(default=None, metavar="JSON",
                                      help="Keyword arguments for the model's HF processor, "
                                           "for every item (a request's own override them)."),
        "--mm-processor-cache-gb": dict(type=float, default=4.0, metavar="GB",
                                        help="Processor outputs kept by content hash (0: off)."),
    }
    for flag, kwargs in flags.items():
        if flag not in parser._option_string_actions:  # noqa: SLF001 - argparse's own table
            parser.add_argument(flag, **kwargs)


def multimodal_config(args: Any, arch) -> MultiModalConfig | None:
    """The model's multi-modal config, or None for a text-only architecture."""
    if not is_multimodal_architecture(arch.architecture):
        return None
    gb = 4.0 if args.mm_processor_cache_gb is None else float(args.mm_processor_cache_gb)
    if gb < 0:
        raise ValueError(f"mm_processor_cache_gb must be >= 0, got {gb}")
    return MultiModalConfig(
        limit_mm_per_prompt=parse_limit_mm_per_prompt(args.limit_mm_per_prompt),
        mm_processor_kwargs=json_object(args.mm_processor_kwargs, "mm_processor_kwargs") or {},
        mm_processor_cache_gb=gb)


def encoder_budget(args: Any, arch, max_num_batched_tokens: int,
                   model_path: str | None = None) -> tuple[int, int]:
    """(max_num_encoder_input_tokens, encoder_cache_size); (0, 0) for a text-only model."""
    if not is_multimodal_architecture(arch.architecture):
        return 0, 0
    largest = (getattr(arch.family_settings, "max_tokens_per_mm_item", 0)
               or _largest_dynamic_item(model_path))
    budget = args.max_num_encoder_input_tokens or max(max_num_batched_tokens, largest)
    cache = args.encoder_cache_size or budget
    if budget < largest:
        raise ValueError(f"max_num_encoder_input_tokens ({budget}) is smaller than one "
                         f"image of {arch.architecture} ({largest} tokens)")
    if cache < budget:
        raise ValueError(f"encoder_cache_size ({cache}) must be >= "
                         f"max_num_encoder_input_tokens ({budget})")
    return budget, cache


def refuse_multimodal_combinations(args: Any, arch, runner: str) -> None:
    """ValueError naming what a multi-modal model is not verified with."""
    if not is_multimodal_architecture(arch.architecture):
        return
    refused = {
        "tensor_parallel_size > 1": args.tensor_parallel_size > 1,
        "pipeline_parallel_size > 1": args.pipeline_parallel_size > 1,
        "--speculative-config": args.speculative_config is not None,
        "--async-scheduling": args.async_scheduling,
        "--kv-offloading-size": bool(args.kv_offloading_size),
        "--enable-lora": args.enable_lora,
        "--runner pooling": runner == "pooling",
    }
    named = [name for name, on in refused.items() if on]
    if named:
        raise ValueError(f"{arch.architecture} (a multi-modal model) is not supported with "
                         f"{', '.join(named)}: the combination is not verified")


def _largest_dynamic_item(model_path: str | None) -> int:
    """A dynamic-resolution processor's largest image in placeholder tokens: its
    `max_pixels` (or `size.longest_edge`) over (patch * merge)**2 (Qwen2-VL's rule);
    0 when the model folder says nothing."""
    path = os.path.join(model_path or "", "preprocessor_config.json")
    if not model_path or not os.path.exists(path):
        return 0
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    max_pixels = config.get("max_pixels") or (config.get("size") or {}).get("longest_edge")
    patch, merge = config.get("patch_size"), config.get("merge_size")
    if not (max_pixels and patch and merge):
        return 0
    return int(max_pixels) // (int(patch) * int(merge)) ** 2
