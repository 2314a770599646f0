"""What the index does with an instance's next batch or heartbeat: a pure decision.

An instance numbers its event batches 0, 1, 2, ... within an epoch (one epoch per
process start). The index keeps, per instance, the epoch and the last batch it
applied. From those and the incoming message alone it decides:

    unknown instance, or a new epoch      -> forget the old entries; apply a batch
                                             numbered 0 or a snapshot, else RESYNC
    same epoch, snapshot                  -> APPLY (replaces everything)
    same epoch, waiting for a snapshot    -> RESYNC (the batch is superseded)
    same epoch, next number               -> APPLY
    same epoch, a number already applied  -> DUPLICATE (acknowledged, not re-applied)
    same epoch, a number past the next    -> RESYNC (batches were lost: a gap)

Invariant: the index applies an instance's batches only in order and without
holes, so its entries equal the instance's cache as of the last applied batch,
or the instance is marked as owing a snapshot.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Action(enum.Enum):
    APPLY = "apply"
    DUPLICATE = "duplicate"
    RESYNC = "resync"


class Reason(enum.Enum):
    """Why a resync was asked for (a metric label)."""

    NONE = "none"
    GAP = "gap"                    # a batch number was skipped
    UNKNOWN = "unknown_instance"   # registration expired, Redis flushed, new index
    PENDING = "pending"            # still waiting for the snapshot asked for earlier


@dataclass(frozen=True)
class InstanceMeta:
    """What the index remembers of one instance."""

    epoch: str
    last_sequence_number: int  # -1: no batch applied in this epoch yet
    resync_pending: bool


@dataclass(frozen=True)
class Decision:
    action: Action
    drop_old_entries: bool  # the instance is new to the index or restarted
    reason: Reason = Reason.NONE


def decide_batch(meta: InstanceMeta | None, epoch: str, sequence_number: int,
                 is_snapshot: bool) -> Decision:
    """The decision for one `PublishKvEvents` batch."""
    fresh = meta is None or meta.epoch != epoch
    if fresh:
        if is_snapshot or sequence_number == 0:
            return Decision(Action.APPLY, drop_old_entries=True)
        return Decision(Action.RESYNC, drop_old_entries=True, reason=Reason.UNKNOWN)
    if is_snapshot:
        return Decision(Action.APPLY, drop_old_entries=False)
    if meta.resync_pending:
        return Decision(Action.RESYNC, drop_old_entries=False, reason=Reason.PENDING)
    if sequence_number == meta.last_sequence_number + 1:
        return Decision(Action.APPLY, drop_old_entries=False)
    if sequence_number <= meta.last_sequence_number:
        return Decision(Action.DUPLICATE, drop_old_entries=False)
    return Decision(Action.RESYNC, drop_old_entries=False, reason=Reason.GAP)


def decide_heartbeat(meta: InstanceMeta | None, epoch: str, num_batches_sent: int) -> Decision:
    """The decision for one `Heartbeat`: APPLY means "registration refreshed, in sync"."""
    if meta is None or meta.epoch != epoch:
        if num_batches_sent == 0:
            return Decision(Action.APPLY, drop_old_entries=True)
        return Decision(Action.RESYNC, drop_old_entries=True, reason=Reason.UNKNOWN)
    if meta.resync_pending:
        return Decision(Action.RESYNC, drop_old_entries=False, reason=Reason.PENDING)
    if num_batches_sent > meta.last_sequence_number + 1:
        return Decision(Action.RESYNC, drop_old_entries=False, reason=Reason.GAP)
    return Decision(Action.APPLY, drop_old_entries=False)
