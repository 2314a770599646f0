"""A request from another process, checked as if it came from outside.

The gateway validates what clients send, but the scheduler does not trust a message
because it came from inside the cluster (a bug, a version skew, or a caller that
reached its port): `check_request` re-checks everything a request could use to make
the replica fail or to take more than its share - the sampling params as their
constructor would, logprobs against `--max-logprobs`, every token id against the
vocabulary, lengths against `max_model_len`, and the sizes of the per-token tables
(stop token ids, logit bias, EOS ids). Each failure is a ValueError naming the field,
so the scheduler answers INVALID_ARGUMENT for that request and goes on.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from pagoda.config import EngineConfig
from pagoda.lora.request import LoRARequest
from pagoda.messages import EngineCoreRequest
from pagoda.sampling_params import SamplingParams

MAX_REQUEST_ID_LEN = 512
# OpenAI's (and vLLM's) bound on a logit bias.
MAX_LOGIT_BIAS = 100.0


def check_logprobs_limit(params: SamplingParams, max_logprobs: int) -> None:
    """vLLM's `--max-logprobs`: ValueError naming the limit (-1: no limit)."""
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and max_logprobs != -1 and value > max_logprobs:
            raise ValueError(f"Requested {name} of {value}, which is greater than the "
                             f"maximum allowed, {max_logprobs} (--max-logprobs).")


def check_lora(lora_request: LoRARequest | None, config: EngineConfig) -> int | None:
    """Refuse an adapter at submission, not in the worker's step: LoRA must be enabled
    and the directory must hold a PEFT LoRA adapter within --max-lora-rank. Its rank."""
    if lora_request is None:
        return None
    if config.lora is None:
        raise ValueError(f"LoRA request {lora_request.lora_name!r} but LoRA is not enabled "
                         f"(enable_lora=True, --enable-lora)")
    from pagoda.lora.adapter import check_adapter

    return check_adapter(lora_request.lora_path, config.lora.max_lora_rank)


def check_request(request: EngineCoreRequest, config: EngineConfig) -> None:
    """Raise ValueError for anything in `request` that this engine must not run."""
    rid = request.request_id
    if not rid or len(rid) > MAX_REQUEST_ID_LEN:
        raise ValueError(f"request_id must have 1 to {MAX_REQUEST_ID_LEN} characters.")
    vocab = config.arch.vocab_size
    max_len = config.scheduler.max_model_len
    _check_ids("prompt_token_ids", request.prompt_token_ids, vocab)
    _check_ids("output_token_ids", request.output_token_ids, vocab)
    _check_ids("eos_token_ids", request.eos_token_ids, vocab)
    check_lora(request.lora_request, config)
    if request.pooling_params is not None:
        if request.output_token_ids:
            raise ValueError("output_token_ids: a pooling request generates nothing.")
        return  # the engine's own check completes its params (validate_pooling_request)
    params = request.sampling_params
    params.validate()  # what its constructor checks; a wire decoder skipped it
    if params.structured_outputs is not None:
        params.structured_outputs.validate()
    if params.n != 1:
        raise ValueError(f"n must be 1 in a scheduler request (the gateway fans out), "
                         f"got {params.n}.")
    check_logprobs_limit(params, config.max_logprobs)
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > vocab:
            raise ValueError(f"{name} of {value} is more than the vocabulary ({vocab}).")
    _check_ids("stop_token_ids", params.stop_token_ids, vocab)
    _check_ids("allowed_token_ids", params.allowed_token_ids or (), vocab)
    bad_words = params.bad_words_token_ids or ()
    if len(bad_words) > vocab:
        raise ValueError(f"bad_words has {len(bad_words)} entries, more than the vocabulary "
                         f"({vocab}).")
    for words in bad_words:
        _check_ids("bad_words", words, vocab)
        if len(words) > max_len:
            raise ValueError(f"bad_words: a word of {len(words)} tokens is longer than the "
                             f"maximum model length ({max_len}).")
    bias = params.logit_bias or {}
    _check_ids("logit_bias", bias.keys(), vocab)
    if any(not isinstance(b, (int, float)) or not math.isfinite(b)
           or abs(b) > MAX_LOGIT_BIAS for b in bias.values()):
        raise ValueError(f"logit_bias values must be finite and within "
                         f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}].")
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        if not math.isfinite(getattr(params, name)):
            raise ValueError(f"{name} must be a finite number.")
    num_tokens = len(request.prompt_token_ids) + len(request.output_token_ids)
    if num_tokens >= max_len:
        raise ValueError(f"The request's {num_tokens} tokens (prompt and output so far) "
                         f"leave no room in the maximum model length of {max_len}.")
    if params.max_tokens is not None:
        if params.max_tokens > max_len:
            raise ValueError(f"max_tokens ({params.max_tokens}) is more than the maximum "
                             f"model length ({max_len}).")
        if len(request.output_token_ids) >= params.max_tokens:
            raise ValueError(f"output_token_ids: the request already has "
                             f"{len(request.output_token_ids)} of its max_tokens "
                             f"({params.max_tokens}) tokens.")


def _check_ids(name: str, ids: Iterable[int], vocab: int) -> None:
    """Every id in [0, vocab), and at most `vocab` of them for the per-token tables
    (more can only be repeats: they add work, never meaning)."""
    count = 0
    for token_id in ids:
        count += 1
        if not isinstance(token_id, int) or not 0 <= token_id < vocab:
            raise ValueError(f"{name}: token id {token_id} is out of vocabulary (vocab size "
                             f"{vocab}).")
    if name not in ("prompt_token_ids", "output_token_ids") and count > vocab:
        raise ValueError(f"{name} has {count} entries, more than the vocabulary ({vocab}).")
