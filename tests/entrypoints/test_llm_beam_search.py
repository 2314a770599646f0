"""`LLM.beam_search` (vLLM's API) on the tiny random Llama in float32: token for token
equal to transformers' beam search where the two algorithms agree (pagoda/beam_search.py
says where), and the beams share the prompt's KV blocks instead of copying them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pagoda import LLM, BeamSearchOutput, BeamSearchParams

PROMPTS = ["The quick brown fox jumps over", "Once upon a time, in a land"]
BLOCK_SIZE = 4
NUM_BLOCKS = 1024  # a small KV cache: plenty for these searches, light on the machine


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=tiny_llama_dir, dtype="float32", block_size=BLOCK_SIZE, max_model_len=256,
              num_gpu_blocks_override=NUM_BLOCKS)


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32)
    return model.eval()


def hf_beams(model, prompt_ids, k, max_tokens, eos, length_penalty, early_stopping):
    """transformers' k best sequences (prompt included, padding cut) and their scores."""
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = eos if eos is not None else 0
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), num_beams=k, num_return_sequences=k,
                             do_sample=False, max_new_tokens=max_tokens,
                             length_penalty=length_penalty, early_stopping=early_stopping,
                             output_scores=True, return_dict_in_generate=True,
                             top_k=None, top_p=None, temperature=None)
    seqs = []
    for row in out.sequences.tolist():
        if eos is not None and eos in row[len(prompt_ids):]:
            row = row[:row.index(eos, len(prompt_ids)) + 1]
        seqs.append(row)
    return seqs, out.sequences_scores.tolist()


@pytest.mark.parametrize("k,length_penalty,early_stopping", [(2, 1.0, False), (3, 0.5, True),
                                                              (4, 2.0, "never")])
def test_equals_transformers_without_eos(llm, hf_model, k, length_penalty, early_stopping):
    """ignore_eos: no hypothesis ends early, so every length_penalty and early_stopping
    of transformers gives vLLM's answer; the scores agree too (transformers divides by
    the generated length, vLLM by the whole length)."""
    tok = llm.get_tokenizer()
    params = BeamSearchParams(beam_width=k, max_tokens=7, ignore_eos=True,
                              length_penalty=length_penalty)
    outs = llm.beam_search(PROMPTS, params)
    assert all(isinstance(o, BeamSearchOutput) for o in outs)
    for prompt, out in zip(PROMPTS, outs):
        ids = tok.encode(prompt)
        hf, scores = hf_beams(hf_model, ids, k, 7, None, length_penalty, early_stopping)
        assert [s.tokens for s in out.sequences] == hf
        for seq, score in zip(out.sequences, scores):
            assert seq.cum_logprob == pytest.approx(score * 7 ** length_penalty, abs=1e-3)
            assert seq.text == tok.decode(seq.tokens)
        assert len({tuple(s.tokens) for s in out.sequences}) == k


@pytest.fixture(scope="module")
def eos_case(llm, tiny_llama_dir, tmp_path_factory):
    """A copy of the tiny model whose EOS is a token the search picks early: the third
    generated token of the second-best beam (so a beam finishes mid-search)."""
    tok = llm.get_tokenizer()
    ids = tok.encode(PROMPTS[0])
    out = llm.beam_search([ids], BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True))
    eos = out[0].sequences[1].tokens[len(ids) + 2]
    path = tmp_path_factory.mktemp("tiny_llama_eos")
    for f in Path(tiny_llama_dir).iterdir():
        shutil.copy(f, path / f.name)
    for name in ("config.json", "generation_config.json"):
        if (path / name).exists():
            data = json.loads((path / name).read_text())
            data["eos_token_id"] = eos
            (path / name).write_text(json.dumps(data))
    return str(path), ids, eos


def test_equals_transformers_canonical_with_eos(eos_case, hf_model):
    """A beam that ends in EOS: transformers' canonical beam search (early_stopping
    "never", length_penalty 0) and vLLM's give the same sequences, the finished one
    included, with equal cumulative logprobs."""
    path, ids, eos = eos_case
    llm = LLM(model=path, dtype="float32", block_size=BLOCK_SIZE, max_model_len=256,
              num_gpu_blocks_override=NUM_BLOCKS)
    for k in (2, 3):
        out = llm.beam_search([ids], BeamSearchParams(beam_width=k, max_tokens=8,
                                                      length_penalty=0.0))[0]
        hf, scores = hf_beams(hf_model, ids, k, 8, eos, 0.0, "never")
        assert [s.tokens for s in out.sequences] == hf
        assert [s.cum_logprob for s in out.sequences] == pytest.approx(scores, abs=1e-3)
        finished = [s for s in out.sequences if s.tokens[-1] == eos]
        assert finished and all(len(s.tokens) < len(ids) + 8 for s in finished)


def used_blocks_per_step(llm: LLM):
    """Wrap the executor: (blocks in use (ref_cnt > 0), the most references one block
    has) when each step runs."""
    core = llm.llm_engine.core
    pool = core.scheduler.kv_cache_manager.pool
    seen: list[tuple[int, int]] = []
    run = core.executor.execute_model

    def counting(plan):
        seen.append((pool.num_blocks - pool.num_free_blocks,
                     max(b.ref_cnt for b in pool.blocks)))
        return run(plan)

    core.executor.execute_model = counting
    return seen


LONG_PROMPT = [(7 * i) % 1000 + 10 for i in range(160)]  # 40 blocks of 4
K, MAX_TOKENS = 4, 6


def max_used_blocks(llm: LLM) -> int:
    seen = used_blocks_per_step(llm)
    out = llm.beam_search([LONG_PROMPT], BeamSearchParams(beam_width=K, max_tokens=MAX_TOKENS,
                                                          ignore_eos=True))[0]
    assert len(out.sequences) == K
    return max(used for used, _ in seen), max(refs for _, refs in seen)


def test_beams_share_the_prompt_blocks(llm):
    """Width 4 on a 160-token prompt: each step holds the prompt's 40 blocks once, plus
    per beam at most its generated tokens' blocks and one partial block -- not 4 copies
    of the prompt (the invariant in pagoda/beam_search.py)."""
    prompt_blocks = len(LONG_PROMPT) // BLOCK_SIZE
    per_beam = -(-MAX_TOKENS // BLOCK_SIZE) + 1
    used, refs = max_used_blocks(llm)
    assert prompt_blocks <= used <= prompt_blocks + K * per_beam
    assert refs == K  # a prompt block is referenced by every beam, not copied


def test_without_prefix_caching_each_beam_holds_a_copy(tiny_llama_dir):
    """The contrast that shows the count above can fail: the sharing is the prefix
    cache's ref counting, and without it every beam holds the prompt's blocks."""
    llm = LLM(model=tiny_llama_dir, dtype="float32", block_size=BLOCK_SIZE, max_model_len=256,
              num_gpu_blocks_override=NUM_BLOCKS,
              enable_prefix_caching=False)
    used, refs = max_used_blocks(llm)
    assert used >= K * (len(LONG_PROMPT) // BLOCK_SIZE) and refs == 1


def test_bad_params_name_the_field(llm):
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=0)
    with pytest.raises(ValueError, match="beam_width"):  # 2 * 11 logprobs > 20
        llm.beam_search(["hi"], BeamSearchParams(beam_width=11, max_tokens=2))
    with pytest.raises(ValueError, match="max_tokens"):
        llm.beam_search(["hi"], BeamSearchParams(beam_width=2, max_tokens=300))
