"""Proto <-> engine dataclass conversions survive the round trip unchanged.

The sampling-params test builds its values from `dataclasses.fields(SamplingParams)`,
each different from the field's default, so a field the wire forgets fails here
instead of silently arriving as its default.
"""

from __future__ import annotations

import typing
from dataclasses import MISSING, fields

import pytest

from pagoda.core.block_hash import hash_request_tokens, request_keys
from pagoda.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from pagoda.core.request import Request
from pagoda.messages import (CachedRequestData, EngineCoreOutput, EngineCoreRequest, FinishReason,
                             LogprobsLists, ModelRunnerOutput, NewRequestData, SchedulerOutput)
import numpy as np

from pagoda.messages import KVOffload, KVOnload, KVSpill
from pagoda.services._proto.pagoda.worker.v1 import worker_pb2
from pagoda.services.common.protocol.worker import (scheduler_output_from_proto,
                                                    scheduler_output_to_proto)

from pagoda.sampling_params import SamplingParams, StructuredOutputsParams
from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2 as spb
from pagoda.services.common.protocol.kv_events import (kv_event_from_proto, kv_event_to_proto,
                                                      publish_request)
from pagoda.repetition_detection import RepetitionDetectionParams
from pagoda.services.common.protocol.sampling_params import (EDGE_ONLY, ENGINE_FIELDS, OFFLINE_ONLY,
                                                             GATEWAY_ONLY,
                                                             TEXT_FIELDS, decode_options_from_proto,
                                                             decode_options_to_proto,
                                                             sampling_params_from_proto,
                                                             sampling_params_to_proto)
from pagoda.services.common.protocol.scheduler import (hash_blocks, outputs_to_responses,
                                                       request_from_proto, request_to_proto,
                                                       response_to_output)
from pagoda.services.common.protocol.worker import (model_runner_output_from_proto,
                                                    model_runner_output_to_proto,
                                                    scheduler_output_from_proto,
                                                    scheduler_output_to_proto)


def _non_default(name: str, hint, default):
    """A valid value of the field's type that differs from its default."""
    args = set(typing.get_args(hint)) - {type(None)}
    if hint is bool:
        return not default
    if hint is float:
        return default / 2 if default else 0.25
    if hint is int or args == {int}:
        return (default or 0) + 3
    if list[str] in args:
        return ["\n\n", "END"]
    if list[int] in args:
        return [2, 7]
    if list[list[int]] in args:
        return [[3, 4], [5]]
    if dict[int, float] in args:
        return {5: -100.0, 9: 2.5}
    if dict[str, typing.Any] in args:
        return {"ban_token_id": 7, "words": ["a", 1.5]}
    if StructuredOutputsParams in args:
        return StructuredOutputsParams(regex=r"[a-z]+\d")
    if RepetitionDetectionParams in args:
        return RepetitionDetectionParams(max_pattern_size=6, min_pattern_size=2, min_count=3)
    raise AssertionError(f"teach this test a non-default value for {name}: {hint}")


def every_field_set() -> SamplingParams:
    hints = typing.get_type_hints(SamplingParams)
    values = {}
    for f in fields(SamplingParams):
        assert f.default is not MISSING
        values[f.name] = _non_default(f.name, hints[f.name], f.default)
    params = SamplingParams(**values)
    defaults = SamplingParams()
    unchanged = [f.name for f in fields(params)
                 if getattr(params, f.name) == getattr(defaults, f.name)]
    assert not unchanged, f"fields left at their defaults: {unchanged}"
    return params


def test_every_sampling_field_travels_to_the_service_that_reads_it():
    params = every_field_set()
    engine = sampling_params_from_proto(sampling_params_to_proto(params))
    for name in ENGINE_FIELDS:  # the scheduler's and the worker's
        assert getattr(engine, name) == getattr(params, name), name
    prompt, text = decode_options_from_proto(decode_options_to_proto([1, 2], params))
    assert prompt == [1, 2]
    for name in TEXT_FIELDS:  # the tokenizer's
        assert getattr(text, name) == getattr(params, name), name
    everything = {f.name for f in fields(SamplingParams)}
    assert set(ENGINE_FIELDS) | set(TEXT_FIELDS) | GATEWAY_ONLY | EDGE_ONLY | OFFLINE_ONLY \
        == everything
    # The bad words travel encoded; the words and the truncation stay at the edge.
    assert "bad_words_token_ids" in ENGINE_FIELDS and not EDGE_ONLY & set(ENGINE_FIELDS)
    # Nothing travels where it is not read: the scheduler never sees stop strings.
    assert "stop" not in ENGINE_FIELDS and "n" not in set(ENGINE_FIELDS) | set(TEXT_FIELDS)


def test_unset_optional_fields_stay_unset():
    params = SamplingParams(max_tokens=None, seed=None, logprobs=None, logit_bias=None)
    back = sampling_params_from_proto(sampling_params_to_proto(params))
    assert back == params
    assert (back.max_tokens, back.seed, back.logprobs, back.logit_bias) == (None, None, None, None)
    zero = sampling_params_from_proto(sampling_params_to_proto(SamplingParams(seed=0, logprobs=0)))
    assert (zero.seed, zero.logprobs) == (0, 0)  # zero is a value, not "unset"


def test_the_wire_does_not_validate_again():
    msg = sampling_params_to_proto(SamplingParams())
    msg.top_p = 0.0  # invalid, but the gateway is the one that checks
    assert sampling_params_from_proto(msg).top_p == 0.0


def test_scheduler_output_round_trip_keeps_order():
    out = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("b", [1, 2, 3], [9], SamplingParams(seed=3), [4, 5], 2)],
        scheduled_cached_reqs=CachedRequestData(["z", "a"], [[], [11, 12]], [40, 7]),
        num_scheduled_tokens={"z": 1, "b": 2, "a": 1},
        total_num_scheduled_tokens=4,
        finished_req_ids={"x", "y"},
        preempted_req_ids={"q"},
    )
    back = scheduler_output_from_proto(scheduler_output_to_proto(out))
    assert back == out
    assert list(back.num_scheduled_tokens) == ["z", "b", "a"]


@pytest.mark.parametrize("constraint", [
    StructuredOutputsParams(json={"type": "object", "properties": {"z": {"type": "integer",
                                  "maximum": 9}, "a": {"type": "number", "minimum": 1.5}}}),
    StructuredOutputsParams(json=True),
    StructuredOutputsParams(regex=r"\d{3}"),
    StructuredOutputsParams(choice=["yes", "no"]),
    StructuredOutputsParams(grammar='root ::= "a"+'),
    StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
    StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": {}}),
])
def test_structured_outputs_reach_the_scheduler_but_not_the_worker(constraint):
    params = SamplingParams(structured_outputs=constraint)
    back = sampling_params_from_proto(sampling_params_to_proto(params)).structured_outputs
    assert back == constraint
    if constraint.json not in (None, True):  # schema key order is kept (it orders the grammar)
        assert list(back.json["properties"]) == ["z", "a"]
    worker = sampling_params_from_proto(sampling_params_to_proto(params, for_worker=True))
    assert worker.structured_outputs is None


def test_grammar_bitmask_round_trip():
    bitmask = np.array([[-1, 0, 5], [7, -(2**31), 2**31 - 1]], dtype=np.int32)
    out = SchedulerOutput([], CachedRequestData(["a", "b"], [[], []], [3, 4]), {"a": 1, "b": 1},
                          2, structured_output_request_ids=["b", "a"], grammar_bitmask=bitmask)
    back = scheduler_output_from_proto(scheduler_output_to_proto(out))
    assert back.structured_output_request_ids == ["b", "a"]
    assert back.grammar_bitmask.dtype == np.int32 and np.array_equal(back.grammar_bitmask, bitmask)
    plain = scheduler_output_from_proto(scheduler_output_to_proto(SchedulerOutput.empty()))
    assert plain.grammar_bitmask is None and plain.structured_output_request_ids == []


def test_model_runner_output_round_trip():
    lp = LogprobsLists([[5, 5, 1]], [[-0.5, -0.5, -1.25]], [[1, 1, 2]])
    out = ModelRunnerOutput(["a", "b"], [[5], []], logprobs={"a": lp}, prompt_logprobs={"b": lp})
    assert model_runner_output_from_proto(model_runner_output_to_proto(out)) == out


@pytest.mark.parametrize("rows", [
    [[5], [6], [7]],  # a decode step: one token (no block) each
    [[], [], []],
    [[5], [], [6, 7, 8], [9]],  # a partial prefill, a verified draft
    [],
])
@pytest.mark.parametrize("columns", [True, False])
def test_ragged_rows_round_trip_as_columns_or_as_a_message_each(rows, columns):
    """Sampled tokens and the cached requests' new blocks travel as two columns each
    when the peer reads them, else as a message per request; a reader takes either."""
    ids = [f"r{i}" for i in range(len(rows))]
    out = ModelRunnerOutput(ids, [list(r) for r in rows])
    msg = model_runner_output_to_proto(out, columns=columns)
    assert len(msg.sampled_token_ids) == (0 if columns else len(rows))
    assert bool(msg.sampled_token_counts) == (columns and bool(rows))
    assert model_runner_output_from_proto(msg) == out
    plan = SchedulerOutput([], CachedRequestData(ids, [list(r) for r in rows], [3] * len(ids)),
                           {r: 1 for r in ids}, len(ids))
    sent = scheduler_output_to_proto(plan, block_columns=columns)
    assert sent.reply_columns  # this version reads a reply's columns
    assert len(sent.scheduled_cached_reqs.new_block_ids) == (0 if columns else len(rows))
    assert bool(sent.scheduled_cached_reqs.new_block_counts) == (columns and bool(rows))
    assert scheduler_output_from_proto(sent) == plan


def test_an_older_peer_gets_the_messages_it_reads():
    """Rolling upgrade: an older scheduler's plan (no reply_columns) gets the reply as
    a message per request, and an older worker's plan as a message per request, each
    exactly what the older reader (the field it knows, nothing else) takes."""
    from pagoda.services._proto.pagoda.worker.v1 import worker_pb2 as wpb
    older_plan = wpb.SchedulerOutput()  # what an older scheduler sends: no reply_columns
    assert not older_plan.reply_columns
    out = ModelRunnerOutput(["a", "b", "c"], [[4], [], [5, 6]])
    reply = model_runner_output_to_proto(out, columns=older_plan.reply_columns)
    assert [t.token_ids[:] for t in reply.sampled_token_ids] == [[4], [], [5, 6]]
    assert not reply.sampled_token_counts and not reply.sampled_token_flat
    plan = SchedulerOutput([], CachedRequestData(["a", "b"], [[7], []], [3, 4]),
                           {"a": 1, "b": 1}, 2)
    sent = scheduler_output_to_proto(plan, block_columns=False)
    assert [b.block_ids[:] for b in sent.scheduled_cached_reqs.new_block_ids] == [[7], []]
    assert not sent.scheduled_cached_reqs.new_block_counts


def test_ragged_columns_a_reader_takes_the_old_messages_and_refuses_bad_counts():
    from pagoda.services._proto.pagoda.worker.v1 import worker_pb2 as wpb
    old = wpb.ModelRunnerOutput(req_ids=["a", "b"])
    old.sampled_token_ids.add(token_ids=[4])
    old.sampled_token_ids.add(token_ids=[])
    assert model_runner_output_from_proto(old).sampled_token_ids == [[4], []]
    bad = wpb.ModelRunnerOutput(req_ids=["a", "b"], sampled_token_counts=[1, 2],
                                sampled_token_flat=[4, 5])
    with pytest.raises(ValueError, match="sampled_token_ids"):
        model_runner_output_from_proto(bad)


@pytest.mark.parametrize("salt", [None, "tenant-7"])
def test_request_round_trip(salt):
    req = EngineCoreRequest("r-1", [1, 2, 3], SamplingParams(max_tokens=5, stop=["x"]), [0], 123.5,
                            [4], cache_salt=salt)
    back = request_from_proto(request_to_proto(req))
    assert back.cache_salt == salt
    # Everything the engine reads arrives; the stop strings stay with the gateway.
    assert back == EngineCoreRequest("r-1", [1, 2, 3], SamplingParams(max_tokens=5), [0], 123.5,
                                     [4], cache_salt=salt)


def test_outputs_coalesce_into_one_chunk_then_complete():
    lp1 = LogprobsLists([[3]], [[-0.25]], [[1]])
    lp2 = LogprobsLists([[4]], [[-0.5]], [[2]])
    outs = [EngineCoreOutput("r", [3], new_logprobs=lp1, num_cached_tokens=16),
            EngineCoreOutput("r", [4], new_logprobs=lp2, num_cached_tokens=16,
                             finish_reason=FinishReason.STOP, stop_reason=4)]
    responses = outputs_to_responses(outs)
    assert [r.WhichOneof("response") for r in responses] == ["chunk", "complete"]
    chunk = response_to_output("r", responses[0])
    assert chunk.new_token_ids == [3, 4] and not chunk.finished
    assert chunk.new_logprobs == LogprobsLists([[3], [4]], [[-0.25], [-0.5]], [[1], [2]])
    done = response_to_output("r", responses[1])
    assert done.finish_reason == FinishReason.STOP and done.stop_reason == 4
    assert done.num_cached_tokens == 16 and done.new_token_ids == []


def test_empty_partial_prefill_output_sends_nothing():
    assert outputs_to_responses([EngineCoreOutput("r", [])]) == []


@pytest.mark.parametrize("salt", ["", "tenant-7"])
def test_hash_blocks_equals_the_engine_requests_hashes(salt):
    ids = list(range(40))
    engine = Request(EngineCoreRequest("r", ids, SamplingParams(), cache_salt=salt or None), 16,
                     "seed", max_model_len=100)
    reply = hash_blocks(spb.HashBlocksRequest(token_ids=ids, block_size=16, cache_salt=salt),
                        "seed")
    assert list(reply.block_hashes) == engine.block_hashes and len(engine.block_hashes) == 2
    assert engine.block_hashes == hash_request_tokens(ids, 16, "seed", request_keys(salt))
    unsalted = hash_request_tokens(ids, 16, "seed")
    assert (engine.block_hashes == unsalted) == (salt == "")
    with pytest.raises(ValueError, match="block_size"):
        hash_blocks(spb.HashBlocksRequest(token_ids=ids, block_size=0), "seed")


def test_decode_options_carry_the_prompt_and_the_stop_strings():
    options = decode_options_to_proto([7, 8], SamplingParams(stop="END", temperature=0.5))
    assert list(options.prompt_token_ids) == [7, 8] and list(options.stop) == ["END"]


@pytest.mark.parametrize("event", [
    BlockStored([b"\x01" * 32, b"\x02" * 32], None, list(range(32)), 16),
    BlockStored([b"\x03" * 32], b"\x02" * 32, list(range(16)), 16),
    BlockRemoved([b"\x01" * 32]),
    AllBlocksCleared(),
])
def test_kv_event_round_trip(event):
    assert kv_event_from_proto(kv_event_to_proto(event)) == event


def test_published_events_are_what_kv_event_to_proto_writes():
    """publish_request fills its events in place (add_kv_events): the same bytes."""
    events = [BlockStored([b"\x01" * 32, b"\x02" * 32], None, list(range(32)), 16),
              BlockStored([b"\x03" * 32], b"\x02" * 32, list(range(16)), 16, "CPU"),
              BlockRemoved([b"\x01" * 32], "DISK"), AllBlocksCleared(),
              BlockStored([b"\x04" * 32], b"\x03" * 32, list(range(16, 32)), 16)]
    request = publish_request("s", "m", 16, "e", 3, events)
    assert list(request.events) == [kv_event_to_proto(event) for event in events]
    assert [kv_event_from_proto(e) for e in request.events] == events


def test_host_tier_copies_cross_the_wire():
    plan = SchedulerOutput([], CachedRequestData(), {}, 0,
                           kv_offloads=[KVOffload(3, 7, b"\x01" * 32)],
                           kv_onloads=[KVOnload("r", 2, 7, 9, b"\x02" * 32),
                                       KVOnload("r", 3, -1, 4, b"\x03" * 32, "disk")],
                           kv_spills=[KVSpill(5, b"\x04" * 32), KVSpill(6, b"\x05" * 32, 0)],
                           kv_disk_drops=[b"\x06" * 32])
    wire = worker_pb2.SchedulerOutput.FromString(
        scheduler_output_to_proto(plan).SerializeToString())
    back = scheduler_output_from_proto(wire)
    assert back.kv_offloads == plan.kv_offloads and back.kv_onloads == plan.kv_onloads
    # A spill from device block 0 stays one (proto3's 0 default is not "from the slot").
    assert back.kv_spills == plan.kv_spills and back.kv_disk_drops == plan.kv_disk_drops


def test_async_onloads_and_their_reports_cross_the_wire():
    plan = SchedulerOutput([], CachedRequestData(), {}, 0,
                           kv_async_onloads=[KVOnload("r", 0, 7, 9, b"\x02" * 32),
                                             KVOnload("r", 1, -1, 4, b"\x03" * 32, "disk")])
    wire = worker_pb2.SchedulerOutput.FromString(
        scheduler_output_to_proto(plan).SerializeToString())
    assert scheduler_output_from_proto(wire).kv_async_onloads == plan.kv_async_onloads
    out = ModelRunnerOutput([], [], finished_recving={"r", "s"}, invalid_block_ids={4, 0})
    back = model_runner_output_from_proto(worker_pb2.ModelRunnerOutput.FromString(
        model_runner_output_to_proto(out).SerializeToString()))
    assert back.finished_recving == {"r", "s"} and back.invalid_block_ids == {0, 4}
