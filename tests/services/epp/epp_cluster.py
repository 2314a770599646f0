"""A pool behind `pagoda epp` on loopback, as an InferencePool would see it.

`pagoda serve --data-parallel-size 2` (Redis, kv-cache-manager, tokenizer, two replicas
and the cluster's own kv_aware gateway; or a P/D topology), plus per replica a *member*
gateway whose only scheduler is that replica (the pod's gateway in the chart: the pool
member's OpenAI endpoint), plus `pagoda epp` over the pool's schedulers with `--endpoint-map` naming each
member (all share 127.0.0.1, so the host alone cannot tell them apart), and a second
picker, `epp-saturated`, that counts every replica as saturated (queue threshold 0)
and treats the objective `batch` as sheddable.
"""

from __future__ import annotations

import argparse
import tempfile

import httpx

from pagoda.services.bench.routing import extra_gateway
from pagoda.services.cli import serve
from pagoda.services.cli.local_cluster import LocalCluster, ServiceProcess
from pagoda.free_ports import free_port
from prefix_index_probe import indexed_blocks
from serve_cluster import wait_until

BS = 16
CLI = ["-m", "pagoda.services.cli.main"]


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


class EppCluster:
    """`topology`: `pagoda serve`'s replica flags. With disaggregation the members are
    the decode replicas, each gateway also listing the prefill replicas (as the chart)."""

    def __init__(self, model: str, redis_url: str,
                 topology: tuple[str, ...] = ("--data-parallel-size", "2")) -> None:
        parser = argparse.ArgumentParser()
        serve.add_parser(parser.add_subparsers())
        args = parser.parse_args([
            "serve", model, "--port", str(free_port()), "--served-model-name", "tiny",
            "--dtype", "float32", "--max-model-len", "1024", "--block-size", str(BS),
            "--disable-log-stats", *topology, "--enable-prompt-tokens-details"])
        services = serve.build_services(args, redis_url)
        gateway = next(s for s in services if s.kind == "gateway")
        self.gateway_url = f"http://{gateway.address}"
        replicas = [s for s in services if s.kind == "scheduler"]
        self.prefill = [s.address for s in replicas if "prefill" in s.name]
        whole = [s for s in replicas if "prefill" not in s.name]
        self.schedulers = [s.address for s in whole]  # the pool's replicas
        self.members: list[str] = []  # endpoint (ip:port) of replica i's member gateway
        for i, replica in enumerate(whole):
            member = extra_gateway(gateway, "kv_aware", free_port())
            member.name = f"member-{i}"
            member.argv[member.argv.index("--scheduler-addrs") + 1] = ",".join(
                [replica.address, *self.prefill])
            # Its /metrics carries its own replica's vllm:* series (GIE's model-server
            # protocol), as the chart's member gateway does.
            member.argv[member.argv.index("--peer-metrics") + 1] = (
                f"scheduler=127.0.0.1:{flag(replica.argv, '--metrics-port')}")
            services.append(member)
            self.members.append(member.address)
        self.tokenizer = flag(gateway.argv, "--tokenizer-addr").split(",")[0]
        self.index = flag(gateway.argv, "--kv-cache-manager-addr")
        mapping = ",".join(f"{s}={m}" for s, m in zip(self.schedulers, self.members))
        python = gateway.argv[0]
        common = ["--host", "127.0.0.1", "--tokenizer-addr", flag(gateway.argv, "--tokenizer-addr"),
                  "--scheduler-addrs", ",".join(self.schedulers),
                  "--kv-cache-manager-addr", self.index, "--endpoint-map", mapping]
        self.epp = f"127.0.0.1:{free_port()}"
        self.epp_metrics = free_port()
        self.saturated = f"127.0.0.1:{free_port()}"
        self.saturated_metrics = free_port()
        services.append(ServiceProcess("epp", [python, *CLI, "epp", *common, "--port",
                                               self.epp.rsplit(":")[1], "--metrics-port",
                                               str(self.epp_metrics), "--pool-name", "tiny-pool"],
                                       self.epp, kind="epp"))
        services.append(ServiceProcess("epp-saturated", [
            python, *CLI, "epp", *common, "--port", self.saturated.rsplit(":")[1],
            "--metrics-port", str(self.saturated_metrics), "--queue-depth-threshold", "0",
            "--objective-priority", "batch=-1,chat=2", "--pool-name", "tiny-pool"],
            self.saturated, kind="epp"))
        self.model = flag(whole[0].argv, "--model")
        self.log = tempfile.NamedTemporaryFile("w+", prefix="pagoda-epp-")
        self.cluster = LocalCluster(services, log_stream=self.log)

    def start(self) -> "EppCluster":
        self.cluster.start()
        try:
            self.cluster.wait_healthy(300)
        except Exception:
            self.stop()
            self.log.seek(0)
            raise RuntimeError("cluster did not come up:\n" + self.log.read()[-5000:]) from None
        # A picker is ready with one routable replica: wait until both see every one.
        ready = f'inference_pool_ready_pods{{name="tiny-pool"}} {len(self.schedulers)}.0'
        for port in (self.epp_metrics, self.saturated_metrics):
            assert wait_until(lambda: ready in self.metrics_text(port), 60, 0.5), \
                self.metrics_text(port)
        return self

    def stop(self) -> None:
        self.cluster.stop()

    def complete(self, base: str, prompt, max_tokens: int = 2) -> httpx.Response:
        return httpx.post(f"http://{base}/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})

    def indexed_blocks(self, prompt: list[int]) -> dict[str, int]:
        """instance id -> leading blocks of `prompt` the cluster index says it holds."""
        return indexed_blocks(self.tokenizer, self.index, self.model, prompt, BS)

    def metrics_text(self, port: int | None = None) -> str:
        return httpx.get(f"http://127.0.0.1:{port or self.epp_metrics}/metrics", timeout=10).text
