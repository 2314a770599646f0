"""Sampler: greedy == argmax, seeded reproducibility across batches, output shapes."""

from __future__ import annotations

import torch

from pagoda.sample.builder import make_generator
from pagoda.sample.sampler import Sampler, SamplerOutput
from pagoda.sampling_params import SamplingParams as SP

V = 1000
NUM_STEPS = 6


def test_all_greedy_fast_path_is_argmax_and_leaves_logits_alone(build):
    torch.manual_seed(0)
    logits = torch.randn(64, V)
    raw = logits.clone()
    out = Sampler()(logits, build([SP(temperature=0.0)] * 64, V))
    assert isinstance(out, SamplerOutput) and out.logprobs is None
    assert out.sampled_token_ids.dtype == torch.long
    assert torch.equal(out.sampled_token_ids, raw.argmax(-1))
    assert torch.equal(logits, raw)


def test_greedy_rows_in_a_mixed_batch_are_exact_argmax(build):
    torch.manual_seed(1)
    logits = torch.randn(32, V) * 4
    params = [SP(temperature=0.0) if i % 2 else SP(temperature=1.3, top_k=20, top_p=0.8)
              for i in range(32)]
    sampled = Sampler()(logits, build(params, V)).sampled_token_ids
    greedy_rows = torch.arange(1, 32, 2)
    assert torch.equal(sampled[greedy_rows], logits.argmax(-1)[greedy_rows])
    # The random rows really sampled: not all of them landed on the argmax.
    random_rows = torch.arange(0, 32, 2)
    assert not torch.equal(sampled[random_rows], logits.argmax(-1)[random_rows])


def test_reduced_precision_logits_are_accepted(build):
    logits = torch.randn(3, V).to(torch.bfloat16)
    out = Sampler()(logits, build([SP(temperature=0.0), SP(), SP(logprobs=2)], V))
    assert out.sampled_token_ids[0].item() == logits.float().argmax(-1)[0].item()
    assert out.logprobs.logprobs.dtype == torch.float32


def test_empty_batch(build):
    out = Sampler()(torch.empty(0, V), build([], V))
    assert out.sampled_token_ids.shape == (0,)


# ----------------------------------------------------------------------------- seeds
TARGET = SP(temperature=0.9, top_k=200, top_p=0.95, seed=1234)


def _step_logits(step: int) -> torch.Tensor:
    """The target request's logits at each step (flat enough that sampling varies)."""
    return torch.randn(V, generator=torch.Generator().manual_seed(step)) * 1.5


def _run_target(build, companions: list[SP], target_row: int, seed: int = 1234,
                default_seed: int = 0) -> list[int]:
    """Sample NUM_STEPS tokens for TARGET at `target_row`, among `companions`."""
    torch.manual_seed(default_seed)
    params = list(companions)
    params.insert(target_row, TARGET.clone(seed=seed))
    generators = {target_row: make_generator(seed)}
    for row, p in enumerate(params):
        if p.seed is not None and row != target_row:
            generators[row] = make_generator(p.seed)
    sampler, tokens = Sampler(), []
    outputs: list[list[int]] = [[] for _ in params]
    for step in range(NUM_STEPS):
        logits = torch.randn(len(params), V) * 3  # companions' logits: arbitrary
        logits[target_row] = _step_logits(step)
        md = build(params, V, prompts=[[1, 2, 3]] * len(params), outputs=outputs,
                   generators=generators, eos=[0])
        sampled = sampler(logits, md).sampled_token_ids.tolist()
        for row, token in enumerate(sampled):
            outputs[row].append(token)
        tokens.append(sampled[target_row])
    return tokens


def test_seeded_request_is_reproducible_whatever_shares_the_batch(build):
    alone = _run_target(build, [], target_row=0)
    companions = [
        SP(temperature=0.0),
        SP(temperature=0.7),  # unseeded: default generator
        SP(temperature=1.2, seed=7, top_p=0.5),
        SP(repetition_penalty=1.3, frequency_penalty=0.5, min_tokens=3, logprobs=2),
        SP(temperature=0.0, logit_bias={5: 3.0}),
        SP(min_p=0.1, top_k=3),
    ]
    mixed = _run_target(build, companions, target_row=3, default_seed=99)
    assert mixed == alone
    assert len(set(alone)) > 1  # it really sampled
    # Same with only greedy companions (the mixed-batch path) and another row index.
    assert _run_target(build, [SP(temperature=0.0)] * 5, target_row=5, default_seed=5) == alone


def test_different_seeds_differ_and_unseeded_rows_follow_the_default_generator(build):
    assert _run_target(build, [], 0, seed=1234) != _run_target(build, [], 0, seed=4321)
    unseeded = [SP(temperature=1.0)] * 8

    def run(default_seed: int) -> list[int]:
        torch.manual_seed(default_seed)
        return Sampler()(torch.zeros(8, V), build(unseeded, V)).sampled_token_ids.tolist()

    assert run(3) == run(3) and run(3) != run(4)
