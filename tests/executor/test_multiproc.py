"""The mp backend starts its ranks without forking the driver: no Python code (no
`os.register_at_fork` handler, gRPC's included) runs in a child before exec. A driver
whose gRPC threads are busy (the gpu-worker, a test process after service tests)
used to see a rank abort with -6 now and then; now nothing runs there to abort."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from concurrent import futures

import grpc
import pytest
from group_cases import GREEDY_PROMPTS, engine_kwargs, greedy_params
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pagoda import LLM

_forks: list[int] = []  # pids that forked while `_counting` held a True
_counting = [False]
os.register_at_fork(before=lambda: _counting[0] and _forks.append(os.getpid()))


class BusyGrpc:
    """A gRPC server in this process and two threads calling it without pause."""

    def __init__(self) -> None:
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.calls = 0
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._call, daemon=True) for _ in range(2)]
        for thread in self.threads:
            thread.start()

    def _call(self) -> None:
        stub = health_pb2_grpc.HealthStub(self.channel)
        while not self.stop.is_set():
            stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
            self.calls += 1

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(15)
        self.channel.close()
        self.server.stop(None)


def test_ranks_start_without_forking_a_driver_with_busy_grpc_threads(tiny_llama_dir, reference):
    busy = BusyGrpc()
    _counting[0] = True
    try:
        llm = LLM(model=tiny_llama_dir, tensor_parallel_size=2, pipeline_parallel_size=2,
                  distributed_executor_backend="mp", **engine_kwargs())
        try:
            outputs = llm.generate(GREEDY_PROMPTS, greedy_params(), use_tqdm=False)
        finally:
            llm.llm_engine.core.shutdown()
    finally:
        _counting[0] = False
        busy.close()
    assert busy.calls > 0  # gRPC was busy while the ranks started
    assert _forks == []  # no Python-level fork, so no fork handler ran anywhere
    assert [o.outputs[0].token_ids for o in outputs] == reference.token_ids


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_rank_whose_driver_is_already_gone_exits_before_reading_its_arguments():
    """The driver died between starting the rank and the rank's prctl: the rank sees a
    parent that is not its driver and kills itself instead of waiting for a group."""
    not_its_driver = os.getppid()
    rank = subprocess.run([sys.executable, "-m", "pagoda.worker.rank_worker",
                           str(not_its_driver)], stdin=subprocess.PIPE, timeout=120)
    assert rank.returncode == -9  # SIGKILL, the mp backend's parent-death signal
