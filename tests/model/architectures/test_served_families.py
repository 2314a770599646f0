"""The families of issue 30 served: `pagoda serve` on each tiny random checkpoint, asked
through the official `openai` client, answers greedy completions with the same token ids
and text as the offline `pagoda.LLM` and as transformers (float32).

The checkpoints are the families' parity checkpoints (test_gpt_oss.py,
test_granitemoehybrid.py, test_deepseek.py) with SmolLM2's whole vocabulary, so text
prompts tokenize inside the model's vocabulary (gpt-oss's also holds the 7 harmony
control tokens, `save_gpt_oss_chat`; its chats: test_gpt_oss_chat.py).

All `extended` (make test-extended; a cluster per family, 45-60 s each here): Granite-4.0-H
and DeepSeek-V3's served paths are also rows of the differential matrix
(tests/matrix/test_matrix_families.py, served == offline); gpt-oss's one-request-at-a-
time steps, which failed served (a lone prefill's sink attention), are covered in
`make test` offline (test_gpt_oss.py::test_a_prompt_prefilled_alone_matches_transformers).
"""

from __future__ import annotations

import sys

import openai
import pytest
import torch
from serve_cluster import ServeProcess
from shared_clusters import PLAIN_TINY_FLAGS
from test_deepseek import _randomize_correction_bias, v3_config
from test_gpt_oss import save_gpt_oss_chat
from test_granitemoehybrid import granite_hybrid_config

from arch_parity import hf_greedy, save_tiny_checkpoint
from pagoda import LLM, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # make test-extended
FULL_VOCAB = 49152  # SmolLM2's tokenizer
PROMPTS = ["The lighthouse keeper opened the door and",
           "Once upon a time, in a town by the sea, the fleet"]
MAX_TOKENS = 12


LONG = dict(vocab_size=FULL_VOCAB, max_position_embeddings=1024)  # PLAIN_TINY_FLAGS' length


def gpt_oss(path, tokenizer) -> str:
    # Layers alternate a window of 8 with full attention; the prompts are longer. The
    # tokenizer has the harmony control tokens (the vocabulary grows by 7 for them).
    return save_gpt_oss_chat(path, tokenizer)


def granite_hybrid(path, tokenizer) -> str:
    config = granite_hybrid_config(**LONG, position_embedding_type=None)  # NoPE, as released
    return save_tiny_checkpoint(path, config, tokenizer)


def deepseek_v3(path, tokenizer) -> str:
    save_tiny_checkpoint(path, v3_config(**LONG), tokenizer)
    _randomize_correction_bias(path)
    return str(path)


def served_greedy(path: str, redis_url: str) -> list[tuple[list[int], str]]:
    """[(token ids, text)] of each prompt from `pagoda serve PATH`, one request each."""
    serve = ServeProcess([path, *PLAIN_TINY_FLAGS, "--redis-url", redis_url])
    try:
        client = openai.OpenAI(base_url=serve.url, api_key="unused", max_retries=0,
                               timeout=120)
        answers = []
        for prompt in PROMPTS:
            choice = client.completions.create(
                model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                logprobs=1, extra_body={"ignore_eos": True,
                                        "return_tokens_as_token_ids": True}).choices[0]
            ids = [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]
            answers.append((ids, choice.text))
    except BaseException:
        print("".join(serve.log[-80:]), file=sys.stderr)  # the cluster's account
        raise
    finally:
        code = serve.stop()
    assert code == 0, serve.stderr_text()[-3000:]
    return answers


def check_served(build, tmp_path, tokenizer, redis_url) -> None:
    path = build(tmp_path, tokenizer)
    llm = LLM(model=path, dtype="float32", max_model_len=1024, block_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    offline = [(list(o.outputs[0].token_ids), o.outputs[0].text)
               for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    prompt_ids = [o.prompt_token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    del llm
    hf = [tokens for tokens, _ in hf_greedy(path, [list(p) for p in prompt_ids], MAX_TOKENS)]
    assert [ids for ids, _ in offline] == hf  # the offline engine is transformers' answer
    served = served_greedy(path, redis_url)
    assert served == offline
    assert len({text for _, text in served}) == len(PROMPTS)  # not one degenerate answer


def test_gpt_oss_served_equals_offline_and_transformers(tmp_path, smollm2_tokenizer,
                                                        shared_redis):
    check_served(gpt_oss, tmp_path, smollm2_tokenizer, shared_redis.url)


@pytest.mark.parametrize("build", [granite_hybrid, deepseek_v3],
                         ids=["granite-4.0-h", "deepseek-v3"])
def test_family_served_equals_offline_and_transformers(tmp_path, smollm2_tokenizer,
                                                       shared_redis, build):
    torch.manual_seed(0)
    check_served(build, tmp_path, smollm2_tokenizer, shared_redis.url)
