"""A local cluster of real processes for the routing tests: N replicas, two gateways.

Built with `pagoda serve`'s own service list (so the flags are the real ones),
plus a second gateway with another router on the same replicas, a short
heartbeat timeout, and direct handles on each scheduler and on the index.
"""

from __future__ import annotations

import argparse
import signal
import tempfile
import time

import grpc
import httpx
import redis

from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2 as spb
from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2_grpc as spb_grpc
from pagoda.services.bench.routing import extra_gateway
from pagoda.services.cli import serve
from pagoda.services.cli.local_cluster import LocalCluster, ServiceProcess
from pagoda.services.gateway.routing.peers import HEALTH_POLL_S
from pagoda.free_ports import free_port
from pagoda.services.kv_cache_manager.index import PrefixIndex
from serve_cluster import wait_until

HEARTBEAT_TIMEOUT_S = 3.0
HEARTBEAT_INTERVAL_S = 0.5


class RoutingCluster:
    """Invariant: `gateways[router]` is the base URL of a gateway using that router."""

    def __init__(self, model: str, redis_url: str, num_replicas: int, num_blocks: int,
                 routers: tuple[str, ...] = ("kv_aware", "round_robin"),
                 drain_timeout: float = 30.0) -> None:
        parser = argparse.ArgumentParser()
        serve.add_parser(parser.add_subparsers())
        args = parser.parse_args([
            "serve", model, "--port", str(free_port()), "--served-model-name", "tiny",
            "--dtype", "float32", "--max-model-len", "1024", "--disable-log-stats",
            "--data-parallel-size", str(num_replicas), "--router", routers[0],
            "--num-gpu-blocks-override", str(num_blocks)])
        services = serve.build_services(args, redis_url)
        for service in services:
            if service.kind == "kv-cache-manager":
                service.argv += ["--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S)]
            if service.kind == "scheduler":
                service.argv += ["--kv-heartbeat-interval", str(HEARTBEAT_INTERVAL_S),
                                 "--drain-timeout", str(drain_timeout)]
        gateway = services[-1]
        self.gateways = {routers[0]: f"http://{gateway.address}"}
        for router in routers[1:]:
            services.append(extra_gateway(gateway, router, free_port()))
            self.gateways[router] = f"http://{services[-1].address}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="pagoda-routing-", suffix=".log")
        self.cluster = LocalCluster(services, log_stream=self.log)
        self.redis = redis.Redis.from_url(redis_url)
        self.schedulers = [s for s in services if s.kind == "scheduler"]
        self._info: dict[str, spb.GetModelInfoResponse] = {}
        self._channels: dict[str, grpc.Channel] = {}

    # ------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 240.0) -> "RoutingCluster":
        self.cluster.start()
        try:
            self.cluster.wait_healthy(timeout)
        except Exception:
            self.stop()
            raise RuntimeError(f"cluster did not come up:\n{self.log_tail()}") from None
        # Every service answers SERVING, but the gateways route to a replica only from
        # their next health poll on (every HEALTH_POLL_S once ready): tests that count
        # which replica served need both known.
        time.sleep(2 * HEALTH_POLL_S)
        return self

    def stop(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self.cluster.stop()
        self.redis.close()

    def service(self, name: str) -> ServiceProcess:
        return self.cluster.services[name]

    def signal(self, name: str, sig: int = signal.SIGKILL) -> None:
        self.service(name).process.send_signal(sig)

    def wait_exit(self, name: str, timeout: float) -> int:
        return self.service(name).process.wait(timeout)

    def restart(self, name: str, timeout: float = 120.0) -> None:
        """Start an exited service again and wait until it serves."""
        self.cluster.restart(name)
        assert wait_until(self.service(name).is_healthy, timeout, 0.1), self.log_tail()

    def log_text(self) -> str:
        """Everything the services logged so far."""
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def log_tail(self, lines: int = 60) -> str:
        return "".join(self.log_text().splitlines(keepends=True)[-lines:])

    # ------------------------------------------------------------ replicas and index
    def stub(self, index: int) -> spb_grpc.SchedulerServiceStub:
        service = self.schedulers[index]
        if service.name not in self._channels:
            self._channels[service.name] = grpc.insecure_channel(service.address)
        return spb_grpc.SchedulerServiceStub(self._channels[service.name])

    def info(self, index: int) -> spb.GetModelInfoResponse:
        name = self.schedulers[index].name
        if name not in self._info:
            self._info[name] = self.stub(index).GetModelInfo(spb.GetModelInfoRequest(),
                                                              timeout=10)
        return self._info[name]

    def instance_id(self, index: int) -> str:
        return self.info(index).instance_id

    def index(self) -> PrefixIndex:
        return PrefixIndex(self.redis, heartbeat_timeout=HEARTBEAT_TIMEOUT_S)

    def cached_blocks(self, index: int) -> set[bytes]:
        """What the replica really holds."""
        reply = self.stub(index).GetCachedBlocks(spb.GetCachedBlocksRequest(), timeout=10)
        return set(reply.block_hashes)

    def indexed_blocks(self, index: int) -> set[bytes]:
        """What the cluster index says it holds."""
        info = self.info(index)
        return self.index().instance_blocks(info.model, info.block_size, info.instance_id)

    def converged(self, index: int) -> bool:
        return self.cached_blocks(index) == self.indexed_blocks(index)

    def live_instances(self) -> list[str]:
        info = self.info(0)
        return [i.instance_id for i in self.index().list_instances(info.model, info.block_size)]

    # ------------------------------------------------------------ traffic
    def complete(self, prompt: list[int], router: str = "kv_aware", max_tokens: int = 2,
                 stream: bool = False) -> httpx.Response:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                "ignore_eos": True, "stream": stream}
        return httpx.post(f"{self.gateways[router]}/v1/completions", json=body, timeout=60)
