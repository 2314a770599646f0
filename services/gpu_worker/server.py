"""`pagoda gpu-worker`: the model runner's process (CPU today, same code on CUDA)."""

from __future__ import annotations

import argparse
import logging

from pagoda.services._proto.pagoda.worker.v1 import worker_pb2_grpc as pb_grpc
from pagoda.services.common.grpc_server import add_server_args, serve_sync
from pagoda.services.common.logs import setup_logging

DEFAULT_PORT = 50053
SERVICE_NAME = "pagoda.worker.v1.WorkerService"
logger = logging.getLogger(__name__)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    from pagoda.engine.arg_utils import EngineArgs

    add_server_args(parser, DEFAULT_PORT)
    EngineArgs.add_cli_args(parser)


def main(args: argparse.Namespace) -> int:
    from pagoda.engine.arg_utils import EngineArgs
    from pagoda.services.gpu_worker.servicer import WorkerServicer

    setup_logging("gpu-worker")
    config = EngineArgs.from_cli_args(args).create_engine_config()
    runner, on_stop = _start_runner(config)
    logger.info("loaded %s (%s on %s)", config.model, config.dtype, config.device)
    servicer = WorkerServicer(runner, config.model, config.dtype, config.device)
    # Steps are sequential; a second thread answers GetWorkerInfo/health meanwhile.
    serve_sync("gpu-worker", args,
               [(pb_grpc.add_WorkerServiceServicer_to_server, servicer, SERVICE_NAME)],
               max_workers=4, on_stop=on_stop)
    return 0


def _start_runner(config):
    """A `ModelRunner` in this process; or, for tensor/pipeline parallelism, a worker
    group whose driver and rank 0 is this process (the other ranks run where its
    backend places them: Ray actors by default). Both answer the same calls."""
    if config.world_size > 1:
        from pagoda.engine.executor import make_executor

        group = make_executor(config)
        return group, group.shutdown
    from pagoda.worker.model_runner import ModelRunner

    runner = ModelRunner(config)
    runner.load_model()
    return runner, None
