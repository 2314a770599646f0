"""Scheduler <-> worker messages: the per-step plan and its result.

The plan keeps its order on the wire (`num_scheduled_tokens` travels as two
parallel lists, since a proto map would not keep the dict's order), so the worker
sees exactly the `SchedulerOutput` the scheduler built. What every running request
has every step (its new blocks, its sampled tokens) travels as two int columns
(`_ragged_to_columns`): a message per request per step cost the scheduler and the
worker ~0.1-0.2 ms each at 256 requests. The columns are negotiated, since
schedulers and workers upgrade separately: a plan carries block columns only to a
worker whose GetWorkerInfo says `reads_plan_columns`, a reply carries token columns
only when its plan says `reply_columns`; otherwise both take the message per request
an older peer reads (every reader takes either form). The structured-output
bitmask travels as raw little-endian int32 bytes (`grammar_bitmask_to_bytes`), its
row count given by its request ids.
"""

from __future__ import annotations

import itertools

import numpy as np

from pagoda.services._proto.pagoda.worker.v1 import worker_pb2 as pb
from pagoda.messages import (CachedRequestData, KVOffload, KVOnload, KVSpill,
                             ModelRunnerOutput, NewRequestData, SchedulerOutput)
from pagoda.pooling_params import PREFILL_ONLY
from pagoda.services.common.protocol.common import (logprobs_from_proto, logprobs_to_proto,
                                                    lora_request_from_proto,
                                                    lora_request_to_proto)
from pagoda.services.common.protocol.multimodal import (features_from_proto,
                                                        features_to_encode, features_to_proto)
from pagoda.services.common.protocol.pooling_params import (pooled_data_from_proto,
                                                            pooled_data_to_proto,
                                                            pooling_params_from_proto,
                                                            pooling_params_to_proto)
from pagoda.services.common.protocol.sampling_params import (
    sampling_params_from_proto,
    sampling_params_to_proto,
)

# Trailing metadata of an ExecuteModel refused INVALID_ARGUMENT: the request at fault.
REJECTED_REQUEST_KEY = "pagoda-rejected-request"
# Trailing metadata of an ExecuteModel that failed midway: the worker dropped every
# request and waits for InitializeKvCache (the scheduler recovers: StepFailed).
STEP_FAILED_KEY = "pagoda-step-failed"


def scheduler_output_to_proto(out: SchedulerOutput, block_columns: bool = False
                              ) -> pb.SchedulerOutput:
    """The plan on the wire; its reply asked for as columns (this version reads them).
    `block_columns`: only for a worker that said it reads them (`reads_plan_columns`)."""
    msg = pb.SchedulerOutput(
        scheduled_req_ids=list(out.num_scheduled_tokens.keys()),
        num_scheduled_tokens=list(out.num_scheduled_tokens.values()),
        total_num_scheduled_tokens=out.total_num_scheduled_tokens,
        finished_req_ids=sorted(out.finished_req_ids),
        preempted_req_ids=sorted(out.preempted_req_ids),
        structured_output_request_ids=out.structured_output_request_ids,
        grammar_bitmask=grammar_bitmask_to_bytes(out.grammar_bitmask),
    )
    for new in out.scheduled_new_reqs:
        added = msg.scheduled_new_reqs.add(
            req_id=new.req_id,
            prompt_token_ids=new.prompt_token_ids,
            output_token_ids=new.output_token_ids,
            block_ids=new.block_ids,
            num_computed_tokens=new.num_computed_tokens,
            state_restore=0 if new.state_restore is None else new.state_restore + 1,
        )
        if new.lora_request is not None:
            lora_request_to_proto(new.lora_request, added.lora_request)
        if new.mm_features:
            features_to_proto(features_to_encode(new.mm_features, new.num_computed_tokens),
                              added.mm_features)
        if new.pooling_params is not None:  # a pooling request: never sampled
            pooling_params_to_proto(new.pooling_params, added.pooling_params)
        else:
            added.sampling_params.CopyFrom(sampling_params_to_proto(new.sampling_params,
                                                                    for_worker=True))
    for req_id, drafts in out.scheduled_spec_decode_tokens.items():
        msg.scheduled_spec_decode_tokens[req_id].token_ids.extend(drafts)
    for op in out.kv_offloads:
        msg.kv_offloads.add(block_id=op.block_id, slot=op.slot, block_hash=op.block_hash)
    for op in out.kv_onloads:
        msg.kv_onloads.add(req_id=op.req_id, block_index=op.block_index, slot=op.slot,
                           block_id=op.block_id, block_hash=op.block_hash, medium=op.medium)
    for spill in out.kv_spills:
        msg.kv_spills.add(slot=spill.slot, block_hash=spill.block_hash,
                          from_device=spill.block_id >= 0, block_id=max(spill.block_id, 0))
    msg.kv_disk_drops.extend(out.kv_disk_drops)
    for req_id, (num_tokens, slot) in out.state_saves.items():
        msg.state_saves.add(req_id=req_id, num_tokens=num_tokens, slot=slot)
    for op in out.kv_async_onloads:
        msg.kv_async_onloads.add(req_id=op.req_id, block_index=op.block_index, slot=op.slot,
                                 block_id=op.block_id, block_hash=op.block_hash,
                                 medium=op.medium)
    cached = out.scheduled_cached_reqs
    msg.scheduled_cached_reqs.req_ids.extend(cached.req_ids)
    msg.scheduled_cached_reqs.num_computed_tokens.extend(cached.num_computed_tokens)
    msg.reply_columns = True
    if block_columns:  # once per running request per step: not a message per request
        _ragged_to_columns(cached.new_block_ids, msg.scheduled_cached_reqs.new_block_counts,
                           msg.scheduled_cached_reqs.new_block_flat)
    else:  # an older worker: it reads only these
        add_block_ids = msg.scheduled_cached_reqs.new_block_ids.add
        for block_ids in cached.new_block_ids:
            # Most decode steps allocate no block: an empty add() is several times
            # cheaper than add(block_ids=[]).
            if block_ids:
                add_block_ids(block_ids=block_ids)
            else:
                add_block_ids()
    return msg


def _ragged_to_columns(rows: list[list[int]], counts, flat) -> None:
    """`rows` into the repeated fields `counts` (each row's length) and `flat` (every
    row's items in order); `_ragged_from_columns` is the inverse."""
    counts.extend([len(row) for row in rows])
    flat.extend(itertools.chain.from_iterable(rows))


def _ragged_from_columns(counts, flat, what: str) -> list[list[int]]:
    """The rows `_ragged_to_columns` wrote, one per count; ValueError naming `what`
    when the counts do not add up to the items."""
    counts = counts[:]  # lists: fastest to walk
    flat = flat[:]
    if sum(counts) != len(flat) or min(counts, default=0) < 0:
        raise ValueError(f"{what}: {len(counts)} counts do not split {len(flat)} items")
    if counts.count(1) == len(counts):  # a decode step: one each
        return [[item] for item in flat]
    if not flat:  # a decode step without new blocks
        return [[] for _ in counts]
    rows, start = [], 0
    for count in counts:
        rows.append(flat[start:start + count])
        start += count
    return rows


def scheduler_output_from_proto(msg: pb.SchedulerOutput) -> SchedulerOutput:
    new_reqs = [
        NewRequestData(
            req_id=m.req_id,
            prompt_token_ids=list(m.prompt_token_ids),
            output_token_ids=list(m.output_token_ids),
            sampling_params=(PREFILL_ONLY if m.HasField("pooling_params")
                             else sampling_params_from_proto(m.sampling_params)),
            block_ids=list(m.block_ids),
            num_computed_tokens=m.num_computed_tokens,
            pooling_params=(pooling_params_from_proto(m.pooling_params)
                            if m.HasField("pooling_params") else None),
            lora_request=(lora_request_from_proto(m.lora_request)
                          if m.HasField("lora_request") else None),
            mm_features=features_from_proto(m.mm_features, len(m.prompt_token_ids)),
            state_restore=m.state_restore - 1 if m.state_restore else None,
        )
        for m in msg.scheduled_new_reqs
    ]
    c = msg.scheduled_cached_reqs
    cached = CachedRequestData(
        req_ids=list(c.req_ids),
        new_block_ids=(_ragged_from_columns(c.new_block_counts, c.new_block_flat,
                                            "new_block_ids")
                       if c.new_block_counts else
                       [b.block_ids[:] for b in c.new_block_ids]),  # [:]: a list, fastest
        num_computed_tokens=list(c.num_computed_tokens),
    )
    return SchedulerOutput(
        scheduled_new_reqs=new_reqs,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=dict(zip(msg.scheduled_req_ids, msg.num_scheduled_tokens)),
        total_num_scheduled_tokens=msg.total_num_scheduled_tokens,
        finished_req_ids=set(msg.finished_req_ids),
        preempted_req_ids=set(msg.preempted_req_ids),
        structured_output_request_ids=list(msg.structured_output_request_ids),
        grammar_bitmask=grammar_bitmask_from_bytes(msg.grammar_bitmask,
                                                   len(msg.structured_output_request_ids)),
        scheduled_spec_decode_tokens={r: list(t.token_ids)
                                      for r, t in msg.scheduled_spec_decode_tokens.items()},
        kv_offloads=[KVOffload(m.block_id, m.slot, m.block_hash) for m in msg.kv_offloads],
        kv_onloads=[KVOnload(m.req_id, m.block_index, m.slot, m.block_id, m.block_hash,
                             m.medium or "cpu") for m in msg.kv_onloads],
        kv_spills=[KVSpill(m.slot, m.block_hash, m.block_id if m.from_device else -1)
                   for m in msg.kv_spills],
        kv_disk_drops=list(msg.kv_disk_drops),
        state_saves={m.req_id: (m.num_tokens, m.slot) for m in msg.state_saves},
        kv_async_onloads=[KVOnload(m.req_id, m.block_index, m.slot, m.block_id, m.block_hash,
                                   m.medium or "cpu") for m in msg.kv_async_onloads],
    )


def grammar_bitmask_to_bytes(bitmask: np.ndarray | None) -> bytes:
    """The packed bitmask as little-endian int32 bytes; b"" for none."""
    if bitmask is None:
        return b""
    return np.ascontiguousarray(bitmask, dtype="<i4").tobytes()


def grammar_bitmask_from_bytes(data: bytes, num_rows: int) -> np.ndarray | None:
    """The inverse of `grammar_bitmask_to_bytes`; ValueError if the bytes do not split
    into `num_rows` whole rows."""
    if not data and not num_rows:
        return None
    if num_rows == 0 or len(data) % (4 * num_rows):
        raise ValueError(f"grammar_bitmask of {len(data)} bytes does not hold {num_rows} rows")
    return np.frombuffer(data, dtype="<i4").astype(np.int32).reshape(num_rows, -1)


def model_runner_output_to_proto(out: ModelRunnerOutput, columns: bool = False
                                 ) -> pb.ModelRunnerOutput:
    """The step's output on the wire; its sampled tokens as columns only when the plan
    asked for them (`SchedulerOutput.reply_columns`), else as an older scheduler reads."""
    msg = pb.ModelRunnerOutput(req_ids=out.req_ids,
                               num_encoder_cache_queries=out.num_encoder_cache_queries,
                               num_encoder_cache_hits=out.num_encoder_cache_hits,
                               finished_recving=sorted(out.finished_recving),
                               invalid_block_ids=sorted(out.invalid_block_ids))
    if columns:
        _ragged_to_columns(out.sampled_token_ids, msg.sampled_token_counts,
                           msg.sampled_token_flat)
    else:
        add_tokens = msg.sampled_token_ids.add
        for tokens in out.sampled_token_ids:
            add_tokens(token_ids=tokens)
    for req_id, lists in out.logprobs.items():
        logprobs_to_proto(lists, msg.logprobs[req_id])
    for req_id, lists in out.prompt_logprobs.items():
        logprobs_to_proto(lists, msg.prompt_logprobs[req_id])
    for req_id, data in out.pooler_output.items():
        pooled_data_to_proto(data, msg.pooler_output[req_id])
    for req_id, tokens in out.draft_token_ids.items():
        msg.draft_token_ids[req_id].token_ids.extend(tokens)
    return msg


def model_runner_output_from_proto(msg: pb.ModelRunnerOutput) -> ModelRunnerOutput:
    return ModelRunnerOutput(
        req_ids=list(msg.req_ids),
        sampled_token_ids=(_ragged_from_columns(msg.sampled_token_counts,
                                                msg.sampled_token_flat, "sampled_token_ids")
                           if msg.sampled_token_counts else
                           [t.token_ids[:] for t in msg.sampled_token_ids]),  # [:]: a list
        logprobs={k: logprobs_from_proto(v) for k, v in msg.logprobs.items()},
        prompt_logprobs={k: logprobs_from_proto(v) for k, v in msg.prompt_logprobs.items()},
        pooler_output={k: pooled_data_from_proto(v) for k, v in msg.pooler_output.items()},
        draft_token_ids={k: list(v.token_ids) for k, v in msg.draft_token_ids.items()},
        num_encoder_cache_queries=msg.num_encoder_cache_queries,
        num_encoder_cache_hits=msg.num_encoder_cache_hits,
        finished_recving=set(msg.finished_recving),
        invalid_block_ids=set(msg.invalid_block_ids),
    )
