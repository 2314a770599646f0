"""KVTransferParams <-> pagoda.kv_transfer.v1.KvTransferParams (field for field)."""

from __future__ import annotations

from dataclasses import fields

from pagoda.kv_transfer.params import KVTransferParams
from pagoda.services._proto.pagoda.kv_transfer.v1 import kv_transfer_pb2 as pb

_NAMES = [f.name for f in fields(KVTransferParams)]


def kv_params_to_proto(params: KVTransferParams, msg: pb.KvTransferParams) -> None:
    for name in _NAMES:
        value = getattr(params, name)
        if isinstance(value, list):
            getattr(msg, name).extend(value)
        else:
            setattr(msg, name, value)


def kv_params_from_proto(msg: pb.KvTransferParams) -> KVTransferParams:
    return KVTransferParams(**{name: (list(v) if not isinstance(v, (bool, int, float, str, bytes))
                                      else v) for name in _NAMES
                               for v in [getattr(msg, name)]})
