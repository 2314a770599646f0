"""Turn one pooling HTTP request into scheduler requests and collect their vectors.

An input list of N texts (or N text pairs) becomes N pooling requests, routed together
to one replica like the choices of a completion (routing/dispatch.py: another replica
if it refuses before answering). Each request's `Generate` stream is a single
`complete` carrying its vector. Inputs are tokenized by the tokenizer service, which
also truncates them (`truncate_prompt_tokens`) and encodes text pairs with their token
types; inputs given as token ids keep their last k tokens. Usage counts every prompt
token once; pooling produces no completion tokens.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc

from pagoda.messages import EngineCoreRequest
from pagoda.pooling_params import PREFILL_ONLY, PoolingParams
from pagoda.score_utils import token_type_split
from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2 as spb
from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2 as tpb
from pagoda.services.gateway.errors import APIError, from_grpc_error
from pagoda.services.gateway.generation.choices import merge_choices
from pagoda.services.gateway.generation.fan_out import check_prompt
from pagoda.services.gateway.openai.completion_bodies import Usage
from pagoda.services.gateway.openai.routes import tokenize
from pagoda.services.gateway.routing.dispatch import routed_deltas
from pagoda.services.gateway.routing.peers import Peers, SchedulerReplica
from pagoda.services.gateway.state import GatewayState

# The API each task serves, for the message a model without it gets (vLLM's wording).
API_NAMES = {"embed": "Embeddings API", "classify": "Classification API",
             "score": "Score API", "encode": "Pooling API"}


@dataclass
class PoolingInput:
    """One tokenized input (a text pair's second text starts at `token_type_split`)."""

    token_ids: list[int]
    token_type_split: int | None = None
    block_hashes: list[bytes] | None = None  # for KV-aware routing, when asked for


@dataclass
class PooledResult:
    """One input's vector; `index` is the input's position in the request."""

    index: int
    data: list[float]
    num_cached_tokens: int = 0


def pooling_model(state: GatewayState, task: str) -> spb.PoolingModelInfo:
    """The served pooling model's info; a 400 if it cannot do `task` ("score": a
    cross-encoder, an embedding model or a late-interaction one; "encode": any
    pooling model)."""
    info = state.peers.model_info()
    if not info.HasField("pooling"):
        raise APIError(f"The model does not support {API_NAMES[task]}: it generates text "
                       "(serve a pooling model, or this one with --runner pooling).")
    pooling = info.pooling
    able = {"encode": True, "embed": pooling.task == "embed",
            "classify": pooling.task == "classify",
            "score": pooling.task in ("embed", "token_embed") or len(pooling.labels) == 1}[task]
    if not able:
        raise APIError(f"The model does not support {API_NAMES[task]} (its task is "
                       f"{pooling.task!r}).")
    return pooling


def pooling_tasks(pooling: spb.PoolingModelInfo) -> tuple[str, ...]:
    """The tasks a request may name for the served model (the engine's
    `PoolerConfig.supported_tasks`): an embedding model its own task; a classifier
    classifies, scores with one label, and classifies every token (token_classify)."""
    if pooling.task in ("embed", "token_embed"):
        return (pooling.task,)
    return ("classify", "score", "token_classify") if len(pooling.labels) == 1 \
        else ("classify", "token_classify")


def requested_task(pooling: spb.PoolingModelInfo, task: str | None) -> str:
    """The task a /pooling request runs: its `task` (400 naming `task` when the model
    cannot run it), else the model's own."""
    if task is None:
        return pooling.task
    supported = pooling_tasks(pooling)
    if task not in supported:
        raise APIError(f"Task {task} is not supported by this model (its task is "
                       f"{pooling.task!r}); it supports {', '.join(supported)}.", param="task")
    return task


def response_id(request, prefix: str) -> tuple[str, bool]:
    """(response id, whether it is unique): from the X-Request-Id middleware's id; a
    client's own id may repeat, so the scheduler ids then get a random suffix."""
    base = getattr(request.state, "request_id", None) or uuid.uuid4().hex
    return f"{prefix}-{base}", not getattr(request.state, "request_id_from_client", False)


def _max_length(state: GatewayState, truncate: int | None) -> int:
    """The tokenizer's limit for `truncate_prompt_tokens` (0: none)."""
    if truncate is None:
        return 0
    return truncation_limit(truncate, state.peers.model_info().max_model_len)


def truncation_limit(truncate: int | None, max_model_len: int) -> int | None:
    """The tokenizer's limit for `truncate_prompt_tokens` (None: none); vLLM's checks,
    as APIError. The gateway and `pagoda run-batch` both use it."""
    if truncate is None:
        return None
    if truncate == -1:
        return max_model_len
    if truncate == 0:
        raise APIError("truncate_prompt_tokens must be -1 (the context length) or positive, "
                       "got 0.", param="truncate_prompt_tokens")
    if truncate > max_model_len:
        raise APIError(f"truncate_prompt_tokens value ({truncate}) is greater than "
                       f"max_model_len ({max_model_len}). Please, select a smaller truncation "
                       "size.", param="truncate_prompt_tokens")
    return truncate


def input_items(value) -> list:
    """A pooling request's `input` as a list of items (texts or token-id lists): one
    text, or one prompt given as token ids, becomes a list of one. 400 for none."""
    items = [value] if isinstance(value, str) else list(value)
    if not items:
        raise APIError("The input cannot be empty.", param="input")
    if all(isinstance(x, int) for x in items):
        items = [items]  # one input given as token ids
    return items


async def tokenize_inputs(state: GatewayState, value, truncate: int | None,
                          add_special_tokens: bool = True, truncate_left: bool = False
                          ) -> list[PoolingInput]:
    """Text, texts, token ids or lists of token ids -> tokenized inputs (the first with
    its block hashes when routing wants them); `truncate_left`: truncation drops a
    text's beginning. 400 for no input, or more than the request limits allow (checked
    before any is tokenized)."""
    items = input_items(value)
    state.options.limits.check_prompts(len(items), "input")
    max_length = _max_length(state, truncate)
    block_size = state.peers.routing_block_size()

    async def one(item, i: int) -> PoolingInput:
        if not isinstance(item, str):
            return PoolingInput(list(item)[-max_length:] if max_length else list(item))
        reply = await tokenize(state, tpb.TokenizeRequest(
            prompt=item, add_special_tokens=add_special_tokens, max_length=max_length,
            block_size=block_size if i == 0 else 0, truncate_left=truncate_left))
        return PoolingInput(list(reply.token_ids), None, list(reply.block_hashes) or None)

    return list(await asyncio.gather(*(one(item, i) for i, item in enumerate(items))))


async def tokenize_pairs(state: GatewayState, left: Sequence[str], right: Sequence[str],
                         truncate: int | None) -> list[PoolingInput]:
    """Each (left[i], right[i]) encoded as one text pair, with its token-type split."""
    state.options.limits.check_prompts(len(left), "input")
    max_length = _max_length(state, truncate)

    async def one(first: str, second: str) -> PoolingInput:
        reply = await tokenize(state, tpb.TokenizeRequest(
            prompt=first, text_pair=second, add_special_tokens=True, max_length=max_length))
        try:
            split = token_type_split(reply.token_type_ids)
        except ValueError as exc:
            raise APIError(str(exc), 500) from None
        return PoolingInput(list(reply.token_ids), split)

    return list(await asyncio.gather(*(one(a, b) for a, b in zip(left, right))))


class Pooling:
    """The scheduler requests of one pooling HTTP request, and their results.

    Invariant: construction checks each input (non-empty, in the vocabulary) and raises
    APIError before anything is submitted; `results()` returns one result per input,
    in input order, or raises.
    """

    def __init__(self, peers: Peers, request_id: str, inputs: list[PoolingInput],
                 params: PoolingParams, user: str | None = None, unique_id: bool = True) -> None:
        vocab_size = peers.tokenizer_info().vocab_size
        self.peers, self.inputs, self.user = peers, inputs, user
        self.usage = Usage(prompt_tokens=sum(len(i.token_ids) for i in inputs))
        engine_id = request_id if unique_id else f"{request_id}-{uuid.uuid4().hex[:8]}"
        now = time.time()
        self.requests: list[EngineCoreRequest] = []
        for index, item in enumerate(inputs):
            check_prompt(item.token_ids, vocab_size, "input")
            request_params = params.clone()
            request_params.token_type_split = item.token_type_split
            self.requests.append(EngineCoreRequest(
                f"{engine_id}-{index}", item.token_ids, PREFILL_ONLY, arrival_time=now,
                pooling_params=request_params))

    async def results(self) -> list[PooledResult]:
        results: list[PooledResult | None] = [None] * len(self.requests)
        async for result in routed_deltas(self.peers, self.requests, self._open, self.user,
                                          self.inputs[0].block_hashes):
            results[result.index] = result
        return results  # type: ignore[return-value]

    def _open(self, replica: SchedulerReplica) -> AsyncIterator[PooledResult]:
        return merge_choices([_pooled(replica, i, r) for i, r in enumerate(self.requests)])


async def _pooled(replica: SchedulerReplica, index: int, request: EngineCoreRequest
                  ) -> AsyncIterator[PooledResult]:
    """One request's result. Raises APIError (ReplicaRefused when the replica refused it
    before answering: routing may try another)."""
    outputs = replica.generate(request)
    try:
        async for out in outputs:
            if not out.finished:
                continue
            if out.pooling_output is None:
                raise APIError(f"The scheduler ended the request without a result "
                               f"({out.finish_reason}).", 503)
            yield PooledResult(index, out.pooling_output, out.num_cached_tokens)
            return
        raise APIError("The scheduler ended the request without finishing it.", 500)
    except grpc.RpcError as exc:
        raise from_grpc_error(exc, f"scheduler {replica.address}") from None
    finally:
        await outputs.aclose()  # cancels the call if still open: the scheduler aborts it
