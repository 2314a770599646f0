"""vLLM's request fields through the offline `LLM`: priority, truncate_prompt_tokens,
allowed_token_ids and bad_words, on a tiny random model."""

import pytest

from pagoda import LLM, SamplingParams
from pagoda.tokenizer.bad_words import bad_words_token_ids

PROMPT = "one two three four five six seven eight nine ten"


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=str(tiny_llama_dir), dtype="float32", block_size=4, max_model_len=256)


@pytest.fixture(scope="module")
def priority_llm(tiny_llama_dir):
    return LLM(model=str(tiny_llama_dir), dtype="float32", block_size=4, max_model_len=256,
               scheduling_policy="priority", max_num_seqs=1)


def greedy(max_tokens=12, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw)


def test_priority_orders_the_offline_queue(priority_llm):
    engine = priority_llm.llm_engine
    for rid, priority in [("p3", 3), ("p0", 0), ("p2", 2), ("p-1", -1)]:
        engine.add_request(PROMPT, None, greedy(4), request_id=rid, priority=priority)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["p-1", "p0", "p2", "p3"]  # one at a time (max_num_seqs=1)
    outs = priority_llm.generate(["a", "b"], greedy(2), priority=[5, 1], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2]  # results in input order


def test_priority_needs_the_priority_policy(llm):
    with pytest.raises(ValueError, match="Got priority 1 but Priority scheduling is not enabled."):
        llm.generate([PROMPT], greedy(), priority=[1], use_tqdm=False)
    with pytest.raises(ValueError, match="priorities"):
        llm.generate([PROMPT, PROMPT], greedy(), priority=[0], use_tqdm=False)
    assert llm.generate([PROMPT], greedy(2), priority=[0], use_tqdm=False)[0].finished


def test_truncation_keeps_the_last_tokens_and_generates_as_that_prompt(llm):
    ids = llm.get_tokenizer().encode(PROMPT)
    cut = llm.generate(PROMPT, greedy(truncate_prompt_tokens=5), use_tqdm=False)[0]
    direct = llm.generate({"prompt_token_ids": ids[-5:]}, greedy(), use_tqdm=False)[0]
    assert cut.prompt_token_ids == ids[-5:]
    assert cut.outputs[0].token_ids == direct.outputs[0].token_ids
    whole = llm.generate(PROMPT, greedy(truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert whole.prompt_token_ids == ids
    with pytest.raises(ValueError, match="greater than max_model_len"):
        llm.generate(PROMPT, greedy(truncate_prompt_tokens=257), use_tqdm=False)


def test_allowed_token_ids_restrict_every_sampled_token(llm):
    allowed = [100, 200, 300, 400]
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=3, ignore_eos=True,
                            allowed_token_ids=allowed)
    out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 20 and set(out.token_ids) <= set(allowed)
    with pytest.raises(ValueError, match="allowed_token_ids contains out-of-vocab token id!"):
        llm.generate(PROMPT, greedy(allowed_token_ids=[10**6]), use_tqdm=False)


def single_token_word(tok, token: int) -> str | None:
    """The text of `token` when banning it as a bad word bans exactly that token (one of
    its encodings is that token alone), wherever it could be sampled."""
    text = tok.decode([token]).strip()
    encode = lambda t: tok.encode(t, add_special_tokens=False)  # noqa: E731
    return text if text and [token] in bad_words_token_ids([text], encode) else None


def test_bad_words_never_appear(llm):
    tok = llm.get_tokenizer()
    free = llm.generate(PROMPT, greedy(20), use_tqdm=False)[0].outputs[0].token_ids
    token, word = next((t, w) for t in free if (w := single_token_word(tok, t)))
    banned = llm.generate(PROMPT, greedy(20, bad_words=[word]), use_tqdm=False)[0].outputs[0]
    assert token not in banned.token_ids and len(banned.token_ids) == 20
    assert banned.token_ids[:free.index(token)] == free[:free.index(token)]  # same until then
