"""`SamplingParams` on the wire: the one place that converts it, by field name.

A request's params are validated once, at the gateway, then split by reader:

    SamplingParams ─┬─ engine fields ─► common.v1.SamplingParams ─► scheduler ─► worker
                    │   (structured_outputs stops at the scheduler: the worker gets bitmasks)
                    ├─ text fields ───► tokenizer.v1.DecodeOptions ─► tokenizer
                    ├─ n ─────────────► (the gateway's fan-out; never sent)
                    └─ bad_words, truncate_prompt_tokens ─► (applied where the prompt is
                       tokenized: bad_words_token_ids, a shorter prompt; never sent)

Which field goes where is read from the proto messages themselves: a
`SamplingParams` field travels in every message that has a field of the same
name. So a new sampling parameter needs its dataclass field and a proto field,
and no code here. Invariant (checked on import): every dataclass field is in the
engine message, in `DecodeOptions`, or in `GATEWAY_ONLY`, so a field that no
message carries fails loudly instead of silently staying at its default.

Decoding does not validate (`SamplingParams.from_validated`): the scheduler, a
trust boundary, validates what it decoded once in its request check
(`pagoda.request_checks`); the tokenizer and the worker trust their senders.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from google.protobuf.message import Message

from pagoda.repetition_detection import RepetitionDetectionParams
from pagoda.sampling_params import STRUCTURED_OUTPUT_KINDS, SamplingParams, StructuredOutputsParams
from pagoda.services._proto.pagoda.common.v1 import common_pb2 as cpb
from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2 as tpb
from pagoda.services.common.protocol.common import (json_object_from_proto, json_object_to_proto,
                                                    json_value_from_proto, json_value_to_proto)

# Read by the gateway alone: it fans `n` out into n requests of n = 1.
GATEWAY_ONLY = frozenset({"n"})
# Applied where the prompt is tokenized (the gateway, the offline engine): the bad words
# travel as `bad_words_token_ids`, a truncation as the shorter prompt itself.
EDGE_ONLY = frozenset({"bad_words", "truncate_prompt_tokens"})
# Read where an offline `LLM` assembles its outputs (the logprobs container): the
# gateway's API has no such field (its JSON has one shape).
OFFLINE_ONLY = frozenset({"flat_logprobs"})
# Field defaults: an empty repeated field reads back as None where None is the default.
_DEFAULTS = {f.name: f.default for f in fields(SamplingParams)}
# Read by the scheduler alone (it compiles the grammar; its worker gets bitmasks).
SCHEDULER_ONLY = frozenset({"structured_outputs"})


def _carried_by(message: type[Message]) -> tuple[str, ...]:
    names = message.DESCRIPTOR.fields_by_name
    return tuple(f.name for f in fields(SamplingParams) if f.name in names)


ENGINE_FIELDS = _carried_by(cpb.SamplingParams)  # the scheduler's and the worker's
TEXT_FIELDS = _carried_by(tpb.DecodeOptions)  # the tokenizer's


def _check_every_field_is_sent() -> None:
    unsent = {f.name for f in fields(SamplingParams)} - set(ENGINE_FIELDS) - set(TEXT_FIELDS) \
        - GATEWAY_ONLY - EDGE_ONLY - OFFLINE_ONLY
    if unsent:
        raise RuntimeError(f"SamplingParams fields no message carries: {sorted(unsent)}; add "
                           f"them to common.v1.SamplingParams or tokenizer.v1.DecodeOptions")


_check_every_field_is_sent()


def _fill(msg: Message, params: SamplingParams, names: Sequence[str]) -> None:
    """Copy the named fields into `msg`; None stays unset (an `optional` field's
    "none", an empty list or map)."""
    for name in names:
        value = getattr(params, name)
        if value is None:
            continue
        if isinstance(value, StructuredOutputsParams):
            structured_outputs_to_proto(value, getattr(msg, name))
        elif isinstance(getattr(msg, name), cpb.JsonObject):  # free-form JSON (extra_args)
            json_object_to_proto(value, getattr(msg, name))
        elif isinstance(value, RepetitionDetectionParams):  # same field names both sides
            getattr(msg, name).CopyFrom(cpb.RepetitionDetectionParams(**vars(value)))
        elif isinstance(value, dict):
            getattr(msg, name).update(value)
        elif isinstance(value, list) and value and isinstance(value[0], list):
            for token_ids in value:  # list[list[int]]: repeated TokenIdList
                getattr(msg, name).add(token_ids=token_ids)
        elif isinstance(value, list):
            getattr(msg, name).extend(value)
        else:
            setattr(msg, name, value)


def _read(msg: Message, names: Sequence[str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name in names:
        descriptor = msg.DESCRIPTOR.fields_by_name[name]
        value = getattr(msg, name)
        if descriptor.is_repeated:
            is_map = descriptor.message_type is not None \
                and descriptor.message_type.GetOptions().map_entry
            if not value and _DEFAULTS.get(name, ...) is None:
                values[name] = None
            elif is_map:
                values[name] = dict(value)
            elif descriptor.message_type is cpb.TokenIdList.DESCRIPTOR:
                values[name] = [list(item.token_ids) for item in value]
            else:
                values[name] = list(value)
        elif descriptor.has_presence and not msg.HasField(name):
            values[name] = None
        elif isinstance(value, cpb.StructuredOutputsParams):
            values[name] = structured_outputs_from_proto(value)
        elif isinstance(value, cpb.JsonObject):
            values[name] = json_object_from_proto(value)
        elif isinstance(value, cpb.RepetitionDetectionParams):
            detection = RepetitionDetectionParams.__new__(RepetitionDetectionParams)
            for f in value.DESCRIPTOR.fields:  # validated by the receiver's request check
                setattr(detection, f.name, getattr(value, f.name))
            values[name] = detection
        else:
            values[name] = value
    return values


def sampling_params_to_proto(params: SamplingParams, for_worker: bool = False
                             ) -> cpb.SamplingParams:
    """The engine fields (what the scheduler and its worker read); `for_worker` leaves
    out the scheduler's own (SCHEDULER_ONLY)."""
    msg = cpb.SamplingParams()
    _fill(msg, params, _WORKER_FIELDS if for_worker else ENGINE_FIELDS)
    return msg


_WORKER_FIELDS = tuple(n for n in ENGINE_FIELDS if n not in SCHEDULER_ONLY)


def structured_outputs_to_proto(params: StructuredOutputsParams,
                                out: cpb.StructuredOutputsParams) -> None:
    kind, spec = params.kind, params.spec
    if kind in ("json", "structural_tag"):
        try:
            json_value_to_proto(spec, getattr(out, kind))
        except (ValueError, OverflowError) as exc:
            raise ValueError(f"structured_outputs.{kind} must be JSON: {exc}") from None
    elif kind == "choice":
        out.choice.values.extend(spec)
    else:  # regex, grammar, json_object
        setattr(out, kind, spec)
    out.disable_any_whitespace = params.disable_any_whitespace


def structured_outputs_from_proto(msg: cpb.StructuredOutputsParams
                                  ) -> StructuredOutputsParams | None:
    kind = msg.WhichOneof("constraint")
    if kind is None:
        return None
    assert kind in STRUCTURED_OUTPUT_KINDS
    value = getattr(msg, kind)
    if kind in ("json", "structural_tag"):
        value = json_value_from_proto(value)
    elif kind == "choice":
        value = list(value.values)
    return StructuredOutputsParams.from_validated(
        **{kind: value, "disable_any_whitespace": msg.disable_any_whitespace})


def sampling_params_from_proto(msg: cpb.SamplingParams) -> SamplingParams:
    """The engine's params, not validated here (the receiver's request check does);
    fields the engine never reads (the text fields, n) keep their defaults."""
    return SamplingParams.from_validated(**_read(msg, ENGINE_FIELDS))


def decode_options_to_proto(prompt_token_ids: Sequence[int], params: SamplingParams
                            ) -> tpb.DecodeOptions:
    """The text fields (what the tokenizer's decoder reads), with the prompt."""
    msg = tpb.DecodeOptions(prompt_token_ids=prompt_token_ids)
    _fill(msg, params, TEXT_FIELDS)
    return msg


def decode_options_from_proto(msg: tpb.DecodeOptions) -> tuple[list[int], SamplingParams]:
    """(the prompt's token ids, params holding the text fields; the others keep their
    defaults), for `StopAwareDecoder.from_sampling_params`."""
    return list(msg.prompt_token_ids), SamplingParams.from_validated(**_read(msg, TEXT_FIELDS))
