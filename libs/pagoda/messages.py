"""The messages that cross the engine's boundaries, in one module every layer imports downward.

Three hops, named by pipeline stage:

  caller ──EngineCoreRequest──► EngineCore ──SchedulerOutput──► worker
  caller ◄──EngineCoreOutput─── EngineCore ◄─ModelRunnerOutput── worker

* Engine core in/out: past the tokenizer only token ids travel. An `EngineCoreRequest`
  carries the prompt's token ids; an `EngineCoreOutput` carries each step's new token
  ids. Text, stop strings and detokenization live outside the core.
* Scheduler -> worker (`SchedulerOutput`): a plan made of diffs. A request's prompt,
  sampling params and block ids travel once (`NewRequestData`); afterwards only its new
  block ids travel (`CachedRequestData`). The worker keeps its own persistent copy of
  every running request, appends the tokens it samples itself, and forgets a request
  when its id shows up in `finished_req_ids` or `preempted_req_ids`. A preempted
  request that is resumed travels again as new.
* Worker -> scheduler (`ModelRunnerOutput`): sampled tokens and logprobs per request,
  or a pooling request's pooled vector (`pooler_output`).
* A pooling request (`pooling_params` set) is a prefill and nothing else: its whole
  prompt runs in one step, the worker pools the hidden states instead of sampling,
  and the request finishes in that step with `EngineCoreOutput.pooling_output`.

This module imports nothing from `core/`, `engine/` or `worker/`: they import it. The
gateway may import it too (small plain dataclasses, no model code).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagoda.kv_transfer.params import KVTransferParams
from pagoda.lora.request import LoRARequest
from pagoda.multimodal.inputs import MultiModalFeature
from pagoda.pooling_params import PoolingParams
from pagoda.sampling_params import SamplingParams

if TYPE_CHECKING:
    import numpy as np


# ---------------------------------------------------------------- worker -> scheduler
@dataclass
class LogprobsLists:
    """Logprobs of sampled (or prompt) positions, one row per position.

    Row i: `token_ids[i]` = [chosen token, top-1, ..., top-k], `logprobs[i]` their
    log-probabilities, `ranks[i]` their ranks (1 = most likely) in the full vocabulary.
    """

    token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    ranks: list[list[int]] = field(default_factory=list)


@dataclass
class ModelRunnerOutput:
    """Per-step result, in the order of `req_ids`.

    `sampled_token_ids[i]` is empty for a request whose prefill is still partial
    (no token sampled this step) and holds one token otherwise; a request verifying
    k draft tokens (speculative decoding) gets 1 to k + 1: its accepted drafts, then
    the target's own token.
    """

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    # req_id -> logprobs of the token sampled this step (only if requested).
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    # req_id -> logprobs of the prompt positions computed this step (only if requested).
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    # req_id -> the pooled vector of a pooling request whose prompt ran this step.
    pooler_output: dict[str, list[float]] = field(default_factory=dict)
    # req_id -> draft tokens a draft model proposes for its next step (speculative
    # decoding with a draft model; the scheduler decides whether to verify them).
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)

    # Encoder cache lookups this step (media items whose placeholder rows the step
    # needed) and how many found the item's encoder output already computed.
    num_encoder_cache_queries: int = 0
    num_encoder_cache_hits: int = 0
    # Asynchronous onloads (`SchedulerOutput.kv_async_onloads`, vLLM's KVConnectorOutput
    # names): the requests whose copies every rank finished since the last report, and
    # the device blocks among theirs that any rank could not fill (hash, checksum or
    # read failure): the scheduler recomputes from the first of those.
    finished_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)

    @classmethod
    def empty(cls) -> "ModelRunnerOutput":
        return cls([], [])


# ---------------------------------------------------------------- engine core in/out
class FinishReason(enum.IntEnum):
    """Why a request stopped. `str()` gives the OpenAI `finish_reason`."""

    STOP = 0  # EOS, a stop token id, or a stop string
    LENGTH = 1  # max_tokens or max_model_len
    ABORT = 2  # client disconnect / abort / error
    # vLLM's (3 is its ERROR): the output looped (SamplingParams.repetition_detection);
    # stop_reason "repetition_detected".
    REPETITION = 4

    def __str__(self) -> str:
        return self.name.lower()


@dataclass
class EngineCoreRequest:
    """A tokenized request entering a scheduler (one completion: the caller fans
    out `n > 1` into n requests)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.time)
    # Resumed requests (migration): tokens already generated elsewhere.
    output_token_ids: list[int] = field(default_factory=list)
    # Hashed into every prefix-cache block (vLLM's `cache_salt`): equal prompts with
    # different salts never share cached KV. None for no salt.
    cache_salt: str | None = None
    # A pooling request: run the prompt and return one vector; its sampling_params
    # are then `pooling_params.PREFILL_ONLY` (never sampled).
    pooling_params: PoolingParams | None = None
    # vLLM's `priority`: under --scheduling-policy priority, lower values are admitted
    # first (ties by arrival) and higher ones are preempted first; must be 0 under fcfs.
    priority: int = 0
    # Prefill/decode disaggregation (vLLM's kv_transfer_params): asks a prefill
    # replica to lease the prompt's blocks, or tells a decode replica where they are.
    kv_transfer_params: KVTransferParams | None = None
    # The LoRA adapter to run with (None: the base model); its name keys the prefix cache.
    lora_request: LoRARequest | None = None
    # One per media item of the prompt, sorted by offset (pagoda.multimodal.inputs):
    # each item's placeholder run in prompt_token_ids, its content hash (which keys the
    # prefix-cache blocks it overlaps and the worker's encoder cache) and its processor
    # outputs (`data`; the encoder input). Empty for a text prompt.
    mm_features: list[MultiModalFeature] = field(default_factory=list)

    @property
    def lora_key(self) -> str | None:
        """The adapter's prefix-cache key (None for the base model)."""
        return self.lora_request.cache_key if self.lora_request else None


@dataclass(slots=True)  # 256 made and read every step at batch 256
class EngineCoreOutput:
    """One request's progress in one step.

    `new_token_ids` may be empty (a partial prefill produces nothing, but a
    finished/aborted request still reports once with its finish_reason).
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # A pooling request's result, on its one (finished) output.
    pooling_output: list[float] | None = None
    # A prefill replica's lease on the finished prompt's blocks (disaggregation).
    kv_transfer_params: KVTransferParams | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


# ---------------------------------------------------------------- scheduler -> worker
@dataclass
class NewRequestData:
    """A request the worker has not seen (or forgot on preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    # Tokens generated before a preemption; empty for a fresh request.
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    pooling_params: PoolingParams | None = None  # set for a pooling request
    # The request's adapter, sent once; the worker loads it (pagoda.lora.manager).
    lora_request: LoRARequest | None = None
    # The prompt's media items with their encoder inputs (`data`), sent once; the
    # worker encodes each when its placeholder run is first scheduled.
    mm_features: list[MultiModalFeature] = field(default_factory=list)
    # A hybrid model's prefix hit (pagoda.core.state_checkpoints): the checkpoint slot
    # holding the recurrent state after its `num_computed_tokens`; None: a zero state.
    state_restore: int | None = None


@dataclass
class CachedRequestData:
    """Requests the worker already holds, in column form."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class KVOffload:
    """Copy device block `block_id` (evicted from the prefix cache this step, its KV
    written in an earlier one) into host-tier slot `slot` under `block_hash`, before
    the step's forward overwrites it (pagoda.worker.host_kv_tier)."""

    block_id: int
    slot: int
    block_hash: bytes


@dataclass
class KVOnload:
    """Copy host-tier slot `slot` (expected to hold `block_hash`) into device block
    `block_id`, block `block_index` of request `req_id`, before the step's forward.
    If the slot does not hold that hash or its checksum fails, the worker recomputes
    the request from that block instead (the answer is the same, only slower)."""

    req_id: str
    block_index: int
    slot: int
    block_id: int
    block_hash: bytes
    # "cpu": from host slot `slot`; "disk": from the disk tier's record of
    # `block_hash` (`slot` unused, -1), verified the same way (vLLM's KV event medium).
    medium: str = "cpu"


@dataclass
class KVSpill:
    """Write host-tier slot `slot` (expected to hold `block_hash`) to the disk tier
    before this step's offloads reuse the slot (pagoda.worker.disk_kv_tier). With
    `block_id` >= 0 the bytes come from that device block instead (its KV written in
    an earlier step): the host tier took and lost the block within this one step."""

    slot: int
    block_hash: bytes
    block_id: int = -1


@dataclass
class SchedulerOutput:
    """One step's plan.

    Invariant: `num_scheduled_tokens` has one entry for every request in
    `scheduled_new_reqs` and `scheduled_cached_reqs`, and their sum is
    `total_num_scheduled_tokens` (<= max_num_batched_tokens). Structured outputs
    (vLLM's `GrammarOutput`): row i of `grammar_bitmask` (packed int32,
    [len(structured_output_request_ids), ceil(vocab_size / 32)], bit t % 32 of word
    t // 32 set = token t allowed) constrains the token that request
    `structured_output_request_ids[i]` samples this step (each of them samples this
    step); None when no row is constrained.
    """

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    structured_output_request_ids: list[str] = field(default_factory=list)
    grammar_bitmask: "np.ndarray | None" = None
    # Speculative decoding: req_id -> the draft tokens it verifies this step, after its
    # known tokens. Its num_scheduled_tokens counts them: known-but-uncomputed (1) +
    # len(drafts). The scheduler rolls back the computed tokens of rejected drafts.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # KV offloading (--kv-offloading-size): host-tier copies the worker makes before the
    # forward, offloads first (their device blocks are reused by this step), then onloads.
    kv_offloads: list[KVOffload] = field(default_factory=list)
    kv_onloads: list[KVOnload] = field(default_factory=list)
    # The disk tier (--kv-offloading-disk-path), run before the offloads: host slots
    # written to disk (the host tier evicted them), then disk records deleted (the disk
    # tier evicted them). Disk onloads are `kv_onloads` with medium "disk".
    kv_spills: list[KVSpill] = field(default_factory=list)
    kv_disk_drops: list[bytes] = field(default_factory=list)
    # A hybrid model's state checkpoints (pagoda.core.state_checkpoints): req_id ->
    # (tokens of its step after which to save the recurrent state, checkpoint slot).
    state_saves: dict[str, tuple[int, int]] = field(default_factory=dict)
    # Asynchronous onloads (the default, `CacheConfig.kv_onload_async`): copies the
    # worker starts after this step's offloads, in the background, into blocks of
    # requests that are not in the batch (they wait, WAITING_FOR_REMOTE_KVS, until the
    # worker reports them in `ModelRunnerOutput.finished_recving`). Their host slots and
    # disk records are neither overwritten nor dropped until then (`kv_offload.py`).
    kv_async_onloads: list[KVOnload] = field(default_factory=list)

    @classmethod
    def empty(cls) -> "SchedulerOutput":
        return cls([], CachedRequestData(), {}, 0)
