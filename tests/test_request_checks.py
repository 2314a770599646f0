"""`pagoda.request_checks`: the one request validator every trust boundary runs.

One test per rule (the rules that used to live in the scheduler's `check_request`, the
engine core's `validate_request`, the gateway's own copies and the worker's plan
check), each on a tiny config built here: no model, no service.
"""

from __future__ import annotations

import math

import pytest

from pagoda.config import CacheConfig, EngineConfig, ModelArchConfig, PoolerConfig, SchedulerConfig
from pagoda.lora.request import LoRARequest
from pagoda.messages import EngineCoreRequest
from pagoda.pooling_params import PREFILL_ONLY, PoolingParams
from pagoda.request_checks import (MAX_LOGIT_BIAS, check_allowed_token_ids, check_logit_bias,
                                   check_prompt, check_request)
from pagoda.sampling_params import SamplingParams, check_bad_words

VOCAB, MAX_LEN = 100, 64


def config(**changes) -> EngineConfig:
    arch = ModelArchConfig(vocab_size=VOCAB, hidden_size=8, intermediate_size=16,
                           num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
                           head_dim=8)
    cache = CacheConfig(block_size=4, num_blocks=changes.pop("num_blocks", 64))
    scheduler = SchedulerConfig(max_model_len=MAX_LEN, policy=changes.pop("policy", "fcfs"))
    return EngineConfig("m", None, "float32", arch, cache, scheduler, **changes)


def request(prompt=(5, 6, 7), output=(), rid="r", **params) -> EngineCoreRequest:
    params.setdefault("max_tokens", 4)
    return EngineCoreRequest(rid, list(prompt), SamplingParams(**params), [2],
                             output_token_ids=list(output))


def wire(**values) -> EngineCoreRequest:
    """A request as a wire decoder builds it: params that skipped their constructor."""
    values.setdefault("max_tokens", 4)
    return EngineCoreRequest("r", [5, 6, 7], SamplingParams.from_validated(**values), [2])


def refused(req: EngineCoreRequest, match: str, cfg: EngineConfig | None = None,
            from_wire: bool = False) -> None:
    with pytest.raises(ValueError, match=match):
        check_request(req, cfg or config(), from_wire=from_wire)


def test_a_good_request_passes_offline_and_from_the_wire():
    check_request(request(), config())
    check_request(request(), config(), from_wire=True)


# ---------------------------------------------------------------- the request
def test_prompt_empty_or_out_of_vocabulary():
    refused(request(prompt=()), "The prompt cannot be empty.")
    refused(request(prompt=(5, VOCAB)), rf"Token id {VOCAB} is out of vocabulary \(vocab size")
    with pytest.raises(ValueError, match="out of vocabulary"):
        check_prompt([-1], VOCAB)


def test_output_and_eos_ids_in_the_vocabulary():
    refused(request(output=(VOCAB,)), "output_token_ids: token id")
    bad_eos = EngineCoreRequest("r", [5], SamplingParams(max_tokens=4), [VOCAB])
    refused(bad_eos, "eos_token_ids: token id")


def test_request_id_from_the_wire():
    refused(request(rid=""), "request_id must have 1 to 512", from_wire=True)
    refused(request(rid="x" * 513), "request_id", from_wire=True)


def test_priority_needs_the_priority_policy():
    req = EngineCoreRequest("r", [5], SamplingParams(max_tokens=4), [2], priority=3)
    refused(req, "Got priority 3 but Priority scheduling is not enabled.")
    check_request(req, config(policy="priority"))


def test_lora_needs_lora_enabled():
    req = EngineCoreRequest("r", [5], SamplingParams(max_tokens=4), [2],
                            lora_request=LoRARequest("a", 1, "/nowhere"))
    refused(req, "LoRA is not enabled")


def test_runner_and_pooling_params():
    pooling = EngineCoreRequest("r", [5, 6], PREFILL_ONLY, pooling_params=PoolingParams())
    refused(pooling, "does not answer pooling requests")
    pooler = config(runner="pooling", pooler_config=PoolerConfig(hidden_size=8))
    refused(request(), "is a pooling model", pooler)
    check_request(pooling, pooler)
    assert pooling.pooling_params.task == "embed"  # completed for the model
    long = EngineCoreRequest("r", [5] * (MAX_LEN + 1), PREFILL_ONLY,
                             pooling_params=PoolingParams())
    refused(long, "maximum context length is 64 tokens", pooler)
    check_request(EngineCoreRequest("r", [5] * MAX_LEN, PREFILL_ONLY,
                                    pooling_params=PoolingParams()), pooler)  # fills it


# ---------------------------------------------------------------- lengths
def test_prompt_and_output_against_max_model_len():
    refused(request(prompt=[5] * MAX_LEN), r"The decoder prompt \(length 64\) is longer than "
            "the maximum model length")
    refused(request(prompt=[5] * 40, output=[5] * 30, max_tokens=40), "leave no room")
    refused(request(max_tokens=MAX_LEN + 1), r"max_tokens \(65\) is more than")
    refused(request(output=[5] * 4, max_tokens=4), "already has 4 of its max_tokens")


def test_kv_capacity():
    refused(request(max_tokens=60), "needs up to 63 tokens of KV cache", config(num_blocks=8))
    check_request(request(max_tokens=60), config(num_blocks=0))  # not resolved yet


# ---------------------------------------------------------------- sampling params
def test_params_from_the_wire_are_validated_once_here():
    refused(wire(temperature=-1.0), "temperature must be non-negative", from_wire=True)
    check_request(wire(temperature=-1.0), config())  # offline: the constructor's job


def test_validate_runs_exactly_once_per_wire_request(monkeypatch):
    calls = []
    original = SamplingParams.validate
    monkeypatch.setattr(SamplingParams, "validate", lambda self: calls.append(1) or
                        original(self))
    check_request(wire(), config(), from_wire=True)
    assert len(calls) == 1
    calls.clear()
    check_request(request(), config())  # built by its constructor: validated there
    assert len(calls) == 1  # the constructor's, none here


def test_finite_floats_from_the_wire():
    refused(wire(temperature=math.inf), "temperature must be a finite number", from_wire=True)
    refused(wire(repetition_penalty=math.inf), "repetition_penalty must be a finite",
            from_wire=True)


def test_logprobs_limit_and_vocabulary():
    refused(request(logprobs=21), r"Requested logprobs of 21, which is greater than the "
            r"maximum allowed, 20 \(--max-logprobs\).")
    refused(request(prompt_logprobs=VOCAB + 1), "prompt_logprobs of 101 is more than the "
            "vocabulary", config(max_logprobs=-1))


def test_stop_token_ids_in_the_vocabulary_and_no_more_than_it():
    refused(request(stop_token_ids=[VOCAB]), "stop_token_ids: token id 100 is out")
    refused(request(stop_token_ids=[1] * (VOCAB + 1)), "stop_token_ids has 101 entries")


def test_allowed_token_ids():
    refused(request(allowed_token_ids=[5, VOCAB]), "allowed_token_ids contains out-of-vocab")
    with pytest.raises(ValueError, match="has 101 entries"):
        check_allowed_token_ids([1] * (VOCAB + 1), VOCAB)


def test_bad_words():
    refused(request(bad_words_token_ids=[[5, VOCAB]]), "bad_words: token id 100")
    refused(request(bad_words_token_ids=[[5]] * (VOCAB + 1)), "bad_words has 101 entries")
    refused(request(bad_words_token_ids=[[5] * (MAX_LEN + 1)]), "longer than the maximum")
    with pytest.raises(ValueError, match="bad_words must be a list of non-empty strings."):
        check_bad_words(["ok", ""])


def test_logit_bias():
    refused(request(logit_bias={VOCAB: 1.0}), "token_id 100 in logit_bias is out of vocabulary")
    refused(request(logit_bias={5: MAX_LOGIT_BIAS + 1}), "logit_bias values must be finite")
    with pytest.raises(ValueError, match="finite"):
        check_logit_bias({5: math.nan}, VOCAB)
    check_logit_bias({5: -MAX_LOGIT_BIAS, 6: MAX_LOGIT_BIAS}, VOCAB)
