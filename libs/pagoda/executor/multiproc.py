"""`--distributed-executor-backend mp`: a worker group on this machine, one child
process per follower rank (rank 0 is the calling process).

Children are started as `python -m pagoda.worker.rank_worker PARENT_PID` with
their arguments pickled on stdin, not with multiprocessing's spawn, which re-runs
the caller's main module (a script calling `LLM(...)` at top level would recurse).

No Python code runs between fork and exec (no `preexec_fn`): the driver may already
have gRPC or other threads (the gpu-worker, a test process), and forking those is
what made ranks abort with -6 (see `pagoda.parent_death`). Each child sets its own
parent-death signal first thing, so a driver that exits, however it exits, leaves
no rank behind. Linux sends it when the *thread* that started the child ends:
create the executor on a long-lived thread.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import subprocess
import sys

import torch

from pagoda.config import EngineConfig
from pagoda.distributed.process_group import GroupInit
from pagoda.executor.base import InsufficientResources
from pagoda.executor.group import WorkerGroupExecutor


class MultiprocExecutor(WorkerGroupExecutor):
    """Invariant: `processes[r]` runs rank r for r in 1..N-1 of the group's current
    life, until shutdown or failure (then it is emptied)."""

    def __init__(self, config: EngineConfig, **kwargs) -> None:
        self.processes: dict[int, subprocess.Popen] = {}
        super().__init__(config, **kwargs)

    def _place_group(self, device_type: str) -> None:
        if device_type == "cuda":
            available = torch.cuda.device_count()
            if available < self.world_size:
                raise InsufficientResources(
                    f"A worker group of {self.world_size} ranks needs {self.world_size} GPUs; "
                    f"this machine has {available}.")

    def _master_addr(self) -> str:
        return "127.0.0.1"

    def _start_followers(self, init: GroupInit) -> None:
        argv = [sys.executable, "-m", "pagoda.worker.rank_worker", str(os.getpid())]
        for rank in range(1, self.world_size):
            device_index = rank if init.device_type == "cuda" else 0
            process = subprocess.Popen(argv, stdin=subprocess.PIPE)
            self.processes[rank] = process
            _send(process, pickle.dumps((self.config, rank, init, device_index)))

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
        self.processes = {}


def _send(process: subprocess.Popen, payload: bytes) -> None:
    """Write `payload` to the child's stdin and close it. A child that died before
    reading it is not an error here: `_dead_followers` reports its exit code."""
    with contextlib.suppress(BrokenPipeError):
        process.stdin.write(payload)
    with contextlib.suppress(BrokenPipeError):
        process.stdin.close()  # closes the pipe even when its final flush fails
