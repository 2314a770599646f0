"""A cluster-wide prefix cache (`--kv-prefix-pull`): a replica pulls the cached prompt
blocks another replica holds instead of computing them.

    route ─► replica R; the prefix index: S holds s leading blocks, R holds r
    s - r >= --kv-prefix-pull-min-blocks ─► S.LeasePrefix(the s blocks' hashes, tokens)
           ◄─ kv_transfer_params: the leading run S still holds, pinned under a lease
    ─► R: the request with those params (do_remote_prefill): R's scheduler pulls the
       blocks it lacks worker to worker (kv_consumer.py), releases the lease, and
       computes only the rest of the prompt (a prefix-cache hit, as after a P/D prefill)

A source may hold part of the run only in its host/disk KV tier (evicted from its
device): the index counts those blocks below its device blocks (`--kv-medium-weights`),
and the source onloads them to its device before leasing (LeasePrefix's from_tier,
services/scheduler/kv_tier_lease.py), so the pull itself is the device pull below.

The same pull as prefill/decode disaggregation, started from a cache hit elsewhere
instead of a prefill: a colocated replica (kv_both) and a decode replica computing a
prompt itself (its P/D prefill fell through) both pull this way; the source is any
replica with a lease service (kv_producer, kv_both) that agrees with R on the KV
layout (disagg.handshake_problem). A kv_producer replica is never routed a whole
request, so it is never the target of a pull.

Nothing here can fail a request: S gone or slow (LEASE_TIMEOUT_S), S no longer
holding `--kv-prefix-pull-min-blocks` more than R (evicted since the index said so)
-> R gets the request without params; a pull that fails or stalls -> R computes the
prompt (counted there: pagoda_kv_transfer_failures_total{reason},
pagoda_kv_transfer_fallbacks_total{kind="recompute"}). The gateway counts its side in
pagoda_gateway_kv_prefix_pulls_total{result}, and the leases that came (partly) from a
source's tier, or were expected to, also in pagoda_gateway_kv_prefix_tier_pulls_total. The lease is released by R after its
pull and by the gateway when the choice ends (twice is harmless), so a dead R strands
nothing; S's reaper covers a dead gateway.

When it pays: `.venv/bin/python benchmarks/bench_prefix_pull.py --trials 3` (SmolLM2-135M
Q4_1, bf16 KV, 16-token blocks of 360 KiB, two replicas on a 2-core CPU; one request at
a time, time to first token, medians):

    prefix tokens (blocks)   pulled    recomputed   local hit
       32 (2)                0.038 s   0.052 s      0.031 s
      512 (32)               0.081 s   0.353 s      0.038 s
     1024 (64)               0.098 s   0.756 s      0.046 s
     2048 (128)              0.158 s   2.074 s      0.056 s

A block moves in 0.7-1.0 ms (the pulling worker's own time) and costs 9-16 ms to
prefill here; beyond the blocks, a pull answers within a few ms of a local hit: every
pull measured (2 blocks and up) was faster. On a GPU a block's prefill is far cheaper and this transfer (gRPC,
through host memory) is not: measure there before turning the flag on.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import grpc

from pagoda.kv_transfer.params import KVTransferParams
from pagoda.messages import EngineCoreOutput, EngineCoreRequest
from pagoda.services._proto.pagoda.kv_transfer.v1 import kv_transfer_pb2 as kpb
from pagoda.services._proto.pagoda.kv_transfer.v1 import kv_transfer_pb2_grpc as kpb_grpc
from pagoda.services.common.protocol.kv_transfer import kv_params_from_proto
from pagoda.services.gateway.disagg.prefill_decode import handshake_problem
from pagoda.services.gateway.observability.metrics import gateway_metrics
from pagoda.services.gateway.routing.router import Route, RouteRequest, weighted_cached_tokens

logger = logging.getLogger(__name__)
# Fewest blocks worth a pull. On the CPU above 2 blocks already pay, by 15 ms; 4 leaves
# prefixes under 64 tokens (a saving of a few ms) to local compute, so the source's
# worker is not made to read out blocks for next to nothing.
DEFAULT_MIN_BLOCKS = 4
# How long a request waits for the source's lease before its replica computes the
# prompt itself; the lease is taken on the source's engine thread, between its steps.
LEASE_TIMEOUT_S = 1.0
# ... when the source may onload part of the prefix from its host/disk tier first
# (every lease but a LoRA or multimodal request's): the onload runs in the background
# between the source's steps (64 host blocks: 31-46 ms of copies on a busy 2-core CPU; a
# disk record a read more), then one token is computed; past this the replica computes
# the prompt (and the source aborts the onload). A lease the device holds answers as
# fast as before: only a stuck source costs the longer wait.
TIER_LEASE_TIMEOUT_S = 3.0
RELEASE_TIMEOUT_S = 5.0
CONSUMER_ROLES = ("kv_consumer", "kv_both")
SOURCE_ROLES = ("kv_producer", "kv_both")  # the roles serving KvLeaseService


def add_prefix_pull_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv-prefix-pull", action="store_true",
                        help="Cluster-wide prefix cache: when the prefix index says another "
                             "replica holds at least --kv-prefix-pull-min-blocks more leading "
                             "blocks of a prompt than the replica it is routed to, that "
                             "replica pulls them worker to worker instead of computing them "
                             "(any failure: it computes them). Measured on a 2-core CPU with "
                             "SmolLM2-135M: a 512/1024/2048-token prefix pulled answers in "
                             "0.08/0.10/0.16 s against 0.35/0.76/2.07 s recomputed "
                             "(benchmarks/bench_prefix_pull.py); measure on a GPU first.")
    parser.add_argument("--kv-prefix-pull-min-blocks", type=_positive_int,
                        default=DEFAULT_MIN_BLOCKS,
                        metavar="N",
                        help="Fewest blocks a --kv-prefix-pull pulls (default "
                             f"{DEFAULT_MIN_BLOCKS}; fewer are computed locally).")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1; got {value}")
    return value


def prefix_pull_flags(args: argparse.Namespace) -> list[str]:
    """The gateway's flags as `pagoda serve` was given them (none when off)."""
    if not args.kv_prefix_pull:
        return []
    return ["--kv-prefix-pull", "--kv-prefix-pull-min-blocks",
            str(args.kv_prefix_pull_min_blocks)]


@dataclass(frozen=True)
class PrefixPullOptions:
    enabled: bool = False
    min_blocks: int = DEFAULT_MIN_BLOCKS

    def __post_init__(self) -> None:
        if self.min_blocks < 1:
            raise ValueError(f"--kv-prefix-pull-min-blocks must be >= 1; got {self.min_blocks}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "PrefixPullOptions":
        return cls(args.kv_prefix_pull, args.kv_prefix_pull_min_blocks)


@dataclass(frozen=True)
class PullChoice:
    """Lease `num_blocks` leading blocks from `source`; the target holds `num_held`.
    The source holds the first `num_device` on its device, the rest in its host/disk
    KV tiers (onloaded there before the lease: `from_tier`)."""

    source: object  # peers.SchedulerReplica
    num_blocks: int
    num_held: int
    num_device: int | None = None  # None: all of them

    @property
    def from_tier(self) -> bool:
        return self.num_device is not None and self.num_device < self.num_blocks


def can_consume(replica) -> bool:
    info = replica.info
    return info is not None and info.kv_role in CONSUMER_ROLES and bool(info.kv_layout.layout)


def can_lease(replica, target) -> bool:
    """`replica` serves, has a lease service and may hand blocks to `target`."""
    info = replica.info
    return (replica.serving and info is not None and not replica.removed
            and replica.hashes_agree is True and info.kv_role in SOURCE_ROLES
            and bool(info.kv_layout.layout) and replica.address != target.address
            and handshake_problem(info, target.info) is None)


def choose_source(replicas, route: Route, num_prompt_tokens: int, min_blocks: int,
                  weights: dict[str, float] | None = None,
                  from_tiers: bool = True) -> PullChoice | None:
    """The replica holding the most leading blocks of the routed prompt, when it holds
    at least `min_blocks` more than the routed replica (of the blocks the request can
    use: never the one holding the prompt's last token, which is always computed).
    Every run is counted as the router counts it: its device blocks whole, then its
    host/disk-tier blocks at their medium's weight (`weights`, default the router's
    `--kv-medium-weights`: an onload, below a device hit, above a recompute), the
    routed replica's own tier run as what it holds, a source's as what it offers (it
    onloads them before leasing: kv_tier_lease.py). `from_tiers` False (a LoRA
    request, whose onload would have to run its adapter there): a source offers only
    its device run."""
    target, prefix = route.replica, route.prefix
    if prefix is None or not can_consume(target):
        return None
    block_size = target.info.block_size
    weights = weights or prefix.medium_weights
    usable = min(len(prefix.block_hashes), (num_prompt_tokens - 1) // block_size)

    def worth(instance_id: str, tiers: bool) -> tuple[float, int, int]:
        """(blocks at the medium weights, blocks, of them on the device)."""
        device = prefix.cached_blocks.get(instance_id, 0)
        host, disk = prefix.tier_blocks.get(instance_id, (0, 0)) if tiers else (0, 0)
        weighted = weighted_cached_tokens(num_prompt_tokens, device, host, disk, block_size,
                                          weights) / block_size
        return weighted, min(device + host + disk, usable), min(device, usable)

    held = min(usable, math.ceil(worth(target.instance_id, True)[0]))
    best, best_worth, best_blocks, best_device = None, 0.0, 0, 0
    for replica in replicas:
        weighted, blocks, device = worth(replica.instance_id, from_tiers)
        if weighted > best_worth and can_lease(replica, target):
            best, best_worth, best_blocks, best_device = replica, weighted, blocks, device
    if best is None or best_worth - held < min_blocks:
        return None
    return PullChoice(best, best_blocks, held, best_device)


def _count(result: str) -> None:
    gateway_metrics().kv_prefix_pulls.labels(result).inc()


def _count_tier(result: str) -> None:
    """A lease asked of a source's KV tiers counts in both counters."""
    _count(result)
    gateway_metrics().kv_prefix_tier_pulls.labels(result).inc()


class PrefixPull:
    """The gateway's one prefix puller (kept on its Peers while --kv-prefix-pull).
    Invariant: every lease it takes is released by `release_soon` once its choice ends."""

    def __init__(self, peers, options: PrefixPullOptions) -> None:
        self.peers = peers
        self.options = options
        self._stubs: dict[str, kpb_grpc.KvLeaseServiceStub] = {}
        self._releases: set[asyncio.Task] = set()  # referenced until done

    def wrap(self, route: Route, request: RouteRequest):
        """The routed replica, as a `PrefixPullReplica` when a pull is worth trying."""
        choice = choose_source(self.peers.schedulers, route, len(request.prompt_token_ids),
                               self.options.min_blocks,
                               from_tiers=request.lora_request is None)
        if choice is None:
            return route.replica
        return PrefixPullReplica(self, route.replica, choice, route.prefix.block_hashes,
                                 list(request.prompt_token_ids))

    def _stub(self, replica) -> kpb_grpc.KvLeaseServiceStub:
        stub = self._stubs.get(replica.address)
        if stub is None:
            stub = self._stubs[replica.address] = kpb_grpc.KvLeaseServiceStub(replica.channel)
        return stub

    async def lease(self, choice: PullChoice, block_hashes: list[bytes],
                    request: EngineCoreRequest) -> KVTransferParams | None:
        """The source's lease on the leading blocks (do_remote_prefill set), or None."""
        n, source = choice.num_blocks, choice.source
        # Asked of the source's tiers whenever the request allows it, not only when the
        # index says so: the index may still count as device blocks what the source has
        # evicted since (a recent route), which its tier then serves. A LoRA request
        # (its onload would run the adapter there) and a multimodal one (its blocks
        # hash its media too) ask for the device run only.
        from_tier = request.lora_request is None and not request.mm_features
        count = _count_tier if choice.from_tier else _count
        try:
            reply = await self._stub(source).LeasePrefix(kpb.LeasePrefixRequest(
                request_id=f"{request.request_id}.prefix", block_hashes=block_hashes[:n],
                token_ids=request.prompt_token_ids[:n * source.info.block_size],
                min_blocks=choice.num_held + self.options.min_blocks,
                from_tier=from_tier, cache_salt=request.cache_salt or ""),
                timeout=TIER_LEASE_TIMEOUT_S if from_tier else LEASE_TIMEOUT_S)
        except grpc.RpcError as exc:
            logger.info("request %s: no prefix lease from %s (%s: %s); computing the prompt",
                        request.request_id, source.address, exc.code().name, exc.details())
            count("lease_failed")
            return None
        if not reply.HasField("kv_transfer_params"):
            count("too_few_blocks")  # evicted there since the index said otherwise
            return None
        params = kv_params_from_proto(reply.kv_transfer_params)
        params.do_remote_prefill = True
        (_count_tier if reply.num_tier_blocks else _count)("leased")
        return params

    def release_soon(self, choice: PullChoice, params: KVTransferParams) -> None:
        """Release a lease without waiting (idempotent at the source)."""
        stub = self._stub(choice.source)

        async def release() -> None:
            try:
                await stub.ReleaseLease(kpb.ReleaseLeaseRequest(
                    lease_id=params.lease_id, epoch=params.remote_epoch),
                    timeout=RELEASE_TIMEOUT_S)
            except grpc.RpcError:
                pass  # the source is gone or busy: its reaper frees the blocks

        task = asyncio.get_running_loop().create_task(release())
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)


class PrefixPullReplica:
    """The routed replica, whose first fresh request for the routed prompt carries a
    lease on the blocks another replica holds. Other requests pass through unchanged:
    a P/D decode (it has its prefill's params), a resumed or pooling request, one
    scoring its prompt (prompt_logprobs: no prefix-cache hit), another prompt of a
    batch, and the other choices of n > 1 (one lease per routed prompt)."""

    def __init__(self, pull: PrefixPull, replica, choice: PullChoice,
                 block_hashes: list[bytes], prompt_token_ids: list[int]) -> None:
        self.pull = pull
        self.replica = replica
        self.choice = choice
        self.block_hashes = block_hashes
        self.prompt_token_ids = prompt_token_ids
        self.used = False

    def __getattr__(self, name):
        return getattr(self.replica, name)

    def _wants_pull(self, request: EngineCoreRequest) -> bool:
        return (not self.used and request.kv_transfer_params is None
                and not request.output_token_ids and request.pooling_params is None
                and request.sampling_params.prompt_logprobs is None
                and list(request.prompt_token_ids) == self.prompt_token_ids)

    async def generate(self, request: EngineCoreRequest) -> AsyncIterator[EngineCoreOutput]:
        params = None
        if self._wants_pull(request):
            self.used = True
            params = await self.pull.lease(self.choice, self.block_hashes, request)
        if params is None:
            async for out in self.replica.generate(request):
                yield out
            return
        try:
            async for out in self.replica.generate(replace(request, kv_transfer_params=params)):
                yield out
        finally:
            self.pull.release_soon(self.choice, params)
