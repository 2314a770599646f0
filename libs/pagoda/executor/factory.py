"""`make_executor`: the executor that runs a config's worker group from this process.

    factory ──► in_process ──────────────► base
            ├─► multiproc ─┐
            └─► ray_group ─┴─► group ────► base, pagoda.distributed
                   └─► ray_head

Only callers (the engine, the gpu-worker) import this module; no executor does.
The group backends are imported when chosen, so one rank loads no Ray code.
"""

from __future__ import annotations

from pagoda.config import EngineConfig
from pagoda.executor.base import Executor


def make_executor(config: EngineConfig) -> Executor:
    """In-process for one rank; else a worker group whose rank 0 is this process,
    its other ranks placed by `config.distributed_executor_backend` (Ray or mp)."""
    if config.world_size == 1:
        from pagoda.executor.in_process import InProcessExecutor

        return InProcessExecutor(config)
    if config.distributed_executor_backend == "ray":
        from pagoda.executor.ray_group import RayExecutor

        return RayExecutor(config)
    from pagoda.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config)
