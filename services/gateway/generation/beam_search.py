"""`use_beam_search`: vLLM's served beam search, run by the gateway over one replica.

As in vLLM (its `EngineClient.beam_search`), the search runs in the front end: each
step sends every live beam of every prompt to the replica as a one-token request with
2 * n logprobs (`pagoda.beam_search.step_sampling_params`) and extends the beams with
the library's rule (`expand_beams`, `best_beams`), the one the offline
`LLM.beam_search` uses, so served and offline answers are equal. All steps go to the
replica the router picked once: its prefix cache shares the beams' common blocks
(the invariant in pagoda/beam_search.py). A replica that refuses before the answer
went out gets the whole search again elsewhere (routing/dispatch.py).

The answer is n choices per prompt (choice index = prompt index * n + i, best first),
each one delta with its whole text: `collect` and `stream_response` take it as they
take a sampled generation's deltas.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import grpc

from pagoda.beam_search import (BeamSearchInstance, best_beams, expand_beams,
                                generated_tokens, step_sampling_params)
from pagoda.lora.request import LoRARequest
from pagoda.messages import EngineCoreRequest
from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2 as tpb
from pagoda.services.gateway.disagg.prefill_decode import disaggregation_of
from pagoda.services.gateway.errors import APIError, from_grpc_error
from pagoda.services.gateway.generation.choices import ChoiceDelta
from pagoda.services.gateway.generation.fan_out import Prompt, check_prompt, resolve_max_tokens
from pagoda.services.gateway.generation.migration import DEFAULT_MIGRATION_LIMIT
from pagoda.services.gateway.openai.beam_fields import beam_search_params
from pagoda.services.gateway.openai.completion_bodies import Usage
from pagoda.services.gateway.openai.request_models import SamplingFields
from pagoda.services.gateway.routing.dispatch import routed_deltas
from pagoda.services.gateway.routing.peers import Peers


class BeamGeneration:
    """The beam search of one HTTP request; the interface of `fan_out.Generation` that
    the routes use (`deltas`, `usage`, `prompts`, `n`, `num_choices`, `requests`).

    Invariant: construction validates everything (prompt, context length, the beam
    parameters; the body's own checks ran in `check_common`) and raises APIError before
    anything is submitted.
    """

    def __init__(self, peers: Peers, request_id: str, prompts: list[Prompt],
                 body: SamplingFields, max_tokens: int | None, prompt_param: str = "prompt",
                 unique_id: bool = True, echo_only: bool = False,
                 lora_request: LoRARequest | None = None) -> None:
        info = peers.model_info()
        tokenizer = peers.tokenizer_info()
        self.peers = peers
        self.request_id = request_id
        self.user = body.user
        self.n = body.n
        self.prompts = prompts
        self.cache_salt = body.cache_salt
        self.priority = body.priority
        self.skip_special_tokens = body.skip_special_tokens
        self.lora_request = lora_request
        self.eos = list(tokenizer.eos_token_ids)
        self.migration_limit = DEFAULT_MIGRATION_LIMIT  # unused: a search never migrates
        self.usage = Usage(prompt_tokens=sum(len(p.token_ids) for p in prompts))
        self.engine_id = request_id if unique_id else f"{request_id}-{uuid.uuid4().hex[:8]}"
        for prompt in prompts:
            check_prompt(prompt.token_ids, tokenizer.vocab_size, prompt_param)
        # vLLM's rule per prompt; one search runs every prompt the same number of steps.
        limit = min(resolve_max_tokens(max_tokens, len(p.token_ids), info.max_model_len,
                                       prompt_param) for p in prompts)
        self.params = beam_search_params(body, limit)
        self.step_params = step_sampling_params(self.params)
        # The first step's requests: what routing looks at and the request log shows.
        self.requests = [self._step_request(p.token_ids, f"{i}-0-0")
                         for i, p in enumerate(prompts)]

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    def _step_request(self, token_ids: list[int], suffix: str) -> EngineCoreRequest:
        return EngineCoreRequest(
            request_id=f"{self.engine_id}-beam-{suffix}", prompt_token_ids=token_ids,
            sampling_params=self.step_params, eos_token_ids=self.eos, arrival_time=time.time(),
            cache_salt=self.cache_salt, priority=self.priority, lora_request=self.lora_request)

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """Each choice's one delta, once the whole search is done."""
        async for delta in routed_deltas(self.peers, self.requests, self._search, self.user,
                                         self.prompts[0].block_hashes):
            self.usage.completion_tokens += len(delta.token_ids)
            yield delta

    async def _search(self, replica) -> AsyncIterator[ChoiceDelta]:
        replica = disaggregation_of(self.peers).wrap(replica)  # prefill elsewhere
        instances = [BeamSearchInstance(p.token_ids, self.lora_request) for p in self.prompts]
        cached = 0
        for step in range(self.params.max_tokens):
            beams = [(i, j, beam) for i, inst in enumerate(instances)
                     for j, beam in enumerate(inst.beams)]
            if not beams:
                break
            rows = await _all(_candidates(replica, self._step_request(beam.tokens,
                                                                      f"{i}-{step}-{j}"))
                              for i, j, beam in beams)
            if step == 0:
                cached = rows[0][1]
            for i, inst in enumerate(instances):
                expand_beams(inst, [r[0] for (k, _, _), r in zip(beams, rows) if k == i],
                             self.params, self.eos)
        for i, inst in enumerate(instances):
            best = best_beams(inst, self.params, self.eos)
            shown = [generated_tokens(b, inst.prompt_len, self.params) for b in best]
            texts = await asyncio.gather(*(self._detokenize(t) for t in shown))
            for j, (beam, text) in enumerate(zip(best, texts)):
                yield ChoiceDelta(i * self.n + j, text, beam.tokens[inst.prompt_len:],
                                  beam.finish_reason, beam.stop_reason,
                                  num_cached_tokens=cached)

    async def _detokenize(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        try:
            reply = await self.peers.tokenizer.stub.Detokenize(
                tpb.DetokenizeRequest(token_ids=token_ids,
                                      skip_special_tokens=self.skip_special_tokens),
                timeout=60.0)
        except grpc.RpcError as exc:
            raise from_grpc_error(exc, "tokenizer") from None
        return reply.text


async def _all(coroutines) -> list:
    """Their results in order; the first failure cancels the rest (their streams close,
    so the replica aborts those step requests) and is raised."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _candidates(replica, request: EngineCoreRequest) -> tuple[dict[int, float], int]:
    """One beam's step: (its next-token candidates, token id -> logprob; the prompt's
    cached tokens on the replica)."""
    stream = replica.generate(request)
    found = None
    try:
        # Read to the end (the finish follows the token at once): the request finishes
        # on the replica instead of being aborted under its last write.
        async for out in stream:
            if found is None and out.new_logprobs is not None and out.new_logprobs.token_ids:
                row = out.new_logprobs
                found = dict(zip(row.token_ids[0], row.logprobs[0])), out.num_cached_tokens
            if out.finished:
                break
    except grpc.RpcError as exc:
        raise from_grpc_error(exc, "scheduler") from None
    finally:
        await stream.aclose()
    if found is None:
        raise APIError("The scheduler ended a beam search step without its logprobs.", 500)
    return found
