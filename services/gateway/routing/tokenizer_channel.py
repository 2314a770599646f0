"""The gateway's one channel to every tokenizer replica, balanced by gRPC itself.

The tokenizer holds no state a unary call needs, so any replica may answer any call:
the channel resolves every address (`--tokenizer-addr`), keeps a connection to each,
and spreads calls over the ready ones with gRPC's `round_robin` policy (a dead
replica's connection drops at once, and the picker skips it until it answers again).
A unary call that fails UNAVAILABLE (its replica died under it) is retried by gRPC on
the next pick, i.e. on another replica: Tokenize (chat rendering included), Detokenize
and GetTokenizerInfo are idempotent. The decode stream is not retried here: its
incremental state lives in one replica (decode_mux.py resumes it elsewhere).

Targets:
  * `host:port`: the addresses the name resolves to (one, or all of a headless
    Kubernetes Service's pods);
  * `dns:///NAME:PORT`: the same, explicitly (gRPC re-resolves when a connection
    fails, so a replaced pod's new address is found);
  * `IP:PORT,IP:PORT,...`: exactly these (`pagoda serve --tokenizer-replicas N`).
"""

from __future__ import annotations

import ipaddress
import json

from pagoda.services.common.grpc_channels import (CLIENT_OPTIONS, DEFAULT_DEADLINE_S,
                                                  LONG_CALLS, current_tls)

TOKENIZER_SERVICE = "pagoda.tokenizer.v1.TokenizerService"
IDEMPOTENT_METHODS = ("Tokenize", "Detokenize", "GetTokenizerInfo")
RETRY_POLICY = {
    "maxAttempts": 3,  # the first try and two more, each picked afresh
    "initialBackoff": "0.05s",
    "maxBackoff": "0.5s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE"],
}


def tokenizer_target(addresses: str) -> str:
    """The gRPC target for `--tokenizer-addr` (see the module docstring); raises
    ValueError for a list that names a host instead of an IP address."""
    parts = [p.strip() for p in addresses.split(",") if p.strip()]
    if not parts:
        raise ValueError("--tokenizer-addr is empty")
    if len(parts) == 1:
        return parts[0]
    families = {_ip_family(p) for p in parts}
    if None in families or len(families) > 1:
        raise ValueError(f"--tokenizer-addr {addresses!r}: a list takes IP:PORT entries of "
                         "one family; for host names use dns:///NAME:PORT (every address "
                         "NAME resolves to)")
    return f"{families.pop()}:{','.join(parts)}"


def _ip_family(address: str) -> str | None:
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        return None
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    return "ipv4" if ip.version == 4 else "ipv6"


def tokenizer_service_config(default_deadline_s: float = DEFAULT_DEADLINE_S) -> str:
    """round_robin over every resolved address; the usual deadlines (grpc_channels);
    retries of the idempotent calls on UNAVAILABLE."""
    return json.dumps({
        "loadBalancingConfig": [{"round_robin": {}}],
        "methodConfig": [
            {"name": [{}], "timeout": f"{default_deadline_s:g}s"},
            {"name": LONG_CALLS},
            {"name": [{"service": TOKENIZER_SERVICE, "method": m} for m in IDEMPOTENT_METHODS],
             "timeout": f"{default_deadline_s:g}s", "retryPolicy": RETRY_POLICY},
        ],
    })


def tokenizer_channel_options(addresses: str) -> list[tuple[str, object]]:
    """CLIENT_OPTIONS with the tokenizer's service config instead of the default one.
    A list's authority (what TLS checks without --grpc-tls-server-name; with it, the
    call host must be that name, which gRPC then sets) is its first address: the
    replicas of one service share a certificate."""
    options = [(key, value) for key, value in CLIENT_OPTIONS if key != "grpc.service_config"]
    options += [("grpc.service_config", tokenizer_service_config()), ("grpc.enable_retries", 1)]
    tls = current_tls()
    if "," in addresses and (tls is None or not tls.server_name):
        options.append(("grpc.default_authority", addresses.split(",")[0].strip()))
    return options
