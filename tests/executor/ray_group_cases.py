"""The Ray backend: a placement group with one bundle per rank, follower ranks as
actors in it, rank 0 in this process. Ray runs on this machine, 4 logical CPUs, as a
private head this process joins (`ray.init()` would fork the test process).

`test_ray_in_own_process.py` runs this module in a child pytest (a raylet that dies
ends its driver, which must not be the whole test run).
"""

from __future__ import annotations

import time

import pytest
from group_cases import GREEDY_PROMPTS, engine_kwargs, greedy_params
from test_group import LONG, kill_during_generation

from pagoda import LLM
from pagoda.executor.base import InsufficientResources, WorkerGroupFailed

pytestmark = pytest.mark.slow


def wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.1)
    return predicate()


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    from pagoda.executor.ray_head import PrivateRayHead, join_with_token

    head = PrivateRayHead(num_cpus=4).start()
    try:
        join_with_token(head.auth_env)  # the head runs with Ray's token auth
        ray.init(address=head.address, log_to_driver=False)
        yield ray
        ray.shutdown()
    finally:
        head.stop()


def ray_llm(model: str, tp: int, pp: int) -> LLM:
    return LLM(model=model, tensor_parallel_size=tp, pipeline_parallel_size=pp,
               distributed_executor_backend="ray", **engine_kwargs())


@pytest.mark.parametrize("tp,pp", [(2, 1), (2, 2)])
def test_greedy_tokens_equal_one_device_with_ray(ray_cluster, tiny_llama_dir, reference, tp, pp):
    llm = ray_llm(tiny_llama_dir, tp, pp)
    executor = llm.llm_engine.core.executor
    try:
        # One bundle per rank; followers are actors placed in bundles 1..N-1.
        bundles = ray_cluster.util.placement_group_table(executor._placement_group)["bundles"]
        assert [b["CPU"] for b in bundles.values()] == [1.0] * (tp * pp)
        assert sorted(executor.actors) == list(range(1, tp * pp))
        outputs = llm.generate(GREEDY_PROMPTS, greedy_params(), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == reference.token_ids
        kv = [r["kv_cache_bytes"] for r in executor.memory_report()]
        assert sum(kv) == reference.kv_cache_bytes * tp // min(tp, 2)
    finally:
        llm.llm_engine.core.shutdown()
    # Shutdown released the bundles for the next group (Ray frees them asynchronously).
    assert wait_until(lambda: ray_cluster.available_resources().get("CPU") == 4.0, 10)


def test_killed_rank_actor_is_replaced_in_its_bundle(ray_cluster, tiny_llama_dir):
    llm = ray_llm(tiny_llama_dir, 2, 1)
    executor = llm.llm_engine.core.executor
    try:
        want = [o.outputs[0].token_ids for o in llm.generate([[5, 6, 7, 8]] * 4, LONG,
                                                             use_tqdm=False)]
        old_actor = executor.actors[1]
        result, _ = kill_during_generation(
            llm, lambda: ray_cluster.kill(executor.actors[1], no_restart=True))
        assert result.get("tokens") == want, result
        assert executor.num_rebuilds == 1 and executor.actors[1] is not old_actor
        # The new actor runs in the group's own bundle: nothing else was reserved.
        assert ray_cluster.util.placement_group_table(executor._placement_group)["state"] \
            == "CREATED"
    finally:
        llm.llm_engine.core.shutdown()


def test_group_larger_than_the_cluster_is_refused_at_start_up(ray_cluster, tiny_llama_dir):
    start = time.monotonic()
    with pytest.raises(InsufficientResources, match=r"lacks the resources for "
                                                    r"tensor_parallel_size=4 x "
                                                    r"pipeline_parallel_size=2: it needs 8 CPU"):
        ray_llm(tiny_llama_dir, 4, 2)
    assert time.monotonic() - start < 30
    assert ray_cluster.is_initialized()  # a cluster it joined is left running

