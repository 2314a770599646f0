"""Draft-model speculation (`{"model": DRAFT, "num_speculative_tokens": k}`), offline
and through `pagoda serve` (the drafts cross the worker's gRPC output): greedy tokens
equal decoding without speculation whatever the draft; a draft equal to the target is
always accepted (so drafts really come from the draft model); a draft of another
vocabulary, or with tensor parallelism, is refused before anything loads."""

from __future__ import annotations

import json

import openai
import pytest
import torch
from serve_cluster import ServeProcess
from transformers import LlamaConfig, LlamaForCausalLM

from pagoda import LLM, SamplingParams
from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.core.scheduler import Scheduler
from pagoda.engine.arg_utils import EngineArgs
from pagoda.messages import EngineCoreRequest, ModelRunnerOutput
from pagoda.spec_decode.config import SpeculativeConfig

PROMPTS = ["Monday, Tuesday, Wednesday, Thursday,", "The capital of France is", "def add(a, b):"]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)  # crosses blocks


@pytest.fixture(scope="module")
def other_draft_dir(tmp_path_factory, smollm2_tokenizer) -> str:
    """A one-layer random Llama with SmolLM2's tokenizer: a poor draft (most drafts
    rejected), which is what exercises the rollback of the draft's own KV."""
    config = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, max_position_embeddings=1024, tie_word_embeddings=True)
    torch.manual_seed(1)
    out = tmp_path_factory.mktemp("draft")
    LlamaForCausalLM(config).save_pretrained(out)
    smollm2_tokenizer.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    return LLM(tiny_llama_dir, dtype="float32", seed=0, max_model_len=512, block_size=16)


def spec_llm(target: str, draft: str, k: int = 3) -> LLM:
    return LLM(target, dtype="float32", seed=0, max_model_len=512, block_size=16,
               speculative_config={"model": draft, "num_speculative_tokens": k})


def tokens(llm: LLM, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def stats(llm: LLM):
    return llm.llm_engine.core.get_stats().spec_decoding


def test_a_draft_equal_to_the_target_is_always_accepted(plain, tiny_llama_dir):
    llm = spec_llm(tiny_llama_dir, tiny_llama_dir, k=4)
    assert tokens(llm) == tokens(plain)
    s = stats(llm)
    assert s.num_draft_tokens > 60  # 3 requests x ~39 tokens, mostly 4 drafts a step
    assert s.num_accepted_tokens == s.num_draft_tokens
    assert s.accepted_per_pos[0] == s.num_drafts


def test_a_poor_draft_changes_no_greedy_token(plain, tiny_llama_dir, other_draft_dir):
    llm = spec_llm(tiny_llama_dir, other_draft_dir)
    assert tokens(llm) == tokens(plain)
    s = stats(llm)
    assert s.num_drafts > 0 and s.num_accepted_tokens < s.num_draft_tokens
    # Sampled requests run with drafts too and stay valid.
    sampled = tokens(llm, SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True))
    assert all(len(t) == 20 and all(0 <= x < 49152 for x in t) for t in sampled)


@pytest.mark.parametrize("config,message", [
    ({"num_speculative_tokens": 2}, None),  # filled in below: a draft of another vocabulary
    ({"method": "eagle", "model": "x", "num_speculative_tokens": 2}, "not supported"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, 'needs "model"'),
])
def test_bad_draft_configs_are_refused(tiny_llama_dir, tmp_path, config, message):
    if message is None:
        small = LlamaConfig(vocab_size=1000, hidden_size=16, intermediate_size=32,
                            num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1)
        LlamaForCausalLM(small).save_pretrained(tmp_path)
        config = {**config, "model": str(tmp_path)}
        message = "must share the tokenizer"
    with pytest.raises(ValueError, match=message):
        LLM(tiny_llama_dir, dtype="float32", speculative_config=config)


def test_tensor_parallel_draft_is_refused(tiny_llama_dir):
    args = EngineArgs(model=tiny_llama_dir, tensor_parallel_size=2, speculative_config={
        "model": tiny_llama_dir, "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="single-rank"):
        args.create_engine_config()


@pytest.mark.extended  # make test-extended: a cluster of its own; the offline tests above cover the draft model
@pytest.mark.slow
def test_served_greedy_text_equals_plain_and_drafts_are_accepted(plain, tiny_llama_dir):
    spec = {"model": tiny_llama_dir, "num_speculative_tokens": 3}
    serve = ServeProcess([tiny_llama_dir, "--dtype", "float32", "--max-model-len", "512",
                          "--block-size", "16", "--served-model-name", "tiny",
                          "--speculative-config", json.dumps(spec)], timeout=300)
    try:
        client = openai.OpenAI(base_url=serve.url, api_key="x", max_retries=0, timeout=120)
        reply = client.completions.create(model="tiny", prompt=PROMPTS, temperature=0,
                                          max_tokens=40, extra_body={"ignore_eos": True})
        texts = [c.text for c in sorted(reply.choices, key=lambda c: c.index)]
        assert texts == [o.outputs[0].text for o in plain.generate(PROMPTS, GREEDY,
                                                                     use_tqdm=False)]
        metrics = serve.scrape()
        drafted = sum(v for (n, _), v in metrics.items()
                      if n == "vllm:spec_decode_num_draft_tokens_total")
        accepted = sum(v for (n, _), v in metrics.items()
                       if n == "vllm:spec_decode_num_accepted_tokens_total")
        assert drafted > 60 and accepted == drafted
    finally:
        assert serve.stop() == 0, "".join(serve.log[-40:])


def test_the_scheduler_allocates_lookahead_and_checks_worker_drafts():
    """With a draft model each scheduled request gets k slots after its tokens (the
    draft writes its proposals' KV there), and drafts from the worker are cut at the
    first token outside the vocabulary and at max_tokens."""
    spec = SpeculativeConfig(3, "draft_model", model="draft", vocab_size=100)
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
                                  speculative_config=spec),
                  CacheConfig(block_size=4, enable_prefix_caching=False), 64)
    s.add_request(EngineCoreRequest("a", list(range(1, 9)), SamplingParams(max_tokens=6), [0]))
    s.add_request(EngineCoreRequest("b", list(range(1, 9)), SamplingParams(max_tokens=3), [0]))
    so = s.schedule()
    # 8 prompt tokens + 3 lookahead slots: 3 blocks of 4 each, not 2.
    assert [len(d.block_ids) for d in so.scheduled_new_reqs] == [3, 3]
    s.update_from_output(so, ModelRunnerOutput(["a", "b"], [[5], [5]], draft_token_ids={
        "a": [6, 100, 7], "b": [6, 7, 8]}))
    so = s.schedule()
    assert so.scheduled_spec_decode_tokens == {"a": [6], "b": [6]}  # vocab; max_tokens room
    assert so.num_scheduled_tokens == {"a": 2, "b": 2}
