"""The typed codec of a worker group's control traffic: every plan and result round-trips,
and bytes that are not a message of the declared type are refused - a pickle gadget
included - without building anything else."""

from __future__ import annotations

import math
import os
import pickle

import numpy as np
import pytest

from pagoda.worker.rank_worker import CALLS, _argument_types
from pagoda.distributed.wire_codec import WireError, decode, dump, encode, from_json
from pagoda.messages import (CachedRequestData, LogprobsLists, ModelRunnerOutput, NewRequestData,
                             SchedulerOutput)
from pagoda.pooling_params import PoolingParams
from pagoda.sampling_params import SamplingParams, StructuredOutputsParams


def plan() -> SchedulerOutput:
    params = SamplingParams(temperature=0.7, top_k=5, seed=2**62, stop_token_ids=[7, 9],
                            logit_bias={3: -100.0, 11: 2.5}, logprobs=4, min_tokens=2,
                            structured_outputs=StructuredOutputsParams(
                                json={"type": "object", "properties": {"a": {"type": "integer"}}}))
    new = [NewRequestData("a", [1, 2, 3], [4], params, [0, 1], 0),
           NewRequestData("e", [5, 6], [], SamplingParams(), [2], 0,
                          pooling_params=PoolingParams(normalize=True))]
    bitmask = np.arange(6, dtype=np.int32).reshape(1, 6)
    return SchedulerOutput(new, CachedRequestData(["b"], [[3, 4]], [17]),
                           {"a": 3, "e": 2, "b": 1}, 6, {"done"}, {"bumped"}, ["a"], bitmask)


def test_a_plan_round_trips():
    original = plan()
    decoded = decode(encode(original, SchedulerOutput), SchedulerOutput)
    assert decoded.scheduled_new_reqs == original.scheduled_new_reqs
    assert decoded.scheduled_cached_reqs == original.scheduled_cached_reqs
    assert decoded.finished_req_ids == {"done"} and decoded.preempted_req_ids == {"bumped"}
    assert np.array_equal(decoded.grammar_bitmask, original.grammar_bitmask)
    assert decoded.grammar_bitmask.dtype == np.int32
    assert decoded.scheduled_new_reqs[0].sampling_params.logit_bias == {3: -100.0, 11: 2.5}


def test_a_result_round_trips_with_infinite_logprobs():
    out = ModelRunnerOutput(["a", "b"], [[5], []],
                            {"a": LogprobsLists([[5, 6]], [[-0.1, -math.inf]], [[1, 2]])},
                            pooler_output={"e": [0.5, -1.0]})
    decoded = decode(encode(out, ModelRunnerOutput), ModelRunnerOutput)
    assert decoded == out


def test_every_worker_call_has_typed_arguments():
    for method in CALLS:
        for tp in _argument_types(method):
            assert tp is not object


class _Gadget:
    def __reduce__(self):
        return (os.system, ("echo pwned > /tmp/pagoda-wire-gadget",))


@pytest.mark.parametrize("payload", [
    pickle.dumps(_Gadget()),                                   # what pickle would have run
    b"not json",
    dump({"req_ids": ["a"], "sampled_token_ids": [[1]]}),     # fields missing
    dump({"req_ids": [1], "sampled_token_ids": [[1]], "logprobs": [], "prompt_logprobs": [],
          "pooler_output": []}),                               # a wrong type inside
    b"[" * 100_000 + b"]" * 100_000,                           # nesting past the parser
])
def test_what_is_not_a_result_is_refused(payload, tmp_path):
    with pytest.raises(WireError):
        decode(payload, ModelRunnerOutput)
    assert not os.path.exists("/tmp/pagoda-wire-gadget")


def test_arrays_and_unions_are_checked():
    with pytest.raises(WireError):  # an object array is no plan's
        from_json({"dtype": "object", "shape": [1], "data": ""}, np.ndarray)
    with pytest.raises(WireError):  # data and shape disagree
        from_json({"dtype": "int32", "shape": [4], "data": "AAAA"}, np.ndarray)
    with pytest.raises(WireError):  # a union value must say which member it is
        from_json("stop", int | str)
    assert from_json([1, "stop"], int | str) == "stop"
