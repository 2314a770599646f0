"""`--kv-events-config`: vLLM's JSON for publishing KV cache events over ZMQ.

The keys and defaults are vLLM's `KVEventsConfig`: `enable_kv_cache_events`,
`publisher` ("zmq" or "null"; unset: "zmq" when events are enabled),
`endpoint` ("tcp://*:5557"), `replay_endpoint` (None), `buffer_steps` (10000),
`hwm` (100000), `max_queue_size` (100000) and `topic` (""). A key vLLM does not
know, a value of the wrong type, or another publisher is refused with a message
naming the key: a typo must not leave an llm-d indexer silently without events.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

PUBLISHERS = ("zmq", "null")
DEFAULT_ENDPOINT = "tcp://*:5557"


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = DEFAULT_ENDPOINT
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def publishes(self) -> bool:
        """Whether a ZMQ publisher runs (events on and the zmq publisher)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def with_port_offset(self, offset: int) -> "KVEventsConfig":
        """The config of replica `offset` on one host (vLLM offsets by DP rank the same way)."""
        if offset == 0:
            return self
        return KVEventsConfig(**{**self.__dict__, "endpoint": offset_endpoint(self.endpoint, offset),
                                 "replay_endpoint": offset_endpoint(self.replay_endpoint, offset)})

    def to_json(self) -> str:
        return json.dumps(self.__dict__)


_TYPES = {"enable_kv_cache_events": (bool,), "publisher": (str,), "endpoint": (str,),
          "replay_endpoint": (str, type(None)), "buffer_steps": (int,), "hwm": (int,),
          "max_queue_size": (int,), "topic": (str,)}


def parse_kv_events_config(text: str | None) -> KVEventsConfig | None:
    """The config of a `--kv-events-config` value (None when not given); ValueError
    naming the key for anything vLLM would not accept."""
    if text is None or text == "":
        return None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--kv-events-config is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError("--kv-events-config must be a JSON object, e.g. "
                         '\'{"enable_kv_cache_events": true, "publisher": "zmq"}\'')
    known = {f.name for f in fields(KVEventsConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"--kv-events-config: unknown key(s) {', '.join(unknown)}; "
                         f"known keys: {', '.join(sorted(known))}")
    for key, value in raw.items():
        ok = _TYPES[key]
        if not isinstance(value, ok) or (isinstance(value, bool) and bool not in ok):
            names = " or ".join("null" if t is type(None) else t.__name__ for t in ok)
            raise ValueError(f"--kv-events-config: {key} must be {names}, got {value!r}")
    for key in ("buffer_steps", "max_queue_size"):
        if key in raw and raw[key] < 1:
            raise ValueError(f"--kv-events-config: {key} must be at least 1, got {raw[key]}")
    if "hwm" in raw and raw["hwm"] < 0:
        raise ValueError(f"--kv-events-config: hwm must not be negative, got {raw['hwm']}")
    if "publisher" not in raw:  # vLLM: zmq when the events are on, else null
        raw["publisher"] = "zmq" if raw.get("enable_kv_cache_events") else "null"
    if raw["publisher"] not in PUBLISHERS:
        raise ValueError(f"--kv-events-config: publisher must be one of "
                         f"{', '.join(PUBLISHERS)}, got {raw['publisher']!r}")
    if not raw.get("endpoint", DEFAULT_ENDPOINT).startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"--kv-events-config: endpoint must be a ZMQ address "
                         f"(tcp://, ipc:// or inproc://), got {raw['endpoint']!r}")
    return KVEventsConfig(**raw)


def offset_endpoint(endpoint: str | None, offset: int) -> str | None:
    """`tcp://*:5557` -> `tcp://*:5558` for offset 1; ipc/inproc get a `_dp<offset>` suffix."""
    if not endpoint or offset == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + offset}"
    return f"{endpoint}_dp{offset}"
