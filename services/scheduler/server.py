"""`pagoda scheduler`: one model replica's scheduler process (grpc.aio + engine thread)."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import logging
import signal
import uuid

from grpc_health.v1 import health, health_pb2_grpc

import pagoda.tracing as tracing
from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2 as pb
from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2_grpc as pb_grpc
from pagoda.metrics import stat_logger
from pagoda.services.common import grpc_channels, startup_clock
from pagoda.services.common.gc_tuning import prepare_gc_for_serving
from pagoda.services.common.grpc_server import (NOT_SERVING, SERVING,
                                                add_server_args, bind, metrics_host)
from pagoda.services.common.logs import setup_logging
from pagoda.engine.async_steps import refuse_async_kv_transfer
from pagoda.spec_decode.config import refuse_mtp_with_kv_transfer
from pagoda.services.common.kv_transfer_args import (add_kv_transfer_args, kv_transfer_config,
                                                   require_prefix_caching)
from pagoda.services.common.metrics_server import maybe_start_metrics
from pagoda.engine.arg_utils import EngineArgs
from pagoda.engine.engine_core import EngineCore, make_structured_output_manager
from pagoda.services.scheduler.drain import drain
from pagoda.services.scheduler.engine_loop import EngineLoop
from pagoda.services.scheduler.kv_events_config import parse_kv_events_config
from pagoda.services.scheduler.kv_publisher import KvEventPublisher
from pagoda.services.scheduler.kv_role import (add_lease_service, build_hooks, describe_role,
                                               fetch_worker_layout,
                                               refuse_kv_transfer_for_hybrid,
                                               refuse_kv_transfer_without_kv_cache)
from pagoda.services.scheduler.metrics import KvPublisherMetrics, build_recorder
from pagoda.services.scheduler.servicer import SchedulerServicer
from pagoda.services.scheduler.worker_executor import GrpcWorkerExecutor
from pagoda.services.scheduler.zmq_kv_events import ZmqKvEventPublisher

DEFAULT_PORT = 50052
# vLLM's default for VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS: far above any real step
# (a long prefill on a slow CPU takes seconds), so only a hung worker reaches it.
DEFAULT_EXECUTE_MODEL_TIMEOUT_S = 300.0
FAILED_EXIT_DELAY_S = 1.0  # after the engine failed: its streams' ends leave first
SERVICE_NAME = "pagoda.scheduler.v1.SchedulerService"
# Longest wait for the structured-output backend before the replica opens its port (it
# takes a few seconds on a loaded 2-core machine).
GRAMMAR_WARM_UP_WAIT_S = 60.0
logger = logging.getLogger(__name__)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_server_args(parser, DEFAULT_PORT)
    parser.add_argument("--worker-addr", default="127.0.0.1:50053",
                        help="host:port of this replica's gpu-worker (rank 0).")
    parser.add_argument("--kv-cache-manager-addr", default="127.0.0.1:50054",
                        help="host:port of the kv-cache-manager that indexes this replica's "
                             "KV events ('' = do not publish).")
    parser.add_argument("--instance-id", default=None,
                        help="This replica's id in the cluster index (default: host:port).")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="Names clients may use for the model (default: the model argument).")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="On SIGTERM: seconds in-flight requests get to finish before they "
                             "are aborted (new ones are refused at once).")
    parser.add_argument("--execute-model-timeout", type=float,
                        default=DEFAULT_EXECUTE_MODEL_TIMEOUT_S, metavar="SECONDS",
                        help="Deadline of one step on the gpu-worker (vLLM's "
                             "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS): a step that runs longer "
                             "fails the replica and its streams move to other replicas. "
                             "Keep it well above the longest step (a full prefill on a slow "
                             "device); a frozen worker is found sooner by keepalive. 0: none.")
    parser.add_argument("--kv-heartbeat-interval", type=float, default=1.0,
                        help="Seconds between heartbeats to the kv-cache-manager when no KV "
                             "event batch went out (keep it well under its --heartbeat-timeout).")
    parser.add_argument("--kv-events-config", default=None,
                        help="vLLM's KV events JSON, e.g. '{\"enable_kv_cache_events\": true, "
                             "\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\"}': "
                             "publishes this replica's KV events in vLLM's ZMQ format "
                             "(for llm-d's kv-cache indexer), besides the kv-cache-manager's.")
    EngineArgs.add_cli_args(parser)
    add_kv_transfer_args(parser, timeouts=True)
    stat_logger.add_cli_args(parser)


def main(args: argparse.Namespace) -> int:
    setup_logging("scheduler")
    startup_clock.mark("imports")
    grpc_channels.configure_from_args(args)  # before the worker channel is made
    tracing.init_tracing("scheduler", args.otlp_traces_endpoint)
    role = kv_transfer_config(args)
    if args.async_scheduling is None and role.kv_role in ("kv_producer", "kv_consumer"):
        args.async_scheduling = False  # the default is on only where it is supported
    config = EngineArgs.from_cli_args(args).create_engine_config()
    startup_clock.mark("engine config")
    try:  # before loading anything: a bad value is the operator's to fix
        args.kv_events = parse_kv_events_config(args.kv_events_config)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    try:  # before waiting for the worker: the operator's to fix
        refuse_async_kv_transfer(config.scheduler.async_scheduling, role.kv_role)
        refuse_mtp_with_kv_transfer(config.scheduler.speculative_config, role.kv_role)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    refuse_kv_transfer_without_kv_cache(args, config)  # before waiting for the worker
    refuse_kv_transfer_for_hybrid(role, config)  # before the prefix-cache requirement
    require_prefix_caching(role, config.cache.enable_prefix_caching)  # before any connection
    executor = GrpcWorkerExecutor(args.worker_addr,
                                  step_timeout=args.execute_model_timeout or None)
    # The grammar backend (the tokenizer's vocabulary tables) loads in the background
    # while EngineCore waits for the worker, so the first structured-output request does
    # not wait for it; the replica starts serving once it is built (below).
    grammar = make_structured_output_manager(config)
    grammar.warm_up()
    core = EngineCore(config, executor, grammar)
    startup_clock.mark("worker and KV cache")  # the wait for the worker, its KV profile
    info = model_info(config, args.instance_id or f"{args.host}:{args.port}")
    layout = None if config.is_encoder else fetch_worker_layout(args.worker_addr, role)
    describe_role(info, role, layout)
    args.kv_role_config, args.kv_worker_layout = role, layout
    recorder, stats_thread = build_recorder(config, args)
    # Before anything of the replica is reachable (the port, the cluster index): once it
    # takes requests it must be able to drain them on SIGTERM at once.
    wait_for_grammar_backend(grammar.warm_up())
    startup_clock.mark("grammar backend")  # what it still needed after the worker's wait
    prepare_gc_for_serving()  # the engine, its block pool, the grammar tables: frozen
    try:
        failed = asyncio.run(_serve(args, core, info, config.arch.eos_token_ids, recorder))
    finally:
        core.shutdown()
        if stats_thread is not None:
            stats_thread.stop()
        tracing.shutdown_tracing()
    return 1 if failed else 0


def wait_for_grammar_backend(ready: concurrent.futures.Future) -> None:
    """Before serving: a backend still loading (several seconds of tokenizer import and
    parsing, holding the GIL) would slow this replica's first steps, and it is ready
    soon. One that failed only fails the structured-output requests, each with the
    error; one that takes longer than GRAMMAR_WARM_UP_WAIT_S keeps loading behind."""
    try:
        ready.result(timeout=GRAMMAR_WARM_UP_WAIT_S)
    except concurrent.futures.TimeoutError:
        logger.warning("the structured-output backend is still loading after %.0f s; "
                       "serving without waiting for it", GRAMMAR_WARM_UP_WAIT_S)
    except Exception as exc:  # noqa: BLE001 - reported, and again to each request
        logger.warning("the structured-output backend failed to load: %s", exc)


def model_info(config, instance_id: str) -> pb.GetModelInfoResponse:
    """What GetModelInfo answers for this replica (a new epoch per call: per process)."""
    info = pb.GetModelInfoResponse(
        model=config.model, max_model_len=config.scheduler.max_model_len,
        block_size=config.cache.block_size, num_gpu_blocks=config.cache.num_blocks,
        instance_id=instance_id, prefix_hash_seed=config.cache.prefix_hash_seed,
        prefix_caching_hash_algo=config.cache.prefix_caching_hash_algo,
        served_model_name=config.served_model_name, epoch=uuid.uuid4().hex)
    if config.lora is not None:  # --enable-lora: the gateway routes adapters by these
        info.max_cpu_loras = config.lora.max_cpu_loras
        info.max_lora_rank = config.lora.max_lora_rank
    if config.pooler_config is not None:  # --runner pooling: what the gateway may ask
        info.pooling.task = config.pooler_config.task
        info.pooling.labels.extend(config.pooler_config.labels)
        info.pooling.prompts.update(dict(config.pooler_config.prompts))
    return info


async def _serve(args: argparse.Namespace, core, info: pb.GetModelInfoResponse,
                 eos_token_ids: list[int], recorder=None) -> bool:
    """Serve until SIGTERM (False) or until the engine failed (True: exit non-zero)."""
    loop = asyncio.get_running_loop()
    publisher = None
    if args.kv_cache_manager_addr:
        publisher = KvEventPublisher(args.kv_cache_manager_addr, info.instance_id, info.model,
                                     info.block_size, info.epoch,
                                     metrics=KvPublisherMetrics(info.served_model_name[0]),
                                     heartbeat_interval=args.kv_heartbeat_interval).start()
    kv_events = getattr(args, "kv_events", None)  # --kv-events-config, parsed by main
    try:
        zmq_events = (ZmqKvEventPublisher(kv_events) if kv_events and kv_events.publishes
                      else None)
    except ValueError as exc:  # the endpoint is taken or malformed: the operator's to fix
        if publisher is not None:
            publisher.stop()
        raise SystemExit(str(exc)) from None
    # One list of events per step, to every consumer in the same order.
    consumers = [p.publish for p in (publisher, zmq_events) if p is not None]
    health_servicer = health.aio.HealthServicer()
    servicer: SchedulerServicer | None = None

    # Before the engine starts: on_failure (engine thread) may set `stop` at once.
    stop, force = asyncio.Event(), asyncio.Event()

    def on_failure(exc: Exception) -> None:
        servicer.on_failure(exc)
        for name in ("", SERVICE_NAME):
            asyncio.run_coroutine_threadsafe(health_servicer.set(name, NOT_SERVING), loop)
        # A failed engine never steps again (its worker died, froze past keepalive, or
        # missed a step deadline; a resumed worker has drifted from it): exit, once the
        # streams' ends reached the gateway (which migrates them), so that the
        # supervisor (`pagoda serve`, or the pod's restart policy) starts the replica
        # afresh instead of leaving it NOT_SERVING forever.
        logger.error("the engine failed: exiting in %.0f s so the replica restarts",
                     FAILED_EXIT_DELAY_S)
        loop.call_soon_threadsafe(loop.call_later, FAILED_EXIT_DELAY_S, stop.set)

    engine = EngineLoop(core, lambda outs: (servicer.kv_transfer.on_outputs(outs),
                                            servicer.on_outputs(outs)),
                        lambda events: [publish(events) for publish in consumers], on_failure,
                        recorder, on_request_failed=lambda *failed: servicer.on_request_failed(
                            *failed))
    servicer = SchedulerServicer(engine, info, eos_token_ids)
    servicer.bind_loop(loop)
    if publisher is not None:  # a resync's snapshot is taken on the engine thread
        publisher.snapshot_source = lambda deliver: engine.call_soon(
            lambda: deliver(core.kv_index_snapshot()))

    server = grpc_channels.aio_server()
    pb_grpc.add_SchedulerServiceServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = bind(server, args.host, args.port)
    servicer.kv_transfer = build_hooks(args, args.kv_role_config, engine, info,
                                       args.kv_worker_layout, port)
    add_lease_service(server, servicer.kv_transfer)
    if servicer.kv_transfer.producer is not None and publisher is not None:
        servicer.kv_transfer.producer.lease_journal = publisher.publish_leases  # Redis
    await server.start()
    engine.start()
    reaper = (asyncio.ensure_future(servicer.kv_transfer.producer.reap_forever())
              if servicer.kv_transfer.producer is not None else None)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, SERVING)
    startup_clock.mark("gRPC server")
    startup_clock.report("serving")
    for sig in (signal.SIGTERM, signal.SIGINT):  # the second signal cuts the drain short
        loop.add_signal_handler(sig, lambda: force.set() if stop.is_set() else stop.set())
    metrics = maybe_start_metrics(metrics_host(args), args.metrics_port,
                                  lambda: engine.failure is None and not servicer.draining)
    logger.info("scheduler %s listening on %s:%d (%d KV blocks of %d tokens)", info.instance_id,
                args.host, port, info.num_gpu_blocks, info.block_size)
    await stop.wait()
    logger.info("shutting down")
    await drain(servicer, health_servicer, args.drain_timeout, force)
    await server.stop(grace=1.0)
    if reaper is not None:
        reaper.cancel()
    engine.stop()
    if publisher is not None:
        publisher.stop(deregister=True)
    if zmq_events is not None:
        zmq_events.stop()
    # `metrics` stays open until the process exits (see drain.py): never stop it here.
    logger.info("scheduler stopped")
    return engine.failure is not None
