"""`SimulatedExecutor`: a device that only takes time (`--simulated-device`, benchmarks).

It stands where the model runner stands (the gpu-worker's executor, or the offline
engine's), so everything around a step runs for real: the scheduler plans, allocates
and frees KV blocks, the worker's plan ledger checks each plan, tokens are streamed and
detokenized. The step itself sleeps (never spins: the control plane on the same cores
gets the CPU) for the configured time, measured from the step's start, so the
bookkeeping here counts inside the simulated step.

Invariants:
- A request's output token at position p (0-based, over all its output tokens) is a
  function of its prompt and p only: the same prompt gives the same tokens in every
  run, batch, chunking and preemption. It is never an EOS id, one of the request's
  stop_token_ids, or outside the vocabulary, unless `eos_after` makes position
  `eos_after - 1` the model's first EOS id.
- A request samples exactly when a real step would: when the step reaches the end of
  its known tokens (a partial prefill chunk samples nothing).
- Logprobs, when asked, are made up: the sampled token at 0.0 (rank 1), k other ids at
  -20.0; prompt logprobs likewise name the real prompt tokens at 0.0.
- The worker keeps a request's state from its first plan until it is finished,
  aborted or preempted (the plan's finished/preempted ids), like the model runner.
"""

from __future__ import annotations

import logging
import time
import zlib
from dataclasses import dataclass, field

import numpy as np
import torch

from pagoda.config import EngineConfig
from pagoda.distributed.parallel_state import SINGLE
from pagoda.executor.base import Executor
from pagoda.messages import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from pagoda.model.kv_cache import kv_cache_bytes_per_block, kv_cache_torch_dtype

logger = logging.getLogger(__name__)
# Token ids below this are left out (special and byte tokens in most vocabularies), so
# the simulated text detokenizes to ordinary words.
_LOWEST_TOKEN = 256


@dataclass
class _Request:
    prompt_len: int
    prompt_hash: int
    num_output: int
    num_computed: int
    block_ids: list[int]
    banned: frozenset[int]
    logprobs: int | None
    prompt_logprobs: int | None
    prompt: list[int] | None  # kept only for prompt_logprobs (their target tokens)
    num_known: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_known = self.prompt_len + self.num_output


class SimulatedExecutor(Executor):
    """One simulated rank. `determine_num_blocks` sizes the cache as the CPU model
    runner would (the model's bytes per block in `kv_cache_memory_bytes`); no block
    holds any tensor."""

    def __init__(self, config: EngineConfig) -> None:
        if config.simulated_device is None:
            raise ValueError("SimulatedExecutor needs --simulated-device")
        if config.runner != "generate":
            raise ValueError("--simulated-device simulates generation, not --runner pooling")
        if config.scheduler.speculative_config is not None:
            raise ValueError("--simulated-device does not simulate speculative decoding")
        if config.world_size != 1:
            raise ValueError("--simulated-device simulates one rank (tensor/pipeline "
                             "parallel size 1)")
        self.config = config
        self.device = config.simulated_device
        self.vocab_size = config.arch.vocab_size
        self.eos_ids = frozenset(config.arch.eos_token_ids or ())
        self.lowest = _LOWEST_TOKEN if self.vocab_size > 4 * _LOWEST_TOKEN else 0
        self.num_blocks: int | None = None
        self.states: dict[str, _Request] = {}
        # Line-buffered: each step's line is in the file when the step returns (one
        # write of microseconds, against a step of milliseconds).
        self._record_file = (open(self.device.record_path, "a", buffering=1, encoding="utf-8")
                             if self.device.record_path is not None else None)
        logger.info("simulated device: %.3f ms + %.4f ms per token per step (no model loaded)",
                    self.device.base_ms, self.device.per_token_ms)

    # ------------------------------------------------------------ Executor
    def determine_num_blocks(self) -> int:
        dtype = kv_cache_torch_dtype(self.config.kv_cache_dtype, getattr(torch, self.config.dtype))
        per_block = kv_cache_bytes_per_block(self.config.arch, self.config.cache.block_size,
                                             dtype, SINGLE)
        return max(self.config.cache.kv_cache_memory_bytes // per_block, 1)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.reset()

    def reset(self) -> None:
        """Forget every request (a restarted scheduler knows none of them)."""
        self.states.clear()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        start = time.time()
        if self.num_blocks is None:
            raise RuntimeError("initialize_kv_cache must run before a step")
        so = scheduler_output
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:  # only news of finished requests: no step
            return ModelRunnerOutput.empty()
        output = self._outputs(so)
        # Sleep out the rest of the simulated step: the bookkeeping above is inside it.
        remaining = start + self.device.step_seconds(so.total_num_scheduled_tokens) - time.time()
        if remaining > 0:
            time.sleep(remaining)
        self._record(start, so)
        return output

    def shutdown(self) -> None:
        if self._record_file is not None:
            self._record_file.close()
            self._record_file = None

    # ------------------------------------------------------------ the step
    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.states.pop(req_id, None)
        for req_id in so.preempted_req_ids:
            self.states.pop(req_id, None)
        for data in so.scheduled_new_reqs:
            self._check_blocks(data.req_id, data.block_ids)
            params = data.sampling_params
            banned = frozenset(params.stop_token_ids or ()) | self.eos_ids
            prompt = np.asarray(data.prompt_token_ids, dtype=np.int64).tobytes()
            self.states[data.req_id] = _Request(
                len(data.prompt_token_ids), zlib.crc32(prompt), len(data.output_token_ids),
                data.num_computed_tokens, list(data.block_ids), banned, params.logprobs,
                params.prompt_logprobs,
                list(data.prompt_token_ids) if params.prompt_logprobs is not None else None)
        cached = so.scheduled_cached_reqs
        for req_id, new_blocks, num_computed in zip(cached.req_ids, cached.new_block_ids,
                                                    cached.num_computed_tokens):
            state = self.states.get(req_id)
            if state is None:
                raise ValueError(f"request {req_id}: a cached request the worker does not hold")
            self._check_blocks(req_id, new_blocks)
            state.block_ids.extend(new_blocks)
            state.num_computed = num_computed

    def _check_blocks(self, req_id: str, block_ids: list[int]) -> None:
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"request {req_id}: block {bad[0]} is outside the cache of "
                             f"{self.num_blocks} blocks")

    def _outputs(self, so: SchedulerOutput) -> ModelRunnerOutput:
        req_ids, sampled = [], []
        logprobs: dict[str, LogprobsLists] = {}
        prompt_logprobs: dict[str, LogprobsLists] = {}
        masks = self._grammar_rows(so)
        for req_id, n in so.num_scheduled_tokens.items():
            state = self.states[req_id]
            if state.prompt_logprobs is not None and state.num_computed < state.prompt_len - 1:
                prompt_logprobs[req_id] = self._prompt_logprobs(state, n)
            state.num_computed += n
            req_ids.append(req_id)
            if state.num_computed < state.num_known:  # a partial prefill chunk
                sampled.append([])
                continue
            token = self._token(state, masks.get(req_id))
            state.num_output += 1
            state.num_known += 1
            sampled.append([token])
            if state.logprobs is not None:
                logprobs[req_id] = self._logprobs([token], state.logprobs)
        return ModelRunnerOutput(req_ids, sampled, logprobs, prompt_logprobs)

    def _token(self, state: _Request, allowed: np.ndarray | None) -> int:
        """The token at output position `state.num_output` (see the invariant)."""
        position = state.num_output
        if self.device.eos_after is not None and position == self.device.eos_after - 1 \
                and self.eos_ids:
            return min(self.eos_ids)
        span = self.vocab_size - self.lowest
        token = self.lowest + (state.prompt_hash + position * 2654435761) % span
        for _ in range(span):
            if token not in state.banned and (allowed is None or allowed[token]):
                return token
            token = self.lowest + (token - self.lowest + 1) % span
        if allowed is not None:  # the grammar allows only low or banned ids: take its first
            return int(np.flatnonzero(allowed)[0])
        raise ValueError("no token is left to sample: every id is a stop token")

    def _grammar_rows(self, so: SchedulerOutput) -> dict[str, np.ndarray]:
        """req_id -> allowed[vocab] (bool) for this step's constrained requests."""
        if so.grammar_bitmask is None:
            return {}
        words = np.asarray(so.grammar_bitmask).view(np.uint32)
        bits = (words[:, :, None] >> np.arange(32, dtype=np.uint32)) & 1
        allowed = bits.reshape(len(words), -1)[:, :self.vocab_size].astype(bool)
        return dict(zip(so.structured_output_request_ids, allowed))

    def _logprobs(self, tokens: list[int], k: int) -> LogprobsLists:
        """The chosen token at log-probability 0 (rank 1), then k more ids far below."""
        rows = [[t, *((t + j) % self.vocab_size for j in range(1, k + 1))] for t in tokens]
        return LogprobsLists(rows, [[0.0] + [-20.0] * k for _ in rows],
                             [list(range(1, k + 2)) for _ in rows])

    def _prompt_logprobs(self, state: _Request, n: int) -> LogprobsLists:
        # Position p, computed now, predicts prompt token p + 1 (as the model runner).
        end = min(state.num_computed + n, state.prompt_len - 1)
        return self._logprobs(state.prompt[state.num_computed + 1:end + 1], state.prompt_logprobs)

    # ------------------------------------------------------------ step record
    def _record(self, start: float, so: SchedulerOutput) -> None:
        if self._record_file is not None:
            self._record_file.write(f"{start:.6f} {time.time():.6f} "
                                    f"{so.total_num_scheduled_tokens} "
                                    f"{len(so.num_scheduled_tokens)}\n")
