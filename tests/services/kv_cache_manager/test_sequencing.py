"""The index's ordering rules for an instance's batches and heartbeats."""

from __future__ import annotations

import pytest

from pagoda.services.kv_cache_manager.sequencing import (Action, InstanceMeta, Reason,
                                                          decide_batch, decide_heartbeat)

KNOWN = InstanceMeta("e1", last_sequence_number=4, resync_pending=False)
OWING = InstanceMeta("e1", last_sequence_number=4, resync_pending=True)


@pytest.mark.parametrize("meta, epoch, seq, snapshot, action, drop, reason", [
    (None, "e1", 0, False, Action.APPLY, True, Reason.NONE),
    (None, "e1", 3, False, Action.RESYNC, True, Reason.UNKNOWN),
    (None, "e1", 3, True, Action.APPLY, True, Reason.NONE),
    (KNOWN, "e2", 0, False, Action.APPLY, True, Reason.NONE),      # restarted
    (KNOWN, "e2", 9, False, Action.RESYNC, True, Reason.UNKNOWN),  # restarted, lost batch 0
    (KNOWN, "e1", 5, False, Action.APPLY, False, Reason.NONE),
    (KNOWN, "e1", 4, False, Action.DUPLICATE, False, Reason.NONE),
    (KNOWN, "e1", 7, False, Action.RESYNC, False, Reason.GAP),
    (OWING, "e1", 5, False, Action.RESYNC, False, Reason.PENDING),
    (OWING, "e1", 9, True, Action.APPLY, False, Reason.NONE),
])
def test_batches(meta, epoch, seq, snapshot, action, drop, reason):
    decision = decide_batch(meta, epoch, seq, snapshot)
    assert (decision.action, decision.drop_old_entries, decision.reason) == (action, drop, reason)


@pytest.mark.parametrize("meta, epoch, sent, action, reason", [
    (None, "e1", 0, Action.APPLY, Reason.NONE),
    (None, "e1", 2, Action.RESYNC, Reason.UNKNOWN),
    (KNOWN, "e1", 5, Action.APPLY, Reason.NONE),
    (KNOWN, "e1", 6, Action.RESYNC, Reason.GAP),  # batch 5 went out and never arrived
    (OWING, "e1", 5, Action.RESYNC, Reason.PENDING),
])
def test_heartbeats(meta, epoch, sent, action, reason):
    decision = decide_heartbeat(meta, epoch, sent)
    assert (decision.action, decision.reason) == (action, reason)
