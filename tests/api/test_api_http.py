"""API keys, CORS, X-Request-Id and served-model-name aliases (gateway + fakes)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from api_fakes import MAX_MODEL_LEN, Gateway

from pagoda.services.cli.main import build_parser
from pagoda.services.gateway.web.cors_request_id import HttpOptions, http_flags, parse_list

KEY = "sekret-key"
ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def guarded(fake_peers):
    """A gateway with an API key, two served names and one allowed CORS origin."""
    gw = Gateway(fake_peers, api_key=KEY, served_model_names=["alias-a", "alias-b"],
                 http_options=HttpOptions(allowed_origins=[ORIGIN]))
    yield gw
    gw.stop()


def test_api_key_is_required_on_v1_only(guarded):
    url = guarded.url
    assert httpx.get(f"{url}/v1/models").status_code == 401
    r = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == 401
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": KEY}).status_code == 401
    assert httpx.get(f"{url}/v1/models",
                     headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    for open_path in ("/health", "/metrics", "/version"):
        assert httpx.get(f"{url}{open_path}").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    ok = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    assert ok.completions.create(model="alias-a", prompt="Hi", max_tokens=2).choices[0].text


def test_api_key_flag_defaults_to_the_environment(monkeypatch):
    monkeypatch.setenv("PAGODA_API_KEY", "from-env")
    for command in (["gateway"], ["serve"]):
        assert build_parser().parse_args(command).api_key == "from-env"


def test_served_model_name_aliases(guarded):
    client = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key=KEY, max_retries=0)
    models = client.models.list().data
    assert [m.id for m in models] == ["alias-a", "alias-b"]
    assert all(m.model_extra["max_model_len"] == MAX_MODEL_LEN for m in models)
    for name in ("alias-a", "alias-b"):
        out = client.chat.completions.create(model=name, max_tokens=2, messages=[
            {"role": "user", "content": "Hi"}])
        assert out.model == name
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="fake-model", prompt="Hi", max_tokens=2)


def test_cors_preflight_and_headers(guarded):
    url = f"{guarded.url}/v1/chat/completions"
    preflight = httpx.options(url, headers={"Origin": ORIGIN,
                                            "Access-Control-Request-Method": "POST",
                                            "Access-Control-Request-Headers": "authorization"})
    assert preflight.status_code == 200  # no API key needed to ask
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    denied = httpx.options(url, headers={"Origin": "https://evil.example",
                                         "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in denied.headers
    r = httpx.get(f"{guarded.url}/v1/models", headers={"Origin": ORIGIN})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN
    assert "x-request-id" in r.headers["access-control-expose-headers"].lower()


def test_default_cors_allows_any_origin(gateway):
    r = httpx.get(f"{gateway.url}/v1/models", headers={"Origin": "https://anywhere.example"})
    assert r.headers["access-control-allow-origin"] == "*"


def test_cors_flags_parse_and_forward():
    assert parse_list('["https://a", "https://b"]') == parse_list("https://a, https://b")
    args = build_parser().parse_args(["serve", "--allowed-origins", "https://a",
                                      "--allow-credentials"])
    assert http_flags(args) == ["--allowed-origins", '["https://a"]', "--allow-credentials"]
    gateway_args = build_parser().parse_args(["gateway", *http_flags(args)])
    assert HttpOptions.from_args(gateway_args) == HttpOptions(["https://a"], ["*"], ["*"], True)
    assert http_flags(build_parser().parse_args(["serve"])) == []
    with pytest.raises(SystemExit):
        build_parser().parse_args(["gateway", "--allowed-origins", "[1, 2]"])


@pytest.mark.parametrize("stream", [False, True])
def test_x_request_id_is_honoured_and_echoed(gateway, stream):
    body = {"model": "fake-model", "prompt": "Hi", "max_tokens": 2, "stream": stream}
    headers = {"X-Request-Id": "my-req-42"}

    def call() -> tuple[str, str]:
        with httpx.stream("POST", f"{gateway.url}/v1/completions", json=body, headers=headers,
                          timeout=30) as r:
            text = r.read().decode()
            return r.headers["x-request-id"], text

    with ThreadPoolExecutor(2) as pool:  # the same id twice at once must not collide
        results = list(pool.map(lambda _: call(), range(2)))
    for echoed, text in results:
        assert echoed == "my-req-42" and '"id":"cmpl-my-req-42"' in text.replace(" ", "")
    assert gateway.scheduler.requests[-1].request_id.startswith("cmpl-my-req-42-")


def test_request_id_is_made_up_when_absent_or_unusable(gateway):
    r = httpx.post(f"{gateway.url}/v1/completions",
                   json={"model": "fake-model", "prompt": "Hi", "max_tokens": 1})
    assert r.json()["id"] == f"cmpl-{r.headers['x-request-id']}"
    bad = httpx.post(f"{gateway.url}/v1/completions", headers={"X-Request-Id": "has spaces"},
                     json={"model": "fake-model", "prompt": "Hi", "max_tokens": 1})
    assert bad.headers["x-request-id"] != "has spaces" and bad.status_code == 200
    error = httpx.post(f"{gateway.url}/v1/completions", headers={"X-Request-Id": "e-1"},
                       json={"prompt": ""})
    assert error.status_code == 400 and error.headers["x-request-id"] == "e-1"
