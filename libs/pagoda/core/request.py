"""A request's state inside the scheduler."""

from __future__ import annotations

import enum
import time

from pagoda.core.block_hash import (DEFAULT_HASH_ALGO, BlockHash, hash_request_tokens,
                                     request_keys)
from pagoda.messages import EngineCoreRequest, FinishReason
from pagoda.repetition_detection import REPETITION_STOP_REASON, check_sequence_repetition
from pagoda.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    # Queued, but its structured-output grammar is still compiling (vLLM's WAITING_FOR_FSM).
    WAITING_FOR_GRAMMAR = enum.auto()
    RUNNING = enum.auto()
    # Out of the queue, its tier hits onloading in the background (vLLM's name): it
    # holds its blocks, is in no batch, and goes back to the queue's head when the
    # worker reports the copies done (`Scheduler._finish_onloads`).
    WAITING_FOR_REMOTE_KVS = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED = enum.auto()


class Request:
    """One sequence being generated.

    Invariants:
      * `all_token_ids == prompt_token_ids + output_token_ids`;
      * `num_computed_tokens <= num_tokens + num_output_placeholders`: the KV of the
        first `num_computed_tokens` tokens is in this request's blocks (or is written
        by steps in flight, under async scheduling). Each step the
        scheduler lets computed tokens catch up with known tokens, which covers
        prefill, chunked prefill, decode and prefix hits with one rule;
      * `block_hashes` covers exactly the full blocks of `all_token_ids`.
    """

    # Slots: every running request is read by the scheduler every step, its cache lines
    # cold by then (the step ran meanwhile); those it reads every step come first.
    __slots__ = (
        "request_id", "status", "num_computed_tokens", "num_output_placeholders",
        "all_token_ids", "output_token_ids", "max_tokens", "structured_output_request",
        "finish_reason", "stop_reason", "sampling_params", "eos_token_ids", "_block_size",
        "num_cached_tokens", "first_token_time", "block_hashes",
        # The rest.
        "pooling_params", "prompt_token_ids", "arrival_time", "priority", "num_preemptions",
        "num_failed_steps", "num_isolated_steps", "onload", "onload_void",
        "holds_onloaded_blocks", "failure", "first_scheduled_time", "spec_token_ids",
        "_hash_seed", "_hash_algo", "lora_request", "_extra_keys", "mm_features",
        "state_save_at", "state_restore",
        "num_started_mm_items",  # the encoder budget's (core/encoder_budget.py)
    )

    def __init__(self, core_request: EngineCoreRequest, block_size: int, hash_seed: str,
                 max_model_len: int, hash_algo: str = DEFAULT_HASH_ALGO) -> None:
        self.request_id = core_request.request_id
        self.sampling_params: SamplingParams = core_request.sampling_params
        # A pooling request: its prompt runs once, then it finishes with the pooled vector.
        self.pooling_params = core_request.pooling_params
        self.prompt_token_ids = list(core_request.prompt_token_ids)
        self.output_token_ids: list[int] = list(core_request.output_token_ids)
        self.all_token_ids = self.prompt_token_ids + self.output_token_ids
        self.eos_token_ids = set(core_request.eos_token_ids)
        self.arrival_time = core_request.arrival_time
        self.priority = core_request.priority  # lower first (--scheduling-policy priority)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # Async scheduling: tokens that steps in flight will sample for this request,
        # planned for before their values are known (pagoda.engine.async_steps).
        self.num_output_placeholders = 0
        self.num_cached_tokens = -1  # prefix-cache hit of the first schedule; -1 until then
        self.num_preemptions = 0
        # Steps that failed midway with this request in them, and the steps it must
        # still run alone before it is trusted again (core/step_quarantine.py).
        self.num_failed_steps = 0
        self.num_isolated_steps = 0
        # WAITING_FOR_REMOTE_KVS: (index of its first tier block, tier blocks, start
        # time.monotonic()) of its onloads in flight; `onload_void`: the worker's cache
        # was set up again meanwhile, so what they copy is not used.
        self.onload: tuple[int, int, float] | None = None
        self.onload_void = False
        # Back in the queue holding the blocks its onload filled (until admitted).
        self.holds_onloaded_blocks = False
        self.finish_reason: FinishReason | None = None
        # Why a scheduler hook ended the request (a grammar that failed to compile): the
        # engine reports it as the request's error, not as a plain abort.
        self.failure: str | None = None
        self.stop_reason: int | str | None = None
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        # Draft tokens proposed for its next decode step (speculative decoding).
        self.spec_token_ids: list[int] = []
        # Set by the scheduler's StructuredOutputManager for a constrained request.
        self.structured_output_request = None
        params = self.sampling_params
        remaining = max_model_len - len(self.prompt_token_ids)
        self.max_tokens = min(params.max_tokens, remaining) if params.max_tokens else remaining
        self._block_size = block_size
        self._hash_seed = hash_seed
        self._hash_algo = hash_algo
        self.lora_request = core_request.lora_request
        self._extra_keys = request_keys(core_request.cache_salt, core_request.lora_key)
        # The prompt's media items (placeholder runs, identifiers, encoder inputs): they
        # key the blocks they overlap and travel to the worker with the request.
        self.mm_features = list(core_request.mm_features)
        self.block_hashes: list[BlockHash] = []
        self._update_block_hashes()
        # A hybrid model with prefix caching (core/state_checkpoints.py): the block
        # boundary whose recurrent state the request's prefill saves (the last one before
        # the last token it arrived with: what the same context's hit ends at), and the
        # checkpoint slot its admission restores (None: it starts from a zero state).
        self.state_save_at = ((len(self.all_token_ids) - 1) // block_size) * block_size
        self.state_restore: int | None = None

    # ------------------------------------------------------------------ sizes
    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    # ------------------------------------------------------------------ updates
    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if len(self.all_token_ids) % self._block_size == 0:
            self._update_block_hashes()

    def append_token_and_check_stop(self, token_id: int) -> bool:
        """`append_output_token(token_id)` then `check_stop()`, in one call: what every
        plain decode request does every step. The usual verdict (no stop tokens, no
        repetition detection, under max_tokens, not EOS) is reached without the rest."""
        output = self.output_token_ids
        output.append(token_id)
        all_ids = self.all_token_ids
        all_ids.append(token_id)
        if len(all_ids) % self._block_size == 0:
            self._update_block_hashes()
        params = self.sampling_params
        if (len(output) < self.max_tokens and not params.stop_token_ids
                and params.repetition_detection is None and self.finish_reason is None
                and (params.ignore_eos or token_id not in self.eos_token_ids)):
            return False  # what check_stop finds then
        return self.check_stop()

    def check_stop(self) -> bool:
        """Sets finish_reason if the last sampled token ends the request."""
        params = self.sampling_params
        num_output = len(self.output_token_ids)  # runs per request per step: no properties
        if num_output < params.min_tokens:
            return False
        last = self.output_token_ids[-1]
        if not params.ignore_eos and last in self.eos_token_ids:
            self.finish_reason, self.stop_reason = FinishReason.STOP, None
        elif params.stop_token_ids and last in params.stop_token_ids:
            self.finish_reason, self.stop_reason = FinishReason.STOP, last
        elif num_output >= self.max_tokens:
            self.finish_reason = FinishReason.LENGTH
        elif params.repetition_detection is not None and check_sequence_repetition(
                self.output_token_ids, params.repetition_detection):
            self.finish_reason, self.stop_reason = FinishReason.REPETITION, REPETITION_STOP_REASON
        return self.finish_reason is not None

    def _update_block_hashes(self) -> None:
        self.block_hashes = hash_request_tokens(
            self.all_token_ids, self._block_size, self._hash_seed, self._extra_keys,
            start_hashes=self.block_hashes, algo=self._hash_algo, mm_features=self.mm_features)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens})")
