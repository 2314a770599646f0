"""Shared messages <-> Python values: logprobs, finish reasons, LoRA requests and free-form JSON
(sampling params have their own module, `sampling_params`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pagoda.lora.request import LoRARequest
from pagoda.messages import FinishReason, LogprobsLists
from pagoda.services._proto.pagoda.common.v1 import common_pb2 as pb

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def logprobs_to_proto(lists: LogprobsLists | None, out: pb.LogprobsLists | None = None
                      ) -> pb.LogprobsLists:
    """Fill `out` (a message field, to avoid a copy) or a new message."""
    msg = pb.LogprobsLists() if out is None else out
    if lists is None:
        return msg
    for ids, lps, ranks in zip(lists.token_ids, lists.logprobs, lists.ranks):
        msg.rows.add(token_ids=ids, logprobs=lps, ranks=ranks)
    return msg


def logprobs_from_proto(msg: pb.LogprobsLists) -> LogprobsLists:
    return LogprobsLists(
        token_ids=[list(r.token_ids) for r in msg.rows],
        logprobs=[list(r.logprobs) for r in msg.rows],
        ranks=[list(r.ranks) for r in msg.rows],
    )


def extend_logprobs(acc: LogprobsLists, more: LogprobsLists) -> None:
    """Append `more`'s rows to `acc` (coalescing several steps into one message)."""
    acc.token_ids.extend(more.token_ids)
    acc.logprobs.extend(more.logprobs)
    acc.ranks.extend(more.ranks)


_FINISH_TO_PROTO = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
    FinishReason.REPETITION: pb.FINISH_REASON_REPETITION,
}
_FINISH_FROM_PROTO = {v: k for k, v in _FINISH_TO_PROTO.items()}


def finish_reason_to_proto(reason: FinishReason | None) -> int:
    return _FINISH_TO_PROTO[reason]


def finish_reason_from_proto(value: int) -> FinishReason | None:
    return _FINISH_FROM_PROTO[value]


def json_object_to_proto(value: Mapping[str, Any], out: pb.JsonObject | None = None
                         ) -> pb.JsonObject:
    """A JSON object (as `json.loads` gives it) -> JsonObject, key order kept. Fills
    `out` (a message field) or a new message. Raises ValueError for a value JSON
    cannot hold."""
    msg = pb.JsonObject() if out is None else out
    for key, item in value.items():
        if not isinstance(key, str):
            raise ValueError(f"JSON object keys must be strings, got {key!r}")
        _json_value(item, msg.members.add(key=key).value)
    return msg


def json_object_from_proto(msg: pb.JsonObject) -> dict[str, Any]:
    return {m.key: _json_from(m.value) for m in msg.members}


def json_value_to_proto(value: Any, out: pb.JsonValue) -> None:
    """Any JSON value (a JSON schema may be `true`) into `out`; ValueError as above."""
    _json_value(value, out)


def json_value_from_proto(msg: pb.JsonValue) -> Any:
    return _json_from(msg)


def _json_value(value: Any, out: pb.JsonValue) -> None:
    if value is None:
        out.null_value = True
    elif isinstance(value, bool):  # before int: a bool is an int in Python
        out.bool_value = value
    elif isinstance(value, int) and INT64_MIN <= value <= INT64_MAX:
        out.integer_value = value
    elif isinstance(value, (int, float)):
        out.number_value = float(value)  # OverflowError past a double's range
    elif isinstance(value, str):
        out.string_value = value
    elif isinstance(value, Mapping):
        out.object_value.SetInParent()  # an empty object is still an object
        json_object_to_proto(value, out.object_value)
    elif isinstance(value, (list, tuple)):
        out.array_value.SetInParent()  # an empty array is still an array
        for item in value:
            _json_value(item, out.array_value.values.add())
    else:
        raise ValueError(f"not a JSON value: {type(value).__name__}")


def _json_from(msg: pb.JsonValue) -> Any:
    kind = msg.WhichOneof("kind")
    if kind == "object_value":
        return json_object_from_proto(msg.object_value)
    if kind == "array_value":
        return [_json_from(v) for v in msg.array_value.values]
    if kind == "null_value" or kind is None:
        return None
    return getattr(msg, kind)


def lora_request_to_proto(lora: LoRARequest, out: pb.LoRARequest) -> None:
    """Fill `out` (a message field) with the adapter's name, id and path."""
    out.lora_name, out.lora_int_id, out.lora_path = lora.lora_name, lora.lora_int_id, lora.lora_path


def lora_request_from_proto(msg: pb.LoRARequest) -> LoRARequest:
    """Raises ValueError for an id below 1 or an empty name (LoRARequest's checks)."""
    return LoRARequest(msg.lora_name, msg.lora_int_id, msg.lora_path)
