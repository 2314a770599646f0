"""Pooling requests and results through the wire converters: a pooling request carries
its pooling params (not sampling params) to the scheduler and the worker, and the
pooled vector comes back on the worker's output and the Generate stream's complete."""

from __future__ import annotations

import pytest

from pagoda.messages import (CachedRequestData, EngineCoreOutput, EngineCoreRequest,
                             FinishReason, ModelRunnerOutput, NewRequestData, SchedulerOutput)
from pagoda.pooling_params import PREFILL_ONLY, PoolingParams
from pagoda.sampling_params import SamplingParams
from pagoda.services.common.protocol.scheduler import (outputs_to_responses, request_from_proto,
                                                       request_to_proto, response_to_output)
from pagoda.services.common.protocol.worker import (model_runner_output_from_proto,
                                                    model_runner_output_to_proto,
                                                    scheduler_output_from_proto,
                                                    scheduler_output_to_proto)

PARAMS = [PoolingParams(), PoolingParams(task="embed", dimensions=8, normalize=False),
          PoolingParams(task="score", use_activation=False, token_type_split=5)]


@pytest.mark.parametrize("params", PARAMS)
def test_generate_request_carries_pooling_params(params):
    request = EngineCoreRequest("r", [2, 5, 6, 3], PREFILL_ONLY, arrival_time=1.0,
                                pooling_params=params)
    msg = request_to_proto(request)
    assert msg.HasField("pooling_params") and not msg.HasField("sampling_params")
    back = request_from_proto(msg)
    assert back.pooling_params == params and back.sampling_params is PREFILL_ONLY
    plain = request_from_proto(request_to_proto(
        EngineCoreRequest("g", [1], SamplingParams(max_tokens=3))))
    assert plain.pooling_params is None and plain.sampling_params.max_tokens == 3


def test_pooled_vector_rides_the_complete_message():
    vector = [0.25, -1.5, 3.0]
    out = EngineCoreOutput("r", [], finish_reason=FinishReason.STOP, num_cached_tokens=4,
                           pooling_output=vector)
    [message] = outputs_to_responses([out])
    assert message.HasField("complete")
    back = response_to_output("r", message)
    assert (back.pooling_output, back.finish_reason, back.num_cached_tokens) == \
        (vector, FinishReason.STOP, 4)
    generated = response_to_output("g", outputs_to_responses([EngineCoreOutput(
        "g", [], finish_reason=FinishReason.LENGTH)])[0])
    assert generated.pooling_output is None


def test_worker_plan_and_output_carry_pooling():
    params = PoolingParams(task="classify", use_activation=True)
    plan = SchedulerOutput([NewRequestData("p", [2, 9, 3], [], PREFILL_ONLY, [0], 0, params),
                            NewRequestData("g", [4], [], SamplingParams(max_tokens=2), [1], 0)],
                           CachedRequestData(), {"p": 3, "g": 1}, 4)
    back = scheduler_output_from_proto(scheduler_output_to_proto(plan))
    assert back.scheduled_new_reqs[0].pooling_params == params
    assert back.scheduled_new_reqs[1].pooling_params is None
    assert back.scheduled_new_reqs[1].sampling_params.max_tokens == 2
    output = ModelRunnerOutput(["p", "g"], [[], [7]], pooler_output={"p": [0.5, 0.25]})
    assert model_runner_output_from_proto(model_runner_output_to_proto(output)).pooler_output \
        == {"p": [0.5, 0.25]}
