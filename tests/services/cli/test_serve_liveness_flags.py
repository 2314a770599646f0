"""`pagoda serve` passes how a frozen peer is found to the services that find it:
the keepalive flags to every service, the step deadline to the schedulers, the bound on
a silent token stream to the gateway, and the chat template limits to the tokenizer; with the defaults, none of them (each service's
own defaults are the same)."""

from __future__ import annotations

import argparse

from pagoda.services.cli.main import build_parser
from pagoda.services.cli.serve import build_services


def serve_args(*flags: str) -> argparse.Namespace:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices["serve"].parse_args(["/models/m", "-dp", "2", *flags])


def services(*flags: str) -> dict[str, list[str]]:
    return {s.name: s.argv for s in build_services(serve_args(*flags), "redis://127.0.0.1:1/0")}


def value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_serve_passes_the_liveness_flags_to_the_services_that_use_them():
    argvs = services("--grpc-keepalive-time", "2", "--grpc-keepalive-timeout", "3",
                     "--execute-model-timeout", "120", "--generate-read-timeout", "60",
                     "--chat-template-render-timeout", "0.5",
                     "--chat-template-max-output-chars", "2000")
    assert set(argvs) == {"kv-cache-manager", "tokenizer-0", "tokenizer-1", "gpu-worker-0",
                          "scheduler-0",
                          "gpu-worker-1", "scheduler-1", "gateway"}
    for name, argv in argvs.items():
        assert (value(argv, "--grpc-keepalive-time"), value(argv, "--grpc-keepalive-timeout")
                ) == ("2", "3"), name
        has_deadline = name.startswith("scheduler")
        assert ("--execute-model-timeout" in argv) == has_deadline, name
        assert ("--chat-template-render-timeout" in argv) == name.startswith("tokenizer"), name
        assert ("--generate-read-timeout" in argv) == (name == "gateway"), name
    assert value(argvs["gateway"], "--generate-read-timeout") == "60"
    assert value(argvs["scheduler-1"], "--execute-model-timeout") == "120"
    for name in ("tokenizer-0", "tokenizer-1"):
        assert value(argvs[name], "--chat-template-render-timeout") == "0.5"
        assert value(argvs[name], "--chat-template-max-output-chars") == "2000"


def test_the_defaults_add_no_flag():
    for name, argv in services().items():
        for flag in ("--grpc-keepalive-time", "--execute-model-timeout", "--generate-read-timeout",
                     "--chat-template-render-timeout", "--chat-template-max-output-chars"):
            assert flag not in argv, (name, flag)


def test_each_service_accepts_the_flags_it_is_given():
    parser = build_parser()
    for name, argv in services("--grpc-keepalive-time", "0", "--execute-model-timeout", "9",
                               "--chat-template-render-timeout", "1").items():
        command = argv[argv.index("pagoda.services.cli.main") + 1:]
        args = parser.parse_args(command)
        assert args.grpc_keepalive_time == 0, name


def test_kv_medium_weights_reach_the_gateway_and_a_bad_value_is_refused_before_start():
    from pagoda.services.cli.serve import _flag_problem
    weights = '{"CPU": 0.7}'
    gateway = services("--kv-medium-weights", weights)["gateway"]
    assert build_parser().parse_args(gateway[gateway.index("pagoda.services.cli.main") + 1:]
                                     ).kv_medium_weights["CPU"] == 0.7
    assert "--kv-medium-weights" not in services()["gateway"]
    assert "kv-medium-weights" in _flag_problem(serve_args("--kv-medium-weights", '{"CPU": 2}'))
