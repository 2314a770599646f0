"""OpenAI request bodies (vLLM's field names), validated by pydantic.

Unknown fields are ignored, as vLLM does. Types are checked by pydantic (a wrong
type is a 400, never a 422); integers that travel on the wire are bounded to
their proto width here, so no value can fail later as a 500. Ranges of sampling
fields are `SamplingParams`' to check: `to_sampling_params` is the one place that
maps request fields onto it, by name, so a new sampling parameter needs only its
field here (and none if the API should not expose it).
"""

from __future__ import annotations

import logging
from dataclasses import fields
from typing import Annotated, Any, ClassVar, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from pagoda.config import DEFAULT_MAX_LOGPROBS
from pagoda.request_checks import MAX_LOGIT_BIAS, check_allowed_token_ids, check_logit_bias
from pagoda.sampling_params import SamplingParams, StructuredOutputsParams
from pagoda.services.gateway.errors import APIError
from pagoda.services.gateway.openai.beam_fields import check_beam_search
from pagoda.services.gateway.openai.structured_outputs import request_structured_outputs
from pagoda.services.gateway.openai.tools import forced_constraint
from pagoda.services.gateway.openai.vllm_only_fields import (UNSERVED, fold_repetition_fields,
                                                             refuse_unserved)

logger = logging.getLogger(__name__)
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# vLLM's default --max-logprobs: the most top logprobs a request may ask for.
MAX_LOGPROBS = DEFAULT_MAX_LOGPROBS
# OpenAI's limit on `n` (also keeps one request from flooding a scheduler).
MAX_N = 128

TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Body(BaseModel):
    # NaN/Infinity are accepted by Python's JSON parser; no sampling field wants them.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    # vLLM's fields of this route that Pagoda does not serve (vllm_only_fields.py).
    vllm_unserved: ClassVar[Mapping[str, str]] = UNSERVED

    @model_validator(mode="wrap")
    @classmethod
    def _log_ignored_fields(cls, data, handler):
        """vLLM's behaviour for fields it does not know: a warning, never a 400; vLLM's
        own fields that Pagoda does not serve are a 400 (vllm_only_fields.py)."""
        refuse_unserved(data, cls.vllm_unserved, own_fields=cls.model_fields)
        if "repetition_detection" in cls.model_fields:
            data = fold_repetition_fields(data)
        result = handler(data)
        if isinstance(data, dict):
            ignored = sorted(set(data) - set(cls.model_fields))
            if ignored:
                logger.warning("The following fields were present in the request but "
                               "ignored: %s", ignored)
        return result


class SamplingFields(_Body):
    """The fields chat and completions share."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: Annotated[int, Field(le=INT32_MAX)] | None = None
    min_p: float | None = None
    seed: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(le=INT32_MAX)] = 0
    max_tokens: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: int | None = None
    return_tokens_as_token_ids: bool = False
    echo: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's: salts the prompt's prefix-cache blocks, so only requests with the same
    # salt share cached KV (e.g. one salt per tenant).
    cache_salt: str | None = None
    # vLLM's: admission order under --scheduling-policy priority (lower first); a
    # non-zero value under fcfs is refused by the scheduler (400).
    priority: Annotated[int, Field(ge=-INT32_MAX - 1, le=INT32_MAX)] = 0
    # vLLM's token filters and prompt truncation (request_fields.py): the only ids the
    # completion may use, words it never contains, the prompt's last N tokens only.
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    _bad_words_token_ids: list[list[int]] | None = PrivateAttr(default=None)
    # Structured outputs (structured_outputs.py): vLLM's field, OpenAI's response_format
    # and the older guided_* fields; at most one constraint per request.
    structured_outputs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's beam search (beam_fields.py: n is the beam width) and best_of (only equal
    # to n: each of the n sampled choices is sampled on its own).
    use_beam_search: bool = False
    best_of: Annotated[int, Field(le=INT32_MAX)] | None = None
    length_penalty: float = 1.0
    # vLLM's: free-form arguments for the custom logits processors (--logits-processors),
    # which read them as SamplingParams.extra_args.
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None
    # vLLM's: at most N reasoning tokens (-1: no budget), the replica's --reasoning-config
    # naming the markers; and early stop of a looping answer (finish_reason
    # "repetition"; unknown keys of the object are refused by name).
    thinking_token_budget: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    repetition_detection: dict[str, Any] | None = None

    # ------------------------------------------------------------ per-API answers
    def num_logprobs(self) -> int | None:
        """Top logprobs per generated token; None for no logprobs (each API's own
        fields say; see the subclasses)."""
        return None

    def num_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    # ------------------------------------------------------------ validation
    def check_common(self, max_logprobs: int = MAX_LOGPROBS) -> None:
        """What pydantic's types cannot say; raises APIError (400). `max_logprobs`:
        the gateway's --max-logprobs (-1: no limit)."""
        if not 1 <= self.n <= MAX_N:
            raise APIError(f"n must be between 1 and {MAX_N}, got {self.n}.", param="n")
        if self.use_beam_search:
            check_beam_search(self, max_logprobs)
        self._refuse_unsupported_search()
        if self.stream_options is not None and not self.stream:
            raise APIError("Stream options can only be defined when `stream=True`.",
                           param="stream_options")
        for name, value in (("logprobs", self.num_logprobs()),
                            ("prompt_logprobs", self.prompt_logprobs)):
            if value is not None and (value < 0 or -1 < max_logprobs < value):
                raise APIError(f"Requested {name} of {value}; it must be between 0 and the "
                               f"maximum allowed, {max_logprobs}.", param=name)
        if self.prompt_logprobs is not None and self.stream:
            raise APIError("`prompt_logprobs` are not available when `stream=True`.",
                           param="prompt_logprobs")
        for text in ([self.stop] if isinstance(self.stop, str) else self.stop or []):
            _check_unicode(text, "stop")
        if self.cache_salt is not None:
            if not self.cache_salt:
                raise APIError("cache_salt must be a non-empty string if given.",
                               param="cache_salt")
            _check_unicode(self.cache_salt, "cache_salt")
        self.structured_output_params()

    def _refuse_unsupported_search(self) -> None:
        """best_of beyond n would change which answers come back: a 400 naming the
        field, since the answer without it would differ."""
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(f"best_of ({self.best_of}) different from n ({self.n}) is not "
                           f"supported by Pagoda: each of the n choices is sampled on its "
                           f"own.", param="best_of")

    def structured_output_params(self) -> StructuredOutputsParams | None:
        """The request's one constraint, if any (raises APIError)."""
        return request_structured_outputs(self, forced_constraint(self))

    def to_sampling_params(self, max_tokens: int, vocab_size: int) -> SamplingParams:
        """Build the engine's params for one completion (n = 1): the request's one
        validation (raises APIError). Every `SamplingParams` field this body has is
        copied by name, None meaning the field's default; the fields whose API form
        differs (n, max_tokens, logprobs, logit_bias) are mapped here."""
        values = {f.name: getattr(self, f.name) for f in fields(SamplingParams)
                  if getattr(self, f.name, None) is not None}
        values.update(n=1, max_tokens=max_tokens, logprobs=self.num_logprobs(),
                      prompt_logprobs=self.num_prompt_logprobs(),
                      logit_bias=self._logit_bias(vocab_size),
                      allowed_token_ids=self._allowed_token_ids(vocab_size),
                      bad_words_token_ids=self._bad_words_token_ids,
                      structured_outputs=self.structured_output_params(),
                      extra_args=self.vllm_xargs)
        try:
            return SamplingParams(**values)
        except ValueError as exc:
            raise APIError(str(exc), param=_param_of(str(exc))) from None

    def set_bad_words_token_ids(self, sequences: list[list[int]]) -> None:
        """The bad words as the tokenizer encoded them (request_fields.py)."""
        self._bad_words_token_ids = sequences or None

    def _allowed_token_ids(self, vocab_size: int) -> list[int] | None:
        if self.allowed_token_ids:
            _library_rule(check_allowed_token_ids, self.allowed_token_ids, vocab_size,
                          param="allowed_token_ids")
        return self.allowed_token_ids

    def _logit_bias(self, vocab_size: int) -> dict[int, float] | None:
        """Keys parsed as token ids, values clamped to ±MAX_LOGIT_BIAS (vLLM's API
        clamps; the library refuses what is still out of range)."""
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            try:
                token_id = int(key)
            except ValueError:
                raise APIError(f"logit_bias keys must be token ids, got {key!r}.",
                               param="logit_bias") from None
            _library_rule(check_logit_bias, {token_id: 0.0}, vocab_size, param="logit_bias")
            bias[token_id] = min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, value))
        return bias


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    # Top logprobs per token (OpenAI's legacy field: an integer, at most 5 there).
    logprobs: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM's: BOS etc. added to a text prompt

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def num_prompt_logprobs(self) -> int | None:
        # Echoed prompt tokens carry logprobs too (OpenAI's echo + logprobs).
        if self.prompt_logprobs is None and self.echo and self.logprobs is not None:
            return self.logprobs
        return self.prompt_logprobs

    def check_common(self, max_logprobs: int = MAX_LOGPROBS) -> None:
        super().check_common(max_logprobs)
        if self.suffix is not None:
            raise APIError("suffix is not currently supported.", param="suffix")
        if self.max_tokens == 0 and not self.echo:
            raise APIError("max_tokens must be at least 1 (0 only with echo).",
                           param="max_tokens")


class ChatCompletionRequest(SamplingFields):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # vLLM's: False drops the reasoning (split off by --reasoning-parser) from the answer.
    include_reasoning: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's; as vLLM, given to the chat template as `reasoning_effort` (gpt-oss style
    # templates read it), over chat_template_kwargs' own.
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    # vLLM's: special tokens added on top of the template's (off), and documents for
    # retrieval-augmented templates (the template's `documents` variable).
    add_special_tokens: bool = False
    documents: list[dict[str, Any]] | None = None
    # vLLM's: the request's own template; refused unless --trust-request-chat-template.
    chat_template: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's: keyword arguments for the model's HF processor (a chat with images).
    mm_processor_kwargs: dict[str, Any] | None = None

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_kwargs(self) -> dict[str, Any] | None:
        """chat_template_kwargs with reasoning_effort set over them."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {**(self.chat_template_kwargs or {}), "reasoning_effort": self.reasoning_effort}

    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens (OpenAI's newer name) wins over max_tokens."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def check_common(self, max_logprobs: int = MAX_LOGPROBS) -> None:
        if self.top_logprobs is not None:
            if self.top_logprobs < 0:
                raise APIError("`top_logprobs` must be a positive value.", param="top_logprobs")
            if self.top_logprobs > 0 and not self.logprobs:
                raise APIError("When using `top_logprobs`, `logprobs` must be set to true.",
                               param="top_logprobs")
        super().check_common(max_logprobs)


class TokenizeCompletionRequest(_Body):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Body):
    model: str | None = None
    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # as in ChatCompletionRequest
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[TokenId] = Field(...)


def _check_unicode(text: str, param: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(f"{param} is not valid Unicode (an unpaired surrogate).",
                       param=param) from None


def _library_rule(check, *args, param: str) -> None:
    """Run one of `pagoda.request_checks`' rules; its ValueError is a 400 naming `param`."""
    try:
        check(*args)
    except ValueError as exc:
        raise APIError(str(exc), param=param) from None


def _param_of(message: str) -> str | None:
    """The SamplingParams field a validation message names (its first word)."""
    first = message.split(" ", 1)[0].rstrip(":")
    # a nested field ("repetition_detection.min_count") is named whole
    return first if all(part.isidentifier() for part in first.split(".")) else None
