"""Prompts, engine shapes and the one-device reference shared by the worker-group tests
(`tests/distributed`, `tests/executor`). A plugin of the root conftest, so the
`reference` fixture is computed once per session for both folders.
"""

from __future__ import annotations

import os

import pytest

# Ray: stay on loopback; set before any test imports ray (this module loads first).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

GREEDY_PROMPTS = [
    list(range(300, 312)),
    [5, 17, 300, 42, 7, 8, 9, 10, 11, 12],
    # The first prompt again, in the same step: it reads the KV blocks the first one
    # writes in that step (prefix cache); under PP it lands in a later micro-batch.
    list(range(300, 312)),
    [11, 12, 13],
    list(range(100, 160)),  # longer than the step budget below: chunked prefill
    [9] * 21,
    [300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310, 311, 312, 313, 314, 315, 316, 7],
]


def greedy_params():
    from pagoda import SamplingParams

    return SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def engine_kwargs(**overrides) -> dict:
    """Small shapes that exercise decodes, chunked prefill and prefix hits in a few steps."""
    kwargs = dict(dtype="float32", block_size=4, max_model_len=256, max_num_batched_tokens=32,
                  num_gpu_blocks_override=96, enable_prefix_caching=True)
    kwargs.update(overrides)
    return kwargs


class Reference:
    """What the T=P=1 engine produces and holds, to compare a group against."""

    def __init__(self, token_ids: list[list[int]], runner) -> None:
        self.token_ids = token_ids
        params = dict(runner.model.named_parameters())
        self.parameter_bytes = sum(_nbytes(p) for p in params.values())
        # Every rank holds its own full copy of the norms (they are tiny).
        self.replicated_bytes = sum(_nbytes(p) for n, p in params.items() if "norm" in n)
        self.kv_cache_bytes = sum(_nbytes(t) for pair in runner.kv_caches for t in pair)


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


@pytest.fixture(scope="session")
def reference(tiny_llama_dir) -> Reference:
    """T=P=1 greedy outputs for GREEDY_PROMPTS (the ground truth) and its memory."""
    from pagoda import LLM

    llm = LLM(model=tiny_llama_dir, **engine_kwargs())
    outputs = llm.generate(GREEDY_PROMPTS, greedy_params(), use_tqdm=False)
    result = Reference([o.outputs[0].token_ids for o in outputs],
                       llm.llm_engine.core.executor.runner)
    llm.llm_engine.core.shutdown()
    return result
