"""Which slot of the Mamba2 layers' state pools each running request owns.

A hybrid model's recurrent layers keep one fixed-size state per request
(`pagoda.model.kv_cache.recurrent_state_shapes`), in pools of `max_num_seqs` slots
allocated with the KV cache. A request gets a slot the first step it runs and gives it
back when it finishes or is preempted (a preempted request recomputes from token 0, so
its state is rebuilt from the tokens).

Invariant: a request is given a slot only when it starts at token 0 (the slot is
zeroed then) or at a prefix-cache hit whose state a checkpoint holds
(`pagoda.core.state_checkpoints`: the slot is copied from the checkpoint, which the
pools keep after the `num_slots` running requests' slots); one arriving with computed
tokens and no checkpoint (pulled or transferred KV blocks) is refused with an error,
never run on a state that skipped those tokens. A migrated request (the gateway re-sends it
with its generated tokens as `output_token_ids`) is not such a request: prefix caching
and KV transfers are off for hybrid models, so it starts at token 0 and its whole
context (prompt + generated tokens) rebuilds the state, as after a preemption
(tests/model/architectures/test_granitemoehybrid_migration.py).
"""

from __future__ import annotations

import torch


class RecurrentStateSlots:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.free = list(range(num_slots - 1, -1, -1))
        self.slots: dict[str, int] = {}

    def release(self, req_id: str) -> None:
        slot = self.slots.pop(req_id, None)
        if slot is not None:
            self.free.append(slot)

    def assign(self, req_ids: list[str], num_computed: list[int],
               caches: list[tuple[torch.Tensor, torch.Tensor]],
               recurrent_layers: list[int], restores: dict[str, int] | None = None
               ) -> list[int]:
        """The slot of each request of the step (in order), new ones zeroed in every
        recurrent layer's pool (`recurrent_layers`: their indices in `caches`), or
        copied from checkpoint `restores[req_id]` (a prefix hit; checkpoint c is pool
        index num_slots + c)."""
        slots = []
        restores = restores or {}
        for req_id, computed in zip(req_ids, num_computed, strict=True):
            slot = self.slots.get(req_id)
            if slot is None and computed != 0 and req_id in restores:
                if not self.free:
                    raise RuntimeError("no free Mamba state slot: more running requests than "
                                       "max_num_seqs")
                slot = self.slots[req_id] = self.free.pop()
                source = self.num_slots + restores[req_id]
                for i in recurrent_layers:
                    conv, ssm = caches[i]
                    conv[slot].copy_(conv[source])
                    ssm[slot].copy_(ssm[source])
            elif slot is None:
                if computed != 0:
                    raise RuntimeError(
                        f"request {req_id!r} starts at token {computed} but its Mamba state "
                        "is not held by this worker: a hybrid model's state must be computed "
                        "from token 0 (prefix caching and KV migration do not carry it)")
                if not self.free:
                    raise RuntimeError("no free Mamba state slot: more running requests than "
                                       "max_num_seqs")
                slot = self.slots[req_id] = self.free.pop()
                for i in recurrent_layers:
                    conv, ssm = caches[i]
                    conv[slot].zero_()
                    ssm[slot].zero_()
            slots.append(slot)
        return slots


def rewind_to_accepted_drafts(model: torch.nn.Module, md, sampled: list[list[int]]) -> None:
    """After draft verification, every Mamba layer keeps the state after each verifying
    request's last accepted token (its emitted tokens less the bonus one), not after its
    rejected drafts, which the next step does not feed again (`pagoda.model.mamba2`)."""
    mixers = [m for m in model.modules() if hasattr(m, "keep_checkpoint")]
    for slot, wanted, tokens in zip(md.state_slots, md.state_checkpoints, sampled):
        if wanted:
            for mixer in mixers:
                mixer.keep_checkpoint(slot, max(len(tokens), 1) - 1)
