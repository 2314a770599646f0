"""`MultiModalFeature` <-> its proto, with the checks every receiver runs.

A feature's tensors travel typed (`pagoda.common.v1.Tensor`: dtype, shape, raw
little-endian bytes). Whoever receives features checks them with `check_features`
before anything reads them: a known dtype, bytes == product(shape) * itemsize, the
request's tensor bytes under `max_bytes`, runs sorted, not overlapping and inside the
prompt, a 64-hex identifier. Nothing is trusted because it came from inside the
cluster (the gateway checks what the tokenizer sent, the scheduler what the gateway
sent, the worker what the scheduler sent).

The gateway never imports torch: it keeps the features' tensors as the proto
`Tensor`s it received (`features_from_proto(..., as_torch=False)`) and
`features_to_proto` copies those through unchanged; the scheduler and the worker get
torch tensors.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

from pagoda.multimodal.inputs import MODALITIES, MultiModalFeature
from pagoda.services._proto.pagoda.common.v1 import common_pb2 as pb

# The tensor bytes one request's features may carry, on every hop (under the gRPC
# message cap of 256 MiB, so a request at the limit still fits its message).
DEFAULT_MAX_FEATURE_BYTES = 192 * 1024 * 1024
DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8,
               "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1}
_IDENTIFIER = re.compile(r"[0-9a-f]{64}")


def check_features(features: Sequence[pb.MultiModalFeature], prompt_len: int,
                   max_bytes: int = DEFAULT_MAX_FEATURE_BYTES) -> None:
    """ValueError naming what is wrong with `features` (see the module docstring)."""
    total = 0
    end = 0
    for i, f in enumerate(features):
        where = f"mm_features[{i}]"
        if f.modality not in MODALITIES:
            raise ValueError(f"{where}.modality {f.modality!r} is not one of {MODALITIES}.")
        if not _IDENTIFIER.fullmatch(f.identifier):
            raise ValueError(f"{where}.identifier must be a hex sha256 digest.")
        if f.length <= 0 or f.offset < end or f.offset + f.length > prompt_len:
            raise ValueError(f"{where}: the run [{f.offset}, {f.offset + f.length}) is empty, "
                             f"overlaps an earlier one or lies outside the prompt "
                             f"({prompt_len} tokens).")
        end = f.offset + f.length
        tensors = list(f.data.tensors.items()) if f.HasField("data") else []
        if f.HasField("is_embed"):
            tensors.append(("is_embed", f.is_embed))
            if f.is_embed.dtype != "bool" or list(f.is_embed.shape) != [f.length]:
                raise ValueError(f"{where}.is_embed must be bool [{f.length}].")
        for name, t in tensors:
            total += check_tensor(t, f"{where}.{name}")
            if total > max_bytes:
                raise ValueError(f"the request's media tensors exceed the limit of "
                                 f"{max_bytes} bytes.")


def check_tensor(t: pb.Tensor, where: str) -> int:
    """The tensor's byte count; ValueError if its dtype, shape and bytes disagree."""
    size = DTYPE_SIZES.get(t.dtype)
    if size is None:
        raise ValueError(f"{where}: dtype {t.dtype!r} is not one of {sorted(DTYPE_SIZES)}.")
    if any(d < 0 for d in t.shape):
        raise ValueError(f"{where}: negative dimension in shape {list(t.shape)}.")
    expected = math.prod(t.shape) * size
    if expected != len(t.data):
        raise ValueError(f"{where}: shape {list(t.shape)} of {t.dtype} needs {expected} "
                         f"bytes, got {len(t.data)}.")
    return expected


def features_to_proto(features: Iterable[MultiModalFeature],
                      out: Any) -> None:
    """Append `features` to the repeated field `out` (torch tensors or proto Tensors)."""
    for f in features:
        msg = out.add(modality=f.modality, identifier=f.identifier, offset=f.offset,
                      length=f.length)
        if f.data is not None:
            msg.data.SetInParent()
            for name, tensor in f.data.items():
                tensor_to_proto(tensor, msg.data.tensors[name])
        if f.is_embed is not None:
            tensor_to_proto(f.is_embed, msg.is_embed)


def features_from_proto(features: Sequence[pb.MultiModalFeature], prompt_len: int,
                        max_bytes: int = DEFAULT_MAX_FEATURE_BYTES, as_torch: bool = True,
                        keep_data: bool = True) -> list[MultiModalFeature]:
    """Checked features; tensors as torch tensors (`as_torch`) or the proto Tensors
    themselves (the gateway, which forwards them). `keep_data=False` drops the data
    (a receiver that needs identifiers and runs only)."""
    check_features(features, prompt_len, max_bytes)
    convert = tensor_from_proto if as_torch else (lambda t: t)
    out = []
    for f in features:
        data = ({name: convert(t) for name, t in f.data.tensors.items()}
                if keep_data and f.HasField("data") else None)
        is_embed = convert(f.is_embed) if f.HasField("is_embed") else None
        out.append(MultiModalFeature(f.modality, f.identifier, f.offset, f.length, data,
                                     is_embed))
    return out


def features_to_encode(features: Sequence[MultiModalFeature], num_computed_tokens: int
                       ) -> list[MultiModalFeature]:
    """What a worker gets with a new request: every item (identifiers and runs), with
    data only for items whose run is not fully computed yet (a prefix hit covering a
    whole image needs no pixels; the worker then never encodes it). A request the
    worker must recompute from scratch (preempted, migrated) is sent as new again, with
    the data its computed tokens then call for."""
    return [f if f.end > num_computed_tokens else f.without_data() for f in features]


def tensor_to_proto(tensor: Any, out: pb.Tensor) -> None:
    """A torch tensor (or a proto Tensor, copied) into `out`."""
    if isinstance(tensor, pb.Tensor):
        out.CopyFrom(tensor)
        return
    import torch  # lazy: the gateway (which never holds torch tensors) imports this module
    t = tensor.detach().cpu().contiguous()
    out.dtype = str(t.dtype).removeprefix("torch.")
    if out.dtype not in DTYPE_SIZES:
        raise ValueError(f"tensor dtype {t.dtype} cannot travel")
    out.shape[:] = list(t.shape)
    out.data = t.reshape(-1).view(torch.uint8).numpy().tobytes()


def tensor_from_proto(msg: pb.Tensor) -> Any:
    """The torch tensor `msg` holds (checked: call `check_tensor` first or via
    `check_features`)."""
    import torch  # lazy: the gateway imports this module and never converts to torch
    check_tensor(msg, "tensor")
    dtype = getattr(torch, msg.dtype)
    if not msg.data:
        return torch.empty(tuple(msg.shape), dtype=dtype)
    flat = torch.frombuffer(bytearray(msg.data), dtype=torch.uint8)
    return flat.view(dtype).reshape(tuple(msg.shape))
