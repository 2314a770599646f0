"""`pagoda gpu-worker`: the model runner's process (CPU today, same code on CUDA).

It runs whatever `make_executor` builds for its config: the model runner in this
process, or a worker group whose driver and rank 0 is this process."""

from __future__ import annotations

import argparse
import logging

from pagoda.services._proto.pagoda.worker.v1 import worker_pb2_grpc as pb_grpc
from pagoda.services.common import startup_clock
from pagoda.services.common.gc_tuning import prepare_gc_for_serving
from pagoda.services.common.grpc_server import add_server_args, serve_sync
from pagoda.services.common.logs import setup_logging
from pagoda.services.common.kv_transfer_args import add_kv_transfer_args, kv_transfer_config
from pagoda.engine.arg_utils import EngineArgs
from pagoda.executor.factory import make_executor
from pagoda.services._proto.pagoda.kv_transfer.v1 import kv_transfer_pb2_grpc
from pagoda.services.gpu_worker.metrics import worker_metrics
from pagoda.services.gpu_worker.servicer import WorkerServicer
from pagoda.services.gpu_worker.step_thread import StepThread
from pagoda.worker.plan_checks import PlanLedger

DEFAULT_PORT = 50053
SERVICE_NAME = "pagoda.worker.v1.WorkerService"
logger = logging.getLogger(__name__)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_server_args(parser, DEFAULT_PORT)
    EngineArgs.add_cli_args(parser)
    add_kv_transfer_args(parser)


def main(args: argparse.Namespace) -> int:
    setup_logging("gpu-worker")
    startup_clock.mark("imports")
    config = EngineArgs.from_cli_args(args).create_engine_config()
    startup_clock.mark("engine config")
    # Before the gRPC server exists: a worker group (T x P > 1) has this process as its
    # rank 0 and starts the other ranks (Ray actors by default) while no gRPC thread runs.
    executor = make_executor(config)
    if hasattr(executor, "on_rebuild"):  # a worker group: count its rebuilds
        executor.on_rebuild = worker_metrics().group_rebuilds.inc
    logger.info("loaded %s (%s on %s)", config.model, config.dtype, config.device)
    startup_clock.mark("model load")
    ledger = PlanLedger(0, config.cache.block_size, config.arch.vocab_size,
                        config.scheduler.max_model_len,  # sized by InitializeKvCache
                        config.cache.num_state_checkpoints)
    step_thread = StepThread()  # served by this (main) thread: see step_thread.py
    servicer = WorkerServicer(executor, config.model, config.dtype, config.device, ledger,
                              config.lora, step_thread)
    # A worker group's KV export/import is a collective call like a step: one at a time.
    step_lock = servicer.step_lock if config.world_size > 1 else None
    kv_transfer = kv_transfer_servicer(args, config, executor, step_lock)
    servicer.on_kv_lost = kv_transfer[1].renew_epoch  # its blocks' KV is gone: new epoch
    # The model's modules and parameters frozen: a gen-2 pass walking them mid-serving
    # would stall the step loop (and so every request) for its whole length.
    prepare_gc_for_serving()
    # Steps are sequential; a second thread answers GetWorkerInfo/health meanwhile
    # (and KV pulls: they never wait for a step).
    serve_sync("gpu-worker", args,
               [(pb_grpc.add_WorkerServiceServicer_to_server, servicer, SERVICE_NAME),
                kv_transfer],
               max_workers=8, on_stop=executor.shutdown,
               main_loop=step_thread.serve)
    return 0


def kv_transfer_servicer(args: argparse.Namespace, config, executor, step_lock=None):
    """The KV transport this worker serves (every role: a kv_both replica may also
    decode remotely prefilled requests), as serve_sync's triple."""
    # lazy: the KV transfer servicer brings torch; the CLI imports this module for its flags
    from pagoda.services.gpu_worker.kv_transfer import SERVICE_NAME as KV_SERVICE
    from pagoda.services.gpu_worker.kv_transfer import KvTransferServicer

    role = kv_transfer_config(args)
    logger.info("KV role %s (%s)", role.kv_role, role.kv_connector)
    servicer = KvTransferServicer(executor, config.model, config.world_size,
                                  config.cache.prefix_hash_seed, step_lock,
                                  connector=role.kv_connector, device=config.device,
                                  bind_host=args.host)
    return (kv_transfer_pb2_grpc.add_KvTransferServiceServicer_to_server, servicer, KV_SERVICE)
