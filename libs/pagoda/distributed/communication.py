"""The collectives a worker group uses, over explicit process groups.

Groups are torch.distributed backends built without the global default group
(`process_group.py`), so one process may drive several groups in turn and a test
may build and drop groups freely. Every op here blocks until done, except
`send_tensor`, which returns the pending work so a pipeline stage can go on with
its next micro-batch while the previous one is on the wire.

Objects (a step's plan, a step's result) travel in one frame of `FRAME_BYTES`; only a
larger payload costs a second message. They are encoded by `wire_codec` for the type
the receiver names, never pickled: a peer's bytes can only become that type.
"""

from __future__ import annotations

from typing import Any

import torch

from pagoda.distributed.wire_codec import decode, encode

# One control frame: 8 bytes of payload length, then the payload if it fits.
# A decode step's plan for a few hundred requests fits in 64 KiB.
FRAME_BYTES = 64 * 1024
_LEN_BYTES = 8


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum `x` over the group, in place; returns `x`."""
    group.allreduce([x]).wait()
    return x


def all_gather(x: torch.Tensor, group, size: int, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, in rank order."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    group.allgather([parts], [x]).wait()
    return torch.cat(parts, dim=dim)


def gather(x: torch.Tensor, group, size: int, rank: int, dst: int = 0,
           dim: int = -1) -> torch.Tensor | None:
    """Concatenate every rank's `x` along `dim` at rank `dst` only; None elsewhere."""
    x = x.contiguous()
    opts = torch.distributed.GatherOptions()
    opts.rootRank = dst
    if rank != dst:
        group.gather([], [x], opts).wait()
        return None
    parts = [torch.empty_like(x) for _ in range(size)]
    group.gather([parts], [x], opts).wait()
    return torch.cat(parts, dim=dim)


def min_over(value: int, group) -> int:
    """The smallest `value` any rank of the group holds."""
    t = torch.tensor([value], dtype=torch.int64)
    opts = torch.distributed.AllreduceOptions()
    opts.reduceOp = torch.distributed.ReduceOp.MIN
    group.allreduce([t], opts).wait()
    return int(t.item())


def send_tensor(x: torch.Tensor, group, dst: int, tag: int = 0):
    """Start sending `x` to rank `dst`; returns the work to `.wait()` on.
    Keep `x` alive and unmodified until then."""
    return group.send([x.contiguous()], dst, tag)


def recv_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str,
                group, src: int, tag: int = 0) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device=device)
    group.recv([out], src, tag).wait()
    return out


def _frame(payload: bytes) -> tuple[torch.Tensor, torch.Tensor | None]:
    """payload -> (fixed-size first frame, overflow tensor or None)."""
    frame = torch.zeros(FRAME_BYTES, dtype=torch.uint8)
    frame[:_LEN_BYTES] = torch.frombuffer(bytearray(len(payload).to_bytes(_LEN_BYTES, "little")),
                                          dtype=torch.uint8)
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else None
    if len(payload) <= FRAME_BYTES - _LEN_BYTES:
        if data is not None:
            frame[_LEN_BYTES:_LEN_BYTES + len(payload)] = data
        return frame, None
    return frame, data


def _length(frame: torch.Tensor) -> int:
    return int.from_bytes(bytes(frame[:_LEN_BYTES].tolist()), "little")


def _unframe(frame: torch.Tensor, overflow: torch.Tensor | None) -> bytes:
    n = _length(frame)
    data = overflow if overflow is not None else frame[_LEN_BYTES:_LEN_BYTES + n]
    return data.numpy().tobytes()


def broadcast_object(obj: Any, group, src: int, rank: int, tp: Any) -> Any:
    """`src` sends `obj`, a `tp`; every rank returns it (a copy everywhere but `src`)."""
    if rank == src:
        broadcast_bytes(encode(obj, tp), group, src, rank)
        return obj
    return decode(broadcast_bytes(None, group, src, rank), tp)


def broadcast_bytes(payload: bytes | None, group, src: int, rank: int) -> bytes:
    """`src` sends `payload`; every rank returns it."""
    if rank == src:
        frame, overflow = _frame(payload)
        group.broadcast([frame], _root(src)).wait()
        if overflow is not None:
            group.broadcast([overflow], _root(src)).wait()
        return payload
    frame = torch.empty(FRAME_BYTES, dtype=torch.uint8)
    group.broadcast([frame], _root(src)).wait()
    n = _length(frame)
    overflow = None
    if n > FRAME_BYTES - _LEN_BYTES:
        overflow = torch.empty(n, dtype=torch.uint8)
        group.broadcast([overflow], _root(src)).wait()
    return _unframe(frame, overflow)


def send_object(obj: Any, group, dst: int, tp: Any, tag: int = 0) -> None:
    """Send `obj`, a `tp`, to rank `dst` (which receives it with the same `tp`)."""
    frame, overflow = _frame(encode(obj, tp))
    group.send([frame], dst, tag).wait()
    if overflow is not None:
        group.send([overflow], dst, tag).wait()


def recv_object(group, src: int, tp: Any, tag: int = 0) -> Any:
    """A `tp` from rank `src`; WireError if what arrives is not one."""
    frame = torch.empty(FRAME_BYTES, dtype=torch.uint8)
    group.recv([frame], src, tag).wait()
    n = _length(frame)
    overflow = None
    if n > FRAME_BYTES - _LEN_BYTES:
        overflow = torch.empty(n, dtype=torch.uint8)
        group.recv([overflow], src, tag).wait()
    return decode(_unframe(frame, overflow), tp)


def _root(src: int):
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = src
    return opts
