"""Scheduler -> kv-cache-manager messages (KV cache events)."""

from __future__ import annotations

from collections.abc import Sequence

from pagoda.services._proto.pagoda.kv_cache_manager.v1 import kv_cache_manager_pb2 as pb
from pagoda.core.kv_events import (MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored,
                                   KVEvent)


def kv_event_to_proto(event: KVEvent) -> pb.KvEvent:
    msg = pb.KvEvent()
    fill_kv_event(msg, event)
    return msg


def fill_kv_event(msg: pb.KvEvent, event: KVEvent) -> None:
    """`event` written into the empty `msg` in place (a repeated field's `add()`: no
    message built and copied in; the scheduler publishes ~1000 a second at batch 256)."""
    if isinstance(event, BlockStored):
        stored = msg.block_stored
        stored.block_hashes.extend(event.block_hashes)
        if event.parent_block_hash:
            stored.parent_block_hash = event.parent_block_hash
        stored.token_ids.extend(event.token_ids)
        stored.block_size = event.block_size
        stored.medium = event.medium
    elif isinstance(event, BlockRemoved):
        removed = msg.block_removed
        removed.block_hashes.extend(event.block_hashes)
        removed.medium = event.medium
    elif isinstance(event, AllBlocksCleared):
        msg.all_blocks_cleared.SetInParent()
    else:
        raise TypeError(f"not a KV event: {event!r}")


def kv_event_from_proto(msg: pb.KvEvent) -> KVEvent:
    kind = msg.WhichOneof("event")
    if kind == "block_stored":
        m = msg.block_stored
        return BlockStored(
            block_hashes=list(m.block_hashes),
            parent_block_hash=m.parent_block_hash or None,
            token_ids=list(m.token_ids),
            block_size=m.block_size,
            medium=m.medium or MEDIUM_GPU,
        )
    if kind == "block_removed":
        return BlockRemoved(block_hashes=list(msg.block_removed.block_hashes),
                            medium=msg.block_removed.medium or MEDIUM_GPU)
    if kind == "all_blocks_cleared":
        return AllBlocksCleared()
    raise ValueError("empty KV event")


def publish_request(instance_id: str, model: str, block_size: int, epoch: str,
                    sequence_number: int, events: Sequence[KVEvent],
                    snapshot: Sequence[bytes] | None = None,
                    leases_pinned: Sequence[pb.KvLease] = (),
                    leases_released: Sequence[str] = ()) -> pb.PublishKvEventsRequest:
    """One numbered batch; with `snapshot` (the instance's whole cache) it resyncs the
    index, and `events` then apply on top of it. Lease changes ride along."""
    msg = pb.PublishKvEventsRequest(
        instance_id=instance_id, model=model, block_size=block_size, epoch=epoch,
        sequence_number=sequence_number,
        is_snapshot=snapshot is not None, snapshot_block_hashes=list(snapshot or ()),
        leases_pinned=list(leases_pinned), leases_released=list(leases_released),
    )
    add_kv_events(msg.events, events)
    return msg


def add_kv_events(field, events: Sequence[KVEvent]) -> None:
    """`events` appended to the repeated KvEvent `field`, each filled in place."""
    add = field.add
    for event in events:
        fill_kv_event(add(), event)


def lease_to_proto(lease) -> pb.KvLease:
    """A prefill replica's `pagoda.kv_transfer.leases.Lease` as its Redis record."""
    return pb.KvLease(lease_id=lease.lease_id, request_id=lease.request_id,
                      block_ids=lease.block_ids, block_hashes=list(lease.block_hashes),
                      expiry=lease.expiry)

