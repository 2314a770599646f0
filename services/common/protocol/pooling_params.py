"""`PoolingParams` and pooled vectors on the wire (common.v1.PoolingParams, PooledData).

`truncate_prompt_tokens` does not travel: it is applied where the prompt is tokenized
(the gateway's tokenizer call). The engine verifies the params against the model
(`PoolingParams.verify`); decoding only rebuilds them.
"""

from __future__ import annotations

from pagoda.pooling_params import PoolingParams
from pagoda.services._proto.pagoda.common.v1 import common_pb2 as cpb

_OPTIONAL = ("dimensions", "normalize", "use_activation", "token_type_split")


def pooling_params_to_proto(params: PoolingParams, out: cpb.PoolingParams | None = None
                            ) -> cpb.PoolingParams:
    """Fill `out` (a message field, to avoid a copy) or a new message."""
    msg = cpb.PoolingParams() if out is None else out
    msg.SetInParent()  # an all-default params message still marks a pooling request
    msg.task = params.task or ""
    for name in _OPTIONAL:
        value = getattr(params, name)
        if value is not None:
            setattr(msg, name, value)
    return msg


def pooling_params_from_proto(msg: cpb.PoolingParams) -> PoolingParams:
    return PoolingParams(task=msg.task or None,
                         **{name: getattr(msg, name) if msg.HasField(name) else None
                            for name in _OPTIONAL})


def pooled_data_to_proto(data: list[float], out: cpb.PooledData) -> cpb.PooledData:
    out.SetInParent()
    out.data.extend(data)
    return out


def pooled_data_from_proto(msg: cpb.PooledData) -> list[float]:
    return list(msg.data)
