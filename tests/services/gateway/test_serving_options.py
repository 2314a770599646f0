"""vLLM's serving flags in the gateway: what each changes, and how `pagoda serve` passes them."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from pagoda.services.cli.main import build_parser
from pagoda.services.gateway.errors import APIError
from pagoda.services.gateway.openai.request_models import ChatCompletionRequest
from pagoda.services.gateway.serving_options import (ServingOptions, gateway_flags, route_path,
                                                     uvicorn_kwargs)


def parse(argv):
    return build_parser().parse_args(argv)


def test_generation_defaults_fill_only_unset_fields(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        '{"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 50}')
    options = ServingOptions()
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], top_p=0.5)
    assert options.fill_defaults(body, None, [10], str(tmp_path), 100) == 50
    assert (body.temperature, body.top_p) == (0.6, 0.5)  # the request's own value stays
    assert options.fill_defaults(body, None, [80], str(tmp_path), 100) == 20  # context left
    assert options.fill_defaults(body, 7, [10], str(tmp_path), 100) == 7  # asked for
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}])
    assert ServingOptions(generation_config="vllm").fill_defaults(
        body, None, [10], str(tmp_path), 100) is None
    assert body.temperature is None


def test_max_logprobs_limit():
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], logprobs=True,
                                 top_logprobs=5)
    with pytest.raises(APIError, match="maximum allowed, 3") as info:
        body.check_common(3)
    assert info.value.param == "logprobs"
    body.check_common(-1)  # no limit
    body.check_common(5)


def test_serve_passes_the_serving_flags_to_the_gateway():
    argv = ["--max-logprobs", "4", "--enable-prompt-tokens-details",
            "--enable-force-include-usage", "--enable-log-requests", "--max-log-len", "9",
            "--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem", "--root-path", "/p",
            "--uvicorn-log-level", "debug", "--generation-config", "vllm"]
    flags = gateway_flags(parse(["serve", *argv]))
    gateway = parse(["gateway", *flags])
    served = parse(["gateway", *argv])
    for name in ("max_logprobs", "enable_prompt_tokens_details", "enable_force_include_usage",
                 "enable_log_requests", "max_log_len", "ssl_keyfile", "ssl_certfile",
                 "root_path", "uvicorn_log_level", "generation_config"):
        assert getattr(gateway, name) == getattr(served, name), name
    assert gateway_flags(parse(["serve"])) == []  # defaults are not passed
    assert "--disable-log-requests" not in gateway_flags(parse(["serve",
                                                                "--disable-log-requests"]))


def test_uvicorn_kwargs():
    kwargs = uvicorn_kwargs(parse(["gateway", "--ssl-keyfile", "k", "--ssl-certfile", "c",
                                   "--ssl-cert-reqs", "2", "--root-path", "/p"]))
    assert (kwargs["ssl_keyfile"], kwargs["ssl_certfile"], kwargs["ssl_cert_reqs"],
            kwargs["root_path"], kwargs["log_level"]) == ("k", "c", 2, "/p", "warning")
    assert "ssl_keyfile" not in uvicorn_kwargs(parse(["gateway"]))
    with pytest.raises(ValueError, match="go together"):
        uvicorn_kwargs(parse(["gateway", "--ssl-certfile", "c"]))


def test_route_path_strips_the_root_path():
    assert route_path({"path": "/proxy/v1/models", "root_path": "/proxy"}) == "/v1/models"
    assert route_path({"path": "/v1/models", "root_path": ""}) == "/v1/models"
    assert route_path({"path": "/proxy", "root_path": "/proxy"}) == "/"


def test_request_log_line(caplog):
    options = ServingOptions(enable_log_requests=True, max_log_len=4)
    prompt = SimpleNamespace(text="a long prompt", token_ids=[1, 2, 3, 4, 5, 6])
    with caplog.at_level(logging.INFO, logger="pagoda.services.gateway.requests"):
        options.log_request("cmpl-1", [prompt], "PARAMS")
        ServingOptions().log_request("cmpl-2", [prompt], "PARAMS")  # off by default
    assert [r.getMessage() for r in caplog.records] == [
        "Received request cmpl-1: prompt: 'a lo', params: PARAMS, prompt_token_ids: [1, 2, 3, 4]"]


def test_serve_passes_the_hardening_flags_to_the_gateway_and_the_drain_to_schedulers():
    from pagoda.services.cli.main import build_parser
    from pagoda.services.cli.serve import build_services

    args = build_parser().parse_args([
        "serve", "/models/m", "--migration-limit", "5", "--max-messages", "10",
        "--trust-request-chat-template", "--metrics-require-key", "--shutdown-grace-period",
        "7", "--limit-concurrency", "99", "--drain-timeout", "3"])
    services = {s.name: s.argv for s in build_services(args, "redis://127.0.0.1:1/0")}
    gateway = services["gateway"]
    for flag, value in (("--migration-limit", "5"), ("--max-messages", "10"),
                        ("--shutdown-grace-period", "7.0"), ("--limit-concurrency", "99")):
        assert gateway[gateway.index(flag) + 1] == value
    assert {"--trust-request-chat-template", "--metrics-require-key"} <= set(gateway)
    scheduler = services["scheduler"]
    assert scheduler[scheduler.index("--drain-timeout") + 1] == "3.0"
    options = ServingOptions.from_args(build_parser().parse_args(gateway[3:]))
    assert (options.migration_limit, options.limits.max_messages) == (5, 10)
