"""One rank's share of a step: the model runner, across a tensor/pipeline group.

Every rank runs the same plan on its share: its slice of each layer (the
collectives inside the layers make the results whole) and its stage's layers.
One rank samples, the output rank (last stage, TP rank 0): its TP peers take part
in gathering the logits, then stop. The driver hands every other rank the sampled
tokens with the next step's plan (`sampled_token_ids`), so all ranks' per-request
states agree before each step starts, with no assumption that two processes draw
the same random numbers.

Pipeline parallelism: within a step the requests are cut into up to P
micro-batches that flow through the stages one after another, so stage s works
on micro-batch m while stage s+1 works on m-1:

    stage 0 | mb0 | mb1 |          a step of 2 micro-batches on 2 stages takes
    stage 1 |     | mb0 | mb1 |    3 half-steps instead of 2 whole ones

The scheduler plans one step at a time, so a step's micro-batches are all a
pipeline holds: stages idle while the driver waits between steps (and one
request cannot be split). Keeping P steps in flight needs an asynchronous
scheduler, which this engine does not have.
"""

from __future__ import annotations

import torch

from pagoda.messages import ModelRunnerOutput, SchedulerOutput
from pagoda.distributed.communication import recv_tensor, send_tensor
from pagoda.worker.host_kv_tier import has_tier_ops
from pagoda.worker.input_builder import ModelInputs, build_model_inputs
from pagoda.worker.model_runner import ModelRunner
from pagoda.model.intermediate_tensors import IntermediateTensors


def split_micro_batches(num_scheduled: dict[str, int], max_batches: int) -> list[dict[str, int]]:
    """Cut a step's requests, in plan order, into at most `max_batches` non-empty
    contiguous groups of about equal token counts. Deterministic: every rank cuts alike.

    Order matters: a request may reuse KV blocks that a request scheduled before it
    writes in the same step (the scheduler offers full blocks to prefix hits at once).
    Contiguous groups, run in order on every stage, write before they are read.
    """
    items = list(num_scheduled.items())
    num_batches = max(1, min(max_batches, len(items)))
    total = sum(n for _, n in items)
    batches: list[dict[str, int]] = [{}]
    done = 0
    for i, (req_id, n) in enumerate(items):
        batches[-1][req_id] = n
        done += n
        still_to_open = num_batches - len(batches)
        items_left = len(items) - i - 1
        if still_to_open and (done * num_batches >= total * len(batches)
                              or items_left == still_to_open):
            batches.append({})
    return batches


class ParallelModelRunner(ModelRunner):
    """A `ModelRunner` on one rank of a group.

    Invariant: at the start of every step, after `sampled_token_ids` is applied,
    each rank's `CachedRequestState`s equal those of every other rank. Only the
    output rank's result carries sampled tokens and logprobs.
    """

    @property
    def is_output_rank(self) -> bool:
        return self.parallel.rank == self.parallel.output_rank

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput,
                      sampled_token_ids: dict[str, list[int]] | None = None
                      ) -> ModelRunnerOutput | None:
        """Run this rank's share of the step, after appending the tokens the output
        rank sampled in the previous one. Returns the step's result on the output
        rank; other ranks return a result without tokens, or None before the last stage."""
        if sampled_token_ids and not self.is_output_rank:
            self._append_sampled(sampled_token_ids)
        if self.parallel.pp_size == 1:
            return super().execute_model(scheduler_output)
        if self.host_tier is not None and has_tier_ops(scheduler_output):
            # Each stage copies its layers' share (see ModelRunner.execute_model).
            scheduler_output = self.host_tier.apply(self.kv_caches, scheduler_output,
                                                    self.block_size, self._agree_on_onloads)
        self._update_states(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            output = ModelRunnerOutput.empty() if self.parallel.is_last_stage else None
        else:
            output = self._execute_pipelined(scheduler_output)
        return self._report_onloads(scheduler_output, output)

    def _agree_on_onloads(self, flags: list[int]) -> list[int]:
        """Every rank's onload failure flags OR-ed (MAX) over the whole group (the world
        group spans every rank under PP, the TP group does otherwise): a block one rank
        could not onload is recomputed by all, so the ranks' plans stay equal."""
        group = self.parallel.pp_group if self.parallel.pp_size > 1 else self.parallel.tp_group
        if group is None:
            return flags
        t = torch.tensor(flags, dtype=torch.int32, device=self.device)
        opts = torch.distributed.AllreduceOptions()
        opts.reduceOp = torch.distributed.ReduceOp.MAX
        group.allreduce([t], opts).wait()
        return t.tolist()

    def _sample(self, inputs: ModelInputs, hidden: torch.Tensor):
        if self.is_output_rank:
            return super()._sample(inputs, hidden)
        # A TP peer of the output rank: take part in the logits gather, sample nothing.
        rows = inputs.sample_rows()
        if rows:
            self.model.compute_logits(hidden[rows])
        return [[] for _ in inputs.req_ids], {}

    def _prompt_logprobs(self, inputs: ModelInputs, hidden: torch.Tensor,
                         num_scheduled: dict[str, int]):
        if self.is_output_rank:
            return super()._prompt_logprobs(inputs, hidden, num_scheduled)
        for _, rows, _, _ in self._prompt_logprob_spans(inputs, num_scheduled):
            self.model.compute_logits(hidden[rows])  # the same gathers, in the same order
        return {}

    def _pool(self, inputs: ModelInputs, hidden: torch.Tensor) -> dict[str, list[float]]:
        # Every TP rank holds the whole hidden states: only the output rank reports.
        return super()._pool(inputs, hidden) if self.is_output_rank else {}

    def _append_sampled(self, sampled_token_ids: dict[str, list[int]]) -> None:
        for req_id, tokens in sampled_token_ids.items():
            state = self.states.get(req_id)
            if state is not None:  # finished or preempted meanwhile: nothing to keep
                for token in tokens:
                    state.append_token(token)

    def _execute_pipelined(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        parallel = self.parallel
        outputs: list[ModelRunnerOutput] = []
        pending = []  # sends still on the wire, with the tensors they read
        for index, batch in enumerate(split_micro_batches(so.num_scheduled_tokens,
                                                          parallel.pp_size)):
            inputs = build_model_inputs(self.states, batch, self.block_size, self.device)
            out = self.model(inputs.input_ids, inputs.positions, self.kv_caches,
                             inputs.attn_metadata, self._receive(inputs, index))
            if parallel.is_last_stage:
                outputs.append(self._finish_micro_batch(inputs, out, batch))
            else:
                stacked = torch.stack((out.hidden, out.residual))
                pending.append((send_tensor(stacked, parallel.pp_group, parallel.next_rank,
                                            tag=index), stacked))
            for req_id, n in batch.items():
                self.states[req_id].num_computed_tokens += n
        for work, _ in pending:
            work.wait()
        return _merge(outputs) if parallel.is_last_stage else None

    def _receive(self, inputs: ModelInputs, index: int):
        """The previous stage's hidden states for this micro-batch (None on stage 0)."""
        if self.parallel.is_first_stage:
            return None

        shape = (2, len(inputs.input_ids), self.config.arch.hidden_size)
        stacked = recv_tensor(shape, self.dtype, self.device, self.parallel.pp_group,
                              self.parallel.prev_rank, tag=index)
        return IntermediateTensors(stacked[0], stacked[1])

    def _finish_micro_batch(self, inputs: ModelInputs, hidden: torch.Tensor,
                            batch: dict[str, int]) -> ModelRunnerOutput:
        prompt_logprobs = self._prompt_logprobs(inputs, hidden, batch)
        sampled, logprobs = self._sample(inputs, hidden)
        return ModelRunnerOutput(inputs.req_ids, sampled, logprobs, prompt_logprobs,
                                 self._pool(inputs, hidden))


def _merge(outputs: list[ModelRunnerOutput]) -> ModelRunnerOutput:
    merged = ModelRunnerOutput([], [])
    for out in outputs:
        merged.req_ids.extend(out.req_ids)
        merged.sampled_token_ids.extend(out.sampled_token_ids)
        merged.logprobs.update(out.logprobs)
        merged.prompt_logprobs.update(out.prompt_logprobs)
        merged.pooler_output.update(out.pooler_output)
    return merged
