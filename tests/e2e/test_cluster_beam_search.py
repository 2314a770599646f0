"""`use_beam_search` through the gateway and the services (the shared tiny cluster, the
official openai client): each choice equals the offline `LLM.beam_search` of the same
model, streamed or not, in completions and chat; bad beam input is a 400 naming the
field and the service stays up."""

from __future__ import annotations

import openai
import pytest

from pagoda import LLM, BeamSearchParams
from pagoda.tokenizer.chat import apply_chat_template

pytestmark = pytest.mark.slow
MODEL = "tiny"
PROMPT = "The capital of France is a city that"
HELLO = [{"role": "user", "content": "Hello there, how are you?"}]


@pytest.fixture(scope="module")
def client(plain_tiny_cluster):
    return openai.OpenAI(base_url=plain_tiny_cluster.url, api_key="unused", max_retries=0,
                         timeout=180)


@pytest.fixture(scope="module")
def offline(tiny_llama_dir):
    """The cluster's model and shape (shared_clusters.PLAIN_TINY_FLAGS) in one process,
    with a small KV cache (the default takes a share of this machine's memory, which the
    cluster's processes need too)."""
    return LLM(model=tiny_llama_dir, dtype="float32", max_model_len=1024, block_size=16,
               num_gpu_blocks_override=512)


def offline_texts(llm: LLM, prompt_ids: list[int], k: int, max_tokens: int, **kwargs) -> list:
    """What the served choices must be: each best sequence's generated text (a final EOS
    left out, special tokens skipped, as the served text is) and finish reason."""
    tok = llm.get_tokenizer()
    eos = llm.llm_engine.config.arch.eos_token_ids
    out = llm.beam_search([prompt_ids], BeamSearchParams(beam_width=k, max_tokens=max_tokens,
                                                         **kwargs))[0]
    result = []
    for seq in out.sequences:
        gen = seq.tokens[len(prompt_ids):]
        stopped = bool(gen) and gen[-1] in eos and not kwargs.get("ignore_eos")
        result.append((tok.decode(gen[:-1] if stopped else gen, skip_special_tokens=True),
                       "stop" if stopped else "length"))
    return result


@pytest.mark.parametrize("k,length_penalty", [(3, 1.0), (2, 0.5)])
def test_completions_equal_offline(client, offline, k, length_penalty):
    extra = {"use_beam_search": True, "length_penalty": length_penalty}
    r = client.completions.create(model=MODEL, prompt=PROMPT, n=k, max_tokens=6, temperature=0,
                                  extra_body=extra)
    want = offline_texts(offline, offline.get_tokenizer().encode(PROMPT), k, 6,
                         length_penalty=length_penalty)
    assert [(c.text, c.finish_reason) for c in r.choices] == want
    assert [c.index for c in r.choices] == list(range(k))
    assert len({c.text for c in r.choices}) == k
    assert r.usage.completion_tokens == 6 * k
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, n=k, max_tokens=6,
                                            temperature=0, stream=True, extra_body=extra))
    streamed = {}
    for chunk in chunks:
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(k)] == [t for t, _ in want]


def test_chat_equals_offline(client, offline):
    r = client.chat.completions.create(model=MODEL, messages=HELLO, n=2, max_tokens=5,
                                       temperature=0,
                                       extra_body={"use_beam_search": True, "ignore_eos": True})
    ids = apply_chat_template(offline.get_tokenizer(), HELLO, add_generation_prompt=True)
    want = offline_texts(offline, ids, 2, 5, ignore_eos=True)
    assert [(c.message.content, c.finish_reason) for c in r.choices] == want


@pytest.mark.parametrize("extra, param", [
    ({"n": 0}, "n"),
    ({"n": 11}, "n"),  # 2 * 11 logprobs per step > --max-logprobs 20
    ({"n": 2, "best_of": 3}, "best_of"),
    ({"n": 2, "stop": ["x"]}, "stop"),
    ({"n": 2, "logprobs": 1}, "logprobs"),
])
def test_bad_beam_input_is_400_naming_the_field(client, extra, param):
    body = {"use_beam_search": True, **extra}
    n = body.pop("n")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, n=n,
                                  extra_body=body)
    assert info.value.body["param"] == param, info.value.body
    ok = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, n=2, temperature=0,
                                   extra_body={"use_beam_search": True})
    assert len(ok.choices) == 2
