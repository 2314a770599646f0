"""/ping, /load, /v1/models/{id} and the instrumentator-named HTTP metrics (over fakes)."""

from __future__ import annotations

import httpx
import openai
import pytest
from api_fakes import MODEL, Gateway
from prometheus_client.parser import text_string_to_metric_families
from serve_cluster import wait_until


def sample(gateway, name: str, **labels) -> float:
    text = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def test_ping_answers_get_and_post_like_health(gateway):
    assert httpx.get(f"{gateway.url}/ping", timeout=10).status_code == 200
    assert httpx.post(f"{gateway.url}/ping", timeout=10).status_code == 200


def test_models_can_be_retrieved_by_id(client):
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model" and model.model_extra["max_model_len"]
    with pytest.raises(openai.NotFoundError, match="does not exist") as err:
        client.models.retrieve("no-such-model")
    assert err.value.body["code"] == 404 and err.value.body["param"] == "model"


def test_load_counts_requests_in_flight(gateway):
    scheduler = gateway.scheduler
    assert httpx.get(f"{gateway.url}/load", timeout=10).json() == {"server_load": 0}
    slow, scheduler.delay_s = scheduler.delay_s, 0.05
    try:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 200, "stream": True}
        with httpx.stream("POST", f"{gateway.url}/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()  # kept: dropping the iterator would close the stream
            next(lines)  # the stream is open: its request is in flight
            assert httpx.get(f"{gateway.url}/load", timeout=10).json() == {"server_load": 1}
    finally:
        scheduler.delay_s = slow
    load = lambda: httpx.get(f"{gateway.url}/load", timeout=10).json()["server_load"]  # noqa: E731
    assert wait_until(lambda: load() == 0, 10)  # the client left: no longer counted


def test_http_metrics_have_the_instrumentators_names(gateway, client):
    chat = dict(handler="/v1/chat/completions", method="POST")
    ok_before = sample(gateway, "http_requests_total", status="2xx", **chat)
    bad_before = sample(gateway, "http_requests_total", status="4xx", **chat)
    hist_before = sample(gateway, "http_request_duration_seconds_count", **chat)
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                   max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    client.models.retrieve(MODEL)
    httpx.get(f"{gateway.url}/no/such/path", timeout=10)
    assert sample(gateway, "http_requests_total", status="2xx", **chat) == ok_before + 1
    assert sample(gateway, "http_requests_total", status="4xx", **chat) == bad_before + 1
    assert sample(gateway, "http_request_duration_seconds_count", **chat) == hist_before + 2
    assert sample(gateway, "http_request_duration_seconds_bucket", le="0.1", **chat) >= 0
    assert sample(gateway, "http_requests_total", handler="/v1/models/{model:path}",
                  method="GET", status="2xx") >= 1
    assert sample(gateway, "http_requests_total", handler="none", method="GET",
                  status="4xx") >= 1  # untemplated paths share one label
    assert sample(gateway, "http_request_duration_highr_seconds_count") > 0
    for probe in ("/health", "/ping", "/load", "/metrics"):  # not counted, as in vLLM
        assert sample(gateway, "http_requests_total", handler=probe) == 0
    # Pagoda's own series stay beside them.
    assert sample(gateway, "pagoda_gateway_http_requests_total", route="/v1/chat/completions",
                  method="POST", status="200") > 0


def test_probes_need_no_api_key(fake_peers):
    gw = Gateway(fake_peers, api_key="sekret")
    try:
        assert httpx.get(f"{gw.url}/ping", timeout=10).status_code == 200
        assert httpx.get(f"{gw.url}/load", timeout=10).status_code == 200
        assert httpx.get(f"{gw.url}/v1/models/{MODEL}", timeout=10).status_code == 401
        assert sample(gw, "http_requests_total", handler="/v1/models/{model:path}",
                      status="4xx") >= 1  # a 401 is counted under its route
    finally:
        gw.stop()
