"""DeepSeek-V3 over a group of ranks (the `mp` backend, gloo on the CPU): tensor
parallelism (MLA split by query head, the latent cache replicated, experts split like
a dense MLP), expert parallelism (whole experts per rank) and pipeline parallelism
give transformers' greedy tokens and logprobs, through prefix caching and chunked
prefill as in `arch_parity`."""

from __future__ import annotations

import pytest

from arch_parity import (ENGINE, assert_same, hf_greedy, pagoda_greedy, random_prompts,
                         save_tiny_checkpoint)
from pagoda import LLM
from test_deepseek import _randomize_correction_bias, v3_config

pytestmark = pytest.mark.extended  # make test-extended: a process group per case


@pytest.fixture(scope="module")
def deepseek_v3_dir(tmp_path_factory, smollm2_tokenizer):
    path = save_tiny_checkpoint(tmp_path_factory.mktemp("deepseek_v3"), v3_config(),
                                smollm2_tokenizer)
    _randomize_correction_bias(path)
    return path


@pytest.mark.parametrize("tp,pp,expert_parallel", [(2, 1, False), (2, 1, True), (1, 2, False)])
def test_parallel_deepseek_matches_transformers(deepseek_v3_dir, tp, pp, expert_parallel):
    prompts = random_prompts([7, 30, 45])
    reference = hf_greedy(deepseek_v3_dir, prompts, 12)
    llm = LLM(model=deepseek_v3_dir, **ENGINE, tensor_parallel_size=tp,
              pipeline_parallel_size=pp, enable_expert_parallel=expert_parallel,
              distributed_executor_backend="mp")
    try:
        ours, _ = pagoda_greedy(llm, prompts, 12)
        if tp > 1:
            report = llm.llm_engine.core.executor.memory_report()
    finally:
        llm.llm_engine.core.shutdown()
    assert_same(ours, reference)
    if tp > 1:  # every rank caches the whole latent: 3 layers x 4 tokens x (16 + 8) fp32
        blocks = ENGINE["num_gpu_blocks_override"]
        assert [r["kv_cache_bytes"] for r in report] == [blocks * 3 * 4 * 24 * 4] * tp
