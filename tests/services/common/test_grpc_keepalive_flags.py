"""Keepalive is an operator's setting (`--grpc-keepalive-time/--grpc-keepalive-timeout`):
every channel and server the process makes afterwards pings, or does not, as configured.
So is the gateway's bound on a silent token stream (`--generate-read-timeout`)."""

from __future__ import annotations

import argparse

import pytest

from pagoda.services.common import grpc_channels
from pagoda.services.common.grpc_channels import Keepalive


@pytest.fixture
def restore_configuration():
    yield
    grpc_channels.configure(None)


def parse(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    grpc_channels.add_keepalive_args(parser)
    grpc_channels.add_generate_read_args(parser)
    return parser.parse_args(list(flags))


def test_the_defaults_are_five_seconds_each():
    assert Keepalive.from_args(parse()) == Keepalive(5_000, 5_000)
    assert dict(Keepalive().options())["grpc.http2.ping_timeout_ms"] == 5_000


def test_flags_set_every_later_channel_and_server(restore_configuration):
    grpc_channels.configure_from_args(parse("--grpc-keepalive-time", "1.5",
                                            "--grpc-keepalive-timeout", "2"))
    options = dict(grpc_channels._with_keepalive(grpc_channels.CLIENT_OPTIONS))
    assert (options["grpc.keepalive_time_ms"], options["grpc.keepalive_timeout_ms"],
            options["grpc.http2.ping_timeout_ms"]) == (1_500, 2_000, 2_000)
    server = dict(grpc_channels._with_keepalive(grpc_channels.SERVER_OPTIONS))
    assert server["grpc.keepalive_time_ms"] == 1_500
    assert Keepalive.from_args(parse("--grpc-keepalive-time", "1.5", "--grpc-keepalive-timeout",
                                     "2")).flags() == ["--grpc-keepalive-time", "1.5",
                                                       "--grpc-keepalive-timeout", "2"]


def test_zero_turns_the_pings_off(restore_configuration):
    grpc_channels.configure_from_args(parse("--grpc-keepalive-time", "0"))
    options = dict(grpc_channels._with_keepalive(grpc_channels.CLIENT_OPTIONS))
    assert "grpc.keepalive_time_ms" not in options and "grpc.http2.ping_timeout_ms" not in options
    with grpc_channels.channel("127.0.0.1:1"):  # still makes channels
        pass


@pytest.mark.parametrize("flags", [["--grpc-keepalive-time", "-1"],
                                   ["--grpc-keepalive-timeout", "0"]])
def test_nonsense_is_refused_at_start(flags):
    with pytest.raises(SystemExit, match="keepalive"):
        Keepalive.from_args(parse(*flags))


def test_the_generate_read_bound_is_set_at_start(restore_configuration, monkeypatch):
    monkeypatch.setattr(grpc_channels, "GENERATE_READ_TIMEOUT_S", 300.0)  # restored after
    assert grpc_channels.generate_read_flags(parse()) == []
    args = parse("--generate-read-timeout", "42")
    grpc_channels.configure_from_args(args)
    assert grpc_channels.GENERATE_READ_TIMEOUT_S == 42.0
    assert grpc_channels.generate_read_flags(args) == ["--generate-read-timeout", "42"]
    with pytest.raises(SystemExit, match="--generate-read-timeout"):
        grpc_channels.configure_from_args(parse("--generate-read-timeout", "0"))
