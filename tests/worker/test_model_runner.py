"""The model runner driven by hand-written plans: only diffs cross the boundary.

A request's prompt and blocks arrive once (`NewRequestData`); afterwards the runner keeps
its own copy, appends what it samples, and follows `CachedRequestData` diffs. These tests
check the things a scheduler relies on: chunked prefill gives the same next token as one
prefill, finished and preempted requests are forgotten, and a preempted seeded request
resumes its random stream exactly where it stopped.
"""

from __future__ import annotations

import pytest

from pagoda.engine.arg_utils import EngineArgs
from pagoda.messages import CachedRequestData, NewRequestData, SchedulerOutput
from pagoda.sample.builder import make_generator
from pagoda.sampling_params import SamplingParams
from pagoda.worker.model_runner import ModelRunner

BLOCK = 16
PROMPT = [5, 17, 93, 2, 41, 8, 300, 12, 7, 66, 901, 3, 14, 15, 92, 65, 35, 89, 79, 32]


@pytest.fixture(scope="module")
def runner(tiny_llama_dir) -> ModelRunner:
    config = EngineArgs(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=64,
                        block_size=BLOCK).create_engine_config()
    runner = ModelRunner(config)
    runner.load_model()
    runner.initialize_kv_cache(64)
    return runner


def new(req_id, blocks, params=None, prompt=PROMPT, output=(), computed=0) -> NewRequestData:
    return NewRequestData(req_id, list(prompt), list(output), params or SamplingParams(temperature=0),
                          list(blocks), computed)


def plan(new_reqs=(), cached=(), tokens=None, finished=(), preempted=()) -> SchedulerOutput:
    """`cached` holds (req_id, new_block_ids, num_computed_tokens) triples."""
    tokens = tokens or {}
    return SchedulerOutput(list(new_reqs), CachedRequestData([c[0] for c in cached], [c[1] for c in cached],
                                                            [c[2] for c in cached]),
                           tokens, sum(tokens.values()), set(finished), set(preempted))


def decode(runner, req_id, computed, steps) -> list[int]:
    out = []
    for _ in range(steps):
        result = runner.execute_model(plan(cached=[(req_id, [], computed)], tokens={req_id: 1}))
        out += result.sampled_token_ids[0]
        computed += 1
    return out


def test_chunked_prefill_then_decode_equals_one_prefill(runner):
    whole = runner.execute_model(plan([new("whole", [0, 1])], tokens={"whole": len(PROMPT)}))
    tokens_whole = whole.sampled_token_ids[0] + decode(runner, "whole", len(PROMPT), 4)

    first = runner.execute_model(plan([new("chunked", [2, 3])], tokens={"chunked": 7}))
    assert first.sampled_token_ids == [[]]  # a partial prefill samples nothing
    rest = runner.execute_model(plan(cached=[("chunked", [], 7)], tokens={"chunked": len(PROMPT) - 7}))
    tokens_chunked = rest.sampled_token_ids[0] + decode(runner, "chunked", len(PROMPT), 4)

    assert tokens_chunked == tokens_whole
    # The runner appended what it sampled: its copy is prompt + everything it returned.
    assert runner.states["chunked"].token_ids == PROMPT + tokens_chunked
    runner.execute_model(plan(finished=["whole", "chunked"]))


def test_finished_and_preempted_requests_are_forgotten(runner):
    runner.execute_model(plan([new("a", [4, 5]), new("b", [6, 7])],
                              tokens={"a": len(PROMPT), "b": len(PROMPT)}))
    assert {"a", "b"} <= set(runner.states)
    out = runner.execute_model(plan(cached=[("b", [], len(PROMPT))], tokens={"b": 1},
                                    finished=["a"]))
    assert out.req_ids == ["b"] and "a" not in runner.states
    runner.execute_model(plan(preempted=["b"]))
    assert "b" not in runner.states
    with pytest.raises(KeyError):  # a diff for a request the worker does not hold
        runner.execute_model(plan(cached=[("b", [], len(PROMPT) + 1)], tokens={"b": 1}))


def test_preempted_seeded_request_resumes_its_random_stream(runner):
    params = SamplingParams(temperature=1.0, seed=1234)
    runner.execute_model(plan([new("ref", [8, 9], params)], tokens={"ref": len(PROMPT)}))
    reference = runner.states["ref"].output_token_ids[:] + decode(runner, "ref", len(PROMPT), 5)
    runner.execute_model(plan(finished=["ref"]))

    runner.execute_model(plan([new("s", [10, 11], params)], tokens={"s": len(PROMPT)}))
    before = runner.states["s"].output_token_ids[:] + decode(runner, "s", len(PROMPT), 2)
    runner.execute_model(plan(preempted=["s"]))
    # Resumed as new with everything generated so far; recomputes prompt + output.
    resumed = new("s", [12, 13], params, output=before)
    out = runner.execute_model(plan([resumed], tokens={"s": len(PROMPT) + len(before)}))
    after = out.sampled_token_ids[0] + decode(runner, "s", len(PROMPT) + len(before), 2)
    runner.execute_model(plan(finished=["s"]))

    assert before + after == reference


@pytest.mark.parametrize("k", [1, 3])
def test_migrated_seeded_request_continues_its_random_stream(runner, k):
    """A request that arrives with k tokens generated elsewhere (request migration: an
    id this runner never saw) gets a fresh generator advanced by k draws, so it samples
    what the unmigrated request samples after its k-th token."""
    params = SamplingParams(temperature=1.0, seed=99)
    runner.execute_model(plan([new("whole", [14, 15], params)], tokens={"whole": len(PROMPT)}))
    reference = runner.states["whole"].output_token_ids[:] + decode(runner, "whole",
                                                                    len(PROMPT), 5)
    runner.execute_model(plan(finished=["whole"]))

    moved = new("moved", [16, 17], params, output=reference[:k])
    out = runner.execute_model(plan([moved], tokens={"moved": len(PROMPT) + k}))
    rest = out.sampled_token_ids[0] + decode(runner, "moved", len(PROMPT) + k, 5 - k)
    runner.execute_model(plan(finished=["moved"]))
    assert reference[:k] + rest == reference
    # Without the advance the stream would restart from the seed: it differs here.
    fresh = new("fresh", [18, 19], params, output=reference[:k])
    runner.generators["fresh"] = make_generator(99)  # as if it were never advanced
    out = runner.execute_model(plan([fresh], tokens={"fresh": len(PROMPT) + k}))
    restarted = out.sampled_token_ids[0] + decode(runner, "fresh", len(PROMPT) + k, 5 - k)
    runner.execute_model(plan(finished=["fresh"]))
    assert restarted != rest


def test_cuda_graphs_skip_models_that_sync_to_the_host(runner):
    """gpt-oss's expert loop reads token counts on the host, which a graph capture
    forbids: the runner keeps its decodes eager on CUDA (the predicate is read with the
    device pretended; nothing runs on it). Llama's stack is captured as before."""
    import types

    import torch

    from pagoda.model.architectures.gpt_oss import GptOssForCausalLM

    fake = types.SimpleNamespace(**{k: getattr(runner, k) for k in
                                    ("config", "parallel", "lora_manager", "state_slots",
                                     "drafter", "model")})
    fake.device = torch.device("cuda")
    assert ModelRunner._cuda_graphs_apply(fake)
    fake.model = types.SimpleNamespace(supports_cuda_graphs=GptOssForCausalLM.supports_cuda_graphs)
    assert not ModelRunner._cuda_graphs_apply(fake)
