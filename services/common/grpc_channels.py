"""Every gRPC server and channel of Pagoda is made here, so TLS, keepalive and deadlines
apply to all of them alike.

Mutual TLS (`--grpc-tls-cert/--grpc-tls-key/--grpc-tls-ca`, all three or none): the
process's servers present the certificate and refuse any client that does not present
one signed by the CA; its channels present the same certificate and accept only a server
whose certificate the CA signed. Replicas are dialled by pod IP, which no certificate
names, so `--grpc-tls-server-name` gives the DNS name every service certificate carries
and channels check that name instead of the address. Without the flags: plaintext
(`pagoda serve` on loopback, or a mesh that encrypts).

Invariant: `configure()` runs once at process start, before the first server or channel
is made; every server port and channel made afterwards uses that configuration.

Hung peers. Every channel pings its peer every `--grpc-keepalive-time` seconds (default
KEEPALIVE_TIME_MS) while a call is open and drops the connection when a ping is not
answered within `--grpc-keepalive-timeout` (KEEPALIVE_TIMEOUT_MS), so the calls on a
frozen (e.g. SIGSTOPped) or unreachable peer fail UNAVAILABLE within ~10 s; servers ping
their clients the same way, so a stream to a vanished caller ends. A frozen process still
holds its sockets open and the kernel still acknowledges its TCP segments: only an
unanswered HTTP/2 ping shows it is gone. A service config gives every
call a deadline of DEFAULT_DEADLINE_S unless the caller sets a shorter one; the long
calls are listed in LONG_CALLS instead: their readers bound each read (peers.py,
decode_mux.py) or pass their own deadline (the worker's steps).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc

from pagoda.services.common.tracing import (aio_client_interceptors, aio_server_interceptors,
                                            server_interceptors)

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
KEEPALIVE_TIME_MS = 5_000
KEEPALIVE_TIMEOUT_MS = 5_000
DEFAULT_DEADLINE_S = 60.0
# Streams that live as long as a generation or the gateway itself, and the worker's
# steps (the scheduler gives each its own, --execute-model-timeout): no default deadline.
LONG_CALLS = [
    {"service": "pagoda.scheduler.v1.SchedulerService", "method": "Generate"},
    {"service": "pagoda.scheduler.v1.SchedulerService", "method": "GenerateStream"},
    {"service": "pagoda.tokenizer.v1.TokenizerService", "method": "DecodeStream"},
    {"service": "pagoda.worker.v1.WorkerService"},
    {"service": "grpc.health.v1.Health", "method": "Watch"},
]


# Longest silence accepted on a stream read: a decode batch answers in milliseconds; a
# generation may wait its turn in a replica's queue, but not this long without a token
# (the gateway's --generate-read-timeout sets it at start).
DECODE_READ_TIMEOUT_S = 30.0
DEFAULT_GENERATE_READ_TIMEOUT_S = 300.0
GENERATE_READ_TIMEOUT_S = DEFAULT_GENERATE_READ_TIMEOUT_S


def service_config(default_deadline_s: float = DEFAULT_DEADLINE_S) -> str:
    """A deadline for every method but LONG_CALLS (the most specific entry wins, and
    an entry without `timeout` means none)."""
    return json.dumps({"methodConfig": [
        {"name": [{}], "timeout": f"{default_deadline_s:g}s"},
        {"name": LONG_CALLS},
    ]})


@dataclass(frozen=True)
class Keepalive:
    """How a process finds a frozen peer: a ping every `time_ms` while a call is open
    (0: no pings, gRPC's own defaults), the connection dropped when one is not answered
    within `timeout_ms`. Detection takes at most about time + timeout."""

    time_ms: int = KEEPALIVE_TIME_MS
    timeout_ms: int = KEEPALIVE_TIMEOUT_MS

    def options(self) -> list[tuple[str, int]]:
        if self.time_ms <= 0:
            return []
        return [
            ("grpc.keepalive_time_ms", self.time_ms),
            ("grpc.keepalive_timeout_ms", self.timeout_ms),
            # gRPC core times out an unanswered ping after this one (default 60 s),
            # whatever keepalive_timeout says.
            ("grpc.http2.ping_timeout_ms", self.timeout_ms),
            # Keep pinging while a stream waits silently (e.g. a request queued in a replica).
            ("grpc.http2.max_pings_without_data", 0),
        ]

    def flags(self) -> list[str]:
        """The flags that give a child process the same configuration."""
        return ["--grpc-keepalive-time", f"{self.time_ms / 1000:g}",
                "--grpc-keepalive-timeout", f"{self.timeout_ms / 1000:g}"]

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Keepalive":
        time_s = getattr(args, "grpc_keepalive_time", None)
        timeout_s = getattr(args, "grpc_keepalive_timeout", None)
        time_s = KEEPALIVE_TIME_MS / 1000 if time_s is None else time_s
        timeout_s = KEEPALIVE_TIMEOUT_MS / 1000 if timeout_s is None else timeout_s
        if time_s < 0 or timeout_s <= 0:
            raise SystemExit(f"--grpc-keepalive-time must be >= 0 (0: off) and "
                             f"--grpc-keepalive-timeout > 0; got {time_s:g} and {timeout_s:g}")
        return cls(round(time_s * 1000), round(timeout_s * 1000))


_KEEPALIVE_KEYS = {"grpc.keepalive_time_ms", "grpc.keepalive_timeout_ms",
                   "grpc.http2.ping_timeout_ms", "grpc.http2.max_pings_without_data"}
_KEEPALIVE = Keepalive().options()
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # gRPC sets SO_REUSEPORT by default, which lets a second server bind a port
    # that is in use and silently split its traffic. Fail loudly instead.
    ("grpc.so_reuseport", 0),
    *_KEEPALIVE,
    # Accept our clients' pings on silent streams (the default policy answers a
    # ping more often than every 5 minutes with GOAWAY "too_many_pings").
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
    ("grpc.http2.max_ping_strikes", 0),
]
# Channels to peers: a peer that is still starting (or restarting) is retried
# within ~0.25 s, not after gRPC's default exponential backoff of up to 2 minutes. A
# cluster's start waits on two such channels in a row (the scheduler's to its
# gpu-worker, the gateway's to the scheduler), each for seconds, so each found its
# peer up to a whole backoff late (0.5 s on average at 1 s); a refused connection
# attempt costs next to nothing.
MAX_RECONNECT_BACKOFF_MS = 250
CLIENT_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
    *_KEEPALIVE,
    ("grpc.service_config", service_config()),
]
# Channels that read token streams (gateway -> scheduler `Generate`): a tiny HTTP/2
# read-ahead window, so a reader that falls behind blocks the sender after a few
# messages and the scheduler coalesces the backlog into one chunk, instead of
# queueing thousands of one-token messages. (Large messages are unaffected: the
# window opens to fit a message being read.)
STREAM_READER_OPTIONS = CLIENT_OPTIONS + [
    ("grpc.http2.lookahead_bytes", 64),
    ("grpc.http2.bdp_probe", 0),
]


@dataclass(frozen=True)
class GrpcTLS:
    """One process's mutual-TLS material (PEM files) and the name servers must prove."""

    cert_file: str
    key_file: str
    ca_file: str
    server_name: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "GrpcTLS | None":
        """None when no TLS flag is set; SystemExit for a partial set or a missing file."""
        files = {"--grpc-tls-cert": getattr(args, "grpc_tls_cert", None),
                 "--grpc-tls-key": getattr(args, "grpc_tls_key", None),
                 "--grpc-tls-ca": getattr(args, "grpc_tls_ca", None)}
        given = [flag for flag, path in files.items() if path]
        if not given:
            return None
        if len(given) != len(files):
            missing = ", ".join(flag for flag in files if flag not in given)
            raise SystemExit(f"mutual TLS needs --grpc-tls-cert, --grpc-tls-key and "
                             f"--grpc-tls-ca together; missing: {missing}")
        for flag, path in files.items():
            if not Path(path).is_file():
                raise SystemExit(f"{flag}: no file at {path}")
        return cls(*files.values(), getattr(args, "grpc_tls_server_name", None) or None)

    def _read(self) -> tuple[bytes, bytes, bytes]:
        return (Path(self.cert_file).read_bytes(), Path(self.key_file).read_bytes(),
                Path(self.ca_file).read_bytes())

    def server_credentials(self) -> grpc.ServerCredentials:
        cert, key, ca = self._read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        cert, key, ca = self._read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                            certificate_chain=cert)

    def channel_options(self) -> list[tuple[str, object]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    def flags(self) -> list[str]:
        """The flags that give a child process the same configuration."""
        out = ["--grpc-tls-cert", self.cert_file, "--grpc-tls-key", self.key_file,
               "--grpc-tls-ca", self.ca_file]
        return out + (["--grpc-tls-server-name", self.server_name] if self.server_name else [])


_tls: GrpcTLS | None = None
_keepalive = Keepalive()


def add_tls_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("gRPC mutual TLS (all three files, or none: plaintext)")
    group.add_argument("--grpc-tls-cert", default=None, metavar="PEM",
                       help="This service's certificate, presented to its peers both ways.")
    group.add_argument("--grpc-tls-key", default=None, metavar="PEM",
                       help="The private key of --grpc-tls-cert.")
    group.add_argument("--grpc-tls-ca", default=None, metavar="PEM",
                       help="CA that signed every peer's certificate; callers and servers "
                            "without one it signed are refused.")
    group.add_argument("--grpc-tls-server-name", default=None, metavar="NAME",
                       help="DNS name every service certificate carries, checked instead of "
                            "the dialled host (replicas are dialled by IP); default: the host.")


def add_keepalive_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("gRPC keepalive (how fast a frozen peer is found)")
    group.add_argument("--grpc-keepalive-time", type=float, default=KEEPALIVE_TIME_MS / 1000,
                       metavar="SECONDS",
                       help="Ping each peer this often while a call to or from it is open "
                            "(0: no pings; a frozen peer is then found only by deadlines).")
    group.add_argument("--grpc-keepalive-timeout", type=float,
                       default=KEEPALIVE_TIMEOUT_MS / 1000, metavar="SECONDS",
                       help="A ping not answered within this drops the connection: the calls "
                            "on it fail UNAVAILABLE (a stream then migrates).")


def configure(tls: GrpcTLS | None, keepalive: Keepalive | None = None) -> None:
    """Set this process's TLS (None: plaintext) and keepalive configuration. Call
    before any server or channel is made."""
    global _tls, _keepalive
    _tls = tls
    _keepalive = keepalive or Keepalive()


def add_generate_read_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--generate-read-timeout", type=float,
                        default=DEFAULT_GENERATE_READ_TIMEOUT_S,
                        metavar="SECONDS",
                        help="Longest silence accepted on a replica's token stream (a request "
                             "may wait in its queue): past it, a replica that still answers "
                             "pings but sends nothing counts as lost and the request migrates.")


def generate_read_flags(args: argparse.Namespace) -> list[str]:
    """--generate-read-timeout for a gateway child process, when not the default."""
    value = getattr(args, "generate_read_timeout", None)
    if value is None or value == DEFAULT_GENERATE_READ_TIMEOUT_S:
        return []
    return ["--generate-read-timeout", f"{value:g}"]


def configure_from_args(args: argparse.Namespace) -> GrpcTLS | None:
    global GENERATE_READ_TIMEOUT_S
    configure(GrpcTLS.from_args(args), Keepalive.from_args(args))
    read_timeout = getattr(args, "generate_read_timeout", None)
    if read_timeout is not None:
        if not read_timeout > 0:
            raise SystemExit(f"--generate-read-timeout must be positive, got {read_timeout:g}")
        GENERATE_READ_TIMEOUT_S = read_timeout
    return _tls


def current_keepalive() -> Keepalive:
    return _keepalive


def _with_keepalive(options: Sequence) -> list:
    """`options` with this process's keepalive settings in place of any given."""
    return [o for o in options if o[0] not in _KEEPALIVE_KEYS] + _keepalive.options()


def current_tls() -> GrpcTLS | None:
    return _tls


def channel(address: str, options: Sequence = CLIENT_OPTIONS) -> grpc.Channel:
    """A blocking channel to `address` (wrap it with tracing.intercept for spans)."""
    options = _with_keepalive(options)
    if _tls is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, _tls.channel_credentials(),
                               options=options + _tls.channel_options())


def aio_channel(address: str, options: Sequence = CLIENT_OPTIONS) -> grpc.aio.Channel:
    """An asyncio channel to `address`, traced when tracing is on (create it in the loop)."""
    interceptors = aio_client_interceptors()
    options = _with_keepalive(options)
    if _tls is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(address, _tls.channel_credentials(),
                                   options=options + _tls.channel_options(),
                                   interceptors=interceptors)


async def read_within(call: grpc.aio.Call, timeout_s: float, peer: str):
    """The next message of a stream (or grpc.aio.EOF). A peer silent for `timeout_s`
    cancels the call and fails it UNAVAILABLE, like a lost connection: keepalive
    catches a peer that stopped answering pings, this one a peer that answers pings
    but stopped producing."""
    try:
        return await asyncio.wait_for(call.read(), timeout_s)
    except asyncio.TimeoutError:
        call.cancel()
        raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                   grpc.aio.Metadata(),
                                   f"{peer} sent nothing for {timeout_s:g} s") from None


def server(max_workers: int, thread_name_prefix: str = "grpc") -> grpc.Server:
    """A thread-pool server with the keepalive policy, traced when tracing is on."""
    return grpc.server(ThreadPoolExecutor(max_workers, thread_name_prefix=thread_name_prefix),
                       options=_with_keepalive(SERVER_OPTIONS),
                       interceptors=server_interceptors())


def aio_server() -> grpc.aio.Server:
    """An asyncio server with the keepalive policy, traced when tracing is on."""
    return grpc.aio.server(options=_with_keepalive(SERVER_OPTIONS),
                           interceptors=aio_server_interceptors())


def add_port(server, address: str) -> int:
    """Listen on `address` (TLS when configured); the bound port, 0 on failure."""
    if _tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, _tls.server_credentials())
