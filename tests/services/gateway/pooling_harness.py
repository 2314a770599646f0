"""A whole pooling replica in this process: the real gpu-worker servicer, scheduler
servicer (with its engine loop), tokenizer servicer and gateway, on loopback gRPC.

Faster than `pagoda serve` (no five processes to start), yet every hop, conversion
and RPC a served pooling request takes is the real one.
"""

from __future__ import annotations

import asyncio
import threading

import grpc
from gateway_harness import run_gateway
from grpc_health.v1 import health, health_pb2_grpc
from grpc_servers import start_grpc_server

from pagoda.engine.arg_utils import EngineArgs
from pagoda.engine.engine_core import EngineCore
from pagoda.executor.in_process import InProcessExecutor
from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2_grpc as spb_grpc
from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2_grpc as tpb_grpc
from pagoda.services._proto.pagoda.worker.v1 import worker_pb2_grpc as wpb_grpc
from pagoda.services.gpu_worker.servicer import WorkerServicer
from pagoda.services.scheduler.engine_loop import EngineLoop
from pagoda.services.scheduler.server import model_info
from pagoda.services.scheduler.servicer import SchedulerServicer
from pagoda.services.scheduler.worker_executor import GrpcWorkerExecutor
from pagoda.services.tokenizer.servicer import TokenizerServicer
from pagoda.tokenizer.loader import load_tokenizer


class PoolingReplica:
    """Invariant once constructed: the gateway at `url` serves `model_dir` ("tiny")."""

    def __init__(self, model_dir, **engine_args) -> None:
        config = EngineArgs(model=str(model_dir), dtype="float32", device="cpu",
                            served_model_name="tiny", **engine_args).create_engine_config()
        self._sync_servers = []
        worker_addr = self._serve(wpb_grpc.add_WorkerServiceServicer_to_server, WorkerServicer(
            InProcessExecutor(config), config.model, config.dtype, config.device))
        tokenizer_addr = self._serve(tpb_grpc.add_TokenizerServiceServicer_to_server,
                                     TokenizerServicer(load_tokenizer(config.model), config.model, []))
        self.core = EngineCore(config, GrpcWorkerExecutor(worker_addr, connect_timeout=30))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.engine = EngineLoop(self.core, lambda o: self.servicer.on_outputs(o), lambda e: None,
                                 lambda exc: self.servicer.on_failure(exc))
        self.servicer = SchedulerServicer(self.engine, model_info(config, "replica-0"), [])
        self.servicer.bind_loop(self.loop)
        scheduler_addr = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result()
        self.engine.start()
        self.gateway = run_gateway(tokenizer_addr, scheduler_addr)
        self.url = self.gateway.url

    def _serve(self, add_fn, servicer) -> str:
        server, address = start_grpc_server(add_fn, servicer)
        self._sync_servers.append(server)
        return address

    async def _start(self) -> str:
        self.server = grpc.aio.server()
        spb_grpc.add_SchedulerServiceServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return f"127.0.0.1:{port}"

    def close(self) -> None:
        self.gateway.stop()
        asyncio.run_coroutine_threadsafe(self.server.stop(None), self.loop).result()
        self.engine.stop()
        self.core.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        for server in self._sync_servers:
            server.stop(None)
