"""`--distributed-executor-backend ray`: Ray places the worker group.

A placement group holds one bundle per rank (`{"CPU": 1}` on CPU, `{"GPU": 1}`
on CUDA), packed onto as few nodes as possible. Bundle 0 is rank 0's, which runs
in this (the driver's) process and so must be on this node; ranks 1..N-1 are
actors started in bundles 1..N-1, each running `serve_follower` as one long
call whose end (normal or not) Ray reports, which is how a dead rank is named.

Ray is joined if already initialized (or `RAY_ADDRESS` is set), else a private
local head is started as a child process and stopped with the group
(`ray_head.py`: `ray.init()` would fork this process instead). On GPUs, an idle
actor holds bundle 0 and tells the driver which GPU Ray assigned to it.
"""

from __future__ import annotations

import logging
import os

from pagoda.config import EngineConfig
from pagoda.distributed.process_group import GroupInit
from pagoda.executor.base import InsufficientResources
from pagoda.executor.group import WorkerGroupExecutor
from pagoda.executor.ray_head import PrivateRayHead, join_with_token
from pagoda.worker.rank_worker import serve_follower

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 60.0


class _RankActor:
    """A follower rank; `run` returns only at shutdown."""

    def run(self, config: EngineConfig, rank: int, init: GroupInit) -> None:
        serve_follower(config, rank, init, 0)  # Ray exposes the bundle's GPU as device 0

    def gpu_ids(self) -> list:
        # lazy: ray is optional (installed for --distributed-executor-backend ray only)
        import ray

        return ray.get_gpu_ids()


class RayExecutor(WorkerGroupExecutor):
    """Invariant: `actors[r]` runs rank r of the group's current life in bundle r of
    `placement_group`, which lasts from start-up to shutdown (rebuilds included)."""

    def __init__(self, config: EngineConfig, **kwargs) -> None:
        self.actors: dict[int, object] = {}
        self._loops: dict[int, object] = {}  # rank -> ObjectRef of its `run` call
        self._placement_group = None
        self._placeholder = None
        self._head: PrivateRayHead | None = None  # set when this group started Ray
        super().__init__(config, **kwargs)

    def _place_group(self, device_type: str) -> None:
        # lazy: ray is optional (installed for --distributed-executor-backend ray only)
        import ray
        # lazy: ray is optional (installed for --distributed-executor-backend ray only)
        from ray.util.placement_group import placement_group, remove_placement_group

        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS")
            if not address:
                self._head = PrivateRayHead().start()
                address = self._head.address
                join_with_token(self._head.auth_env)  # the head asks for its token
            ray.init(address=address, log_to_driver=True)
        self._bundle = {"GPU": 1.0} if device_type == "cuda" else {"CPU": 1.0}
        self._check_totals(ray.cluster_resources())
        bundles = [dict(self._bundle) for _ in range(self.world_size)]
        node = f"node:{ray.util.get_node_ip_address()}"
        if node in ray.cluster_resources():  # rank 0 runs here, in the driver
            bundles[0][node] = 0.001
        group = placement_group(bundles, strategy="PACK")
        ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            remove_placement_group(group)
            raise InsufficientResources(
                f"Ray could not place {self.world_size} bundles of {self._bundle} within "
                f"{PLACEMENT_TIMEOUT_S:g} s; available now: {_brief(ray.available_resources())}")
        self._placement_group = group

    def _check_totals(self, total: dict) -> None:
        for key, amount in self._bundle.items():
            needed = amount * self.world_size
            if total.get(key, 0.0) < needed:
                raise InsufficientResources(
                    f"The Ray cluster lacks the resources for tensor_parallel_size="
                    f"{self.config.tensor_parallel_size} x pipeline_parallel_size="
                    f"{self.config.pipeline_parallel_size}: it needs {needed:g} {key} "
                    f"({self.world_size} bundles of {self._bundle}) and has "
                    f"{total.get(key, 0.0):g} in all.")

    def _master_addr(self) -> str:
        # lazy: ray is optional (installed for --distributed-executor-backend ray only)
        import ray

        return ray.util.get_node_ip_address()

    def _actor_class(self, bundle_index: int):
        # lazy: ray is optional (installed for --distributed-executor-backend ray only)
        import ray
        # lazy: ray is optional (installed for --distributed-executor-backend ray only)
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(self._placement_group,
                                                    placement_group_bundle_index=bundle_index)
        return ray.remote(_RankActor).options(
            num_cpus=self._bundle.get("CPU", 0), num_gpus=self._bundle.get("GPU", 0),
            max_restarts=0, scheduling_strategy=strategy)

    def _start_followers(self, init: GroupInit) -> None:
        for rank in range(1, self.world_size):
            actor = self._actor_class(rank).remote()
            self.actors[rank] = actor
            self._loops[rank] = actor.run.remote(self.config, rank, init)

    def _driver_device_index(self) -> int:
        if "GPU" not in self._bundle:
            return 0
        # lazy: ray is optional (installed for --distributed-executor-backend ray only)
        import ray

        self._placeholder = self._actor_class(0).remote()
        return int(ray.get(self._placeholder.gpu_ids.remote())[0])

    def _dead_followers(self) -> dict[int, str]:
        # lazy: ray is optional (installed for --distributed-executor-backend ray only)
        import ray

        if not self._loops:
            return {}
        refs = list(self._loops.values())
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        rank_of = {ref: rank for rank, ref in self._loops.items()}
        dead = {}
        for ref in ready:
            try:
                ray.get(ref, timeout=0)
                dead[rank_of[ref]] = "its actor returned"
            except Exception as exc:  # noqa: BLE001 - ActorDiedError, RayTaskError, ...
                dead[rank_of[ref]] = f"actor died ({type(exc).__name__})"
        return dead

    def _stop_followers(self, graceful: bool) -> None:
        # lazy: ray is optional (installed for --distributed-executor-backend ray only)
        import ray

        if ray.is_initialized():
            if graceful and self._loops:
                ray.wait(list(self._loops.values()), num_returns=len(self._loops), timeout=5)
            for actor in [*self.actors.values(), self._placeholder]:
                if actor is not None:
                    ray.kill(actor, no_restart=True)
        # The bundles stay reserved: a rebuilt group's actors start in them again.
        self.actors, self._loops, self._placeholder = {}, {}, None

    def _release_group(self) -> None:
        # lazy: ray is optional (installed for --distributed-executor-backend ray only)
        import ray
        # lazy: ray is optional (installed for --distributed-executor-backend ray only)
        from ray.util.placement_group import remove_placement_group

        if not ray.is_initialized():
            self._stop_head()
            return
        if self._placement_group is not None:
            remove_placement_group(self._placement_group)
            self._placement_group = None
        if self._head is not None:
            ray.shutdown()
            self._stop_head()

    def _stop_head(self) -> None:
        if self._head is not None:
            self._head.stop()
            self._head = None


def _brief(resources: dict) -> dict:
    """Resources without Ray's per-node and per-bundle bookkeeping entries."""
    return {k: v for k, v in resources.items() if "_group_" not in k and not k.startswith("node:")}
