"""`--async-scheduling` (the next step planned while the last one runs) gives the same
greedy and seeded outputs as one step at a time, on the tiny Llama: requests finishing
mid-batch on stop tokens, stop strings and different max_tokens, n > 1, chunked
prefill and preemption under a small KV pool. Combinations it cannot keep exact are
refused at start-up, naming them."""

import pytest

from pagoda import LLM, SamplingParams
from pagoda.engine.arg_utils import EngineArgs

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a kingdom far away, there lived a princess who loved to read",
    "1, 2, 3, 4,",
    "Hello",
]
VARIANTS = {
    "default": dict(),
    "chunked_prefill": dict(max_num_batched_tokens=16, enable_prefix_caching=False),
    "preemption": dict(num_gpu_blocks_override=24, block_size=4),
}


def run(tiny_llama_dir, params, async_scheduling, **engine):
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", async_scheduling=async_scheduling,
              **engine)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    core = llm.llm_engine.core
    pool = core.scheduler.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks  # nothing leaked
    result = [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
              for o in outputs]
    return result, core.scheduler.num_preemptions


def mixed_params(reference_tokens):
    """Per prompt: greedy with a max_tokens of its own, a stop token taken from the
    middle of its synchronous output, seeded sampling with n=2, a stop string."""
    params = []
    for i, tokens in enumerate(reference_tokens):
        kind = i % 3
        if kind == 0:
            params.append(SamplingParams(temperature=0.0, max_tokens=5 + 3 * i))
        elif kind == 1:
            params.append(SamplingParams(temperature=0.0, max_tokens=20,
                                         stop_token_ids=[tokens[4]]))
        else:
            params.append(SamplingParams(temperature=1.0, seed=100 + i, n=2, max_tokens=12))
    return params


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_async_scheduling_same_outputs(tiny_llama_dir, variant):
    engine = VARIANTS[variant]
    greedy = SamplingParams(temperature=0.0, max_tokens=20)
    sync, _ = run(tiny_llama_dir, greedy, False, **engine)
    params = mixed_params([o[0][0] for o in sync])
    expected, sync_preemptions = run(tiny_llama_dir, params, False, **engine)
    got, async_preemptions = run(tiny_llama_dir, params, True, **engine)
    assert got == expected
    # Requests do finish mid-batch on their stop token, before max_tokens.
    assert any(c[2] == "stop" and len(c[0]) < 20 for o in expected for c in o)
    if variant == "preemption":
        assert sync_preemptions > 0 and async_preemptions > 0


def test_async_scheduling_stop_string(tiny_llama_dir):
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    sync, _ = run(tiny_llama_dir, greedy, False)
    # A stop string cut from the middle of each synchronous text.
    params = [SamplingParams(temperature=0.0, max_tokens=16, stop=[o[0][1][6:9]])
              if len(o[0][1]) > 9 else greedy for o in sync]
    expected, _ = run(tiny_llama_dir, params, False)
    got, _ = run(tiny_llama_dir, params, True)
    assert got == expected
    assert any(c[2] == "stop" for o in expected for c in o)


@pytest.mark.parametrize("extra, named", [
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                              "prompt_lookup_max": 3}), "speculative decoding"),
    (dict(runner="pooling"), "pooling"),
])
def test_async_scheduling_refuses_inexact_combinations(tiny_llama_dir, extra, named):
    args = EngineArgs(model=str(tiny_llama_dir), dtype="float32", async_scheduling=True, **extra)
    with pytest.raises(ValueError, match=f"--async-scheduling is not supported with {named}"):
        args.create_engine_config()


def test_async_scheduling_structured_outputs_exact(tiny_llama_dir):
    """A constrained request steps only once its last token is known (its grammar mask
    needs it); its unconstrained neighbours run ahead. Outputs are unchanged."""
    from pagoda.sampling_params import StructuredOutputsParams
    from structured_output_cases import CASES

    params = [SamplingParams(temperature=1.0, seed=7 + i, max_tokens=24,
                             structured_outputs=StructuredOutputsParams(**CASES["json"]))
              if i % 2 else SamplingParams(temperature=0.0, max_tokens=24)
              for i in range(len(PROMPTS))]
    expected, _ = run(tiny_llama_dir, params, False, max_model_len=512)
    got, _ = run(tiny_llama_dir, params, True, max_model_len=512)
    assert got == expected


@pytest.mark.parametrize("extra, expected", [
    (dict(device="cuda"), True),  # vLLM >= 0.14's default
    (dict(device="cpu"), False),  # the step is the same cores' time: nothing to overlap
    (dict(device="cuda", async_scheduling=False), False),  # --no-async-scheduling
    (dict(device="cuda", speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                             "prompt_lookup_max": 3}), False),
    (dict(device="cuda", kv_offloading_size=0.01), False),
    (dict(device="cuda", runner="pooling"), False),
])
def test_the_default_is_on_for_cuda_where_supported_and_never_refuses(tiny_llama_dir, extra,
                                                                       expected):
    """No device is needed to build the config: only the resolution is checked here
    (the GPU runs of benchmarks/gpu_check.py serve with the default)."""
    config = EngineArgs(model=str(tiny_llama_dir), dtype="float32", **extra).create_engine_config()
    assert config.scheduler.async_scheduling is expected


def test_the_cli_flag_has_a_no_form():
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert parser.parse_args([]).async_scheduling is None
    assert parser.parse_args(["--async-scheduling"]).async_scheduling is True
    assert parser.parse_args(["--no-async-scheduling"]).async_scheduling is False
