"""Faults in prefill/decode transfers and in grammars, with real processes: each ends in
the reference answer (the offline float32 engine's tokens and logprobs) or a clean
error, never in another answer (issue 26, item 3).

One `pagoda serve --prefill-replicas 1 --decode-replicas 1` cluster serves every case;
faults are switched on and off in its processes through pagoda/fault_injection.py
(PAGODA_FAULT_INJECT names a file the test rewrites). Each KV case uses a prompt of its
own (20 full blocks: two pull batches of 16), so the decode replica pulls it whole.

    the pull breaks after 17 blocks (16 written into the decode cache)   -> reference
    the pull ends cleanly, short, after 17 blocks                        -> reference
    the lease expires mid-pull and its blocks are reused by other prompts -> reference
    the source worker is set up again between lease and pull / mid-pull  -> reference
    the grammar compile fails (both replicas, the prefill or the decode one only)
        -> an OpenAI error (400) naming the failed compile, never a bare "abort"
        finish a client could take for an answer; once the fault is gone the same
        constraint compiles again and answers the reference
    a decode worker's fetch starts after its scheduler stopped waiting for it
        -> reference, and nothing is written into the blocks the scheduler gave away
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest
from disaggregation.pd_cluster import generate, metric, role_address, start_pd
from fault_cases import FaultFile, Reference, assert_reference, prompt, served
from serve_cluster import wait_until

from pagoda.messages import EngineCoreRequest
from pagoda.sampling_params import SamplingParams
from pagoda.services._proto.pagoda.kv_transfer.v1 import kv_transfer_pb2 as kpb
from pagoda.services._proto.pagoda.kv_transfer.v1 import kv_transfer_pb2_grpc as kpb_grpc
from pagoda.services.common.redis_server import PrivateRedis
from pagoda.services.scheduler.kv_consumer import FETCH_GRACE_S

# Part of `make test-matrix` (PAGODA_MATRIX=full): a P/D cluster and nine faults, ~2.5 min.
pytestmark = [pytest.mark.matrix, pytest.mark.matrix_full, pytest.mark.slow]
LEASE_TIMEOUT_S = 3.0
# A stall long enough for the lease to lapse, be reaped and its blocks be reused (or for
# the source's worker to be set up again) before the pull goes on.
STALL_S = 8.0
TRANSFER_TIMEOUT_S = STALL_S + 4
# A fetch that starts this late has outlived its scheduler's wait for it
# (--kv-transfer-timeout + kv_consumer.FETCH_GRACE_S), with time to spare.
LATE_S = TRANSFER_TIMEOUT_S + FETCH_GRACE_S + 4
POOL_BLOCKS = 64  # per replica: 4 prompts of 21 blocks reuse every block
FAILURES = "pagoda_kv_transfer_failures_total"
REGEX = r"[a-z]{2,4}-\d{2}"


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    return FaultFile(str(tmp_path_factory.mktemp("faults") / "faults.json"))


@pytest.fixture(scope="module")
def pd(tiny_llama_dir, faults):
    with PrivateRedis() as redis:
        serve = start_pd(tiny_llama_dir, redis.url, "--kv-lease-timeout", str(LEASE_TIMEOUT_S),
                         "--kv-transfer-timeout", str(TRANSFER_TIMEOUT_S),
                         "--num-gpu-blocks-override", str(POOL_BLOCKS), env=faults.env)
        try:
            yield serve
        finally:
            serve.stop()  # its prefill worker failed a step on purpose: no exit code to check


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    return Reference(tiny_llama_dir)


@pytest.fixture(autouse=True)
def no_fault_left(faults):
    faults.arm()
    yield
    faults.arm()


def client(serve) -> openai.OpenAI:
    return openai.OpenAI(base_url=serve.url, api_key="x", max_retries=0, timeout=120)


def failures(pd, reason: str) -> float:
    return metric(pd, FAILURES, reason=reason)


def injected(pd, point: str) -> int:
    """Faults fired at `point` so far, from the cluster's log."""
    return sum(f"fault injected at {point}:" in line for line in pd.log)


def wait_counted(pd, reason: str, before: float) -> None:
    """A failure for `reason` was counted (the gateway merges its peers' /metrics as it
    scrapes them; the prefill side's reaper counts lease_expired too)."""
    assert wait_until(lambda: failures(pd, reason) > before, 20), \
        (reason, before, failures(pd, reason))


def producer_leases(pd) -> list[str]:
    with grpc.insecure_channel(role_address(pd, "scheduler", "kv_producer")) as channel:
        return list(kpb_grpc.KvLeaseServiceStub(channel).ListLeases(
            kpb.ListLeasesRequest(), timeout=10).lease_ids)


def prefill_directly(pd, request_id: str, prompt_ids: list[int]) -> None:
    """A plain request straight to the prefill replica (no lease): its blocks go through
    the prefill worker's cache."""
    request = EngineCoreRequest(request_id, prompt_ids,
                                SamplingParams(max_tokens=1, temperature=0.0), eos_token_ids=[0])
    assert generate(role_address(pd, "scheduler", "kv_producer"), request)[-1].finished


def in_background(fn, *args):
    pool = ThreadPoolExecutor(1)
    future = pool.submit(fn, *args)
    pool.shutdown(wait=False)
    return future


@pytest.mark.parametrize("action,case,reason", [("fail", 1, "unavailable"),
                                                ("truncate", 2, "checksum")])
def test_a_pull_that_breaks_half_way_is_recomputed(pd, faults, reference, action, case, reason):
    want = reference.answer(prompt(case))
    before = failures(pd, reason)
    # Blocks 0-15 are written into the decode replica's cache, block 16 is sent, then
    # the stream breaks (fail) or ends short (truncate).
    faults.arm({"point": "kv_pull.block", "action": action, "after": 17,
                "process": "kv_producer"})
    assert_reference(served(client(pd), prompt(case)), want)
    assert injected(pd, "kv_pull.block") >= 1
    wait_counted(pd, reason, before)


def test_a_lease_that_expires_mid_pull_is_recomputed(pd, faults, reference):
    case = 3
    want = reference.answer(prompt(case))
    before = failures(pd, "lease_expired")
    stalls = injected(pd, "kv_pull.block")
    # The pull stalls before the second batch is read; meanwhile the lease lapses, the
    # reaper frees its blocks and other prompts overwrite them: what is read after the
    # stall is other KV, which the decode side must not keep.
    faults.arm({"point": "kv_pull.block", "action": "delay", "seconds": STALL_S,
                "after": 16, "process": "kv_producer"})
    answer = in_background(served, client(pd), prompt(case))
    assert wait_until(lambda: injected(pd, "kv_pull.block") > stalls, 30)
    stalled_at = time.monotonic()
    assert wait_until(lambda: not producer_leases(pd), LEASE_TIMEOUT_S + 3)
    for i in range(4):
        prefill_directly(pd, f"churn-{i}", prompt(100 + i))
    assert time.monotonic() - stalled_at < STALL_S, "the churn ended after the stall"
    assert_reference(answer.result(timeout=120), want)
    wait_counted(pd, "lease_expired", before)


@pytest.mark.parametrize("point,after,case", [("kv_pull.start", 0, 4),
                                              ("kv_pull.block", 16, 5)])
def test_a_source_set_up_again_before_or_during_the_pull_is_recomputed(
        pd, faults, reference, point, after, case):
    """The prefill worker fails a step while a lease is out (its scheduler then sets
    the KV cache up again as zeros, ends every lease, and the worker serves under a
    new epoch: what a restarted source looks like to the decode side)."""
    want = reference.answer(prompt(case))
    before = failures(pd, "stale_epoch")
    stalls = injected(pd, point)
    faults.arm({"point": point, "action": "delay", "seconds": STALL_S, "after": after,
                "process": "kv_producer"})
    answer = in_background(served, client(pd), prompt(case))
    assert wait_until(lambda: injected(pd, point) > stalls, 30)
    faults.arm({"point": "worker.step", "action": "fail", "process": "kv_producer"})
    # This request's step fails; the scheduler recovers and runs it again, alone.
    prefill_directly(pd, f"reset-{case}", prompt(200 + case))
    assert injected(pd, "worker.step") >= 1
    assert_reference(answer.result(timeout=120), want)
    wait_counted(pd, "stale_epoch", before)


@pytest.mark.parametrize("process,case", [("", 6), ("kv_consumer", 7), ("kv_producer", 10)])
def test_a_grammar_that_fails_to_compile_is_an_error_then_compiles_again(
        pd, faults, reference, process, case):
    """A compile that fails on either replica (or both) ends the request in an OpenAI
    error naming the cause, never in a bare abort the client could take for an answer."""
    structured = {"regex": REGEX + f"{case}"}  # a constraint no other case compiled
    want = reference.answer(prompt(case), structured)
    assert want.finish_reason == "stop"
    faults.arm({"point": "grammar.compile", "action": "fail", "times": 0, "process": process})
    with pytest.raises(openai.BadRequestError, match="grammar failed to compile"):
        served(client(pd), prompt(case), structured)
    faults.arm()
    assert_reference(served(client(pd), prompt(case), structured), want)


def test_a_fetch_its_scheduler_gave_up_on_writes_nothing(pd, faults, reference):
    """The decode worker starts a fetch after its scheduler stopped waiting for it (its
    thread pool was busy): the scheduler has recomputed the prompt and handed the
    fetch's target blocks to other requests, so the fetch must not write into them."""
    case, victim = 8, prompt(9, POOL_BLOCKS - 4)  # the victim needs nearly every block
    want, want_victim = reference.answer(prompt(case)), reference.answer(victim)
    before = failures(pd, "timeout")
    faults.arm({"point": "kv_fetch.start", "action": "delay", "seconds": LATE_S,
                "process": "kv_consumer"})
    started = time.monotonic()
    assert_reference(served(client(pd), prompt(case)), want)
    wait_counted(pd, "timeout", before)
    faults.arm()
    assert_reference(served(client(pd), victim), want_victim)  # holds the target blocks
    assert time.monotonic() - started < LATE_S, "the victim ended after the late fetch"
    time.sleep(max(0.0, started + LATE_S + 2 - time.monotonic()))  # the fetch has run
    # Again, from the decode replica's prefix cache: the victim's blocks as they are now.
    assert_reference(served(client(pd), victim), want_victim)
