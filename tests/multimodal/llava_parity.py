"""HF transformers' LLaVA as the reference: greedy tokens, their logprobs and the prompt
logprobs of one prompt with images, in float32 with eager attention."""

from __future__ import annotations

import functools

import torch

from pagoda import LLM, SamplingParams

LOGPROB_ATOL = 1e-4


@functools.lru_cache(maxsize=2)
def _hf_model(path: str):
    from transformers import LlavaForConditionalGeneration
    return LlavaForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()


def hf_reference(path: str, input_ids: list[int], pixel_values: torch.Tensor | None,
                 max_tokens: int):
    """(greedy tokens, their logprobs, prompt logprobs of tokens 1..n-1)."""
    model = _hf_model(path)
    ids = torch.tensor([input_ids])
    kwargs = {"pixel_values": pixel_values} if pixel_values is not None else {}
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=max_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0, **kwargs)
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs).logits[0]
    tokens = out.sequences[0, len(input_ids):].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item()
                for step, t in zip(out.logits, tokens)]
    prompt = torch.log_softmax(logits[:-1].float(), -1).gather(
        1, ids[0, 1:, None])[:, 0].tolist()
    return tokens, logprobs, prompt


def pagoda_results(llm: LLM, prompts: list[dict], max_tokens: int, prompt_logprobs: bool = True):
    """[(tokens, sample logprobs, prompt logprobs or None)], outputs. A request with
    prompt logprobs takes no prefix-cache hit (vLLM's rule), so a warm pass asks none."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0,
                            prompt_logprobs=0 if prompt_logprobs else None, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    results = []
    for out in outs:
        c = out.outputs[0]
        tokens = list(c.token_ids)
        sample = [lp[t].logprob for lp, t in zip(c.logprobs, tokens)]
        prompt = ([lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:],
                                                   out.prompt_token_ids[1:])]
                  if prompt_logprobs else None)
        results.append((tokens, sample, prompt))
    return results, outs


def assert_same(ours, reference) -> None:
    tokens, sample, prompt = ours
    want_tokens, want_sample, want_prompt = reference
    assert tokens == want_tokens
    torch.testing.assert_close(torch.tensor(sample), torch.tensor(want_sample),
                               atol=LOGPROB_ATOL, rtol=0)
    if prompt is not None:
        torch.testing.assert_close(torch.tensor(prompt), torch.tensor(want_prompt),
                                   atol=LOGPROB_ATOL, rtol=0)
