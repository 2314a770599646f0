"""`--distributed-executor-backend mp`: a worker group on this machine, one child
process per follower rank (rank 0 is the calling process).

Children are started as `python -m pagoda.distributed.rank_worker` with their
arguments pickled on stdin, not with multiprocessing's spawn, which re-runs the
caller's main module (a script calling `LLM(...)` at top level would recurse).
They die with the driver (Linux parent-death signal, which fires when the thread
that started them ends: create the executor on a long-lived thread), so a driver
that exits, however it exits, leaves no rank behind.
"""

from __future__ import annotations

import ctypes
import pickle
import signal
import subprocess
import sys

from pagoda.config import EngineConfig
from pagoda.distributed.group_executor import InsufficientResources, WorkerGroupExecutor
from pagoda.distributed.process_group import GroupInit

_PR_SET_PDEATHSIG = 1


class MultiprocExecutor(WorkerGroupExecutor):
    """Invariant: `processes[r]` runs rank r for r in 1..N-1 until shutdown or failure."""

    def __init__(self, config: EngineConfig, **kwargs) -> None:
        self.processes: dict[int, subprocess.Popen] = {}
        super().__init__(config, **kwargs)

    def _place_group(self, device_type: str) -> None:
        if device_type == "cuda":
            import torch

            available = torch.cuda.device_count()
            if available < self.world_size:
                raise InsufficientResources(
                    f"A worker group of {self.world_size} ranks needs {self.world_size} GPUs; "
                    f"this machine has {available}.")

    def _master_addr(self) -> str:
        return "127.0.0.1"

    def _start_followers(self, init: GroupInit) -> None:
        for rank in range(1, self.world_size):
            device_index = rank if init.device_type == "cuda" else 0
            process = subprocess.Popen(
                [sys.executable, "-m", "pagoda.distributed.rank_worker"], stdin=subprocess.PIPE,
                preexec_fn=_die_with_parent)
            process.stdin.write(pickle.dumps((self.config, rank, init, device_index)))
            process.stdin.close()
            self.processes[rank] = process

    def _dead_followers(self) -> dict[int, str]:
        return {rank: f"process exited with code {p.poll()}"
                for rank, p in self.processes.items() if p.poll() is not None}

    def _stop_followers(self, graceful: bool) -> None:
        for process in self.processes.values():
            if graceful:
                try:
                    process.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
            if process.poll() is None:
                process.kill()
                process.wait(timeout=5)


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
