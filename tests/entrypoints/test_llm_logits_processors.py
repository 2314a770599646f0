"""vLLM's v1 custom logits processors in `LLM(logits_processors=[...])`: run in the real
sampler, per-request `extra_args`, and persistent-batch updates kept right while
requests join and leave a continuously batched engine."""

from __future__ import annotations

import pytest
import torch
from logits_processors_cases import BanTokenProcessor, BatchSizeRecorder

from pagoda import LLM, SamplingParams
from pagoda.sample.logits_processor import BatchUpdate, MoveDirectionality
from pagoda.sample.logits_processor_batch import CustomLogitsProcessors

GREEDY = dict(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    BanTokenProcessor.instances.clear()
    return LLM(str(tiny_llama_dir), dtype="float32", block_size=4, max_model_len=256,
               max_num_seqs=3,
               logits_processors=[BanTokenProcessor,
                                  "logits_processors_cases.BatchSizeRecorder"])


def test_banning_a_token_changes_the_output_only_where_asked(llm):
    plain = llm.generate("the cat", SamplingParams(**GREEDY), use_tqdm=False)[0]
    first = plain.outputs[0].token_ids[0]
    banned = llm.generate("the cat", SamplingParams(**GREEDY, extra_args={"ban_token_id": first}),
                          use_tqdm=False)[0]
    assert banned.outputs[0].token_ids[0] != first
    assert first not in banned.outputs[0].token_ids
    again = llm.generate("the cat", SamplingParams(**GREEDY), use_tqdm=False)[0]
    assert again.outputs[0].token_ids == plain.outputs[0].token_ids


def test_row_state_follows_requests_under_continuous_batching(llm):
    """More prompts than max_num_seqs, different lengths: rows leave, join and move;
    each request's ban must stay on its own row throughout."""
    prompts = [f"prompt number {i} " * (1 + i % 3) for i in range(7)]
    lengths = [3 + 4 * (i % 3) for i in range(7)]
    plain = llm.generate(prompts, [SamplingParams(**{**GREEDY, "max_tokens": n}) for n in lengths],
                         use_tqdm=False)
    bans = [p.outputs[0].token_ids[-1] if i % 2 == 0 else None for i, p in enumerate(plain)]
    params = [SamplingParams(**{**GREEDY, "max_tokens": n},
                             extra_args=None if ban is None else {"ban_token_id": ban})
              for n, ban in zip(lengths, bans)]
    BatchSizeRecorder.mismatches.clear()
    outs = llm.generate(prompts, params, use_tqdm=False)
    for i, (out, ref, ban) in enumerate(zip(outs, plain, bans)):
        alone = llm.generate(prompts[i], params[i], use_tqdm=False)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids, i
        if ban is None:
            assert out.outputs[0].token_ids == ref.outputs[0].token_ids, i
        else:
            assert ban not in out.outputs[0].token_ids, i
    assert not BatchSizeRecorder.mismatches
    updates = [u for p in BanTokenProcessor.instances for u in p.updates]
    assert any(u.removed for u in updates) and any(u.moved for u in updates)


def test_argmax_invariant_processor_is_skipped_for_greedy_batches(llm):
    BatchSizeRecorder.applied = 0
    llm.generate("x", SamplingParams(**GREEDY), use_tqdm=False)
    assert BatchSizeRecorder.applied == 0
    llm.generate("x", SamplingParams(temperature=1.0, seed=1, max_tokens=3), use_tqdm=False)
    assert BatchSizeRecorder.applied > 0


def test_validate_params_refuses_at_intake(llm):
    with pytest.raises(ValueError, match="ban_token_id"):
        llm.generate("x", SamplingParams(extra_args={"ban_token_id": "seven"}), use_tqdm=False)


def test_bad_processor_names_are_refused(tiny_llama_dir):
    for spec in ("no_such_module.Processor", "NotQualified", int):
        with pytest.raises(ValueError, match="logits_processors"):
            LLM(str(tiny_llama_dir), dtype="float32", logits_processors=[spec])


class _State:
    def __init__(self, req_id):
        self.req_id, self.sampling_params = req_id, SamplingParams()
        self.prompt_token_ids, self.output_token_ids = [1], []


class _Recorder:
    def __init__(self, *args):
        self.updates = []

    def is_argmax_invariant(self):
        return False

    def update_state(self, update):
        self.updates.append(update)

    def apply(self, logits):
        return logits


def _replay(rows: list, update: BatchUpdate) -> list:
    """Apply a BatchUpdate to a list of ids the way a processor would."""
    rows = list(rows) + [None] * max(0, update.batch_size + len(update.added) - len(rows))
    for index in update.removed:
        rows[index] = None
    for index, _, _, output in update.added:
        rows[index] = output
    for a, b, direction in update.moved:
        if direction == MoveDirectionality.SWAP:
            rows[a], rows[b] = rows[b], rows[a]
        else:
            rows[b], rows[a] = rows[a], None
    return rows[:update.batch_size]


def test_batch_updates_replay_to_the_step_order():
    procs = CustomLogitsProcessors([_Recorder], None, torch.device("cpu"))
    states = {r: _State(r) for r in "abcdef"}
    for s in states.values():
        s.output_token_ids = [s.req_id]  # the live list identifies the request
    view: list = []
    for step in (["a", "b", "c"], ["a", "c"], ["c", "d", "a", "e"], ["e"], ["f", "e", "b"], []):
        procs.update([states[r] for r in step])
        update = procs.processors[0].updates[-1]
        if update is not None:
            view = _replay(view, update)
        assert [v[0] if v else None for v in view] == step
