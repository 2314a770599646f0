"""LoRA under tensor parallelism: two ranks (mp backend, gloo on CPU) give the greedy
tokens of one device, with two adapters and a base request in one batch."""

from __future__ import annotations

from pagoda import LLM, LoRARequest, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
KWARGS = dict(dtype="float32", block_size=4, max_model_len=128, num_gpu_blocks_override=64,
              enable_lora=True, max_loras=2, max_lora_rank=8)


def test_two_ranks_equal_one_device(tiny_llama_dir, adapters):
    loras = [LoRARequest("a1", 1, adapters[0]), None, LoRARequest("a2", 2, adapters[1])]
    single = LLM(tiny_llama_dir, **KWARGS)
    want = [o.outputs[0].token_ids for o in single.generate(PROMPTS, GREEDY, use_tqdm=False,
                                                            lora_request=loras)]
    single.llm_engine.core.shutdown()
    group = LLM(tiny_llama_dir, tensor_parallel_size=2, distributed_executor_backend="mp",
                **KWARGS)
    try:
        got = group.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=loras)
        assert [o.outputs[0].token_ids for o in got] == want
    finally:
        group.llm_engine.core.shutdown()
