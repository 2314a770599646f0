"""Gateway <-> scheduler messages: tokenized requests in, token-id deltas out.

A `Generate` stream carries one request's `EngineCoreOutput`s. The scheduler
coalesces every output that piled up since its last write into one chunk
(`outputs_to_responses`), and the gateway turns each message back into one
`EngineCoreOutput` (`response_to_output`), so both ends speak the engine's types.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagoda.core.block_hash import DEFAULT_HASH_ALGO, hash_request_tokens, request_keys
from pagoda.messages import EngineCoreOutput, EngineCoreRequest, FinishReason, LogprobsLists
from pagoda.repetition_detection import REPETITION_STOP_REASON
from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2 as pb
from pagoda.services.common.protocol.common import (
    extend_logprobs,
    finish_reason_from_proto,
    finish_reason_to_proto,
    logprobs_from_proto,
    logprobs_to_proto,
    lora_request_from_proto,
    lora_request_to_proto,
)
from pagoda.pooling_params import PREFILL_ONLY
from pagoda.services.common.protocol.kv_transfer import kv_params_from_proto, kv_params_to_proto
from pagoda.services.common.protocol.multimodal import features_from_proto, features_to_proto
from pagoda.services.common.protocol.pooling_params import (
    pooled_data_from_proto,
    pooled_data_to_proto,
    pooling_params_from_proto,
    pooling_params_to_proto,
)
from pagoda.services.common.protocol.sampling_params import (
    sampling_params_from_proto,
    sampling_params_to_proto,
)


# Trailing metadata of a `Generate` stream the scheduler ends UNAVAILABLE although the
# request could go on: why (drain_timeout, replica_failed). The gateway migrates the
# request and counts the reason (pagoda_gateway_migrations_total{reason}).
MIGRATION_REASON_KEY = "pagoda-migration-reason"
# How a sleeping replica's refusal of `Generate` (FAILED_PRECONDITION) begins: the
# gateway answers such a refusal 503 with the message, as vLLM does while asleep.
SLEEPING_MESSAGE = "The model is sleeping"


def request_to_proto(req: EngineCoreRequest) -> pb.GenerateRequest:
    """A pooling request carries its pooling params instead of sampling params."""
    msg = pb.GenerateRequest(
        request_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        eos_token_ids=req.eos_token_ids,
        arrival_time=req.arrival_time,
        output_token_ids=req.output_token_ids,
        cache_salt=req.cache_salt or "",
        priority=req.priority,
    )
    if req.pooling_params is not None:
        pooling_params_to_proto(req.pooling_params, msg.pooling_params)
    else:
        msg.sampling_params.CopyFrom(sampling_params_to_proto(req.sampling_params))
    if req.kv_transfer_params is not None:
        kv_params_to_proto(req.kv_transfer_params, msg.kv_transfer_params)
    if req.lora_request is not None:
        lora_request_to_proto(req.lora_request, msg.lora_request)
    features_to_proto(req.mm_features, msg.mm_features)
    return msg


def request_from_proto(msg: pb.GenerateRequest) -> EngineCoreRequest:
    """The sampling params are not validated here (the scheduler's request check does,
    once); a malformed LoRA request or media feature raises ValueError."""
    pooling = msg.HasField("pooling_params")
    return EngineCoreRequest(
        request_id=msg.request_id,
        prompt_token_ids=list(msg.prompt_token_ids),
        sampling_params=PREFILL_ONLY if pooling else sampling_params_from_proto(msg.sampling_params),
        eos_token_ids=list(msg.eos_token_ids),
        arrival_time=msg.arrival_time,
        output_token_ids=list(msg.output_token_ids),
        cache_salt=msg.cache_salt or None,
        priority=msg.priority,
        pooling_params=pooling_params_from_proto(msg.pooling_params) if pooling else None,
        kv_transfer_params=(kv_params_from_proto(msg.kv_transfer_params)
                            if msg.HasField("kv_transfer_params") else None),
        lora_request=(lora_request_from_proto(msg.lora_request)
                      if msg.HasField("lora_request") else None),
        mm_features=features_from_proto(msg.mm_features, len(msg.prompt_token_ids)),
    )


def outputs_to_responses(outputs: Sequence[EngineCoreOutput]) -> list[pb.GenerateResponse]:
    """Coalesce one request's outputs (oldest first) into at most one chunk, plus
    a `complete` if the last one finished."""
    return _coalesce(outputs, pb.GenerateResponse)


def outputs_to_items(request_id: str, outputs: Sequence[EngineCoreOutput],
                     into: list[pb.GenerateStreamItem]) -> None:
    """`outputs_to_responses` as `GenerateStream` items of `request_id`, appended to `into`."""
    last = outputs[-1]
    if (len(outputs) == 1 and last.new_token_ids and last.new_logprobs is None
            and last.new_prompt_logprobs is None and last.finish_reason is None):
        into.append(pb.GenerateStreamItem(request_id=request_id, chunk=pb.GenerateChunk(
            token_ids=last.new_token_ids, num_cached_tokens=last.num_cached_tokens)))
        return
    into.extend(_coalesce(outputs, lambda **kw: pb.GenerateStreamItem(request_id=request_id,
                                                                       **kw)))


def _coalesce(outputs: Sequence[EngineCoreOutput], wrap) -> list:
    """At most one `wrap(chunk=...)` and one `wrap(complete=...)` for the outputs."""
    last = outputs[-1]
    if (len(outputs) == 1 and last.new_token_ids and last.new_logprobs is None
            and last.new_prompt_logprobs is None and last.finish_reason is None):
        # A decode step's tokens, nothing else (every stream, every step): the chunk
        # the general path below builds, without its accumulation.
        return [wrap(chunk=pb.GenerateChunk(
            token_ids=last.new_token_ids, num_cached_tokens=last.num_cached_tokens))]
    token_ids: list[int] = []
    logprobs: LogprobsLists | None = None
    prompt_logprobs: LogprobsLists | None = None
    for out in outputs:
        token_ids.extend(out.new_token_ids)
        if out.new_logprobs is not None:
            logprobs = logprobs or LogprobsLists()
            extend_logprobs(logprobs, out.new_logprobs)
        if out.new_prompt_logprobs is not None:
            prompt_logprobs = prompt_logprobs or LogprobsLists()
            extend_logprobs(prompt_logprobs, out.new_prompt_logprobs)
    last = outputs[-1]
    responses = []
    if token_ids or logprobs or prompt_logprobs:
        chunk = pb.GenerateChunk(token_ids=token_ids, num_cached_tokens=last.num_cached_tokens)
        if logprobs is not None:
            logprobs_to_proto(logprobs, chunk.logprobs)
        if prompt_logprobs is not None:
            logprobs_to_proto(prompt_logprobs, chunk.prompt_logprobs)
        responses.append(wrap(chunk=chunk))
    if last.finished:
        complete = pb.GenerateComplete(
            finish_reason=finish_reason_to_proto(last.finish_reason),
            num_cached_tokens=last.num_cached_tokens,
        )
        if isinstance(last.stop_reason, int):
            complete.stop_token_id = last.stop_reason
        if last.pooling_output is not None:
            pooled_data_to_proto(last.pooling_output, complete.pooling_output)
        if last.kv_transfer_params is not None:
            kv_params_to_proto(last.kv_transfer_params, complete.kv_transfer_params)
        responses.append(wrap(complete=complete))
    return responses


def response_to_output(request_id: str, msg: pb.GenerateResponse) -> EngineCoreOutput:
    """One stream message -> one EngineCoreOutput (a `complete` has no tokens); `msg`
    may also be a `GenerateStreamItem` with a chunk or a complete (same field names)."""
    if msg.HasField("chunk"):
        c = msg.chunk
        return EngineCoreOutput(
            request_id=request_id,
            new_token_ids=list(c.token_ids),
            new_logprobs=logprobs_from_proto(c.logprobs) if c.HasField("logprobs") else None,
            new_prompt_logprobs=(logprobs_from_proto(c.prompt_logprobs)
                                 if c.HasField("prompt_logprobs") else None),
            num_cached_tokens=c.num_cached_tokens,
        )
    c = msg.complete
    reason = finish_reason_from_proto(c.finish_reason)
    if reason is None:  # FinishReason.STOP is 0: test against None, not falsiness
        reason = FinishReason.ABORT
    return EngineCoreOutput(
        request_id=request_id,
        new_token_ids=[],
        finish_reason=reason,
        stop_reason=(c.stop_token_id if c.HasField("stop_token_id")
                     else REPETITION_STOP_REASON if reason == FinishReason.REPETITION else None),
        num_cached_tokens=c.num_cached_tokens,
        pooling_output=(pooled_data_from_proto(c.pooling_output)
                        if c.HasField("pooling_output") else None),
        kv_transfer_params=(kv_params_from_proto(c.kv_transfer_params)
                            if c.HasField("kv_transfer_params") else None),
    )


def hash_blocks(request: pb.HashBlocksRequest, prefix_hash_seed: str,
                hash_algo: str = "") -> pb.HashBlocksResponse:
    """A prompt's block hashes exactly as the engine's `Request` computes them (the
    same library function, salt and adapter keyed by `request_keys`). Raises ValueError for a
    block size below 1."""
    if request.block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {request.block_size}")
    algo = hash_algo or DEFAULT_HASH_ALGO
    hashes = hash_request_tokens(list(request.token_ids), request.block_size, prefix_hash_seed,
                                 request_keys(request.cache_salt, request.lora_key), algo=algo)
    return pb.HashBlocksResponse(block_hashes=hashes, prefix_hash_seed=prefix_hash_seed,
                                 prefix_caching_hash_algo=algo)
