"""How a scheduler takes part in prefill/decode disaggregation, by its KV role
(`--kv-transfer-config`): a producer leases finished prompts' blocks (kv_producer.py),
a consumer pulls remotely prefilled prompts' blocks before admitting them
(kv_consumer.py), kv_both does both. The engine never sees `kv_transfer_params`:
they are handled here, before submit and when the outputs leave the engine thread.
"""

from __future__ import annotations

import argparse
import logging
import socket

import grpc

from pagoda.kv_transfer.config import KVTransferConfig
from pagoda.messages import EngineCoreOutput, EngineCoreRequest
from pagoda.services._proto.pagoda.kv_transfer.v1 import kv_transfer_pb2 as kpb
from pagoda.services._proto.pagoda.kv_transfer.v1 import kv_transfer_pb2_grpc as kpb_grpc
from pagoda.services.common import grpc_channels
from pagoda.services.scheduler.kv_consumer import KvConsumer
from pagoda.services.scheduler.kv_producer import KvLeaseServicer, KvProducer

logger = logging.getLogger(__name__)


class KvTransferHooks:
    """Invariant: a request's `kv_transfer_params` are consumed by `before_submit`
    (the engine gets the request without them) and `after_stream` is called once per
    request whose handler ran, whatever happened."""

    def __init__(self, role: KVTransferConfig, producer: KvProducer | None,
                 consumer: KvConsumer | None) -> None:
        self.role = role
        self.producer = producer
        self.consumer = consumer

    async def before_submit(self, request: EngineCoreRequest) -> None:
        params = request.kv_transfer_params
        if params is None:
            return
        if params.do_remote_decode and self.producer is not None:
            self.producer.expect(request)
        elif params.do_remote_prefill and self.consumer is not None:
            await self.consumer.prepare(request)
        request.kv_transfer_params = None

    def on_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        """Engine thread, before the outputs are dispatched to their streams."""
        if self.producer is not None:
            self.producer.on_outputs(outputs)

    def after_stream(self, request_id: str, delivered: bool = True) -> None:
        """`delivered`: the stream's last output (the one naming a lease) was sent."""
        if self.producer is not None:
            self.producer.forget(request_id, delivered)
        if self.consumer is not None:
            self.consumer.finish(request_id)


def fetch_worker_layout(worker_addr: str, role: KVTransferConfig) -> kpb.KvLayout | None:
    """The gpu-worker's KV layout and epoch (its KV cache is allocated by then).

    None when the worker's executor cannot transfer KV (UNIMPLEMENTED) and this
    replica has the default colocated role: it then serves as before, without transfers. A
    producer or consumer replica on such a worker is a start-up error."""
    try:
        with grpc_channels.channel(worker_addr) as channel:
            return kpb_grpc.KvTransferServiceStub(channel).GetKvLayout(
                kpb.GetKvLayoutRequest(), timeout=30.0)
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.UNIMPLEMENTED or role.kv_role != "kv_both":
            raise
        logger.info("KV transfer off: %s", exc.details())
        return None


def refuse_kv_transfer_without_kv_cache(args: argparse.Namespace, config) -> None:
    """An encoder (`config.is_encoder`) keeps no KV cache: there is no layout to fetch,
    nothing to index or hand over. SystemExit when a KV transfer role was asked of it;
    otherwise its replica publishes no KV events (`--kv-cache-manager-addr` cleared)."""
    if not config.is_encoder:
        return
    if getattr(args, "kv_transfer_config", None):
        raise SystemExit(f"error: {config.arch.architecture} is an encoder and keeps no KV "
                         "cache, so it cannot take part in prefill/decode disaggregation "
                         "(--kv-transfer-config, --prefill-replicas/--decode-replicas): "
                         "serve it colocated")
    args.kv_cache_manager_addr = ""


def refuse_kv_transfer_for_hybrid(role: KVTransferConfig, config) -> None:
    """SystemExit for a kv_producer or kv_consumer replica of a hybrid model (Mamba2
    layers, `config.arch.mamba`): P/D hands over KV blocks, and a hybrid model's
    recurrent state is not in them, so the decode side would start from a state that
    skipped the prompt. Said before the prefix-cache requirement, which the family
    turns off itself and would otherwise be blamed. A colocated (kv_both) replica
    serves without transfers (`fetch_worker_layout`); its migrated requests recompute
    their context (pagoda.worker.recurrent_state)."""
    arch = config.arch
    if arch.mamba is None or role.kv_role not in ("kv_producer", "kv_consumer"):
        return
    raise SystemExit(f"error: {arch.architecture} is a hybrid model with Mamba2 layers: "
                     f"prefill/decode disaggregation (kv_role {role.kv_role}, "
                     "--prefill-replicas/--decode-replicas) is not supported, since the "
                     "layers' recurrent state does not travel with the KV blocks; serve it "
                     "with colocated replicas (--data-parallel-size)")


def worker_epoch(worker_addr: str) -> str | None:
    """The gpu-worker's KV epoch now (it renews it whenever its KV cache is set up
    again); None when it does not answer."""
    try:
        with grpc_channels.channel(worker_addr) as channel:
            return kpb_grpc.KvTransferServiceStub(channel).GetKvLayout(
                kpb.GetKvLayoutRequest(), timeout=30.0).epoch
    except grpc.RpcError as exc:
        logger.warning("the gpu-worker's KV epoch is unknown (%s): transfers fail until it "
                       "answers", exc.code().name)
        return None


def describe_role(info, role: KVTransferConfig, layout: kpb.KvLayout) -> None:
    """Fill the handshake's fields of GetModelInfo: role, connector, layout."""
    info.kv_role = role.kv_role
    info.kv_connector = role.kv_connector
    if layout is not None:
        info.kv_layout.CopyFrom(layout)


def advertised_address(host: str, port: int) -> str:
    """An address peers can dial: a wildcard bind is advertised as this host's IP."""
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = socket.gethostbyname(socket.gethostname())
    return f"{host}:{port}"


def _join(host: str, port: int | str) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def kv_addresses(args: argparse.Namespace, port: int) -> tuple[str, str]:
    """(lease service, gpu-worker) addresses this replica puts in `kv_transfer_params`
    for decode replicas to dial.

    With --kv-advertise-host both are that host, with this scheduler's port and the
    --worker-addr's port: a scheduler and gpu-worker sharing one network namespace (a
    Kubernetes pod, whose --worker-addr is loopback) are reached at the pod's IP.
    Without it: the bound host (a wildcard as this machine's IP) and --worker-addr as
    given, which a local `pagoda serve` dials on 127.0.0.1."""
    host = getattr(args, "kv_advertise_host", None)
    if not host:
        return advertised_address(args.host, port), args.worker_addr
    host = host.strip("[]")
    return _join(host, port), _join(host, args.worker_addr.rpartition(":")[2])


def build_hooks(args: argparse.Namespace, role: KVTransferConfig, engine, info,
                layout: kpb.KvLayout, port: int) -> KvTransferHooks:
    pool = engine.core.scheduler.kv_cache_manager.pool
    producer = consumer = None
    if layout is None:  # the worker cannot transfer KV (see fetch_worker_layout)
        return KvTransferHooks(role, producer, consumer)
    if role.is_kv_producer:
        scheduler_address, worker_address = kv_addresses(args, port)
        producer = KvProducer(engine, pool, info, scheduler_address, worker_address,
                              layout.epoch, args.kv_lease_timeout)
        engine.core.kv_reset_listeners.append(
            lambda: producer.on_kv_reset(worker_epoch(args.worker_addr)))
    if role.is_kv_consumer:
        consumer = KvConsumer(engine, pool, info, args.worker_addr, args.kv_transfer_timeout)
        engine.core.kv_reset_listeners.append(consumer.on_kv_reset)
    return KvTransferHooks(role, producer, consumer)


def add_lease_service(server, hooks: KvTransferHooks) -> KvLeaseServicer | None:
    if hooks.producer is None:
        return None
    servicer = KvLeaseServicer(hooks.producer)
    kpb_grpc.add_KvLeaseServiceServicer_to_server(servicer, server)
    return servicer
