"""The scheduler's grammar handling, driven by a scripted model that samples from the
bitmask the scheduler built (no torch model): waiting for a grammar without blocking
others, masks only for constrained rows that sample, matchers advanced per token,
compile once per constraint, failures contained, reasoning gate."""

from __future__ import annotations

import copy
import random
import re
import threading

import numpy as np
import pytest

from pagoda.config import CacheConfig, SchedulerConfig, StructuredOutputsConfig
from pagoda.core.request import RequestStatus
from pagoda.core.scheduler import Scheduler
from pagoda.messages import EngineCoreRequest, FinishReason, ModelRunnerOutput
from pagoda.sampling_params import SamplingParams, StructuredOutputsParams
from pagoda.tokenizer.harmony import CONTROL_TOKENS

EOS = 2
FREE_TOKEN = 7  # what the script "samples" for an unconstrained request


def make_scheduler(manager, num_blocks=64, budget=64):
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget,
                                     max_model_len=256),
                     CacheConfig(block_size=4, enable_prefix_caching=True), num_blocks, manager)


def add(s, rid, prompt_len=6, max_tokens=40, constraint=None, first=10, **kw):
    so = StructuredOutputsParams(**constraint) if constraint else None
    s.add_request(EngineCoreRequest(rid, list(range(first, first + prompt_len)),
                                    SamplingParams(max_tokens=max_tokens, structured_outputs=so,
                                                   **kw), [EOS]))


def allowed(bitmask_row: np.ndarray, vocab_size: int = 49152) -> np.ndarray:
    bits = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)


def step(s, rng=None, pick=None, raw_rows=False):
    """One step; constrained rows sample uniformly from their allowed tokens (EOS first
    when allowed, so a finished grammar ends at once). `raw_rows`: `pick` gets the
    packed bitmask row, not the allowed ids (a vocabulary larger than SmolLM2's)."""
    rng = rng or random.Random(0)
    so = s.schedule()
    if not so.total_num_scheduled_tokens:
        s.wait_for_grammars(0.05)  # as EngineCore.step does
    rows = dict(zip(so.structured_output_request_ids,
                    so.grammar_bitmask if so.grammar_bitmask is not None else []))
    req_ids, sampled = [], []
    for rid in so.num_scheduled_tokens:
        req = s.requests[rid]
        req_ids.append(rid)
        if req.num_computed_tokens < req.num_tokens:
            sampled.append([])
        elif rid in rows:
            ok = rows[rid] if raw_rows else allowed(rows[rid])
            token = pick(rid, ok) if pick else (EOS if EOS in ok else int(rng.choice(list(ok))))
            sampled.append([token])
        else:
            sampled.append([pick(rid, None) if pick else FREE_TOKEN])
    return so, s.update_from_output(so, ModelRunnerOutput(req_ids, sampled))


def run_to_end(s, max_steps=200, **kw):
    outputs = {}
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            break
        _, outs = step(s, **kw)
        for out in outs:
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def text_of(outs, tokenizer):
    ids = [t for o in outs for t in o.new_token_ids if t != EOS]
    return tokenizer.decode(ids)


def ready(manager, s):
    """Wait until every queued grammar compiled."""
    for r in list(s.waiting):
        if r.structured_output_request is not None:
            r.structured_output_request.future.result(timeout=60)


def test_constrained_output_matches_and_ends_with_eos(make_manager, smollm2_tokenizer):
    s = make_scheduler(make_manager())
    add(s, "r", constraint=dict(regex=r"[a-z]{3}-\d{2}"))
    assert s.requests["r"].status == RequestStatus.WAITING_FOR_GRAMMAR
    ready(None, s)
    outs = run_to_end(s)["r"]
    assert outs[-1].finish_reason == FinishReason.STOP and outs[-1].new_token_ids[-1] == EOS
    assert re.fullmatch(r"[a-z]{3}-\d{2}", text_of(outs, smollm2_tokenizer))


def test_only_constrained_rows_that_sample_get_a_bitmask(make_manager):
    s = make_scheduler(make_manager(), budget=8)
    add(s, "free", prompt_len=4)
    add(s, "c", prompt_len=12, constraint=dict(choice=["yes", "no"]))
    ready(None, s)
    so, _ = step(s)  # c's prefill is chunked: it samples nothing yet
    assert so.num_scheduled_tokens == {"free": 4, "c": 4}
    assert so.structured_output_request_ids == [] and so.grammar_bitmask is None
    step(s)
    so, _ = step(s)  # c's last chunk: it samples, so its row is there (and only its)
    assert so.structured_output_request_ids == ["c"] and so.grammar_bitmask.shape == (1, 1536)
    assert EOS not in allowed(so.grammar_bitmask[0])  # EOS only once the grammar accepts


def test_a_compiling_grammar_holds_back_only_its_own_request(make_manager, smollm2_tokenizer):
    manager = make_manager()
    backend = manager.backend
    release = threading.Event()
    compile_ = backend.compile
    backend.compile = lambda parsed: (release.wait(30), compile_(parsed))[1]
    try:
        s = make_scheduler(manager)
        add(s, "slow", constraint=dict(regex=r"\d{4}"))
        add(s, "free", max_tokens=3)
        so, _ = step(s)
        assert list(so.num_scheduled_tokens) == ["free"]
        assert s.requests["slow"].status == RequestStatus.WAITING_FOR_GRAMMAR
        s.wait_for_grammars(0.01)  # bounded: returns although nothing compiled
        step(s)
        assert s.requests["slow"].status == RequestStatus.WAITING_FOR_GRAMMAR
        release.set()
        outs = run_to_end(s)
    finally:
        backend.compile = compile_
        release.set()
    assert outs["free"][-1].finish_reason == FinishReason.LENGTH
    assert re.fullmatch(r"\d{4}", text_of(outs["slow"], smollm2_tokenizer))


def test_equal_constraints_compile_once_and_match_independently(make_manager, smollm2_tokenizer):
    manager = make_manager()
    calls = []
    backend = manager.backend
    compile_ = backend.compile
    backend.compile = lambda parsed: (calls.append(1), compile_(parsed))[1]
    try:
        s = make_scheduler(manager)
        for i in range(3):  # n = 3: three children, one constraint
            add(s, f"c{i}", constraint=dict(regex=r"[a-z]{2,5}"))
        add(s, "other", constraint=dict(regex=r"[0-9]{2,5}"))
        ready(manager, s)
        outs = run_to_end(s, rng=random.Random(3))
    finally:
        backend.compile = compile_
    assert len(calls) == 2
    texts = [text_of(outs[f"c{i}"], smollm2_tokenizer) for i in range(3)]
    assert all(re.fullmatch(r"[a-z]{2,5}", t) for t in texts)
    assert len(set(texts)) > 1  # each child its own matcher, its own path
    assert re.fullmatch(r"[0-9]{2,5}", text_of(outs["other"], smollm2_tokenizer))


@pytest.mark.parametrize("constraint, field", [
    (dict(regex="a(b"), "structured_outputs.regex"),
    (dict(json={"type": "foo"}), "structured_outputs.json"),
    (dict(grammar="root ::= undefined_rule"), "structured_outputs.grammar"),
])
def test_an_invalid_constraint_is_refused_before_it_is_queued(make_manager, constraint, field):
    s = make_scheduler(make_manager())
    with pytest.raises(ValueError, match=re.escape(field)) as info:
        add(s, "bad", constraint=constraint)
    assert "xgrammar" in str(info.value) and "/project/" not in str(info.value)
    assert not s.requests and not s.waiting


def test_a_grammar_that_fails_to_compile_aborts_only_its_request(make_manager):
    manager = make_manager()
    backend = manager.backend
    compile_ = backend.compile
    backend.compile = lambda parsed: (_ for _ in ()).throw(RuntimeError("out of memory"))
    try:
        s = make_scheduler(manager)
        add(s, "doomed", constraint=dict(regex=r"xy"))
        add(s, "free", max_tokens=2)
        ready_or_failed = s.requests["doomed"].structured_output_request.future
        with pytest.raises(RuntimeError):
            ready_or_failed.result(timeout=30)
        outs = run_to_end(s)
    finally:
        backend.compile = compile_
    assert outs["doomed"][-1].finish_reason == FinishReason.ABORT
    assert outs["free"][-1].finish_reason == FinishReason.LENGTH
    # The failure is not cached: the same constraint compiles again.
    s2 = make_scheduler(manager)
    add(s2, "again", constraint=dict(regex=r"xy"))
    ready(manager, s2)
    assert run_to_end(s2)["again"][-1].finish_reason == FinishReason.STOP


def test_preempted_constrained_request_keeps_its_matcher(make_manager, smollm2_tokenizer):
    """Preemption recomputes KV but keeps the tokens, so the matcher stays in step:
    the resumed request still produces a text of its grammar."""
    s = make_scheduler(make_manager(), num_blocks=10, budget=32)  # 40 tokens: one fits
    add(s, "a", prompt_len=10, max_tokens=64, constraint=dict(regex=r"[a-z]{60}"))
    add(s, "b", prompt_len=10, max_tokens=64, constraint=dict(regex=r"[0-9]{20}"), first=500)
    ready(None, s)
    outs = run_to_end(s, rng=random.Random(1))
    assert s.num_preemptions > 0
    assert re.fullmatch(r"[a-z]{60}", text_of(outs["a"], smollm2_tokenizer))
    assert re.fullmatch(r"[0-9]{20}", text_of(outs["b"], smollm2_tokenizer))


def test_a_complete_grammar_ends_the_request_even_with_ignore_eos(make_manager):
    s = make_scheduler(make_manager())
    add(s, "r", constraint=dict(choice=["ok"]), ignore_eos=True)
    ready(None, s)
    outs = run_to_end(s)["r"]
    assert outs[-1].finish_reason == FinishReason.STOP
    assert outs[-1].new_token_ids[-1] == EOS


# ---------------------------------------------------------------- reasoning gate
def _gate_run(manager, prompt, script, stop_token_ids=(), prefer=EOS, vocab_size=49152):
    """Run one constrained request whose 'model' first emits `script` (token ids; each
    must be allowed), then samples from its bitmask (`prefer` whenever allowed). Returns
    (output ids, each step's allowed ids: None where the step had no bitmask row)."""
    s = make_scheduler(manager)
    s.add_request(EngineCoreRequest("r", prompt, SamplingParams(
        max_tokens=40, structured_outputs=StructuredOutputsParams(regex=r"[a-z]{3}"),
        stop_token_ids=list(stop_token_ids)), [EOS]))
    ready(manager, s)
    rows, queue, rng = [], list(script), random.Random(0)

    def pick(rid, ok):
        rows.append(None if ok is None else set(allowed(ok, vocab_size)))
        if queue:
            token = queue.pop(0)
            assert ok is None or token in rows[-1]
            return token
        for choice in (prefer, EOS):
            if choice in rows[-1]:
                return choice
        return int(rng.choice(sorted(rows[-1])))

    outs = run_to_end(s, pick=pick, raw_rows=True)["r"]
    return [t for o in outs for t in o.new_token_ids], rows


def test_deepseek_r1_grammar_starts_after_the_reasoning_ends(make_manager, think_tokenizer):
    manager = make_manager(StructuredOutputsConfig(reasoning_parser="deepseek_r1"),
                           think_tokenizer, 49160)
    vocab = think_tokenizer.get_vocab()
    end = vocab["</think>"]
    free = think_tokenizer.encode(" Hmm, 42!", add_special_tokens=False)
    ids, rows = _gate_run(manager, [10, 11, 12], [*free, end], vocab_size=49160)
    masked = [row is not None for row in rows]
    # Free text while reasoning (no row), the end marker, then the grammar's answer.
    assert masked[:len(free) + 1] == [False] * (len(free) + 1) and all(masked[len(free) + 1:])
    answer = think_tokenizer.decode(ids[len(free) + 1:-1])
    assert re.fullmatch(r"[a-z]{3}", answer) and ids[-1] == EOS


def test_qwen3_answer_without_thinking_is_constrained_from_the_first_token(make_manager,
                                                                          think_tokenizer):
    manager = make_manager(StructuredOutputsConfig(reasoning_parser="qwen3"),
                           think_tokenizer, 49160)
    start = think_tokenizer.get_vocab()["<think>"]
    s = make_scheduler(manager)
    s.add_request(EngineCoreRequest("r", [10, 11], SamplingParams(
        max_tokens=40, structured_outputs=StructuredOutputsParams(regex=r"[a-z]{3}")), [EOS]))
    ready(manager, s)
    so = s.schedule()
    first = set(allowed(so.grammar_bitmask[0], 49160))
    assert start in first  # it may still open a thinking block ...
    assert len(first) > 1 and think_tokenizer.get_vocab()["</think>"] not in first
    # ... and a prompt that closed the block (thinking off) starts constrained, no escape.
    ids, rows = _gate_run(manager, [10, start, think_tokenizer.get_vocab()["</think>"], 11],
                          [], vocab_size=49160)
    assert all(row is not None for row in rows)
    assert re.fullmatch(r"[a-z]{3}", think_tokenizer.decode(ids[:-1]))


def test_aborting_a_request_whose_grammar_is_compiling(make_manager):
    manager = make_manager()
    backend = manager.backend
    release = threading.Event()
    compile_ = backend.compile
    backend.compile = lambda parsed: (release.wait(30), compile_(parsed))[1]
    try:
        s = make_scheduler(manager)
        add(s, "c", constraint=dict(regex=r"[0-9]{3}x"))
        future = s.requests["c"].structured_output_request.future
        s.finish_requests(["c"], FinishReason.ABORT)
        assert not s.has_unfinished_requests() and not s.waiting
        assert [o.finish_reason for o in s.take_pending_outputs()] == [FinishReason.ABORT]
        release.set()
        future.result(timeout=30)  # the compile finishes for nobody: nothing breaks
        add(s, "again", constraint=dict(regex=r"[0-9]{3}x"))  # and is reused
        assert s.requests["again"].structured_output_request.future is future
    finally:
        backend.compile = compile_
        release.set()


def test_reasoning_markers_without_tokens_start_up_and_refuse_constraints(make_manager):
    """gpt_oss's markers on a tokenizer without the harmony control tokens (SmolLM2's)
    are plain text the model may spell any way: the engine starts and a constrained
    request is refused, naming why, instead of being constrained from the wrong token."""
    manager = make_manager(StructuredOutputsConfig(reasoning_parser="gpt_oss"))
    with pytest.raises(ValueError, match="cannot tell where the reasoning ends"):
        manager.init_request(StructuredOutputsParams(regex=r"[a-z]{3}"), [10, 11])
    # without a constraint nothing is asked of the gate
    assert make_manager(StructuredOutputsConfig(reasoning_parser="gpt_oss",
                                                enable_in_reasoning=True)) is not None


@pytest.fixture(scope="module")
def harmony_tokenizer(smollm2_tokenizer):
    """SmolLM2's tokenizer with the harmony control tokens as special tokens (as the
    tiny gpt-oss checkpoint's: tests/model/architectures/test_gpt_oss.py)."""
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": list(CONTROL_TOKENS)})
    return tokenizer


def test_gpt_oss_grammar_applies_to_the_final_message_only(make_manager, harmony_tokenizer):
    """A scripted harmony answer through the real xgrammar backend: a multi-turn prompt
    (its previous final answer does not count), an analysis message and a final header
    holding `<|constrain|>json` go unconstrained and unfed; the body obeys the grammar
    and ends with <|return|>, a stop token of the request, allowed only once the body is
    complete."""
    tok = harmony_tokenizer
    ids = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    manager = make_manager(StructuredOutputsConfig(reasoning_parser="gpt_oss"), tok, len(tok))
    ret = tok.convert_tokens_to_ids("<|return|>")
    prompt = ids("<|start|>user<|message|>Hi<|end|><|start|>assistant<|channel|>final"
                 "<|message|>Hello<|end|><|start|>user<|message|>Again<|end|>"
                 "<|start|>assistant")
    script = ids("<|channel|>analysis<|message|>Think: 42, \"{!<|end|><|start|>assistant"
                 "<|channel|>final <|constrain|>json<|message|>")
    out, rows = _gate_run(manager, prompt, script, stop_token_ids=[ret], prefer=ret,
                          vocab_size=len(tok))
    n = len(script)
    assert [row is not None for row in rows] == [False] * n + [True] * (len(rows) - n)
    assert re.fullmatch(r"[a-z]{3}", tok.decode(out[n:-1])) and out[-1] == ret
    assert all(ret not in row for row in rows[n:-1])  # only a complete body may end


def test_gpt_oss_prompt_prefilled_to_the_final_header_is_constrained_at_once(
        make_manager, harmony_tokenizer):
    tok = harmony_tokenizer
    manager = make_manager(StructuredOutputsConfig(reasoning_parser="gpt_oss"), tok, len(tok))
    prompt = tok.encode("<|start|>assistant<|channel|>final<|message|>",
                        add_special_tokens=False)
    out, rows = _gate_run(manager, prompt, [], vocab_size=len(tok))
    assert all(row is not None for row in rows)
    assert re.fullmatch(r"[a-z]{3}", tok.decode(out[:-1])) and out[-1] == EOS


def test_gpt_oss_resumed_request_replays_its_output_through_the_gate(make_manager,
                                                                     harmony_tokenizer):
    """A request resumed with tokens generated elsewhere (migration, or a grammar that
    became ready after them): every output token goes through the gate in order, so
    the reasoning and the final header are skipped and only the body reaches the
    matcher; a body outside the grammar is reported."""
    tok = harmony_tokenizer
    ids = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    manager = make_manager(StructuredOutputsConfig(reasoning_parser="gpt_oss"), tok, len(tok))
    prompt = ids("<|start|>user<|message|>Hi<|end|><|start|>assistant")
    header = ids("<|channel|>analysis<|message|>1, 2!<|end|><|start|>assistant"
                 "<|channel|>final<|message|>")
    constraint = StructuredOutputsParams(regex=r"[a-z]{3}")
    so_request = manager.init_request(constraint, prompt)
    so_request.future.result(timeout=60)
    body = ids("ab")
    assert manager.check_ready(so_request, [EOS], [*header, *body]) is None
    assert so_request.num_processed == len(header) + len(body)
    row = set(allowed(manager.grammar_bitmask([so_request])[0], len(tok)))
    assert ids("c")[0] in row and EOS not in row  # one letter still owed
    bad = manager.init_request(constraint, prompt)
    bad.future.result(timeout=60)
    assert "do not match" in manager.check_ready(bad, [EOS], [*header, *ids("a1")])
