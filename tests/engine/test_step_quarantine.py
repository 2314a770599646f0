"""A step that fails midway because of one request: that request ends (abort), every
other request finishes with exactly the tokens of a run without it, and the engine
goes on serving (pagoda.core.step_quarantine)."""

from __future__ import annotations

import pytest

from pagoda import LLM, SamplingParams

POISON = 4242  # a token id whose presence in a step makes the forward raise
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [[1, 17, 23, 99, 5], [1, 301, 8, 44, 12, 7, 7], [1, 64, 65, 66]]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, dtype="float32", block_size=4, max_model_len=128)


def ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_the_request_at_fault_fails_alone(llm, monkeypatch):
    want = ids(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                            use_tqdm=False))
    runner = llm.llm_engine.core.executor.runner
    forward = runner.model.forward
    calls = {"failed": 0}

    def poisoned(input_ids, *args, **kwargs):
        if bool((input_ids == POISON).any()):
            calls["failed"] += 1
            raise RuntimeError("a kernel fault on this request's input")
        return forward(input_ids, *args, **kwargs)

    monkeypatch.setattr(runner.model, "forward", poisoned)
    prompts = PROMPTS[:2] + [[1, 9, POISON, 3]] + PROMPTS[2:]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                           use_tqdm=False)
    assert outputs[2].outputs[0].finish_reason == "abort"
    assert ids(outputs[:2] + outputs[3:]) == want
    assert calls["failed"] == 2  # once with the batch, once alone
    # The engine still serves, and nothing stays held.
    assert ids(llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY,
                            use_tqdm=False)) == want[:1]
    assert llm.llm_engine.core.get_stats().kv_cache_usage == 0.0


def test_a_failure_no_request_repeats_costs_nothing(llm, monkeypatch):
    """A fault that happens once (not any request's): every request still finishes
    with its own tokens, none is ended."""
    want = ids(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                            use_tqdm=False))
    runner = llm.llm_engine.core.executor.runner
    forward = runner.model.forward
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("a transient fault")
        return forward(*args, **kwargs)

    monkeypatch.setattr(runner.model, "forward", flaky)
    resets = []  # whoever handed blocks out (the KV producer's leases) hears of it
    monkeypatch.setattr(llm.llm_engine.core, "kv_reset_listeners", [lambda: resets.append(1)])
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                           use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outputs] == ["length"] * 3
    assert ids(outputs) == want
    assert resets == [1]  # once, after the KV cache was set up again
