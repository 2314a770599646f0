"""vLLM's `--speculative-config` JSON, parsed and validated."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

from pagoda.json_flag import json_object

logger = logging.getLogger(__name__)

# vLLM's defaults when neither lookup bound is given.
DEFAULT_PROMPT_LOOKUP = 5
_KNOWN_KEYS = {"method", "model", "num_speculative_tokens", "prompt_lookup_max",
               "prompt_lookup_min", "disable_by_batch_size"}


METHODS = ("ngram", "draft_model", "mtp")
MTP_METHODS = ("mtp", "deepseek_mtp")  # vLLM's names for drafts from the model's MTP heads


@dataclass(frozen=True)
class SpeculativeConfig:
    """n-gram (prompt lookup), draft-model or MTP speculation.

    Invariants: 1 <= prompt_lookup_min <= prompt_lookup_max; num_speculative_tokens >= 1
    (0 only between `parse` and the engine config for "mtp" without it: the engine fills
    in the checkpoint's number of MTP layers, as vLLM does); `model` (a draft model's path
    or hub id) is set exactly when method is "draft_model". "mtp" drafts come from the
    target checkpoint's own multi-token-prediction layer (vLLM's "deepseek_mtp" is read
    as "mtp", as vLLM does).
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

    @property
    def uses_mtp(self) -> bool:
        return self.method == "mtp"

    @property
    def drafts_on_worker(self) -> bool:
        """Drafts proposed by the worker after each step (a draft model, MTP layers),
        not by the scheduler (n-gram)."""
        return self.method in ("draft_model", "mtp")

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
        if method == "deepseek_mtp":  # vLLM: deprecated, replaced with mtp
            logger.warning("method `deepseek_mtp` is deprecated and replaced with mtp.")
            method = "mtp"
        if method is None and model in ("[ngram]", "ngram"):  # vLLM's older spelling
            method, model = "ngram", None
        elif method is None and model is not None:  # vLLM: a model alone means a draft model
            method = "draft_model"
        if method not in METHODS:
            raise ValueError(f"--speculative-config: method {method!r} is not supported; "
                             'Pagoda implements {"method": "ngram"} (prompt lookup), '
                             '{"model": DRAFT} (a draft model of the same tokenizer) and '
                             '{"method": "mtp"} (a DeepSeek-V3 checkpoint\'s MTP layer)')
        if method == "draft_model" and (not isinstance(model, str) or not model):
            raise ValueError('--speculative-config: a draft model needs "model": its path '
                             "or Hugging Face id")
        if method == "ngram" and model is not None:
            raise ValueError('--speculative-config: "model" names a draft model; the ngram '
                             "method takes none")
        if method == "mtp" and model is not None:
            raise ValueError('--speculative-config: "model" names a draft model; the mtp '
                             "method drafts with the target checkpoint's own MTP layer")
        k = value.get("num_speculative_tokens")
        if k is None and method == "mtp":
            k = 0  # the checkpoint's number of MTP layers, filled in by the engine config
        elif not isinstance(k, int) or isinstance(k, bool) or k < 1:
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


def num_mtp_layers(model_path: str) -> int:
    """config.json's `num_nextn_predict_layers` (0 when absent or unreadable)."""
    config_file = os.path.join(model_path, "config.json")
    if not os.path.isfile(config_file):
        return 0
    with open(config_file, encoding="utf-8") as f:
        return json.load(f).get("num_nextn_predict_layers") or 0


def refuse_mtp(config: SpeculativeConfig | None, architecture: str, model_path: str,
               mtp_architecture: bool, **limits: bool) -> None:
    """ValueError for `{"method": "mtp"}` where it cannot run: a checkpoint without MTP
    heads (config.json `num_nextn_predict_layers`), an architecture whose MTP layers
    Pagoda does not run (`mtp_architecture` false), or a feature of `limits` (a flag
    name -> whether it is on) that MTP drafts were not verified with. Each message names
    the cause and the methods that do run."""
    if config is None or not config.uses_mtp:
        return
    other = ('Use {"method": "ngram"} (prompt lookup) or {"model": DRAFT} (a draft model '
             "of the same tokenizer)")
    num_mtp = num_mtp_layers(model_path)
    if not num_mtp:
        raise ValueError(f"--speculative-config: method 'mtp' drafts with the model's "
                         f"multi-token-prediction heads; {architecture} has no MTP heads "
                         f"(config.json has no num_nextn_predict_layers). {other}")
    if not mtp_architecture:
        raise ValueError(f"--speculative-config: method 'mtp' runs DeepSeek-V3's MTP layers "
                         f"(DeepseekV3ForCausalLM) only; {architecture}'s checkpoint has "
                         f"{num_mtp} MTP layer(s) Pagoda does not run. {other}")
    for flag, on in limits.items():
        if on:
            raise ValueError(f"--speculative-config: method 'mtp' is not supported with "
                             f"{flag} (MTP drafts run on a single-rank worker and were not "
                             f"verified with it). {other}")
    if config.num_speculative_tokens > num_mtp and config.num_speculative_tokens % num_mtp:
        raise ValueError(f"--speculative-config: num_speculative_tokens "
                         f"({config.num_speculative_tokens}) must be divisible by the "
                         f"checkpoint's {num_mtp} MTP layer(s) (vLLM's rule for reusing them)")
    if config.num_speculative_tokens > 1:
        logger.warning("Enabling num_speculative_tokens > 1 will run multiple times of forward "
                       "on same MTP layer, which may result in lower acceptance rate")


def refuse_mtp_with_kv_transfer(config: SpeculativeConfig | None, kv_role: str | None) -> None:
    """ValueError for MTP drafts on a prefill or decode replica of P/D: the blocks handed
    over carry no MTP layer cache (unverified; a draft model's cache is not moved either).
    A colocated replica (kv_both, the default) is served; blocks it pulls from a peer's
    prefix only lower acceptance."""
    if config is not None and config.uses_mtp and kv_role in ("kv_producer", "kv_consumer"):
        raise ValueError(f"--speculative-config: method 'mtp' is not supported with KV "
                         f"transfer (--kv-transfer-config kv_role {kv_role}): the blocks "
                         "moved between replicas do not carry the MTP layer's cache")
