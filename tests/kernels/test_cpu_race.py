"""The sampler's exponential race in one pass (kernels/cpu/csrc/race.h): the fp64
argmax of l - ln(-ln U), truncated tokens never drawn, and the softmax's distribution."""

from __future__ import annotations


import pytest
import torch

from pagoda.kernels import cpu as cpu_kernels

from cpu_kernel_guard import kernels_loaded, requires_compiler  # noqa: F401 (autouse)

pytestmark = requires_compiler


@pytest.mark.parametrize("vocab", [1, 15, 17, 100, 49152, 49155])
def test_race_argmax_is_the_fp64_gumbel_argmax(vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=g) * 4
    logits[:, 1::5] = float("-inf")  # truncated tokens
    uniforms = torch.rand(6, vocab, generator=g)
    uniforms[0, 0] = 0.0  # E = inf: this token loses the draw
    got = cpu_kernels.race_argmax(logits, uniforms)
    want = (logits.double() - torch.log(-torch.log(uniforms.double()))).argmax(dim=-1)
    if vocab > 1:
        assert torch.equal(got, want)
        assert bool(torch.isfinite(logits.gather(1, got[:, None])).all())
    # the torch path the sampler ran before: the same token from the same draws
    old = torch.softmax(logits, dim=-1).div_(uniforms.log().neg()).argmax(dim=-1)
    assert torch.equal(got, old)


def test_race_argmax_draws_the_softmax_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0, float("-inf")] + [-3.0] * 29])  # 33: a tail
    g = torch.Generator().manual_seed(0)
    draws = cpu_kernels.race_argmax(logits.expand(40000, -1).contiguous(),
                                    torch.rand(40000, 33, generator=g))
    freq = torch.bincount(draws, minlength=33).double() / draws.numel()
    probs = torch.softmax(logits[0].double(), dim=0)
    assert freq[3] == 0
    assert (freq - probs).abs().max() < 0.01  # ~4 standard errors at 40k draws
