"""The simulated device (`--simulated-device`, pagoda.executor.simulated) under the real
scheduler: deterministic tokens, KV blocks back to the pool, abort, and only the flag
turns it on."""

from __future__ import annotations

import argparse

import pytest

from pagoda import LLM, SamplingParams
from pagoda.engine.arg_utils import EngineArgs
from pagoda.executor.simulated import SimulatedExecutor
from pagoda.simulated_device import SimulatedDeviceConfig

PROMPTS = ["Hello there", "The capital of France is", "One two three four five six seven",
           "A much longer prompt " * 20]


def _llm(model_dir: str, record_path=None, **kwargs) -> LLM:
    device = {"base_ms": 1}
    if record_path is not None:
        device["record_path"] = str(record_path)
    return LLM(model=model_dir, simulated_device=device, **kwargs)


def _token_ids(llm: LLM, prompts: list[str], params: SamplingParams) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def _pool(llm: LLM):
    return llm.llm_engine.core.scheduler.kv_cache_manager.pool


def test_tokens_are_deterministic_across_runs_batches_and_chunking(tiny_llama_dir):
    params = SamplingParams(max_tokens=24, temperature=0)
    first = _token_ids(_llm(tiny_llama_dir), PROMPTS, params)
    # Another engine, the prompts one at a time and in reverse, prefill in 8-token chunks.
    other = _llm(tiny_llama_dir, max_num_batched_tokens=8, max_num_seqs=2)
    alone = [_token_ids(other, [p], params)[0] for p in reversed(PROMPTS)][::-1]
    assert alone == first
    assert all(len(t) == 24 for t in first)
    assert len({tuple(t) for t in first}) == len(PROMPTS)  # a function of the prompt


def test_never_eos_or_stop_tokens_unless_asked(tiny_llama_dir):
    llm = _llm(tiny_llama_dir)
    eos = set(llm.llm_engine.config.arch.eos_token_ids)
    tokens = _token_ids(llm, PROMPTS, SamplingParams(max_tokens=64, temperature=0))
    assert all(len(t) == 64 and not eos & set(t) for t in tokens)
    # Stopping on the token the device would emit third: it emits another one instead.
    banned = tokens[0][2]
    outputs = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=8, stop_token_ids=[banned]),
                           use_tqdm=False)
    assert banned not in outputs[0].outputs[0].token_ids
    assert outputs[0].outputs[0].token_ids[:2] == tokens[0][:2]
    assert outputs[0].outputs[0].finish_reason == "length"
    # eos_after: the 5th token is EOS, so a request stops there; ignore_eos goes on.
    eos_llm = LLM(model=tiny_llama_dir, simulated_device='{"base_ms": 1, "eos_after": 5}')
    stopped = eos_llm.generate(PROMPTS[:1], SamplingParams(max_tokens=16), use_tqdm=False)
    assert len(stopped[0].outputs[0].token_ids) == 5
    assert stopped[0].outputs[0].finish_reason == "stop"
    ignoring = eos_llm.generate(PROMPTS[:1], SamplingParams(max_tokens=16, ignore_eos=True),
                                use_tqdm=False)
    assert len(ignoring[0].outputs[0].token_ids) == 16


def test_kv_blocks_return_to_the_pool_after_finish_and_abort(tiny_llama_dir, tmp_path):
    record = tmp_path / "steps.txt"
    llm = _llm(tiny_llama_dir, record_path=record, enable_prefix_caching=False)
    engine = llm.llm_engine
    pool = _pool(llm)
    full = pool.num_free_blocks
    ids = [engine.add_request(p, None, SamplingParams(max_tokens=40, ignore_eos=True))
           for p in PROMPTS]
    for _ in range(5):
        engine.step()
    assert pool.num_free_blocks < full  # the running requests hold blocks
    executor = engine.core.executor
    assert set(executor.states) == set(ids)
    engine.abort_request([ids[1]])  # abort mid-stream
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            finished[out.request_id] = out
    assert pool.num_free_blocks == full
    assert ids[1] not in executor.states  # told in the plan after the abort
    # Like the model runner, the worker hears of the last finished ones in the next plan.
    later = engine.add_request(PROMPTS[0], None, SamplingParams(max_tokens=1))
    engine.step()
    assert set(executor.states) == {later}
    assert ids[1] not in finished or finished[ids[1]].outputs[0].finish_reason == "abort"
    assert all(len(finished[i].outputs[0].token_ids) == 40 for i in ids if i != ids[1])
    executor.shutdown()  # closes the step record
    lines = [line.split() for line in record.read_text().splitlines()]
    assert len(lines) >= 40
    # Each step lasted at least the simulated 1 ms (sleep only lengthens it).
    assert all(float(end) - float(start) >= 0.001 - 1e-4 for start, end, *_ in lines)


def test_abort_mid_stream_frees_the_request_at_the_worker(tiny_llama_dir):
    llm = _llm(tiny_llama_dir)
    engine = llm.llm_engine
    pool = _pool(llm)
    full = pool.num_free_blocks
    params = SamplingParams(max_tokens=1000, ignore_eos=True)
    request_id = engine.add_request(PROMPTS[3], None, params)
    other = engine.add_request(PROMPTS[0], None, params)
    for _ in range(6):
        engine.step()
    executor = engine.core.executor
    assert executor.states[request_id].num_output >= 1
    engine.abort_request([request_id])
    engine.step()  # the next plan tells the worker
    assert set(executor.states) == {other}
    before = executor.states[other].num_output
    engine.step()
    assert executor.states[other].num_output == before + 1  # the rest goes on
    engine.abort_request([other])
    assert not engine.core.scheduler.requests
    assert pool.num_free_blocks == full
    assert request_id not in engine.core.scheduler.requests


def test_only_the_flag_turns_it_on(tiny_llama_dir):
    assert EngineArgs(model=tiny_llama_dir).create_engine_config().simulated_device is None
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--model", tiny_llama_dir])
    assert args.simulated_device is None
    assert "--simulated-device" in parser.format_help()
    on = parser.parse_args(["--model", tiny_llama_dir, "--simulated-device",
                            '{"base_ms": 25, "per_token_ms": 0.5}'])
    config = EngineArgs.from_cli_args(on).create_engine_config()
    assert config.simulated_device == SimulatedDeviceConfig(25.0, 0.5)
    assert config.simulated_device.step_seconds(10) == pytest.approx(0.030)
    with pytest.raises(ValueError, match="base_ms"):
        SimulatedDeviceConfig.parse('{"per_token_ms": 1}')
    with pytest.raises(ValueError, match="stepms"):
        SimulatedDeviceConfig.parse('{"base_ms": 1, "stepms": 2}')
    with pytest.raises(ValueError, match="not valid JSON"):
        SimulatedDeviceConfig.parse("25+0.1*tokens")
    speculative = EngineArgs(model=tiny_llama_dir, simulated_device={"base_ms": 1},
                             speculative_config={"method": "ngram",
                                                 "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="speculative"):
        SimulatedExecutor(speculative.create_engine_config())
