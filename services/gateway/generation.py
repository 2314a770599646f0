"""Turn one OpenAI request into scheduler requests and run them.

A request with P prompts and `n` choices becomes P x n scheduler requests (choice
index = prompt index * n + i, as vLLM numbers them), all routed to one replica so
that the choices of a prompt share its cached prefix.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pagoda.engine.core_types import EngineCoreRequest
from pagoda.services.gateway.choices import ChoiceDelta, merge_choices, stream_choice
from pagoda.services.gateway.errors import APIError
from pagoda.services.gateway.openai_models import SamplingFields
from pagoda.services.gateway.peers import Peers
from pagoda.services.gateway.responses import Usage


@dataclass
class Prompt:
    """A tokenized prompt (and its text when it had one, for `echo`)."""

    token_ids: list[int]
    text: str | None = None


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int) -> int:
    """vLLM's rule: default to the remaining context; reject what cannot fit."""
    if prompt_len >= max_model_len:
        raise APIError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {prompt_len} input tokens. Please reduce the length of the input.",
            param="messages")
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
    """The scheduler requests of one HTTP request, and their merged deltas."""

    def __init__(self, peers: Peers, request_id: str, prompts: list[Prompt],
                 body: SamplingFields, max_tokens: int | None) -> None:
        body.check_common()
        info = peers.model_info()
        eos = list(peers.tokenizer_info().eos_token_ids)
        self.peers = peers
        self.request_id = request_id
        self.n = body.n
        self.usage = Usage(prompt_tokens=sum(len(p.token_ids) for p in prompts) * body.n)
        self.requests: list[EngineCoreRequest] = []
        now = time.time()
        for p_idx, prompt in enumerate(prompts):
            if not prompt.token_ids:
                raise APIError("The prompt cannot be empty.", param="prompt")
            limit = resolve_max_tokens(max_tokens, len(prompt.token_ids), info.max_model_len)
            params = body.to_sampling_params(limit)
            for i in range(body.n):
                self.requests.append(EngineCoreRequest(
                    request_id=f"{request_id}-{p_idx}-{i}", prompt_token_ids=prompt.token_ids,
                    sampling_params=params, eos_token_ids=eos, arrival_time=now))

    @property
    def num_choices(self) -> int:
        return len(self.requests)

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """Every choice's deltas as they come; counts completion tokens into usage."""
        replica = self.peers.pick_scheduler()
        mux = self.peers.tokenizer.mux
        streams = [stream_choice(replica, mux, req, index)
                   for index, req in enumerate(self.requests)]
        cached: dict[int, int] = {}
        async for delta in merge_choices(streams):
            self.usage.completion_tokens += len(delta.token_ids)
            cached[delta.index] = delta.num_cached_tokens
            self.usage.cached_tokens = sum(cached.values())
            yield delta
