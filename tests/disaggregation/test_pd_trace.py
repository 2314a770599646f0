"""One trace per disaggregated request: the gateway's prefill and decode phases, and
under the decode replica's Generate the KV pull down to the prefill worker."""

from __future__ import annotations

import secrets

import httpx
import pytest
from serve_cluster import wait_until

pytestmark = pytest.mark.slow
PROMPT = " ".join(f"token{i}" for i in range(60))
FETCH = "pagoda.kv_transfer.v1.KvTransferService/FetchBlocks"
PULL = "pagoda.kv_transfer.v1.KvTransferService/PullBlocks"
GENERATE = "pagoda.scheduler.v1.SchedulerService/Generate"
SERVER, CLIENT = 2, 3  # OTLP span kinds


@pytest.fixture(scope="module")
def collector(pd_collector):
    return pd_collector


@pytest.fixture(scope="module")
def pd(traced_pd_cluster):
    """The session's plain P/D cluster with tracing (conftest.py). start_pd returns once the
    gateway routes prefills to the prefill replica: before its start-up checks pass, a
    request is prefilled locally and its trace has no transfer (a CI failure)."""
    return traced_pd_cluster


def test_prefill_transfer_and_decode_are_one_trace(pd, collector):
    trace_id, parent_id = secrets.token_bytes(16), secrets.token_bytes(8)
    reply = httpx.post(f"{pd.base}/v1/completions", timeout=60,
                       headers={"traceparent": f"00-{trace_id.hex()}-{parent_id.hex()}-01"},
                       json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4})
    assert reply.status_code == 200, reply.text

    def spans():
        found = collector.trace(trace_id)
        names = {s.name for _, s in found}
        wanted = {"pagoda.disagg.prefill", "pagoda.disagg.decode", "kv_transfer.pull", PULL}
        ids = {s.span_id for _, s in found} | {parent_id}
        whole = all(s.parent_span_id in ids for _, s in found)  # every parent exported
        # The prefill worker's PullBlocks server span ends after the decode worker's client
        # span has its answer, so it may be exported a batch later: wait for both (a
        # clean-clone CI run read the trace between the two exports).
        pull_kinds = {s.kind for svc, s in found if s.name == PULL and svc == "pagoda-gpu-worker"}
        both_pulls = pull_kinds >= {SERVER, CLIENT}
        return found if wanted <= names and whole and both_pulls else None

    found = wait_until(spans, 20)
    assert found, sorted({(svc, s.name) for svc, s in collector.trace(trace_id)})
    by_id = {s.span_id: (svc, s) for svc, s in found}

    def parent(name: str, service: str) -> tuple[str, str]:
        _, span = next((svc, s) for svc, s in found if s.name == name and svc == service)
        svc, up = by_id[span.parent_span_id]
        return svc, up.name

    root = ("pagoda-gateway", "POST /v1/completions")
    assert parent("pagoda.disagg.prefill", "pagoda-gateway") == root
    assert parent("pagoda.disagg.decode", "pagoda-gateway") == root
    # Two Generate calls from the gateway: the prefill replica's and the decode replica's.
    assert sum(s.name == GENERATE and svc == "pagoda-gateway" for svc, s in found) == 2
    assert parent("kv_transfer.pull", "pagoda-scheduler") == ("pagoda-scheduler", GENERATE)
    assert parent(FETCH, "pagoda-gpu-worker") == ("pagoda-scheduler", FETCH)
    # The decode worker's PullBlocks call (under its FetchBlocks) reaches the prefill worker.
    pulls = {s.kind: s for svc, s in found if s.name == PULL and svc == "pagoda-gpu-worker"}
    assert set(pulls) == {SERVER, CLIENT}
    assert pulls[SERVER].parent_span_id == pulls[CLIENT].span_id
    assert by_id[pulls[CLIENT].parent_span_id][1].name == FETCH
    pull = next(s for _, s in found if s.name == "kv_transfer.pull")
    attributes = {a.key: a.value for a in pull.attributes}
    full_blocks = reply.json()["usage"]["prompt_tokens"] // 16  # the decode side held none
    assert attributes["pagoda.kv_transfer.blocks"].int_value == full_blocks
    assert attributes["pagoda.kv_transfer.result"].string_value == "ok"
