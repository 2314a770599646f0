"""Shared messages <-> engine dataclasses: sampling params, logprobs, finish reasons.

Invariant: `sampling_params_from_proto(sampling_params_to_proto(p)) == p` for every
valid `SamplingParams` (the proto uses doubles and `optional` where None matters).
"""

from __future__ import annotations

import json

from pagoda.services._proto.pagoda.common.v1 import common_pb2 as pb
from pagoda.messages import FinishReason, LogprobsLists
from pagoda.sampling_params import SamplingParams

# Fields copied verbatim (same name, scalar or repeated scalar, no None).
_PLAIN_FIELDS = (
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature",
    "top_p", "top_k", "min_p", "ignore_eos", "min_tokens", "include_stop_str_in_output",
    "skip_special_tokens", "spaces_between_special_tokens",
)
_OPTIONAL_FIELDS = ("seed", "max_tokens", "logprobs", "prompt_logprobs")


def sampling_params_to_proto(params: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(**{name: getattr(params, name) for name in _PLAIN_FIELDS})
    for name in _OPTIONAL_FIELDS:
        value = getattr(params, name)
        if value is not None:
            setattr(msg, name, value)
    msg.stop.extend(params.stop or [])
    msg.stop_token_ids.extend(params.stop_token_ids or [])
    if params.logit_bias:
        for token_id, bias in params.logit_bias.items():
            msg.logit_bias[int(token_id)] = float(bias)
    if params.extra_args is not None:
        msg.extra_args_json = json.dumps(params.extra_args)
    return msg


def sampling_params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Rebuild (and so re-validate: raises ValueError) the engine's SamplingParams."""
    kwargs = {name: getattr(msg, name) for name in _PLAIN_FIELDS}
    for name in _OPTIONAL_FIELDS:
        kwargs[name] = getattr(msg, name) if msg.HasField(name) else None
    kwargs["stop"] = list(msg.stop)
    kwargs["stop_token_ids"] = list(msg.stop_token_ids)
    kwargs["logit_bias"] = dict(msg.logit_bias) or None
    kwargs["extra_args"] = json.loads(msg.extra_args_json) if msg.extra_args_json else None
    return SamplingParams(**kwargs)


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
}
_FINISH_FROM_PROTO = {v: k for k, v in _FINISH_TO_PROTO.items()}


def finish_reason_to_proto(reason: FinishReason | None) -> int:
    return _FINISH_TO_PROTO[reason]


def finish_reason_from_proto(value: int) -> FinishReason | None:
    return _FINISH_FROM_PROTO[value]
