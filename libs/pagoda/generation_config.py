"""Default sampling parameters from a model's `generation_config.json` (vLLM's `--generation-config`).

A model's creator may recommend sampling settings in `generation_config.json`
(e.g. Llama 3: temperature 0.6, top_p 0.9). As in vLLM, these become the defaults
of every request that leaves the field unset, on the served path (the gateway) and
offline (`LLM.generate(prompts)` without sampling params, `pagoda run-batch`).

`--generation-config` chooses the source:
  * `auto` (default): the model folder's `generation_config.json`;
  * `vllm`: none; Pagoda's (= vLLM's) own defaults;
  * a folder: that folder's `generation_config.json`.
`--override-generation-config '{"temperature": 0.5}'` is laid over the loaded values
(and works with `vllm` too).

The fields read are vLLM's: temperature, top_p, top_k, min_p, repetition_penalty and
max_new_tokens (which becomes `max_tokens`). As with vLLM (which reads the file
through transformers' `GenerationConfig.to_diff_dict`), a value equal to
transformers' default is no recommendation and is dropped, so a file that merely
spells out `top_k: 50` does not turn top-k on. This module is pure: no torch, so
the gateway may use it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import Any

from pagoda.json_flag import json_object

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
# generation_config.json field -> SamplingParams field.
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
# transformers' GenerationConfig defaults: a file's value equal to these is not a
# recommendation (to_diff_dict leaves it out, so vLLM never sees it).
_TRANSFORMERS_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50,
                          "repetition_penalty": 1.0}
MODES = ("auto", "vllm")


def load_generation_defaults(model_path: str | None, generation_config: str = "auto",
                             override: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """SamplingParams keyword arguments recommended for `model_path` (possibly empty).

    `model_path`: the resolved model (a folder, or a GGUF file, which has no
    generation config); `generation_config`: `auto`, `vllm` or a folder. Raises
    ValueError for a folder that does not exist or a file that is not a JSON object.
    """
    if generation_config == "vllm":
        config: dict[str, Any] = {}
    elif generation_config == "auto":
        folder = model_path if model_path and os.path.isdir(model_path) else None
        config = _read(folder) if folder else {}
    else:
        if not os.path.isdir(generation_config):
            raise ValueError(f"--generation-config {generation_config!r} is neither 'auto', "
                             f"'vllm' nor a folder")
        config = _read(generation_config)
    defaults = {FIELDS[k]: v for k, v in config.items()
                if k in FIELDS and v is not None and _TRANSFORMERS_DEFAULTS.get(k) != v}
    for key, value in (override or {}).items():
        if key not in FIELDS:
            raise ValueError(f"--override-generation-config: unknown field {key!r}; "
                             f"expected one of {', '.join(FIELDS)}")
        defaults[FIELDS[key]] = value
    if defaults:
        logger.info("Default sampling parameters from the generation config: %s (start with "
                    "--generation-config vllm to use Pagoda's own defaults)", defaults)
    return defaults


def parse_override(value: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """`--override-generation-config`'s JSON (a mapping passes through)."""
    return json_object(value, "--override-generation-config") or {}


def default_max_tokens(defaults: Mapping[str, Any], remaining: int) -> int:
    """vLLM's default completion length: the room left in the context, capped by the
    generation config's `max_new_tokens` when it has one."""
    recommended = defaults.get("max_tokens")
    return min(remaining, recommended) if recommended else remaining


def _read(folder: str) -> dict[str, Any]:
    path = os.path.join(folder, GENERATION_CONFIG_FILE)
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return config
