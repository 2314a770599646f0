"""vLLM's `--speculative-config` JSON, parsed and validated."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from pagoda.json_flag import json_object

# vLLM's defaults when neither lookup bound is given.
DEFAULT_PROMPT_LOOKUP = 5
_KNOWN_KEYS = {"method", "model", "num_speculative_tokens", "prompt_lookup_max",
               "prompt_lookup_min", "disable_by_batch_size"}


METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """n-gram (prompt lookup) or draft-model speculation.

    Invariants: 1 <= prompt_lookup_min <= prompt_lookup_max; num_speculative_tokens >= 1;
    `model` (a draft model's path or hub id) is set exactly when method is "draft_model".
    `disable_by_batch_size`: no drafts while this many requests or more run (at large
    batches the step is compute-bound and verifying drafts costs more than it saves).
    `vocab_size`: the target's, filled in by the engine config for a draft model (the
    scheduler drops worker drafts outside it).
    """

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    disable_by_batch_size: int | None = None
    model: str | None = None
    vocab_size: int | None = None

    @property
    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"

    @classmethod
    def parse(cls, value: dict | str | None) -> "SpeculativeConfig | None":
        """The config from the flag's JSON (or a dict); None when unset. ValueError
        names what is wrong, as vLLM's validation does."""
        value = json_object(value, "--speculative-config")
        if not value:
            return None
        unknown = sorted(set(value) - _KNOWN_KEYS)
        if unknown:
            raise ValueError(f"--speculative-config: unsupported key(s) {unknown}; Pagoda "
                             f"reads {sorted(_KNOWN_KEYS)}")
        method = value.get("method")
        model = value.get("model")
        if method is None and model in ("[ngram]", "ngram"):  # vLLM's older spelling
            method, model = "ngram", None
        elif method is None and model is not None:  # vLLM: a model alone means a draft model
            method = "draft_model"
        if method not in METHODS:
            raise ValueError(f"--speculative-config: method {method!r} is not supported; "
                             'Pagoda implements {"method": "ngram"} (prompt lookup) and '
                             '{"model": DRAFT} (a draft model of the same tokenizer)')
        if method == "draft_model" and (not isinstance(model, str) or not model):
            raise ValueError('--speculative-config: a draft model needs "model": its path '
                             "or Hugging Face id")
        if method == "ngram" and model is not None:
            raise ValueError('--speculative-config: "model" names a draft model; the ngram '
                             "method takes none")
        k = value.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError("--speculative-config: num_speculative_tokens must be a "
                             f"positive integer, got {k!r}")
        lookup_max, lookup_min = value.get("prompt_lookup_max"), value.get("prompt_lookup_min")
        if lookup_max is None and lookup_min is None:
            lookup_max = lookup_min = DEFAULT_PROMPT_LOOKUP
        elif lookup_max is None:
            lookup_max = lookup_min
        elif lookup_min is None:
            lookup_min = lookup_max
        for name, bound in (("prompt_lookup_min", lookup_min), ("prompt_lookup_max", lookup_max)):
            if not isinstance(bound, int) or isinstance(bound, bool) or bound < 1:
                raise ValueError(f"--speculative-config: {name} must be a positive integer, "
                                 f"got {bound!r}")
        if lookup_min > lookup_max:
            raise ValueError(f"--speculative-config: prompt_lookup_min ({lookup_min}) must be "
                             f"<= prompt_lookup_max ({lookup_max})")
        disable = value.get("disable_by_batch_size")
        if disable is not None and (not isinstance(disable, int) or disable < 2):
            raise ValueError("--speculative-config: disable_by_batch_size must be an integer "
                             f">= 2, got {disable!r}")
        return cls(k, method, lookup_max, lookup_min, disable, model)


MTP_METHODS = ("mtp", "deepseek_mtp")  # vLLM's names for drafts from the model's MTP heads


def refuse_mtp(value: dict | str | None, architecture: str, model_path: str) -> None:
    """ValueError for `{"method": "mtp"}` (vLLM's multi-token-prediction drafts), naming
    the architecture, whether its checkpoint has MTP heads (config.json
    `num_nextn_predict_layers`) and the methods Pagoda implements instead."""
    value = json_object(value, "--speculative-config")
    if not value or value.get("method") not in MTP_METHODS:
        return
    config_file = os.path.join(model_path, "config.json")
    num_mtp = 0
    if os.path.isfile(config_file):
        with open(config_file, encoding="utf-8") as f:
            num_mtp = json.load(f).get("num_nextn_predict_layers") or 0
    if num_mtp:
        why = (f"{architecture}'s checkpoint has {num_mtp} MTP layer(s), but Pagoda does not "
               "run MTP heads as drafts (it loads the model without them)")
    else:
        why = (f"{architecture} has no MTP heads (config.json has no "
               "num_nextn_predict_layers)")
    raise ValueError(f"--speculative-config: method {value['method']!r} drafts with the "
                     f"model's multi-token-prediction heads; {why}. Use "
                     '{"method": "ngram"} (prompt lookup) or {"model": DRAFT} (a draft '
                     "model of the same tokenizer)")
