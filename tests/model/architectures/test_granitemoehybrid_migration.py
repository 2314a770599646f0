"""A migrated Granite-4.0-H request (hybrid: Mamba2 + attention) continues exactly.

Migration (services/gateway/generation/migration.py) re-sends a request to another
replica with the tokens it already generated as `output_token_ids`. For a hybrid model
the target rebuilds the Mamba2 conv and SSM state by computing the whole context
(prompt + generated tokens) in a freshly zeroed state slot, or, with prefix caching,
from the state checkpoint at the last cached block boundary that has one
(pagoda.core.state_checkpoints: here the original request's, run on the same engine).
These tests drive the engine as a scheduler replica does: the migrated request, given
k tokens generated elsewhere, must give exactly the tokens the unmigrated one gave
after its k-th, greedy and seeded, while other requests run beside it and the slot it
gets was used before (a slot not zeroed, a checkpoint not saved or not restored, or a
state not rebuilt, changes the tokens).
"""

from __future__ import annotations

import pytest

from arch_parity import ENGINE, random_prompts, save_tiny_checkpoint
from pagoda import LLM
from pagoda.messages import EngineCoreRequest
from pagoda.sampling_params import SamplingParams
from test_granitemoehybrid import granite_hybrid_config

MAX_TOKENS = 12


def _run(core, requests: list[EngineCoreRequest]) -> dict[str, list[int]]:
    """Every request's generated tokens, the requests run together to the end."""
    out: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for request in requests:
        core.add_request(request)
    while core.scheduler.has_unfinished_requests():
        for output in core.step():
            out[output.request_id] += output.new_token_ids
    return out


def _params(seeded: bool) -> SamplingParams:
    if seeded:
        return SamplingParams(temperature=1.0, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True)
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=[False, True], ids=["recompute", "checkpoints"])
def hybrid_core(request, tmp_path_factory, smollm2_tokenizer):
    path = save_tiny_checkpoint(tmp_path_factory.mktemp("granite_hybrid"),
                                granite_hybrid_config(position_embedding_type=None),
                                smollm2_tokenizer)
    # 16-token steps: a migrated context (prompt + k tokens) is computed in chunks.
    llm = LLM(model=path, **{**ENGINE, "enable_prefix_caching": request.param})
    assert llm.llm_engine.config.cache.enable_prefix_caching is request.param
    return llm.llm_engine.core


@pytest.mark.parametrize("k", [1, 5, MAX_TOKENS - 1])
def test_a_migrated_hybrid_request_continues_with_the_unmigrated_tokens(hybrid_core, k):
    caching = hybrid_core.scheduler.kv_cache_manager.enable_caching
    prompts = random_prompts([7, 30, 45], seed=k)  # not cached by the k before
    originals = [EngineCoreRequest(f"r{i}-{seeded}", p, _params(seeded))
                 for i, p in enumerate(prompts) for seeded in (False, True)]
    reference = _run(hybrid_core, originals)
    assert all(len(tokens) == MAX_TOKENS for tokens in reference.values())

    # The resumed form the gateway sends (migration.ChoiceRoute.next_request), run
    # beside fresh requests, in slots the requests above left non-zero.
    migrated = [EngineCoreRequest(f"{r.request_id}.m1", r.prompt_token_ids,
                                  r.sampling_params,
                                  output_token_ids=reference[r.request_id][:k])
                for r in originals]
    others = [EngineCoreRequest(f"other{i}", p[::-1], _params(False))
              for i, p in enumerate(prompts)]
    stats = hybrid_core.scheduler.kv_cache_manager.prefix_stats
    hits_before = stats.hits
    got = _run(hybrid_core, [*others, *migrated])
    for r in originals:
        want = reference[r.request_id]
        assert want[:k] + got[f"{r.request_id}.m1"] == want, (r.request_id, k)
    # With prefix caching the migrated contexts started from the originals' checkpoints.
    assert (stats.hits > hits_before) is caching
