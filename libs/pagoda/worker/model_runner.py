"""Runs one step on the model: update the persistent batch, forward, sample."""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch

from pagoda.config import EngineConfig
from pagoda.messages import LogprobsLists, ModelRunnerOutput, NewRequestData, SchedulerOutput
from pagoda.distributed.parallel_state import SINGLE, ParallelContext
from pagoda.worker.batch_state import CachedRequestState
from pagoda.worker.input_builder import ModelInputs, build_model_inputs
from pagoda.kernels import cpu as cpu_kernels
from pagoda.lora.manager import LoRAModelManager
from pagoda.model import batch_invariant_linear, cpu_packed_weights, prepack_cpu_weights
from pagoda.model.intermediate_tensors import IntermediateTensors
from pagoda.model.kv_cache import (allocate_kv_caches, kv_cache_bytes_per_block,
                                   kv_cache_torch_dtype, recurrent_state_bytes)
from pagoda.model.loader import load_model
from pagoda.model.pooler import Pooler
from pagoda.model.quantization import gguf_int4
from pagoda.sample.builder import build_sampling_metadata, make_generator
from pagoda.sample.grammar import apply_grammar_bitmask
from pagoda.sample.logits_processor import resolve_logits_processor_classes
from pagoda.sample.logits_processor_batch import CustomLogitsProcessors
from pagoda.sample.thinking_budget import force_thinking_end
from pagoda.sample.logprobs import compute_topk_logprobs
from pagoda.sample.rejection_sampler import verify_drafts
from pagoda.sample.sampler import Sampler, advance_generator
from pagoda.sampling_params import SamplingParams
from pagoda.spec_decode.draft_model import DraftModelRunner
from pagoda.spec_decode.mtp import MTPProposer
from pagoda.worker import cpu_allocator
from pagoda.worker.load_threads import load_threads
from pagoda.worker.cuda_graphs import DecodeCUDAGraphs, cuda_graph_sizes
from pagoda.worker.encoder_cache import EncoderCache
from pagoda.worker.host_kv_tier import (HostKVTier, has_tier_ops, host_tier_slots,
                                       make_disk_tier)
from pagoda.worker.kv_onload_async import with_reports
from pagoda.worker.mm_inputs import MultiModalStepInputs
from pagoda.worker.pooling import pool_requests, token_type_ids
from pagoda.worker.recurrent_state import RecurrentStateSlots, rewind_to_accepted_drafts

logger = logging.getLogger(__name__)
# How long a step that runs no token waits for an asynchronous onload to finish.
ONLOAD_IDLE_WAIT_S = 0.02


class ModelRunner:
    """Holds the weights, the KV cache and the state of every running request.

    Invariant: after `execute_model`, each request that sampled has the sampled
    token appended to its `CachedRequestState`, matching what the scheduler appends.
    Given a `ParallelContext`, the weights and KV cache are this rank's share
    (`pagoda.worker.parallel_runner` runs the step across the group).
    """

    def __init__(self, config: EngineConfig, parallel: ParallelContext | None = None) -> None:
        self.config = config
        # Expert placement is an engine setting, not a group coordinate: set it here so
        # every rank's model sees it (`moe.FusedMoE`).
        self.parallel = dataclasses.replace(parallel or SINGLE,
                                            enable_expert_parallel=config.enable_expert_parallel)
        self.device = torch.device(config.device)
        self.dtype = getattr(torch, config.dtype)
        self.kv_cache_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, self.dtype)
        self.block_size = config.cache.block_size
        self.states: dict[str, CachedRequestState] = {}
        # Generators outlive preemption so a resumed seeded request continues its stream.
        self.generators: dict[str, torch.Generator] = {}
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_kv_blocks = 0  # blocks in each attention layer's cache
        # This step's structured-output rows (request ids, packed bitmask), from the plan.
        self._grammar: tuple[list[str], object] | None = None
        self.model = None
        self.pooler = None  # the model's Pooler under --runner pooling
        self.cuda_graphs = None  # DecodeCUDAGraphs on CUDA unless enforce_eager
        self.lora_manager = None  # pagoda.lora.manager.LoRAModelManager under --enable-lora
        # spec_decode.draft_model.DraftModelRunner with a draft model, spec_decode.mtp's
        # MTPProposer with MTP drafts
        self.drafter = None
        # A hybrid model's Mamba state slots per request (`recurrent_state`); None otherwise.
        self.state_slots: RecurrentStateSlots | None = None
        self._recurrent_caches: list[int] = []  # their layers' indices in kv_caches
        self.host_tier: HostKVTier | None = None  # under --kv-offloading-size
        # A multi-modal model's encoder cache and input-embedding builder (mm_inputs).
        self.mm_inputs: MultiModalStepInputs | None = None

    # ------------------------------------------------------------------ set-up
    def load_model(self) -> None:
        torch.manual_seed(self.config.seed)
        pack_bf16 = cpu_packed_weights.applies(self.device, self.dtype)
        with load_threads():  # bit-equal weights whatever the count (load_threads.py)
            if self.device.type == "cpu":
                cpu_allocator.tune()
                cpu_kernels.available()  # builds the fused kernels now, not in the first step
            self.model = load_model(self.config.model, self.config.arch, self.dtype,
                                    self.device, self.parallel, self.config.runner)
            if self.config.gguf_int4:
                gguf_int4.pack_small_batch_int4(
                    self.model, gguf_int4.gguf_4bit_parts(self.config.model)[1],
                    gguf_int4.MAX_INT4_ROWS_PACKED if pack_bf16 else gguf_int4.MAX_INT4_ROWS)
        if pack_bf16:
            prepack_cpu_weights.pack_linear_weights(self.model)
        if self.config.batch_invariant:
            batch_invariant_linear.fix_linear_rows(self.model, gguf_int4.logits_head(self.model))
        self.sampler = Sampler()
        self.custom_logits = None  # CustomLogitsProcessors under logits_processors
        if self.config.logits_processors and self.config.runner == "generate":
            self.custom_logits = CustomLogitsProcessors(
                resolve_logits_processor_classes(self.config.logits_processors), self.config,
                self.device)
        if self.config.pooler_config is not None:
            self.pooler = Pooler(self.config.pooler_config, self.model)
        spec = self.config.scheduler.speculative_config
        if spec is not None and spec.uses_draft_model:
            self.drafter = DraftModelRunner(self.config, self.dtype, self.device)
        elif spec is not None and spec.uses_mtp:
            self.drafter = MTPProposer(self.model, self.config, self.device)
        if getattr(self.model, "supports_multimodal", False):
            self.mm_inputs = MultiModalStepInputs(
                self.model, EncoderCache(self.config.scheduler.encoder_cache_size))
        if self.config.lora is not None:
            self.lora_manager = LoRAModelManager(self.model, self.config.lora, self.device,
                                                 self.dtype)

    @property
    def is_encoder(self) -> bool:
        """A bidirectional encoder (BERT): no KV cache, each prompt whole in its step."""
        return getattr(self.model, "is_encoder", False)

    def determine_num_blocks(self) -> int:
        if self.is_encoder:
            # No KV cache: the scheduler's blocks only count the tokens of one step (an
            # encoder's requests finish in the step that runs them).
            sched = self.config.scheduler
            return -(-sched.max_num_batched_tokens // self.block_size) + sched.max_num_seqs
        per_block = kv_cache_bytes_per_block(self.config.arch, self.block_size,
                                             self.kv_cache_dtype, self.parallel)
        if self.drafter is not None:  # each block id has a slot in both caches
            per_block += self.drafter.bytes_per_block(self.kv_cache_dtype)
        if self.device.type == "cuda":
            # What the weights, the largest step's activations and everything else on the
            # card leave of the `gpu_memory_utilization` share goes to the KV cache.
            peak_activations = self._profile_peak_activation_bytes()
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(total * self.config.cache.gpu_memory_utilization) - (total - free) \
                - peak_activations
        else:
            budget = self.config.cache.kv_cache_memory_bytes
        # A hybrid model's Mamba state pools come first: one slot per running request.
        # (and, with prefix caching, as many checkpoint slots: core/state_checkpoints.py).
        budget -= recurrent_state_bytes(self.config.arch, self._num_state_slots(),
                                        self.kv_cache_dtype)
        return max(budget // per_block, 1)

    @torch.inference_mode()
    def _profile_peak_activation_bytes(self) -> int:
        """Run the largest step the scheduler may plan (one prefill of
        max_num_batched_tokens) on a scratch cache and measure its peak memory."""
        sched = self.config.scheduler
        num_tokens = min(sched.max_num_batched_tokens, sched.max_model_len)
        num_blocks = -(-num_tokens // self.block_size)
        caches = allocate_kv_caches(self.config.arch, num_blocks, self.block_size,
                                    self.kv_cache_dtype, self.device, self.parallel)
        state = CachedRequestState.from_new(NewRequestData(
            "profile", [0] * num_tokens, [], SamplingParams(), list(range(num_blocks)), 0), None)
        inputs = build_model_inputs({"profile": state}, {"profile": num_tokens}, self.block_size,
                                    self.device)
        if self.config.arch.mamba is not None:
            inputs.attn_metadata.state_slots = [0]
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, caches, inputs.attn_metadata,
                            self._profile_stage_input(num_tokens))
        if self.parallel.is_last_stage:  # every TP rank of the stage: the logits all-gather
            self.model.compute_logits(hidden[-1:])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del caches, hidden
        torch.cuda.empty_cache()
        return peak

    def _profile_stage_input(self, num_tokens: int):
        """A pipeline stage after the first profiles on zeros in place of the previous
        stage's hidden states (no send/recv while profiling)."""
        if self.parallel.is_first_stage:
            return None
        zeros = torch.zeros(num_tokens, self.config.arch.hidden_size, dtype=self.dtype,
                            device=self.device)
        return IntermediateTensors(zeros, zeros.clone())

    def _num_state_slots(self) -> int:
        """Slots of each Mamba layer's state pool: the running requests', then the
        prefix cache's state checkpoints."""
        return self.config.scheduler.max_num_seqs + self.config.cache.num_state_checkpoints

    def initialize_kv_cache(self, num_blocks: int) -> None:
        if self.is_encoder:
            return  # attention reads only the step's own keys and values
        self.num_kv_blocks = num_blocks
        max_num_seqs = self.config.scheduler.max_num_seqs
        self.kv_caches = allocate_kv_caches(self.config.arch, num_blocks, self.block_size,
                                            self.kv_cache_dtype, self.device, self.parallel,
                                            num_state_slots=self._num_state_slots())
        if self.config.arch.mamba is not None:
            self.state_slots = RecurrentStateSlots(max_num_seqs)
            start = self.model.model.start_layer
            self._recurrent_caches = [i - start for i in self.config.arch.mamba.layers
                                      if 0 <= i - start < len(self.kv_caches)]
        num_slots = host_tier_slots(self.config)[0]
        if self.host_tier is not None:  # set up again: onloads in flight copy into the old
            self.host_tier.onloader.void()
        if num_slots > 0 and self.host_tier is None:  # kept when the cache is set up again
            self.host_tier = HostKVTier(self.kv_caches, num_slots,
                                        make_disk_tier(self.config, self.kv_caches,
                                                       self.parallel))
        if self.drafter is not None:
            self.drafter.initialize_kv_cache(num_blocks, self.kv_cache_dtype)
        if self._cuda_graphs_apply():
            self._capture_cuda_graphs()

    def _cuda_graphs_apply(self) -> bool:
        """Whether decode steps are captured as CUDA graphs (see the conditions)."""
        # Graphs capture a whole-model decode; a group's ranks run eagerly for now.
        return (self.device.type == "cuda" and not self.config.enforce_eager
                and self.parallel.world_size == 1 and self.config.runner == "generate"
                and self.lora_manager is None  # graphs would freeze one step's adapters
                and self.state_slots is None  # Mamba slots change per step; eager
                # MTP reads the forward's pre-norm hidden state, which a graph replay
                # would not set (unverified on a device: eager)
                and not isinstance(self.drafter, MTPProposer)
                # A model whose forward reads device values on the host (gpt-oss's
                # expert loop counts its tokens) cannot be captured at all.
                and getattr(self.model, "supports_cuda_graphs", True))

    def _capture_cuda_graphs(self) -> None:
        sched = self.config.scheduler
        self.cuda_graphs = DecodeCUDAGraphs(
            lambda ids, pos, md: self.model(ids, pos, self.kv_caches, md),
            cuda_graph_sizes(sched.max_num_seqs), -(-sched.max_model_len // self.block_size),
            sched.max_model_len, self.device)
        self.cuda_graphs.capture()

    # One rank: its own onload failures are the group's (ParallelRunner ORs every rank's).
    _agree_on_onloads = None

    def reset(self) -> None:
        """Forget every request (a restarted scheduler knows none of them)."""
        self.states.clear()
        self.generators.clear()
        if self.host_tier is not None:  # their copies end first, reported as failed
            self.host_tier.onloader.drain()
        if self.mm_inputs is not None:
            self.mm_inputs.cache.clear()
        if self.state_slots is not None:
            self.state_slots = RecurrentStateSlots(self.config.scheduler.max_num_seqs)

    # ------------------------------------------------------------------ step
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        output = self._execute_step(scheduler_output)
        return self._report_onloads(scheduler_output, output)

    def _report_onloads(self, scheduler_output: SchedulerOutput, output):
        """After the step: the asynchronous onloads every rank finished meanwhile (a
        step with no token first waits a little for one, so that a scheduler with
        only onloads to wait for does not spin). Every rank calls it at this point."""
        if self.host_tier is None or not self.host_tier.onloader.pending:
            return output
        wait_s = ONLOAD_IDLE_WAIT_S if scheduler_output.total_num_scheduled_tokens == 0 else 0.0
        finished, invalid = self.host_tier.poll(self._agree_on_onloads, wait_s)
        return with_reports(output, finished, invalid) if output is not None else None

    @torch.inference_mode()
    def _execute_step(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.host_tier is not None and has_tier_ops(scheduler_output):
            # Before anything of the step: a failed onload turns into recompute here.
            scheduler_output = self.host_tier.apply(self.kv_caches, scheduler_output,
                                                    self.block_size, self._agree_on_onloads)
        self._update_states(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput.empty()
        inputs = build_model_inputs(self.states, scheduler_output.num_scheduled_tokens,
                                    self.block_size, self.device, self.config.batch_invariant)
        self._prepare_lora(inputs)
        if self.state_slots is not None:
            restores = {d.req_id: d.state_restore for d in scheduler_output.scheduled_new_reqs
                        if d.state_restore is not None}
            inputs.attn_metadata.state_slots = self.state_slots.assign(
                inputs.req_ids, [self.states[r].num_computed_tokens for r in inputs.req_ids],
                self.kv_caches, self._recurrent_caches, restores)
            if scheduler_output.state_saves:  # checkpoint c: pool index max_num_seqs + c
                saves, base = scheduler_output.state_saves, self.state_slots.num_slots
                inputs.attn_metadata.state_saves = [
                    (saves[r][0], base + saves[r][1]) if r in saves else None
                    for r in inputs.req_ids]
            if inputs.num_drafts is not None:
                inputs.attn_metadata.state_checkpoints = [d + 1 if d else 0
                                                          for d in inputs.num_drafts]
        embeds = (self.mm_inputs.prepare(self.states, inputs)
                  if self.mm_inputs is not None else None)
        hidden = self._forward(inputs, embeds)
        prompt_logprobs = self._prompt_logprobs(inputs, hidden, scheduler_output.num_scheduled_tokens)
        sampled, logprobs = self._sample(inputs, hidden)
        if inputs.attn_metadata.state_checkpoints is not None:
            rewind_to_accepted_drafts(self.model, inputs.attn_metadata, sampled)
        pooled = self._pool(inputs, hidden)
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            self.states[req_id].num_computed_tokens += n
        drafts = self._draft(inputs, sampled) if self.drafter is not None else {}
        output = ModelRunnerOutput(inputs.req_ids, sampled, logprobs, prompt_logprobs, pooled,
                                   drafts)
        if self.mm_inputs is not None:
            self.mm_inputs.release(self.states)
            output.num_encoder_cache_queries, output.num_encoder_cache_hits = \
                self.mm_inputs.cache.take_counts()
        return output

    def _draft(self, inputs: ModelInputs, sampled: list[list[int]]) -> dict[str, list[int]]:
        """The drafter's KV for this step's tokens, then its proposals for the requests
        that sampled and may be speculated on (spec_decode.draft_model, spec_decode.mtp)."""
        is_mtp = isinstance(self.drafter, MTPProposer)
        if not is_mtp:
            self.drafter.observe(inputs.input_ids, inputs.positions, inputs.attn_metadata)
        limit = self.drafter.disable_by_batch_size
        constrained = set(self._grammar[0]) if self._grammar is not None else set()
        wanted = []
        for req_id, tokens in zip(inputs.req_ids, sampled):
            state = self.states[req_id]
            params = state.sampling_params
            # As the scheduler's may_speculate: no grammar, no seeded random stream.
            if tokens and req_id not in constrained and (params.seed is None or params.is_greedy):
                wanted.append((req_id, state.token_ids, state.block_ids))
        if limit is not None and len(self.states) >= limit:
            wanted = []
        if is_mtp:  # its pass over the step runs even when nothing is wanted: its cache
            return self.drafter.propose(inputs, sampled, self.states, {r for r, _, _ in wanted})
        return self.drafter.propose(wanted) if wanted else {}

    def _forward(self, inputs: ModelInputs, inputs_embeds: torch.Tensor | None = None
                 ) -> torch.Tensor:
        md = inputs.attn_metadata
        if self.mm_inputs is not None and self.mm_inputs.uses_mrope:  # 3-D positions, eager
            return self.model(inputs.input_ids, self.mm_inputs.positions(self.states, inputs),
                              self.kv_caches, md, inputs_embeds=inputs_embeds)
        if inputs_embeds is not None:  # media rows in the step: eager, from embeddings
            return self.model(inputs.input_ids, inputs.positions, self.kv_caches, md,
                              inputs_embeds=inputs_embeds)
        if self.is_encoder:
            return self.model(inputs.input_ids, inputs.positions, self.kv_caches, md,
                              token_type_ids=token_type_ids(self.states, inputs))
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(md, len(inputs.input_ids)):
            return self.cuda_graphs.run(inputs.input_ids, inputs.positions, md)
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, md)

    def _prepare_lora(self, inputs: ModelInputs) -> None:
        """Give each row of the step its request's adapter (loaded on first use)."""
        if self.lora_manager is None:
            return
        qsl = inputs.attn_metadata.query_start_loc_cpu
        self.lora_manager.prepare_step([(self.states[r].lora_request, qsl[i + 1] - qsl[i])
                                        for i, r in enumerate(inputs.req_ids)])

    def _pool(self, inputs: ModelInputs, hidden: torch.Tensor) -> dict[str, list[float]]:
        return pool_requests(self.pooler, self.states, inputs, hidden)

    def _update_states(self, so: SchedulerOutput) -> None:
        self._grammar = ((so.structured_output_request_ids, so.grammar_bitmask)
                         if so.grammar_bitmask is not None else None)
        for req_id in so.finished_req_ids:
            self.states.pop(req_id, None)
            self.generators.pop(req_id, None)
            self._release_state(req_id)
        for req_id in so.preempted_req_ids:
            self.states.pop(req_id, None)
            self._release_state(req_id)
        for data in so.scheduled_new_reqs:
            self.states[data.req_id] = CachedRequestState.from_new(data, self._generator(data))
        cached = so.scheduled_cached_reqs
        for req_id, new_blocks, num_computed in zip(cached.req_ids, cached.new_block_ids,
                                                    cached.num_computed_tokens):
            state = self.states[req_id]
            state.block_ids.extend(new_blocks)
            state.num_computed_tokens = num_computed
        spec = so.scheduled_spec_decode_tokens
        for req_id in so.num_scheduled_tokens:
            self.states[req_id].spec_token_ids = spec.get(req_id, [])

    def _release_state(self, req_id: str) -> None:
        """A finished or preempted request's Mamba state slot goes back to the pool (a
        preempted one recomputes from token 0 and gets a fresh slot)."""
        if self.state_slots is not None:
            self.state_slots.release(req_id)

    def _generator(self, data) -> torch.Generator | None:
        """The request's generator: kept across preemption; a new one for a request
        that arrives with tokens generated elsewhere (migrated) is advanced past them,
        so its seeded stream continues where it left off."""
        seed = data.sampling_params.seed
        if seed is None:
            return None
        if data.req_id not in self.generators:
            generator = make_generator(seed, self.device)
            if data.output_token_ids and not data.sampling_params.is_greedy:
                advance_generator(generator, len(data.output_token_ids),
                                  self.config.arch.vocab_size)
            self.generators[data.req_id] = generator
        return self.generators[data.req_id]

    def _sample(self, inputs: ModelInputs, hidden: torch.Tensor):
        rows = [i for i, s in enumerate(inputs.samples) if s]
        sampled: list[list[int]] = [[] for _ in inputs.req_ids]
        if not rows:
            return sampled, {}
        states = [self.states[inputs.req_ids[i]] for i in rows]
        logits = self.model.compute_logits(hidden[inputs.sample_rows()])
        # Logits row of each state's first position (one row per state without drafts).
        drafts = [s.spec_token_ids for s in states]
        first_row = [0]
        for d in drafts[:-1]:
            first_row.append(first_row[-1] + len(d) + 1)
        if self._grammar is not None:
            self._apply_grammar(logits, states, first_row)
        # With drafts, row j of a request samples as if its first j drafts were output.
        expanded = [(s, s.output_token_ids + d[:j] if j else s.output_token_ids)
                    for s, d in zip(states, drafts)
                    for j in range(len(d) + 1)]
        force_thinking_end(logits, [(s.sampling_params, s.token_ids + d[:j] if j else s.token_ids)
                                    for s, d in zip(states, drafts) for j in range(len(d) + 1)],
                           self.config.scheduler.reasoning_config)
        generators = {first_row[j]: s.generator for j, s in enumerate(states)
                      if s.generator is not None}
        eos = self.config.arch.eos_token_ids
        metadata = build_sampling_metadata(
            [s.sampling_params for s, _ in expanded], [s.prompt_token_ids for s, _ in expanded],
            [out for _, out in expanded], generators, self.config.arch.vocab_size,
            [eos for _ in expanded], self.device)
        if self.custom_logits is not None:  # no drafts: one row per state (config check)
            self.custom_logits.update(states)
            metadata.custom_logits = functools.partial(self.custom_logits.apply,
                                                       all_greedy=metadata.all_greedy)
        if inputs.num_drafts is not None:
            verified = verify_drafts(logits, metadata, drafts)
            token_lists, lists = verified.token_ids, (
                verified.logprobs.tolists() if verified.logprobs is not None else None)
        else:
            out = self.sampler(logits, metadata)
            token_lists = [[t] for t in out.sampled_token_ids.tolist()]
            lists = out.logprobs.tolists() if out.logprobs is not None else None
        logprobs: dict[str, LogprobsLists] = {}
        position = 0  # logprobs rows: one per emitted token, in order
        for i, state, tokens in zip(rows, states, token_lists):
            for token in tokens:
                state.append_token(token)
            sampled[i] = tokens
            k = state.sampling_params.logprobs
            if lists is not None and k is not None:
                span = range(position, position + len(tokens))
                logprobs[state.req_id] = LogprobsLists(
                    [lists.token_ids[p][:k + 1] for p in span],
                    [lists.logprobs[p][:k + 1] for p in span],
                    [lists.ranks[p][:k + 1] for p in span])
            position += len(tokens)
        return sampled, logprobs

    def _apply_grammar(self, logits: torch.Tensor, states: list[CachedRequestState],
                       first_row: list[int]) -> None:
        """Mask the rows of constrained requests (a pipeline micro-batch holds some of
        them); a constrained request has no drafts, so its one row is its first."""
        req_ids, bitmask = self._grammar
        position = {s.req_id: first_row[j] for j, s in enumerate(states)}
        pairs = [(i, position[r]) for i, r in enumerate(req_ids) if r in position]
        if pairs:
            apply_grammar_bitmask(logits, bitmask[[i for i, _ in pairs]], [j for _, j in pairs])

    def _prompt_logprobs(self, inputs: ModelInputs, hidden: torch.Tensor,
                         num_scheduled: dict[str, int]) -> dict[str, LogprobsLists]:
        """Logprobs of each prompt token given its prefix, for the positions computed now."""
        result: dict[str, LogprobsLists] = {}
        for req_id, rows, start, end in self._prompt_logprob_spans(inputs, num_scheduled):
            state = self.states[req_id]
            targets = torch.tensor(state.prompt_token_ids[start + 1:end + 1], device=self.device)
            k = state.sampling_params.prompt_logprobs
            result[req_id] = compute_topk_logprobs(self.model.compute_logits(hidden[rows]),
                                                   targets, k).tolists()
        return result

    def _prompt_logprob_spans(self, inputs: ModelInputs, num_scheduled: dict[str, int]
                              ) -> list[tuple[str, slice, int, int]]:
        """(req_id, its rows of the step's hidden states, start, end) of each request
        that wants prompt logprobs for positions [start, end) computed this step."""
        spans = []
        qsl = inputs.attn_metadata.query_start_loc_cpu
        for i, req_id in enumerate(inputs.req_ids):
            state = self.states[req_id]
            start = state.num_computed_tokens
            # Position p predicts prompt token p + 1.
            end = min(start + num_scheduled[req_id], state.num_prompt_tokens - 1)
            if state.sampling_params.prompt_logprobs is not None and end > start:
                spans.append((req_id, slice(qsl[i], qsl[i] + (end - start)), start, end))
        return spans
