"""`LLM.beam_search`: vLLM's offline beam search over the engine (pagoda.beam_search).

Each step runs every live beam of every prompt as one batch of one-token requests
through `LLM.generate`; the engine's prefix cache shares the beams' common full blocks
(the invariant is stated in pagoda/beam_search.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from tqdm.auto import tqdm

from pagoda.beam_search import (BeamSearchInstance, BeamSearchOutput, BeamSearchParams,
                                best_beams, expand_beams, step_sampling_params)
from pagoda.entrypoints.prompts import Prompt, as_prompt_list, normalize_prompt
from pagoda.lora.request import LoRARequest, loras_per_prompt

if TYPE_CHECKING:
    from pagoda.entrypoints.llm import LLM


def run_beam_search(llm: "LLM", prompts: Prompt | Sequence[Prompt], params: BeamSearchParams,
                    lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                    use_tqdm: bool = False, concurrency_limit: int | None = None,
                    ) -> list[BeamSearchOutput]:
    """The best `params.beam_width` sequences of each prompt, in the order of the prompts.
    `concurrency_limit`: how many prompts search at once (None: all)."""
    if not isinstance(params, BeamSearchParams):
        raise TypeError("params must be a BeamSearchParams.")
    tokenizer = llm.get_tokenizer()
    eos = llm.llm_engine.config.arch.eos_token_ids
    items = [normalize_prompt(p) for p in as_prompt_list(prompts)]
    loras = loras_per_prompt(lora_request, len(items))
    instances = [BeamSearchInstance(ids if ids is not None else tokenizer.encode(text), lora)
                 for (text, ids, _salt), lora in zip(items, loras)]
    salts = {id(inst): salt for inst, (_t, _i, salt) in zip(instances, items)}
    max_len = llm.llm_engine.config.scheduler.max_model_len
    for inst in instances:
        if inst.prompt_len + params.max_tokens > max_len:
            raise ValueError(f"max_tokens: a prompt of {inst.prompt_len} tokens and "
                             f"{params.max_tokens} new ones exceed the maximum model length "
                             f"({max_len}).")
    max_logprobs = llm.llm_engine.config.max_logprobs
    if max_logprobs != -1 and 2 * params.beam_width > max_logprobs:
        raise ValueError(f"beam_width {params.beam_width} needs 2 * beam_width = "
                         f"{2 * params.beam_width} logprobs per step, more than the maximum "
                         f"allowed, {max_logprobs} (--max-logprobs).")
    step_params = step_sampling_params(params)
    limit = concurrency_limit or max(len(instances), 1)
    for start in range(0, len(instances), limit):
        batch = instances[start:start + limit]
        steps = tqdm(range(params.max_tokens), desc="Beam search", disable=not use_tqdm)
        for _ in steps:
            beams = [(inst, beam) for inst in batch for beam in inst.beams]
            if not beams:
                break
            outputs = llm.generate([{"prompt_token_ids": beam.tokens,
                                     "cache_salt": salts[id(inst)]} for inst, beam in beams],
                                   step_params, use_tqdm=False,
                                   lora_request=[beam.lora_request for _, beam in beams])
            candidates: dict[int, list] = {id(inst): [] for inst in batch}
            for (inst, _), out in zip(beams, outputs):
                rows = out.outputs[0].logprobs
                candidates[id(inst)].append(
                    {t: lp.logprob for t, lp in rows[0].items()} if rows else None)
            for inst in batch:
                expand_beams(inst, candidates[id(inst)], params, eos)
    results = []
    for inst in instances:
        best = best_beams(inst, params, eos)
        for beam in best:
            beam.text = tokenizer.decode(beam.tokens)  # vLLM's: the prompt's text too
        results.append(BeamSearchOutput(best))
    return results
