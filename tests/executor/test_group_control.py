"""`collective_rpc`, `apply_model`, sleep mode and weight transfer on a TP=2 worker
group (mp backend): every rank runs the call, results come back in rank order, and
a rank's error is reported without failing the group."""

from __future__ import annotations

import os
import pathlib
import socket
import threading

import pytest
import torch
from group_cases import engine_kwargs

from pagoda import LLM, SamplingParams
from pagoda.distributed import weight_transfer
from pagoda.executor.base import WorkerGroupFailed

import group_rpc_funcs

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = [list(range(300, 321)), [5, 17, 300, 42, 7]]
TESTS = pathlib.Path(__file__).resolve().parents[1]


def greedy(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.slow
def test_group_runs_calls_on_every_rank_sleeps_and_takes_new_weights(
        tiny_llama_dir, tmp_path, monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    from fixture_paths import TINY_LLAMA_CONFIG

    # The followers import group_rpc_funcs by name.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(TESTS)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    llm = LLM(model=tiny_llama_dir, tensor_parallel_size=2, distributed_executor_backend="mp",
              enable_sleep_mode=True, **engine_kwargs())
    try:
        before = greedy(llm)
        # Named methods and module-level callables reach both ranks, in rank order.
        assert llm.collective_rpc(group_rpc_funcs.rank_and_layers, args=("x",)) == [
            [0, 3, "x"], [1, 3, "x"]]
        assert llm.apply_model(group_rpc_funcs.qkv_rows) == [64, 64]  # half of 128 each
        with pytest.raises(TypeError, match="module-level"):
            llm.collective_rpc(lambda worker: worker.rank)
        with pytest.raises(RuntimeError, match=r"rank 0: .*Unknown worker method.*rank 1: "):
            llm.collective_rpc("no_such_method")
        weights = llm.collective_rpc("weight_bytes")
        assert len(weights) == 2 and all(w > 0 for w in weights)

        llm.sleep(level=1)
        assert llm.collective_rpc("weight_bytes") == [0, 0]
        assert llm.collective_rpc("kv_cache_bytes") == [0, 0]
        llm.wake_up()
        assert llm.collective_rpc("weight_bytes") == weights
        assert greedy(llm) == before  # the group survived the failed call and the sleep

        # New weights from a trainer: ranks 1 and 2 of a group of three.
        torch.manual_seed(1)
        model_b = LlamaForCausalLM(LlamaConfig.from_json_file(str(TINY_LLAMA_CONFIG)))
        named = [(n, t.detach().clone()) for n, t in model_b.state_dict().items()
                 if n != "lm_head.weight"]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        init_info = {"master_address": "127.0.0.1", "master_port": port, "world_size": 3}
        errors: list = []

        def trainer() -> None:
            try:
                group = weight_transfer.trainer_init(init_info, timeout_s=120)
                weight_transfer.trainer_send_weights(named, group)
            except Exception as exc:  # noqa: BLE001 - checked below
                errors.append(exc)

        thread = threading.Thread(target=trainer, daemon=True)
        thread.start()
        llm.init_weight_transfer_engine({"init_info": {**init_info, "rank_offset": 1}})
        llm.update_weights({"update_info": weight_transfer.update_info_for(named)})
        thread.join(120)
        assert not errors and not thread.is_alive()
        updated = greedy(llm)
        # A rank that dies now cannot be replaced from the checkpoint: that would
        # serve the old model. The group fails, saying why.
        executor = llm.llm_engine.core.executor
        executor.processes[1].kill()
        executor.processes[1].wait(10)
        with pytest.raises(WorkerGroupFailed, match="update_weights"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        llm.llm_engine.core.shutdown()
    assert updated != before
    model_b.save_pretrained(tmp_path)
    llm.get_tokenizer().save_pretrained(tmp_path)
    fresh = LLM(model=str(tmp_path), **engine_kwargs())
    assert greedy(fresh) == updated
