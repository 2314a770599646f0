"""Fixtures for the worker-group tests.

`run_ranks(world, fn, tp_size)` runs `fn(handles, rank)` on `world` threads of this
process, each a rank joined to real gloo groups over loopback: the collectives,
layers and model are tested as they run in a group, in milliseconds, without
starting processes. The offline tests start real groups (`mp`, and Ray in the slow
tests) through `pagoda.LLM`.
"""

from __future__ import annotations

import os
import threading

import pytest

# Ray: stay on loopback (see the issue); set before any test imports ray.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def run_ranks(world: int, fn, tp_size: int | None = None, timeout: float = 60.0) -> list:
    """Results of `fn(handles, rank)` for ranks 0..world-1, each on its own thread."""
    from pagoda.distributed.process_group import (GroupInit, connect_store, create_master_store,
                                                  join_group)

    tp_size = tp_size or world
    master = create_master_store("127.0.0.1", world, timeout)
    init = GroupInit("127.0.0.1", master.port, tp_size, world // tp_size, "cpu", timeout)
    results: list = [None] * world
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            store = master if rank == 0 else connect_store(init)
            results[rank] = fn(join_group(store, init, rank), rank)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return results


@pytest.fixture
def ranks():
    return run_ranks


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
    from pagoda import LLM, SamplingParams

    llm = LLM(model=tiny_llama_dir, **engine_kwargs())
    outputs = llm.generate(GREEDY_PROMPTS, greedy_params(), use_tqdm=False)
    result = Reference([o.outputs[0].token_ids for o in outputs],
                       llm.llm_engine.core.executor.runner)
    llm.llm_engine.core.shutdown()
    return result
