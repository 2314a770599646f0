"""Proto <-> engine dataclass conversions survive the round trip unchanged."""

from __future__ import annotations

import pytest

from pagoda.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from pagoda.messages import (CachedRequestData, EngineCoreOutput, EngineCoreRequest, FinishReason,
                             LogprobsLists, ModelRunnerOutput, NewRequestData, SchedulerOutput)
from pagoda.services.common.protocol.common import sampling_params_from_proto, sampling_params_to_proto
from pagoda.services.common.protocol.kv_events import kv_event_from_proto, kv_event_to_proto
from pagoda.services.common.protocol.scheduler import (outputs_to_responses, request_from_proto,
                                       request_to_proto, response_to_output)
from pagoda.services.common.protocol.worker import (model_runner_output_from_proto, model_runner_output_to_proto,
                                    scheduler_output_from_proto, scheduler_output_to_proto)
from pagoda.sampling_params import SamplingParams


@pytest.mark.parametrize("params", [
    SamplingParams(),
    SamplingParams(temperature=0.7, top_p=0.93, top_k=40, min_p=0.05, seed=1234567890123,
                   stop=["\n\n", "END"], stop_token_ids=[2, 7], ignore_eos=True, max_tokens=None,
                   min_tokens=3, logprobs=0, prompt_logprobs=5, presence_penalty=-1.5,
                   frequency_penalty=0.3, repetition_penalty=1.1,
                   include_stop_str_in_output=True, skip_special_tokens=False,
                   spaces_between_special_tokens=False, logit_bias={5: -100.0, 9: 2.5},
                   extra_args={"cache_salt": "abc", "k": [1, 2]}),
])
def test_sampling_params_round_trip(params):
    assert sampling_params_from_proto(sampling_params_to_proto(params)) == params


def test_invalid_sampling_params_are_rejected_on_arrival():
    msg = sampling_params_to_proto(SamplingParams())
    msg.top_p = 0.0
    with pytest.raises(ValueError, match="top_p"):
        sampling_params_from_proto(msg)


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


def test_model_runner_output_round_trip():
    lp = LogprobsLists([[5, 5, 1]], [[-0.5, -0.5, -1.25]], [[1, 1, 2]])
    out = ModelRunnerOutput(["a", "b"], [[5], []], logprobs={"a": lp}, prompt_logprobs={"b": lp})
    assert model_runner_output_from_proto(model_runner_output_to_proto(out)) == out


def test_request_round_trip():
    req = EngineCoreRequest("r-1", [1, 2, 3], SamplingParams(max_tokens=5), [0], 123.5, [4])
    assert request_from_proto(request_to_proto(req)) == req


def test_outputs_coalesce_into_one_chunk_then_complete():
    lp1 = LogprobsLists([[3]], [[-0.25]], [[1]])
    lp2 = LogprobsLists([[4]], [[-0.5]], [[2]])
    outs = [EngineCoreOutput("r", [3], new_logprobs=lp1, num_cached_tokens=16),
            EngineCoreOutput("r", [4], new_logprobs=lp2, num_cached_tokens=16,
                             finish_reason=FinishReason.STOP, stop_reason=4)]
    responses = outputs_to_responses(outs, num_prompt_tokens=20, num_output_tokens=2)
    assert [r.WhichOneof("response") for r in responses] == ["chunk", "complete"]
    chunk = response_to_output("r", responses[0])
    assert chunk.new_token_ids == [3, 4] and not chunk.finished
    assert chunk.new_logprobs == LogprobsLists([[3], [4]], [[-0.25], [-0.5]], [[1], [2]])
    done = response_to_output("r", responses[1])
    assert done.finish_reason == FinishReason.STOP and done.stop_reason == 4
    assert done.num_cached_tokens == 16 and done.new_token_ids == []
    assert responses[1].complete.num_output_tokens == 2


def test_empty_partial_prefill_output_sends_nothing():
    assert outputs_to_responses([EngineCoreOutput("r", [])], 10, 0) == []


@pytest.mark.parametrize("event", [
    BlockStored([b"\x01" * 32, b"\x02" * 32], None, list(range(32)), 16),
    BlockStored([b"\x03" * 32], b"\x02" * 32, list(range(16)), 16),
    BlockRemoved([b"\x01" * 32]),
    AllBlocksCleared(),
])
def test_kv_event_round_trip(event):
    assert kv_event_from_proto(kv_event_to_proto(event)) == event
