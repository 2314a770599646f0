"""A cluster-wide prefix cache with real processes: `pagoda serve --data-parallel-size 2
--router session --kv-prefix-pull` (two colocated kv_both replicas S and R, the session
header pinning each request to one), and a second gateway on the same replicas without
the flag.

After S served a prompt, the same prefix sent to R is pulled from S (blocks pulled = the
leading blocks S holds minus those R holds), the greedy output equals a from-scratch
computation, and cached_tokens counts the pulled blocks; without the flag nothing is
pulled; with S's gpu-worker SIGKILLed after the lease the pull fails and R computes
the prompt, and with S gone altogether the request is served too."""

from __future__ import annotations

import argparse
import signal
import tempfile

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prefix_index_probe import indexed_blocks
from serve_cluster import wait_until

from pagoda.services.bench.routing import extra_gateway
from pagoda.services.cli import serve
from pagoda.services.cli.local_cluster import LocalCluster
from pagoda.free_ports import free_port
from pagoda.services.gateway.routing.router import _rendezvous

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # make test-extended
BS = 16
PREFIX = list(range(2000, 2000 + 6 * BS))  # 6 full blocks
MIN_BLOCKS = 2


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


class PullCluster:
    """Two kv_both replicas (`S` = 0, `R` = 1), gateway `pull` with the flag and
    gateway `plain` without; `session[i]` is a session key the gateways route to
    replica i."""

    def __init__(self, model: str, redis_url: str, extra: tuple[str, ...] = (),
                 env: dict[str, str] | None = None) -> None:
        """`extra`: more `pagoda serve` flags; `env`: set in every process."""
        parser = argparse.ArgumentParser()
        serve.add_parser(parser.add_subparsers())
        args = parser.parse_args([
            "serve", model, "--port", str(free_port()), "--served-model-name", "tiny",
            "--dtype", "float32", "--max-model-len", "1024", "--block-size", str(BS),
            "--disable-log-stats", "--data-parallel-size", "2", "--router", "session",
            "--kv-prefix-pull", "--kv-prefix-pull-min-blocks", str(MIN_BLOCKS),
            "--kv-lease-timeout", "60", "--enable-prompt-tokens-details", *extra])
        services = serve.build_services(args, redis_url)
        for service in services:
            service.env.update(env or {})
        gateway = next(s for s in services if s.kind == "gateway")
        plain = extra_gateway(gateway, "session", free_port())
        for name in ("--kv-prefix-pull-min-blocks", "--kv-prefix-pull"):
            at = plain.argv.index(name)
            del plain.argv[at:at + (2 if name.endswith("blocks") else 1)]
        services.append(plain)
        self.urls = {"pull": f"http://{gateway.address}", "plain": f"http://{plain.address}"}
        self.log = tempfile.NamedTemporaryFile("w+", prefix="pagoda-prefix-pull-")
        self.cluster = LocalCluster(services, log_stream=self.log)
        self.by_name = {s.name: s for s in services}
        addresses = flag(gateway.argv, "--scheduler-addrs").split(",")
        self.session = {}
        for i in range(100):
            key = f"user{i}"
            winner = max(range(2), key=lambda r: _rendezvous(key, addresses[r]))
            self.session.setdefault(winner, key)
        self.addresses = addresses
        # One of the tokenizer replicas the gateway balances over (any answers the same).
        self.tokenizer = flag(gateway.argv, "--tokenizer-addr").split(",")[0]
        self.index = flag(gateway.argv, "--kv-cache-manager-addr")
        self.model = flag(self.by_name["scheduler-0"].argv, "--model")

    def start(self) -> "PullCluster":
        self.cluster.start()
        try:
            self.cluster.wait_healthy(240)
        except Exception:
            self.stop()
            self.log.seek(0)
            raise RuntimeError("cluster did not come up:\n" + self.log.read()[-5000:]) from None
        # A gateway is healthy once one replica is routable: wait for both, at both.
        for gateway in self.urls:
            for replica in (0, 1):
                assert wait_until(lambda: self.routed(gateway, replica), 60, 0.5), (gateway,
                                                                                   replica)
        return self

    def routed(self, gateway: str, replica: int) -> bool:
        reply = httpx.post(f"{self.urls[gateway]}/v1/completions", timeout=60,
                           headers={"X-Session-Id": self.session[replica]},
                           json={"model": "tiny", "prompt": [1, 2], "max_tokens": 1})
        return reply.headers.get("x-pagoda-instance") == self.addresses[replica]

    def stop(self) -> None:
        self.cluster.stop()

    def complete(self, prompt: list[int], replica: int, gateway: str = "pull",
                 salt: str | None = None):
        client = openai.OpenAI(base_url=f"{self.urls[gateway]}/v1", api_key="x",
                               max_retries=0, timeout=120)
        raw = client.completions.with_raw_response.create(
            model="tiny", prompt=prompt, max_tokens=6, temperature=0.0, logprobs=1,
            extra_headers={"X-Session-Id": self.session[replica]},
            extra_body={"cache_salt": salt} if salt else None)
        return raw.headers.get("x-pagoda-instance"), raw.parse()

    def metric(self, service: str, name: str, **labels) -> float:
        url = f"http://127.0.0.1:{flag(self.by_name[service].argv, '--metrics-port')}/metrics"
        return _sum(httpx.get(url, timeout=10).text, name, labels)

    def gateway_metric(self, gateway: str, name: str, **labels) -> float:
        text = httpx.get(f"{self.urls[gateway]}/metrics", timeout=10).text
        return _sum(text, name, {**labels, "instance": None})

    def indexed_blocks(self, prompt: list[int]) -> dict[str, int]:
        """instance id -> leading blocks of `prompt` the cluster index says it holds."""
        return indexed_blocks(self.tokenizer, self.index, self.model, prompt, BS)

    def wait_indexed(self, prompt: list[int], replica: int, num_blocks: int) -> None:
        address = self.addresses[replica]
        assert wait_until(lambda: self.indexed_blocks(prompt).get(address, 0) >= num_blocks,
                          20), self.indexed_blocks(prompt)


def _sum(text: str, name: str, labels: dict) -> float:
    """The sum of `name`'s samples whose labels match (a None value: label absent)."""
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples if s.name == name
               and all(s.labels.get(k) == v for k, v in labels.items()))


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir, redis_server):
    cluster = PullCluster(tiny_llama_dir, redis_server.url).start()
    yield cluster
    cluster.stop()


S, R = 0, 1


def pulled_blocks(cluster) -> float:
    return cluster.metric("gpu-worker-1", "pagoda_kv_transfer_blocks_total")


def tokens(completion) -> list[str]:
    return completion.choices[0].logprobs.tokens


def test_replica_pulls_what_the_other_holds_and_answers_the_same(cluster):
    assert set(cluster.session) == {S, R}
    instance, _ = cluster.complete(PREFIX + [7, 8, 9, 10, 11], S)
    assert instance == cluster.addresses[S]
    cluster.wait_indexed(PREFIX, S, 6)
    prompt = PREFIX + [21, 22, 23, 24, 25, 26, 27]  # 6 usable blocks, all on S
    _, want = cluster.complete(prompt, R, "plain", salt="from-scratch")
    assert want.usage.prompt_tokens_details.cached_tokens == 0
    before = pulled_blocks(cluster)
    instance, got = cluster.complete(prompt, R)
    assert instance == cluster.addresses[R]
    assert wait_until(lambda: pulled_blocks(cluster) - before, 10) == 6
    assert tokens(got) == tokens(want)
    assert got.choices[0].logprobs.token_logprobs == pytest.approx(
        want.choices[0].logprobs.token_logprobs, abs=1e-3)
    assert got.usage.prompt_tokens == len(prompt)
    assert got.usage.prompt_tokens_details.cached_tokens == 6 * BS
    assert cluster.gateway_metric("pull", "pagoda_gateway_kv_prefix_pulls_total",
                                  result="leased") == 1


def test_only_the_blocks_the_replica_lacks_move(cluster):
    longer = PREFIX + list(range(3000, 3000 + 2 * BS))  # S will hold 8, R holds 6
    cluster.complete(longer + [1, 2, 3], S)
    cluster.wait_indexed(longer, S, 8)
    cluster.wait_indexed(PREFIX, R, 6)  # what R pulled is in the index too
    prompt = longer + [4, 5, 6]
    _, want = cluster.complete(prompt, R, "plain", salt="from-scratch")
    before = pulled_blocks(cluster)
    _, got = cluster.complete(prompt, R)
    assert wait_until(lambda: pulled_blocks(cluster) - before, 10) == 2
    assert tokens(got) == tokens(want)
    assert got.usage.prompt_tokens_details.cached_tokens == 8 * BS


def test_without_the_flag_nothing_is_pulled(cluster):
    prompt = list(range(4000, 4000 + 5 * BS)) + [9, 9]
    cluster.complete(prompt, S, "plain")
    cluster.wait_indexed(prompt, S, 5)
    before = pulled_blocks(cluster)
    _, got = cluster.complete(prompt, R, "plain")
    assert got.usage.prompt_tokens_details.cached_tokens == 0  # R computed it all
    assert pulled_blocks(cluster) == before
    assert cluster.gateway_metric("plain", "pagoda_gateway_kv_prefix_pulls_total") == 0


def test_a_dead_source_means_the_replica_computes_the_prompt(cluster):
    first = list(range(5000, 5000 + 6 * BS))
    second = list(range(6000, 6000 + 6 * BS))
    for prompt in (first, second):
        cluster.complete(prompt + [1], S)
        cluster.wait_indexed(prompt, S, 6)
    want = {tuple(p): tokens(cluster.complete(p + [2], R, "plain", salt="fresh")[1])
            for p in (first, second)}
    before = pulled_blocks(cluster)
    unavailable = cluster.metric("scheduler-1", "pagoda_kv_transfer_failures_total",
                                 reason="unavailable")
    # S's gpu-worker dies: its scheduler still leases (it is idle), R's pull fails.
    cluster.by_name["gpu-worker-0"].process.send_signal(signal.SIGKILL)
    cluster.by_name["gpu-worker-0"].process.wait(10)
    _, got = cluster.complete(first + [2], R)
    assert tokens(got) == want[tuple(first)]
    assert got.usage.prompt_tokens_details.cached_tokens == 0
    assert cluster.metric("scheduler-1", "pagoda_kv_transfer_failures_total",
                          reason="unavailable") == unavailable + 1
    assert cluster.metric("scheduler-1", "pagoda_kv_transfer_fallbacks_total",
                          kind="recompute") >= 1
    # Then S is gone altogether: no lease (refused, or S already out of the routing).
    cluster.by_name["scheduler-0"].process.send_signal(signal.SIGKILL)
    cluster.by_name["scheduler-0"].process.wait(10)
    _, got = cluster.complete(second + [2], R)
    assert tokens(got) == want[tuple(second)]
    assert pulled_blocks(cluster) == before
