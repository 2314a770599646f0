"""`--kv-transfer-config`: vLLM's JSON, with Pagoda's connector names.

    {"kv_connector": "PagodaConnector", "kv_role": "kv_producer"}

A replica's role decides what it does: a `kv_producer` prefills and keeps each
prompt's blocks under a lease for a decode replica to pull; a `kv_consumer` decodes
requests whose prompt another replica prefilled (pulling the blocks it lacks); a
`kv_both` replica (the default, today's colocated behaviour) prefills and decodes
its own requests and may also decode remotely prefilled ones.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from pagoda.json_flag import json_object

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
# The connector chooses the transport. PagodaConnector: chunked, checksummed gRPC
# streaming between gpu-workers (CPU or GPU, any two processes or machines).
# PagodaDistConnector: a torch.distributed pair group between the two gpu-workers,
# NCCL on CUDA (device to device), gloo on CPU; gRPC carries only control messages.
DIST_CONNECTOR = "PagodaDistConnector"
KV_CONNECTORS = ("PagodaConnector", DIST_CONNECTOR)
# vLLM's other fields: accepted so a vLLM config parses, ignored by this transport.
_VLLM_IGNORED = ("engine_id", "kv_buffer_device", "kv_buffer_size", "kv_rank",
                 "kv_parallel_size", "kv_ip", "kv_port", "kv_connector_extra_config")
DEFAULT_KV_LEASE_TIMEOUT_S = 30.0
DEFAULT_KV_TRANSFER_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class KVTransferConfig:
    """Invariant: `kv_role` is one of KV_ROLES and `kv_connector` one of KV_CONNECTORS."""

    kv_connector: str = "PagodaConnector"
    kv_role: str = "kv_both"
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {', '.join(KV_ROLES)}; got "
                             f"{self.kv_role!r}")
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"kv_connector {self.kv_connector!r} is not available; Pagoda "
                             f"has {', '.join(KV_CONNECTORS)} (gRPC streaming, or a "
                             f"torch.distributed pair group, between gpu-workers)")

    @classmethod
    def from_json(cls, text: str | None) -> "KVTransferConfig":
        """Parse the flag's JSON; None or '' is the default (kv_both). ValueError on an
        unknown field or value, naming it."""
        data = json_object(text, "--kv-transfer-config")
        if data is None:
            return cls()
        unknown = sorted(set(data) - {"kv_connector", "kv_role", *_VLLM_IGNORED})
        if unknown:
            raise ValueError(f"--kv-transfer-config: unknown field(s) {', '.join(unknown)}")
        extra = {k: data[k] for k in _VLLM_IGNORED if k in data}
        return cls(data.get("kv_connector", "PagodaConnector"), data.get("kv_role", "kv_both"),
                   extra)

    def to_json(self) -> str:
        return json.dumps({"kv_connector": self.kv_connector, "kv_role": self.kv_role},
                          separators=(",", ":"))

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")
