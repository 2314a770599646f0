"""Turn one OpenAI request into scheduler requests and run them.

A request with P prompts and `n` choices becomes P x n scheduler requests (choice
index = prompt index * n + i, as vLLM numbers them), all routed to one replica so
that the choices of a prompt share its cached prefix.

Usage is exact and counted here, not by the scheduler: prompt tokens count once per
prompt (not per choice, as OpenAI and vLLM count them), from the prompts this
gateway sent; completion tokens are the tokens each choice's text came from, which
only the gateway knows (a stop string found by the tokenizer drops the tokens
generated after it). Cached tokens are the scheduler's, from the stream.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pagoda.request_checks as request_checks
from pagoda.lora.request import LoRARequest
from pagoda.messages import EngineCoreRequest
from pagoda.services.gateway.disagg.prefill_decode import disaggregation_of
from pagoda.services.gateway.errors import APIError
from pagoda.services.gateway.generation.choices import ChoiceDelta, merge_choices, stream_choice
from pagoda.services.gateway.generation.migration import DEFAULT_MIGRATION_LIMIT, Migration
from pagoda.services.gateway.generation.stream_interval import (DEFAULT_STREAM_INTERVAL,
                                                                coalesce_deltas)
from pagoda.services.gateway.openai.completion_bodies import Usage
from pagoda.services.gateway.openai.request_models import SamplingFields
from pagoda.services.gateway.routing.dispatch import route_request, routed_deltas
from pagoda.services.gateway.routing.peers import Peers


@dataclass
class Prompt:
    """A tokenized prompt (and its text when it had one, for `echo`)."""

    token_ids: list[int]
    text: str | None = None
    # Its prefix-cache block hashes, when routing asked the tokenizer for them along
    # with the tokenization (None otherwise: the router hashes ids itself if it must).
    block_hashes: list[bytes] | None = None
    # Its media items (a chat with images), from the tokenizer: the scheduler keys
    # blocks by their identifiers and the worker encodes their data.
    mm_features: list = field(default_factory=list)


def new_request_id(prefix: str, base: str | None = None) -> str:
    """The response's id: `prefix-base` (base: the request's X-Request-Id), else random."""
    return f"{prefix}-{base or uuid.uuid4().hex}"


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int,
                       prompt_param: str = "messages") -> int:
    """vLLM's rule: default to the remaining context; reject what cannot fit."""
    if prompt_len >= max_model_len:
        raise APIError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {prompt_len} input tokens. Please reduce the length of the input.",
            param=prompt_param)
    if requested is None:
        return max_model_len - prompt_len
    if requested < 1:
        raise APIError(f"max_tokens must be at least 1, got {requested}.", param="max_tokens")
    if prompt_len + requested > max_model_len:
        raise APIError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + requested} tokens ({prompt_len} in the messages, "
            f"{requested} in the completion). Please reduce the length of the messages or "
            f"completion.", param="max_tokens")
    return requested


class Generation:
    """The scheduler requests of one HTTP request, and their merged deltas.

    Invariant: construction (after the route's `body.check_common()`) validates
    everything the gateway can (types, ranges, vocabulary, context length) and
    raises APIError before anything is submitted;
    it builds each distinct `SamplingParams` once (one per max_tokens limit), and
    no later hop validates them again.
    `echo_only` (completions' echo with max_tokens 0, to score a prompt) generates
    one token and shows none of it. `lora_request`: the adapter every choice runs
    with (the request's `model` named one), None for the base model.
    """

    def __init__(self, peers: Peers, request_id: str, prompts: list[Prompt],
                 body: SamplingFields, max_tokens: int | None,
                 prompt_param: str = "prompt", unique_id: bool = True,
                 echo_only: bool = False, lora_request: LoRARequest | None = None) -> None:
        info = peers.model_info()
        tokenizer = peers.tokenizer_info()
        eos = list(tokenizer.eos_token_ids)
        self.peers = peers
        self.request_id = request_id
        self.user = body.user  # the session key of the `session` router, unless a header says
        self.n = body.n
        self.prompts = prompts
        self.discard_output = echo_only
        self.cache_salt = body.cache_salt
        # How often one choice may move to another replica (--migration-limit; set by
        # ServingOptions.on_generation).
        self.migration_limit = DEFAULT_MIGRATION_LIMIT
        # Tokens per delta of each choice (--stream-interval; set by on_generation too).
        self.stream_interval = DEFAULT_STREAM_INTERVAL
        self.usage = Usage(prompt_tokens=sum(len(p.token_ids) for p in prompts))
        self.requests: list[EngineCoreRequest] = []
        # Ids in the scheduler must be unique; a client's X-Request-Id may not be.
        engine_id = request_id if unique_id else f"{request_id}-{uuid.uuid4().hex[:8]}"
        now = time.time()
        params_by_limit = {}
        for p_idx, prompt in enumerate(prompts):
            check_prompt(prompt.token_ids, tokenizer.vocab_size, prompt_param)
            limit = resolve_max_tokens(1 if self.discard_output else max_tokens,
                                       len(prompt.token_ids), info.max_model_len, prompt_param)
            if limit not in params_by_limit:
                params_by_limit[limit] = body.to_sampling_params(limit, tokenizer.vocab_size)
            params = params_by_limit[limit]
            for i in range(body.n):
                # vLLM's rule, and the offline engine's (llm_engine.py): choice i of a seeded
                # request samples with seed + i (one seed for all: n identical choices).
                choice_params = params.clone(seed=params.seed + i) \
                    if body.n > 1 and params.seed is not None else params
                self.requests.append(EngineCoreRequest(
                    request_id=f"{engine_id}-{p_idx}-{i}", prompt_token_ids=prompt.token_ids,
                    sampling_params=choice_params, eos_token_ids=eos, arrival_time=now,
                    cache_salt=body.cache_salt, priority=body.priority,
                    lora_request=lora_request, mm_features=prompt.mm_features))

    @property
    def num_choices(self) -> int:
        return len(self.requests)

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """Every choice's deltas as they come; counts completion tokens into usage.
        The router picks the replica (router_dispatch.py: another one if it refuses);
        a choice whose replica goes away mid-stream migrates (migration.py)."""
        mux = self.peers.tokenizer.mux
        session_key = route_request(self.requests, self.user).session_key  # the header's too
        migration = Migration(self.peers, self.migration_limit, session_key, self.cache_salt)

        def open_streams(replica):
            replica = disaggregation_of(self.peers).wrap(replica)  # prefill elsewhere
            streams = [stream_choice(replica, mux, req, index, self.discard_output, migration)
                       for index, req in enumerate(self.requests)]
            if self.stream_interval > 1:
                streams = [coalesce_deltas(s, self.stream_interval) for s in streams]
            return merge_choices(streams)

        cached: dict[int, int] = {}
        async for delta in routed_deltas(self.peers, self.requests, open_streams, self.user,
                                         self.prompts[0].block_hashes):
            self.usage.completion_tokens += len(delta.token_ids)
            if cached.get(delta.index) != delta.num_cached_tokens:  # (per token: only on change)
                cached[delta.index] = delta.num_cached_tokens
                # Once per prompt, like prompt_tokens: its first choice's count.
                self.usage.cached_tokens = sum(v for i, v in cached.items() if i % self.n == 0)
            yield delta


def check_prompt(token_ids: list[int], vocab_size: int, param: str) -> None:
    """400 for an empty prompt or a token id outside the tokenizer's vocabulary (the
    library's rule, `pagoda.request_checks.check_prompt`)."""
    try:
        request_checks.check_prompt(token_ids, vocab_size)
    except ValueError as exc:
        raise APIError(str(exc), param=param) from None
