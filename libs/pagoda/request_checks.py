"""One request, checked against the model it asks for: every request rule, once.

Validation is one library function run at each trust boundary (ARCHITECTURE.md,
"Failure semantics"); a rule lives here and nowhere else:

    gateway ─────► the rules it can check with what it knows (the tokenizer's
                   vocabulary, the replica's max_model_len): `check_prompt`,
                   `check_allowed_token_ids`, `check_logit_bias`; an early 400
    scheduler ───► `check_request(request, config, from_wire=True)`: every rule, once
    offline LLM ─► `check_request(request, config)`: every rule, once
    worker ──────► only its plan's own invariants (worker/plan_checks.py)

`SamplingParams` check their own values when built (`__post_init__`); a wire decoder
skips the constructor (`from_validated`), so `from_wire=True` runs `validate()` here,
once. Each failure is a ValueError naming the field, with vLLM's wording where vLLM
has one: the scheduler answers INVALID_ARGUMENT for that request and serves on.
This module imports no engine code, so the gateway may import it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import fields

from pagoda.config import EngineConfig
from pagoda.lora.request import LoRARequest
from pagoda.messages import EngineCoreRequest
from pagoda.multimodal.checks import check_mm_features
from pagoda.sampling_params import SamplingParams

MAX_REQUEST_ID_LEN = 512
# OpenAI's (and vLLM's) bound on a logit bias.
MAX_LOGIT_BIAS = 100.0


def check_request(request: EngineCoreRequest, config: EngineConfig, *,
                  from_wire: bool = False) -> None:
    """Raise ValueError for anything in `request` this engine must not run. `from_wire`:
    the request was decoded from a message, so its params skipped their constructor's
    checks and its id and float fields are checked too (the gateway's pydantic
    model refuses inf and NaN; a message straight to the scheduler may not)."""
    vocab = config.arch.vocab_size
    if from_wire:
        _check_request_id(request.request_id)
    check_prompt(request.prompt_token_ids, vocab)
    _check_ids("output_token_ids", request.output_token_ids, vocab)
    _check_ids("eos_token_ids", request.eos_token_ids, vocab)
    check_priority(request.priority, config.scheduler.policy)
    check_lora(request.lora_request, config)
    check_mm_features(request, config)
    if not _check_pooling(request, config):
        if from_wire:
            _check_wire_params(request.sampling_params)
        check_sampling_params(request.sampling_params, config)
        if config.logits_processors:
            check_logits_processor_params(request.sampling_params, config)
    _check_lengths(request, config)


def check_logits_processor_params(params, config: EngineConfig) -> None:
    """Each custom logits processor's `validate_params` (vLLM checks them on intake),
    so a request its processor cannot serve is refused here, never in a worker step."""
    # lazy: the processors' module imports torch; only an engine with processors needs it
    from pagoda.sample.logits_processor import (resolve_logits_processor_classes,
                                                validate_request_params)

    validate_request_params(resolve_logits_processor_classes(config.logits_processors), params)


# ---------------------------------------------------------------- the request
def check_prompt(token_ids: list[int], vocab_size: int) -> None:
    """A prompt has at least one token, each in the vocabulary."""
    if not token_ids:
        raise ValueError("The prompt cannot be empty.")
    bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab_size),
               None)
    if bad is not None:
        raise ValueError(f"Token id {bad} is out of vocabulary (vocab size {vocab_size}).")


def check_priority(priority: int, policy: str) -> None:
    if priority != 0 and policy != "priority":
        raise ValueError(f"Got priority {priority} but Priority scheduling is not enabled.")


def check_lora(lora_request: LoRARequest | None, config: EngineConfig) -> int | None:
    """Refuse an adapter at submission, not in the worker's step: LoRA must be enabled
    and the directory must hold a PEFT LoRA adapter within --max-lora-rank. Its rank."""
    if lora_request is None:
        return None
    if config.lora is None:
        raise ValueError(f"LoRA request {lora_request.lora_name!r} but LoRA is not enabled "
                         f"(enable_lora=True, --enable-lora)")
    from pagoda.lora.adapter import check_adapter  # lazy: torch; the gateway imports this

    return check_adapter(lora_request.lora_path, config.lora.max_lora_rank)


def _check_request_id(request_id: str) -> None:
    if not request_id or len(request_id) > MAX_REQUEST_ID_LEN:
        raise ValueError(f"request_id must have 1 to {MAX_REQUEST_ID_LEN} characters.")


def _check_pooling(request: EngineCoreRequest, config: EngineConfig) -> bool:
    """True for a pooling request, whose params are then completed for the model
    (`PoolingParams.verify`); ValueError for a request the runner cannot serve (a
    generation request on a pooling model, or the reverse)."""
    params = request.pooling_params
    if config.runner != "pooling":
        if params is not None:
            raise ValueError("This model generates text (--runner generate); it does not "
                             "answer pooling requests (embeddings, classification, scores).")
        return False
    if params is None:
        raise ValueError("This model is a pooling model (--runner pooling): it answers "
                         "embedding, classification and score requests, not text generation.")
    if request.output_token_ids:
        raise ValueError("output_token_ids: a pooling request generates nothing.")
    pooler = config.pooler_config
    params.verify(params.task or pooler.task, pooler, config.served_model_name[0]
                  if config.served_model_name else config.model)
    return True


def _check_lengths(request: EngineCoreRequest, config: EngineConfig) -> None:
    """The prompt, the output so far and max_tokens against max_model_len, and the
    whole request against the KV cache (one that can never fit would be preempted
    forever). A pooling request is prefill only: its prompt may fill the context."""
    num_prompt, num_output = len(request.prompt_token_ids), len(request.output_token_ids)
    max_len = config.scheduler.max_model_len
    if request.pooling_params is not None:
        if num_prompt > max_len:
            raise ValueError(f"This model's maximum context length is {max_len} tokens. "
                             f"However, you requested {num_prompt} tokens in the input for "
                             "embedding generation. Please reduce the length of the input.")
    elif num_prompt >= max_len:
        raise ValueError(
            f"The decoder prompt (length {num_prompt}) is longer than the maximum model length "
            f"of {max_len}. Make sure that `max_model_len` is no smaller than the number of "
            f"text tokens plus one.")
    elif num_prompt + num_output >= max_len:
        raise ValueError(f"The request's {num_prompt + num_output} tokens (prompt and output "
                         f"so far) leave no room in the maximum model length of {max_len}.")
    max_tokens = request.sampling_params.max_tokens
    if request.pooling_params is None and max_tokens is not None:
        if max_tokens > max_len:
            raise ValueError(f"max_tokens ({max_tokens}) is more than the maximum model "
                             f"length ({max_len}).")
        if num_output >= max_tokens:
            raise ValueError(f"output_token_ids: the request already has {num_output} of its "
                             f"max_tokens ({max_tokens}) tokens.")
    _check_kv_capacity(num_prompt, max_tokens, config)


def _check_kv_capacity(num_prompt: int, max_tokens: int | None, config: EngineConfig) -> None:
    """`config.cache.num_blocks` is resolved when the engine starts (0 before: unchecked)."""
    max_len, cache = config.scheduler.max_model_len, config.cache
    max_total = min(num_prompt + (max_tokens or max_len), max_len)
    if cache.sliding_window is not None:  # blocks before the window are released as it runs
        max_total = min(max_total, cache.sliding_window - 1
                        + config.scheduler.max_num_batched_tokens + 2 * cache.block_size)
    capacity = cache.num_blocks * cache.block_size
    if cache.num_blocks and max_total > capacity:
        raise ValueError(f"The request needs up to {max_total} tokens of KV cache, more than "
                         f"this replica holds ({capacity} tokens).")


# ---------------------------------------------------------------- its sampling params
def check_sampling_params(params: SamplingParams, config: EngineConfig) -> None:
    """Params against the model: logprobs within --max-logprobs and the vocabulary,
    every per-token table's ids in the vocabulary and its size at most the vocabulary
    (more can only be repeats: they add work, never meaning)."""
    vocab, max_len = config.arch.vocab_size, config.scheduler.max_model_len
    check_logprobs_limit(params, config.max_logprobs)
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > vocab:
            raise ValueError(f"{name} of {value} is more than the vocabulary ({vocab}).")
    _check_ids("stop_token_ids", params.stop_token_ids, vocab)
    if params.allowed_token_ids is not None:
        check_allowed_token_ids(params.allowed_token_ids, vocab)
    bad_words = params.bad_words_token_ids or ()
    if len(bad_words) > vocab:
        raise ValueError(f"bad_words has {len(bad_words)} entries, more than the vocabulary "
                         f"({vocab}).")
    for words in bad_words:
        _check_ids("bad_words", words, vocab)
        if len(words) > max_len:
            raise ValueError(f"bad_words: a word of {len(words)} tokens is longer than the "
                             f"maximum model length ({max_len}).")
    check_logit_bias(params.logit_bias or {}, vocab)
    if params.thinking_token_budget is not None and config.scheduler.reasoning_config is None:
        raise ValueError("thinking_token_budget needs the thinking markers: start the engine "
                         "with --reasoning-config (think_start_str/think_end_str).")


def check_logprobs_limit(params: SamplingParams, max_logprobs: int) -> None:
    """vLLM's `--max-logprobs`: ValueError naming the limit (-1: no limit)."""
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and max_logprobs != -1 and value > max_logprobs:
            raise ValueError(f"Requested {name} of {value}, which is greater than the "
                             f"maximum allowed, {max_logprobs} (--max-logprobs).")


def check_allowed_token_ids(token_ids: list[int], vocab_size: int) -> None:
    """vLLM's check and message; at most `vocab_size` of them."""
    if not all(isinstance(t, int) and 0 <= t < vocab_size for t in token_ids):
        raise ValueError("allowed_token_ids contains out-of-vocab token id!")
    if len(token_ids) > vocab_size:
        raise ValueError(f"allowed_token_ids has {len(token_ids)} entries, more than the "
                         f"vocabulary ({vocab_size}).")


def check_logit_bias(bias: dict[int, float], vocab_size: int) -> None:
    """Token ids in the vocabulary (so at most `vocab_size` entries); finite biases
    within ±MAX_LOGIT_BIAS (the gateway clamps a client's to it, as vLLM does)."""
    bad = next((t for t in bias if not isinstance(t, int) or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"token_id {bad} in logit_bias is out of vocabulary (vocab size "
                         f"{vocab_size}).")
    if any(not isinstance(b, (int, float)) or not math.isfinite(b)
           or abs(b) > MAX_LOGIT_BIAS for b in bias.values()):
        raise ValueError(f"logit_bias values must be finite and within "
                         f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}].")


def _check_wire_params(params: SamplingParams) -> None:
    """What the constructor would have checked (a wire decoder skipped it), once; and
    what the gateway's HTTP model refuses before params exist: inf or NaN in any float
    field (found by type: a new field needs no edit). `n` never travels (the gateway
    fans out): a decoded request has n = 1."""
    params.validate()
    if params.structured_outputs is not None:
        params.structured_outputs.validate()
    for f in fields(params):
        value = getattr(params, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{f.name} must be a finite number.")


def _check_ids(name: str, ids: Iterable[int], vocab: int) -> None:
    """Every id in [0, vocab), and at most `vocab` of them (a per-token table)."""
    count = 0
    for token_id in ids:
        count += 1
        if not isinstance(token_id, int) or not 0 <= token_id < vocab:
            raise ValueError(f"{name}: token id {token_id} is out of vocabulary (vocab size "
                             f"{vocab}).")
    if name != "output_token_ids" and count > vocab:
        raise ValueError(f"{name} has {count} entries, more than the vocabulary ({vocab}).")
