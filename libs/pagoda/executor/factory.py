"""`make_executor`: the executor that runs a config's worker group from this process.

    factory ──► in_process ──────────────► base
            ├─► multiproc ─┐
            └─► ray_group ─┴─► group ────► base, pagoda.distributed
                   └─► ray_head

Only callers (the engine, the gpu-worker) import this module; no executor does.
The backends are imported when chosen (lazy imports), so one rank loads no group or
Ray code, and a process that imports this module without building an executor (the
CLI, through the gpu-worker's server) loads no torch.
"""

from __future__ import annotations

from pagoda.config import EngineConfig
from pagoda.executor.base import Executor


def make_executor(config: EngineConfig) -> Executor:
    """In-process for one rank; else a worker group whose rank 0 is this process,
    its other ranks placed by `config.distributed_executor_backend` (Ray or mp).
    Only `config.simulated_device` (--simulated-device) gives the simulated device."""
    if config.simulated_device is not None:
        from pagoda.executor.simulated import SimulatedExecutor  # lazy: chosen backend only

        return SimulatedExecutor(config)
    if config.world_size == 1:
        from pagoda.executor.in_process import InProcessExecutor  # lazy: chosen backend only

        return InProcessExecutor(config)
    if config.distributed_executor_backend == "ray":
        from pagoda.executor.ray_group import RayExecutor  # lazy: chosen backend only

        return RayExecutor(config)
    from pagoda.executor.multiproc import MultiprocExecutor  # lazy: chosen backend only

    return MultiprocExecutor(config)
