"""Weight transfer for RL loops (vLLM's `init_weight_transfer_engine` /
`update_weights`): a trainer broadcasts a second checkpoint's tensors into a running
engine; its greedy output becomes that of a fresh load of the new weights, and no KV
block cached under the old weights is served after the update."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.distributed import weight_transfer

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPT = list(range(300, 333))  # 33 tokens: 8 full blocks of 4 to cache
KWARGS = dict(dtype="float32", block_size=4, max_model_len=128, num_gpu_blocks_override=64)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def second_checkpoint(tmp_path_factory, smollm2_tokenizer):
    """Another random tiny Llama (seed 1): the "trained" weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fixture_paths import TINY_LLAMA_CONFIG

    torch.manual_seed(1)
    model = LlamaForCausalLM(LlamaConfig.from_json_file(str(TINY_LLAMA_CONFIG)))
    out = tmp_path_factory.mktemp("tiny_llama_b")
    model.save_pretrained(out)
    smollm2_tokenizer.save_pretrained(out)
    return str(out), {name: t.detach().clone() for name, t in model.state_dict().items()}


def run_trainer(init_info: dict, rounds: list[list[tuple[str, torch.Tensor]]], errors: list):
    """The trainer: join as rank 0, then broadcast each round's tensors."""
    try:
        group = weight_transfer.trainer_init(init_info, timeout_s=120)
        for named in rounds:
            weight_transfer.trainer_send_weights(named, group)
    except Exception as exc:  # noqa: BLE001 - checked by the test
        errors.append(exc)


def greedy(llm: LLM):
    out = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), out.num_cached_tokens


def test_update_weights_matches_a_fresh_load_and_drops_stale_prefix_cache(
        tiny_llama_dir, second_checkpoint):
    path_b, tensors_b = second_checkpoint
    llm = LLM(model=tiny_llama_dir, weight_transfer_config={"backend": "gloo"}, **KWARGS)
    old, _ = greedy(llm)
    again, cached = greedy(llm)
    assert again == old and cached > 0  # the prompt's blocks are in the prefix cache

    named = [(n, t) for n, t in tensors_b.items() if n != "lm_head.weight"]  # tied
    port = free_port()
    init_info = {"master_address": "127.0.0.1", "master_port": port, "world_size": 2}
    errors: list = []
    trainer = threading.Thread(target=run_trainer, args=(init_info, [named], errors),
                               daemon=True)
    trainer.start()
    llm.init_weight_transfer_engine({"init_info": {**init_info, "rank_offset": 1}})
    llm.update_weights({"update_info": weight_transfer.update_info_for(named)})
    trainer.join(120)
    assert not errors and not trainer.is_alive()

    new, cached = greedy(llm)
    assert cached == 0, "a block cached under the old weights was served after the update"
    assert new != old
    fresh = LLM(model=path_b, **KWARGS)
    assert greedy(fresh)[0] == new


def test_an_incomplete_round_is_refused_before_anything_is_received(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, **KWARGS)
    with pytest.raises(RuntimeError, match="init_weight_transfer_engine"):
        llm.update_weights({"update_info": {"names": [], "dtype_names": [], "shapes": []}})
    port = free_port()
    init_info = {"master_address": "127.0.0.1", "master_port": port, "world_size": 2}
    trainer = threading.Thread(target=weight_transfer.trainer_init, args=(init_info,),
                               kwargs={"timeout_s": 60}, daemon=True)
    trainer.start()
    llm.init_weight_transfer_engine({"init_info": {**init_info, "rank_offset": 1}})
    trainer.join(60)
    before = greedy(llm)[0]
    with pytest.raises(ValueError, match="lacks"):
        llm.update_weights({"update_info": {"names": ["model.norm.weight"],
                                            "dtype_names": ["float32"], "shapes": [[64]]}})
    with pytest.raises(ValueError, match="dtype"):
        llm.update_weights({"update_info": {"names": ["model.norm.weight"],
                                            "dtype_names": ["float99"], "shapes": [[64]]}})
    with pytest.raises(ValueError, match="update_info"):
        llm.update_weights({"update_info": {"names": ["x"], "dtype_names": [], "shapes": []}})
    assert greedy(llm)[0] == before
