"""A worker's check of each step's plan before anything of it is applied.

The model runner trusts its plan: a block id past the cache, a token id past the
vocabulary (an out-of-range embedding index: on a GPU a device assert that ends the
process), a position past `max_model_len`, a diff for a request it never saw would
raise deep inside a step (after some state was already changed) or, worse, silently
read another request's KV. `PlanLedger` mirrors what the worker holds for
each request (known tokens, blocks, computed tokens) from the plans it accepted and
the tokens it sampled, and `check` refuses a plan that does not fit it, naming the
request at fault (`PlanRejected`), before the runner sees any of it.

Only the plan's own invariants live here (step ids in the servicer; block ids, token
spans, draft rows, token ids and lengths against the model's tables here). A request's
rules (sampling params, logprobs, per-token tables) are the scheduler's, checked once
at its trust boundary (`pagoda.request_checks`); a value they let through that still
fails a step is the step-recovery path's (`pagoda.core.step_quarantine`).

Invariant: between steps the ledger equals the runner's request states in the
numbers it keeps; `check` changes nothing, `record` is called once per executed step.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.lora.adapter import check_adapter
from pagoda.messages import ModelRunnerOutput, NewRequestData, SchedulerOutput


class PlanRejected(ValueError):
    """A plan the worker will not run; `request_id` is the request at fault, if one is."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


@dataclass(slots=True)
class _Held:
    num_tokens: int  # prompt + output tokens the worker knows
    num_blocks: int
    num_computed_tokens: int


class PlanLedger:
    """What the worker holds, request by request, as far as a plan can change it."""

    def __init__(self, num_blocks: int, block_size: int, vocab_size: int,
                 max_model_len: int, num_state_checkpoints: int = 0) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        # A hybrid model's state checkpoint slots (pagoda.core.state_checkpoints).
        self.num_state_checkpoints = num_state_checkpoints
        self.held: dict[str, _Held] = {}

    def check(self, plan: SchedulerOutput) -> None:
        """Raise PlanRejected for a plan the runner cannot run as given."""
        # The requests the worker holds for this plan: those it drops first are not.
        # (Looked up, not copied: a decode step runs every held request, and the check
        # runs between two steps, where the device waits.)
        gone = plan.finished_req_ids | plan.preempted_req_ids
        all_held = self.held
        held = all_held if not gone else {r: h for r, h in all_held.items() if r not in gone}
        scheduled = plan.num_scheduled_tokens
        new_ids = [d.req_id for d in plan.scheduled_new_reqs]
        cached = plan.scheduled_cached_reqs
        ids = new_ids + list(cached.req_ids)
        if len(set(ids)) != len(ids) or set(ids) != set(scheduled):
            raise PlanRejected("the plan's requests and its token counts disagree")
        if sum(scheduled.values()) != plan.total_num_scheduled_tokens:
            raise PlanRejected("total_num_scheduled_tokens is not the sum of the counts")
        if not (len(cached.new_block_ids) == len(cached.num_computed_tokens) == len(cached.req_ids)):
            raise PlanRejected("the cached requests' columns have different lengths")
        drafts = plan.scheduled_spec_decode_tokens
        if not set(drafts) <= set(cached.req_ids):
            raise PlanRejected("draft tokens for a request that is not a scheduled decode")
        # Host-tier copies: device block ids in the cache; an onload fills blocks of a
        # request new this step, before its computed tokens (the slot is the tier's check).
        self._check_blocks([op.block_id for op in plan.kv_offloads], None)
        new_by_id = {d.req_id: d for d in plan.scheduled_new_reqs}
        for op in plan.kv_onloads:
            data = new_by_id.get(op.req_id)
            if data is None or op.medium not in ("cpu", "disk") \
                    or not 0 <= op.block_index < len(data.block_ids) \
                    or data.block_ids[op.block_index] != op.block_id \
                    or (op.block_index + 1) * self.block_size > data.num_computed_tokens:
                raise PlanRejected("a host-tier onload that is not a computed block of a new "
                                   "request", op.req_id if data is not None else None)
        self._check_state_checkpoints(plan)
        # Asynchronous onloads: into device blocks of the cache, of requests in no batch.
        self._check_blocks([op.block_id for op in plan.kv_async_onloads], None)
        for op in plan.kv_async_onloads:
            if op.medium not in ("cpu", "disk") or op.req_id in scheduled or op.req_id in held:
                raise PlanRejected("an asynchronous onload for a request in the batch or of "
                                   "an unknown medium", op.req_id if op.req_id in held else None)
        for data in plan.scheduled_new_reqs:
            if data.req_id in held:
                raise PlanRejected("a new request with the id of one the worker holds",
                                   data.req_id)
            self._check_new(data, scheduled[data.req_id])
        block_size = self.block_size
        for req_id, new_blocks, computed in zip(cached.req_ids, cached.new_block_ids,
                                                cached.num_computed_tokens):
            h = held.get(req_id)
            if h is None:
                raise PlanRejected("a diff for a request the worker does not hold", req_id)
            if new_blocks:
                self._check_blocks(new_blocks, req_id)
            num_tokens = h.num_tokens
            if drafts and req_id in drafts:
                num_tokens += self._check_drafts(req_id, drafts[req_id], num_tokens - computed)
            # _check_span inline (a decode step's every request): refused there when not.
            num_scheduled = scheduled[req_id]
            end = computed + num_scheduled
            if (num_scheduled < 1 or computed < 0 or end > num_tokens
                    or end > (h.num_blocks + len(new_blocks)) * block_size):
                self._check_span(req_id, num_tokens, h.num_blocks + len(new_blocks), computed,
                                 num_scheduled)
        self._check_grammar(plan)

    def record(self, plan: SchedulerOutput, output: ModelRunnerOutput) -> None:
        """Apply an executed step: the plan's diffs, then the tokens it sampled."""
        for req_id in plan.finished_req_ids | plan.preempted_req_ids:
            self.held.pop(req_id, None)
        for data in plan.scheduled_new_reqs:
            self.held[data.req_id] = _Held(len(data.prompt_token_ids) + len(data.output_token_ids),
                                           len(data.block_ids), data.num_computed_tokens)
        held = self.held
        cached = plan.scheduled_cached_reqs
        scheduled = plan.num_scheduled_tokens
        for req_id, new_blocks, computed in zip(cached.req_ids, cached.new_block_ids,
                                                cached.num_computed_tokens):
            h = held[req_id]
            if new_blocks:
                h.num_blocks += len(new_blocks)
            h.num_computed_tokens = computed
        for req_id, n in scheduled.items():
            held[req_id].num_computed_tokens += n
        for req_id, tokens in zip(output.req_ids, output.sampled_token_ids):
            h = held.get(req_id)
            if h is not None:
                h.num_tokens += len(tokens)

    def reset(self, num_blocks: int | None = None) -> None:
        self.held.clear()
        if num_blocks is not None:
            self.num_blocks = num_blocks

    # ---------------------------------------------------------------- parts
    def _check_state_checkpoints(self, plan: SchedulerOutput) -> None:
        """A restore names a checkpoint slot of a request starting past token 0; a
        save, one of a request of the step, within its tokens of the step."""
        slots = range(self.num_state_checkpoints)
        for data in plan.scheduled_new_reqs:
            if data.state_restore is not None and (data.state_restore not in slots
                                                   or data.num_computed_tokens == 0):
                raise PlanRejected(f"a state checkpoint restore from slot {data.state_restore} "
                                   f"(the worker has {len(slots)})", data.req_id)
        for req_id, (num_tokens, slot) in plan.state_saves.items():
            if slot not in slots or not 0 < num_tokens <= plan.num_scheduled_tokens.get(req_id, 0):
                raise PlanRejected(f"a state checkpoint save of {num_tokens} tokens into slot "
                                   f"{slot} (the worker has {len(slots)})", req_id)

    def _check_new(self, data: NewRequestData, num_scheduled: int) -> None:
        rid = data.req_id
        tokens = [*data.prompt_token_ids, *data.output_token_ids]
        if not data.prompt_token_ids or len(tokens) > self.max_model_len:
            raise PlanRejected(f"{len(tokens)} tokens do not fit the model length", rid)
        if any(not 0 <= t < self.vocab_size for t in tokens):
            raise PlanRejected("a token id outside the vocabulary", rid)
        self._check_blocks(data.block_ids, rid)
        self._check_span(rid, len(tokens), len(data.block_ids), data.num_computed_tokens,
                         num_scheduled)

    def _check_blocks(self, block_ids: list[int], req_id: str) -> None:
        if any(not 0 <= b < self.num_blocks for b in block_ids):
            raise PlanRejected(f"a block id outside the cache's {self.num_blocks} blocks", req_id)

    def _check_span(self, req_id: str, num_tokens: int, num_blocks: int, computed: int,
                    num_scheduled: int) -> None:
        end = computed + num_scheduled
        if num_scheduled < 1 or computed < 0 or end > num_tokens:
            raise PlanRejected(f"tokens [{computed}, {end}) are not among its {num_tokens}",
                               req_id)
        if end > num_blocks * self.block_size:
            raise PlanRejected(f"{end} tokens do not fit its {num_blocks} blocks", req_id)

    def _check_drafts(self, req_id: str, drafts: list[int] | None, num_uncomputed: int) -> int:
        """Drafts follow exactly one known-but-uncomputed token, within the vocabulary."""
        if not drafts:
            return 0
        if num_uncomputed != 1:
            raise PlanRejected("draft tokens for a request that is not decoding", req_id)
        if any(not 0 <= t < self.vocab_size for t in drafts):
            raise PlanRejected("a draft token id outside the vocabulary", req_id)
        return len(drafts)

    def _check_grammar(self, plan: SchedulerOutput) -> None:
        ids, bitmask = plan.structured_output_request_ids, plan.grammar_bitmask
        if bitmask is None:
            return
        if bitmask.ndim != 2 or bitmask.shape[0] != len(ids) or not set(ids) <= set(
                plan.num_scheduled_tokens):
            raise PlanRejected("the grammar bitmask does not match its requests")


def load_adapters(executor, lora_config, plan: SchedulerOutput) -> None:
    """Before a step runs: every LoRA adapter its new requests name can run here, and
    (in a single-rank worker) is loaded into the host cache now, so a missing, too
    large or malformed adapter refuses the plan naming its request (PlanRejected)
    instead of failing the step midway. `lora_config` is None without --enable-lora.
    A multi-rank group's ranks load in their step; here the cheap check covers it."""
    manager = getattr(getattr(executor, "runner", None), "lora_manager", None)
    for data in plan.scheduled_new_reqs:
        lora = data.lora_request
        if lora is None:
            continue
        if lora_config is None:
            raise PlanRejected("a LoRA request but LoRA is not enabled", data.req_id)
        try:
            check_adapter(lora.lora_path, lora_config.max_lora_rank)
            if manager is not None:
                manager.add_adapter(lora)
        except (ValueError, OSError, RuntimeError) as exc:
            raise PlanRejected(f"LoRA adapter {lora.lora_name!r}: {exc}", data.req_id) from None
