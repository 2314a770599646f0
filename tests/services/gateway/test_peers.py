"""Replica discovery (a list or DNS) and the block-hash self-check, against in-process peers."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

import grpc
import httpx
import pytest
from grpc_servers import start_grpc_server

from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2 as spb
from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2_grpc as spb_grpc
from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2_grpc as tpb_grpc
from pagoda.services.common.protocol.scheduler import hash_blocks
from pagoda.free_ports import free_port
from pagoda.services.gateway.routing.discovery import Discovery, Target, parse_scheduler_addrs
from pagoda.services.gateway.routing.peers import Peers, SchedulerReplica
from pagoda.services.tokenizer.servicer import TokenizerServicer


class TinyTokenizer:
    """Enough of an HF tokenizer for GetTokenizerInfo (hashing a prompt given as ids
    needs none)."""

    chat_template = None

    def __len__(self) -> int:
        return 1000


class HashingScheduler(spb_grpc.SchedulerServiceServicer):
    """A scheduler that serves model info and hashes with its own seed."""

    def __init__(self, seed: str, instance_id: str = "s0", algo: str = "") -> None:
        self.seed = seed
        self.instance_id = instance_id
        self.algo = algo  # --prefix-caching-hash-algo ("": the default)

    def GetModelInfo(self, request, context):
        return spb.GetModelInfoResponse(model="m", max_model_len=512, block_size=4,
                                        instance_id=self.instance_id, prefix_hash_seed=self.seed,
                                        served_model_name=["m"],
                                        prefix_caching_hash_algo=self.algo)

    def GetLoad(self, request, context):
        return spb.GetLoadResponse(serving=True)

    def HashBlocks(self, request, context):
        return hash_blocks(request, self.seed, self.algo)


@pytest.fixture
def peers_at(grpc_server_factory):
    def start(tokenizer_seed: str, scheduler_seeds: list[str], tokenizer_algo: str = "pagoda",
              scheduler_algos: list[str] | None = None) -> tuple[str, list[str]]:
        tokenizer = grpc_server_factory(tpb_grpc.add_TokenizerServiceServicer_to_server,
                                        TokenizerServicer(TinyTokenizer(), "m", [2],
                                                          tokenizer_seed, tokenizer_algo))
        algos = scheduler_algos or [""] * len(scheduler_seeds)
        schedulers = [grpc_server_factory(spb_grpc.add_SchedulerServiceServicer_to_server,
                                          HashingScheduler(seed, f"s{i}", algo))
                      for i, (seed, algo) in enumerate(zip(scheduler_seeds, algos))]
        return tokenizer.address, [s.address for s in schedulers]
    return start


def test_scheduler_addrs_take_a_list_and_dns_names():
    targets = parse_scheduler_addrs("a:1, dns:///sched-headless.ns.svc:50052,"
                                    "dns://8.8.8.8/other:7,[::1]:9")
    assert targets == [Target("a", 1, False), Target("sched-headless.ns.svc", 50052, True),
                       Target("other", 7, True), Target("::1", 9, False)]
    with pytest.raises(ValueError):
        parse_scheduler_addrs("no-port")


def test_dns_names_are_re_resolved_and_a_failure_keeps_the_last_answer():
    answers = [["10.0.0.1", "10.0.0.2"], ["10.0.0.2", "10.0.0.3"], OSError("SERVFAIL")]

    async def resolver(host, port):
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return [(None, None, None, "", (ip, port)) for ip in answer]

    discovery = Discovery(parse_scheduler_addrs("static:1,dns:///svc:50052"), resolver,
                          refresh_s=5.0)

    async def run():
        first = await discovery.addresses(now=0.0)
        cached = await discovery.addresses(now=1.0)  # not due: no query
        second = await discovery.addresses(now=5.0)
        third = await discovery.addresses(now=10.0)
        return first, cached, second, third

    first, cached, second, third = asyncio.run(run())
    assert first == cached == ["static:1", "10.0.0.1:50052", "10.0.0.2:50052"]
    assert second == third == ["static:1", "10.0.0.2:50052", "10.0.0.3:50052"]


def _serve_scheduler_at(host: str, port: int, servicer) -> grpc.Server:
    return start_grpc_server(spb_grpc.add_SchedulerServiceServicer_to_server, servicer,
                             f"{host}:{port}", max_workers=4)[0]


def test_dns_replicas_join_and_leave_the_gateway(peers_at):
    """Like a headless Service: one name, one A record per replica, one port."""
    tokenizer, _ = peers_at("seed", [])
    port = free_port()
    ips = ["127.0.0.2", "127.0.0.3"]
    servers = [_serve_scheduler_at(ip, port, HashingScheduler("seed", ip)) for ip in ips]
    answer = [ips[0]]

    async def resolver(host, p):
        assert (host, p) == ("sched-headless", port)
        return [(None, None, None, "", (ip, p)) for ip in answer]

    async def routable(peers) -> list[str]:
        await peers.refresh()
        return sorted(s.address for s in peers.schedulers if s.is_routable())

    async def run():
        target = f"dns:///sched-headless:{port}"
        peers = Peers(tokenizer, target,
                      discovery=Discovery(parse_scheduler_addrs(target), resolver, 0.0))
        peers.use_prefix_index("127.0.0.1:1")  # hashes get checked; lookups would fail
        try:
            one = await routable(peers)
            answer.append(ips[1])
            two = await routable(peers)
            answer.remove(ips[0])
            left = await routable(peers)
            return one, two, left, [s.address for s in peers.schedulers]
        finally:
            await peers.close()

    try:
        one, two, left, known = asyncio.run(run())
    finally:
        for server in servers:
            server.stop(None)
    assert one == [f"127.0.0.2:{port}"]
    assert two == [f"127.0.0.2:{port}", f"127.0.0.3:{port}"]
    assert left == known == [f"127.0.0.3:{port}"]  # idle: its channel is closed at once


def refreshed_once(tokenizer: str, schedulers: list[str], fatal: list[str]):
    """One refresh of a gateway's peers with the prefix index on: ({address: routable},
    healthy); fatal start-up errors go to `fatal`."""

    async def run():
        peers = Peers(tokenizer, ",".join(schedulers), on_fatal=fatal.append)
        peers.use_prefix_index("127.0.0.1:1")
        try:
            await peers.refresh()
            return {s.address: s.is_routable() for s in peers.schedulers}, peers.is_healthy()
        finally:
            await peers.close()

    return asyncio.run(run())


def test_replicas_whose_hashes_differ_get_no_traffic_and_stop_a_starting_gateway(peers_at):
    tokenizer, schedulers = peers_at("seed-a", ["seed-a", "seed-b"])
    fatal: list[str] = []
    routable, healthy = refreshed_once(tokenizer, schedulers, fatal)
    assert routable == {schedulers[0]: True, schedulers[1]: False}
    assert not healthy and len(fatal) == 1
    assert "seed-a" in fatal[0] and "seed-b" in fatal[0] and schedulers[1] in fatal[0]


def test_prompts_are_hashed_for_routing_only_when_there_is_a_choice(peers_at):
    # Issue 28: one replica is routed without the prefix index (router.py), so the
    # tokenizer is not asked for block hashes either; --kv-prefix-pull still wants them.
    tokenizer, schedulers = peers_at("seed-a", ["seed-a", "seed-a"])

    async def run(addresses: list[str], pull: bool = False) -> int:
        peers = Peers(tokenizer, ",".join(addresses))
        peers.use_prefix_index("127.0.0.1:1")
        peers.router.lookup_single_replica = pull
        try:
            await peers.refresh()
            return peers.routing_block_size()
        finally:
            await peers.close()

    block_size = asyncio.run(run(schedulers))
    assert block_size > 0
    assert asyncio.run(run(schedulers[:1])) == 0
    assert asyncio.run(run(schedulers[:1], pull=True)) == block_size


def test_the_hash_algorithm_must_match_too(peers_at):
    """--prefix-caching-hash-algo reaches the tokenizer and HashBlocks: equal algorithms
    agree, another one (same seed) is a mismatch that names both algorithms."""
    tokenizer, schedulers = peers_at("0", ["0", "0"], "sha256_cbor", ["sha256_cbor", ""])
    fatal: list[str] = []
    routable, _ = refreshed_once(tokenizer, schedulers, fatal)
    assert routable == {schedulers[0]: True, schedulers[1]: False}
    assert len(fatal) == 1 and "tokenizer 'sha256_cbor', scheduler 'pagoda'" in fatal[0]
    assert "--prefix-caching-hash-algo" in fatal[0]


def test_the_gateway_process_exits_loudly_on_a_hash_mismatch(peers_at):
    tokenizer, schedulers = peers_at("seed-a", ["seed-b"])
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "pagoda.services.cli.main", "gateway", "--port", str(port),
         "--tokenizer-addr", tokenizer, "--scheduler-addrs", schedulers[0],
         "--kv-cache-manager-addr", "127.0.0.1:1"], stderr=subprocess.PIPE, text=True)
    try:
        code = process.wait(60)
        log = process.stderr.read()
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
    assert code == 1
    assert "CRITICAL" in log and "block hashes differ" in log and "Traceback" not in log
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)


def test_without_the_index_no_hash_check_is_needed(peers_at):
    tokenizer, schedulers = peers_at("seed-a", ["seed-b"])

    async def run():
        peers = Peers(tokenizer, schedulers[0], router="round_robin")
        try:
            start = time.monotonic()
            while not peers.is_healthy() and time.monotonic() - start < 10:
                await peers.refresh()
            return peers.is_healthy()
        finally:
            await peers.close()

    assert asyncio.run(run())


def test_a_replica_restarted_between_two_polls_is_described_again(grpc_server_factory):
    """Its epoch changed although no poll saw it down: the gateway reads its model info
    again (a new incarnation's handshake and hash check), instead of keeping the old."""

    class Restarting(HashingScheduler):
        epoch = "e1"

        def GetModelInfo(self, request, context):
            info = super().GetModelInfo(request, context)
            info.epoch = self.epoch
            return info

        def GetLoad(self, request, context):
            return spb.GetLoadResponse(serving=True, epoch=self.epoch)

    servicer = Restarting("seed")
    server = grpc_server_factory(spb_grpc.add_SchedulerServiceServicer_to_server, servicer)

    async def run():
        replica = SchedulerReplica(server.address)
        await replica.refresh()
        first = replica.info.epoch
        replica.hashes_agree = True
        servicer.epoch = "e2"  # restarted: same address, up at every poll
        await replica.refresh()
        return first, replica.info.epoch, replica.hashes_agree

    assert asyncio.run(run()) == ("e1", "e2", None)
