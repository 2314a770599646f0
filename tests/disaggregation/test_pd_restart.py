"""A prefill replica restarts, with real processes: its scheduler and gpu-worker are
SIGKILLed and started again with the same command lines on the same ports (what
Kubernetes does to a crashed pod; `pagoda serve` itself restarts nothing).

    before ─► kill ─► outage: local prefill ─► restart ─► prefills go there again
    lease + block ids of the dead incarnation ─► refused by epoch ─► computed locally

The client sees the same greedy text in every phase and never an error; nothing the
dead incarnation handed out is pulled (its lease and its blocks are refused by epoch,
and a decode request still carrying them computes the prompt itself); the prefix index
in Redis forgets the old incarnation's lease and blocks once the new one registers; at
the end every block pool is free and Redis holds no lease.
"""

from __future__ import annotations

import signal
import subprocess
from dataclasses import dataclass, replace

import grpc
import openai
import psutil
import pytest
import redis
from pd_cluster import (PREFILL_HEADER, generate, lease_records, metric, role_address,
                        role_process, start_pd, usage)
from serve_cluster import CLI_MODULE, flag_value, wait_until

from pagoda.kv_transfer.params import KVTransferParams
from pagoda.messages import EngineCoreOutput, EngineCoreRequest
from pagoda.parent_death import dying_with_this_process
from pagoda.sampling_params import SamplingParams
from pagoda.services._proto.pagoda.kv_transfer.v1 import kv_transfer_pb2 as kpb
from pagoda.services._proto.pagoda.kv_transfer.v1 import kv_transfer_pb2_grpc as kpb_grpc
from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2 as spb
from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2_grpc as spb_grpc

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # make test-extended
# Far past the test's end: a lease record that leaves Redis was dropped, not expired.
LEASE_TIMEOUT_S = 300
PROMPT = " ".join(f"restart{i}" for i in range(50))
TOKENS = list(range(300, 365))  # four full blocks of 16 and one token
BLOCKS = "pagoda_kv_transfer_blocks_total"  # pulled by decode gpu-workers
FAILURES = "pagoda_kv_transfer_failures_total"  # by reason, at decode schedulers
FALLBACKS = "pagoda_gateway_disagg_fallbacks_total"  # prefilled by the decode side
RESYNCS = "pagoda_kv_index_resyncs_total"  # reason="restart": the index saw a new epoch
DROPS = "pagoda_kv_index_dropped_instances_total"  # reason="heartbeat": silent too long


@pytest.fixture(scope="module")
def pd(tiny_llama_dir, redis_server):
    serve = start_pd(tiny_llama_dir, redis_server.url, "--kv-lease-timeout",
                     str(LEASE_TIMEOUT_S))
    yield serve
    serve.stop()


@pytest.fixture(scope="module")
def store(redis_server):
    return redis.Redis.from_url(redis_server.url)


@pytest.fixture
def pods(tmp_path):
    """(processes the test starts, a folder for their logs); none outlives the test."""
    started: list[subprocess.Popen] = []
    yield started, tmp_path
    descendants = []
    for process in started:
        try:
            descendants += psutil.Process(process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            pass
        if process.poll() is None:
            process.terminate()  # the scheduler deregisters while the index still runs
    for process in started:
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    for child in descendants:
        if child.is_running():
            child.kill()


@dataclass(frozen=True)
class PodSpec:
    """How a process was started: enough to start it again the same way."""

    name: str
    argv: list[str]
    env: dict[str, str]
    cwd: str


def crash(serve, role: str) -> list[PodSpec]:
    """SIGKILL the replica's gpu-worker and scheduler (nothing drained, deregistered or
    released); how each was started."""
    processes = [role_process(serve, kind, role) for kind in ("gpu-worker", "scheduler")]
    specs = [PodSpec(flag_value(p.cmdline(), CLI_MODULE), p.cmdline(), p.environ(), p.cwd())
             for p in processes]
    for process in processes:
        process.kill()
    # A zombie is dead too: `pagoda serve` reaps a retired replica only when it stops.
    assert wait_until(lambda: all(not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
                                  for p in processes), 15)
    return specs


def start_again(spec: PodSpec, started: list[subprocess.Popen], logs) -> None:
    """`spec` started anew by this process (it dies with the test run, if not before)."""
    with open(logs / f"{spec.name}.log", "wb") as log:
        started.append(subprocess.Popen(
            dying_with_this_process(spec.argv, signal.SIGTERM), env=spec.env, cwd=spec.cwd,
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True))


def complete(serve, salt: str) -> tuple[str, str | None]:
    """PROMPT's greedy text through the gateway, and the prefill replica it names. Each
    salt keys its own prefix-cache blocks: no call finds another's KV on either side."""
    client = openai.OpenAI(base_url=serve.url, api_key="x", max_retries=0, timeout=60)
    raw = client.completions.with_raw_response.create(
        model="tiny", prompt=PROMPT, max_tokens=8, temperature=0.0,
        extra_body={"cache_salt": salt, "ignore_eos": True})
    return raw.parse().choices[0].text, raw.headers.get(PREFILL_HEADER)


def prefilled_remotely(serve) -> bool:
    client = openai.OpenAI(base_url=serve.url, api_key="x", max_retries=0, timeout=60)
    raw = client.completions.with_raw_response.create(model="tiny", prompt="hi", max_tokens=1)
    return PREFILL_HEADER in raw.headers


def token_request(request_id: str, max_tokens: int, salt: str, output=(),
                  params: KVTransferParams | None = None) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, list(TOKENS),
                             SamplingParams(max_tokens=max_tokens, temperature=0.0),
                             output_token_ids=list(output), cache_salt=salt,
                             kv_transfer_params=params)


def tokens(outputs: list[EngineCoreOutput]) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


def epoch(address: str) -> str | None:
    """The scheduler's epoch (one per process start), None while it does not answer."""
    try:
        with grpc.insecure_channel(address) as channel:
            return spb_grpc.SchedulerServiceStub(channel).GetModelInfo(
                spb.GetModelInfoRequest(), timeout=2).epoch
    except grpc.RpcError:
        return None


def index_epoch(store, instance_id: str) -> str | None:
    """The epoch the kv-cache-manager's index holds for an instance."""
    keys = store.keys(f"pagoda:kv:*:inst:{instance_id}:meta")
    return store.hget(keys[0], "epoch").decode() if len(keys) == 1 else None


def indexed(store, instance_id: str, block_hashes: list[bytes]) -> int:
    """How many of `block_hashes` the index says the instance holds (where routing and
    prefix pulls would look for them)."""
    return sum(store.sismember(key, h.hex()) for key in
               store.keys(f"pagoda:kv:*:inst:{instance_id}:blocks") for h in block_hashes)


def index_counts(serve) -> tuple[float, float]:
    """(instances the index saw restart, silent instances it dropped)."""
    return metric(serve, RESYNCS, reason="restart"), metric(serve, DROPS, reason="heartbeat")


def live_leases(address: str) -> list[str]:
    with grpc.insecure_channel(address) as channel:
        return list(kpb_grpc.KvLeaseServiceStub(channel).ListLeases(
            kpb.ListLeasesRequest(), timeout=10).lease_ids)


def assert_refused(old: KVTransferParams, scheduler: str, worker: str) -> None:
    """The replica at these addresses neither releases `old`'s lease nor serves its
    blocks: they belong to another epoch."""
    with grpc.insecure_channel(scheduler) as channel:
        assert not kpb_grpc.KvLeaseServiceStub(channel).ReleaseLease(
            kpb.ReleaseLeaseRequest(lease_id=old.lease_id, epoch=old.remote_epoch),
            timeout=10).valid
    with grpc.insecure_channel(worker) as channel:
        with pytest.raises(grpc.RpcError) as err:
            list(kpb_grpc.KvTransferServiceStub(channel).PullBlocks(kpb.PullBlocksRequest(
                block_ids=old.remote_block_ids, epoch=old.remote_worker_epoch,
                lease_id=old.lease_id), timeout=10))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_a_restarted_prefill_replica_serves_again_and_its_old_transfers_are_refused(
        pd, store, pods):
    started, logs = pods
    prefill = role_address(pd, "scheduler", "kv_producer")
    prefill_worker = role_address(pd, "gpu-worker", "kv_producer")
    decode = role_address(pd, "scheduler", "kv_consumer")
    old_epoch = epoch(prefill)

    # Before: prefilled there, pulled by the decode replica.
    pulled = metric(pd, BLOCKS)
    want, instance = complete(pd, "before")
    assert instance == prefill
    assert wait_until(lambda: metric(pd, BLOCKS) > pulled, 30)
    reference = tokens(generate(prefill, token_request("reference", 6, "reference")))
    old = generate(prefill, token_request("old-lease", 1, "stale", params=KVTransferParams(
        do_remote_decode=True)))[-1].kv_transfer_params
    assert old is not None and old.lease_id and old.remote_epoch == old_epoch
    assert wait_until(lambda: old.lease_id in lease_records(store), 10)
    assert wait_until(lambda: indexed(store, prefill, old.block_hashes) == 4, 10)

    # Down: the decode replica prefills locally; the client sees the same text.
    index_changes = index_counts(pd)
    specs = crash(pd, "kv_producer")
    fallbacks = metric(pd, FALLBACKS)
    assert complete(pd, "outage")[0] == want
    assert metric(pd, FALLBACKS) > fallbacks

    # Back: a new incarnation on the same ports; the gateway prefills there again.
    for spec in specs:
        start_again(spec, started, logs)
    new_epoch = wait_until(lambda: epoch(prefill), 60)
    assert new_epoch and new_epoch != old_epoch, [
        (p.poll(), (logs / f"{s.name}.log").read_text()[-2000:]) for p, s in zip(started, specs)]
    assert wait_until(lambda: prefilled_remotely(pd), 30)
    # The index knows the new incarnation, and forgot the old one's lease and blocks.
    assert wait_until(lambda: index_epoch(store, prefill) == new_epoch, 10)
    assert old.lease_id not in lease_records(store)
    assert indexed(store, prefill, old.block_hashes) == 0
    # Once: as a new epoch of the instance (the lease dropped with the old one's entries),
    # or, if the new one took longer than the index's heartbeat timeout to start, as a
    # silent instance dropped before the new one registered.
    assert wait_until(lambda: sum(index_counts(pd)) == sum(index_changes) + 1, 10)
    pulled, fallbacks = metric(pd, BLOCKS), metric(pd, FALLBACKS)
    assert complete(pd, "after") == (want, prefill)
    assert wait_until(lambda: metric(pd, BLOCKS) > pulled, 30)  # from the new incarnation
    assert metric(pd, FALLBACKS) == fallbacks

    # The dead incarnation's lease and blocks are refused by epoch, so a decode request
    # still carrying them computes the prompt itself.
    assert_refused(old, prefill, prefill_worker)
    stale, pulled = metric(pd, FAILURES, reason="stale_epoch"), metric(pd, BLOCKS)
    outputs = generate(decode, token_request("with-old-lease", 6, "stale", reference[:1],
                                             replace(old, do_remote_prefill=True)))
    assert reference[:1] + tokens(outputs) == reference
    assert wait_until(lambda: metric(pd, FAILURES, reason="stale_epoch") == stale + 1, 30)
    assert metric(pd, BLOCKS) == pulled

    # Every block back in both pools (cached blocks count as free), no lease anywhere.
    def state():
        return (usage(prefill), usage(decode), live_leases(prefill), lease_records(store))

    assert wait_until(lambda: state() == (0, 0, [], {}), 15), state()
