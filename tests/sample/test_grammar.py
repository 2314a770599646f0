"""The worker's side of structured outputs: the scheduler's packed bitmask on the logits."""

from __future__ import annotations

import numpy as np
import torch

from pagoda.sample.grammar import apply_grammar_bitmask, unpack_bitmask


def pack(allowed: list[set[int]], vocab_size: int) -> np.ndarray:
    """The reference packing, written out: bit t % 32 of word t // 32."""
    words = (vocab_size + 31) // 32
    out = np.zeros((len(allowed), words), dtype=np.uint32)
    for row, tokens in enumerate(allowed):
        for t in tokens:
            out[row, t // 32] |= np.uint32(1 << (t % 32))
    return out.view(np.int32)


def test_only_the_constrained_rows_lose_exactly_the_forbidden_tokens():
    vocab = 70  # not a multiple of 32: the last word is partial
    logits = torch.randn(4, vocab)
    before = logits.clone()
    allowed = [{0, 31, 32, 69}, {5}]
    apply_grammar_bitmask(logits, pack(allowed, vocab), rows=[3, 1])
    for row, tokens in ((3, allowed[0]), (1, allowed[1])):
        finite = set(torch.isfinite(logits[row]).nonzero().flatten().tolist())
        assert finite == tokens
        assert torch.equal(logits[row, sorted(tokens)], before[row, sorted(tokens)])
    assert torch.equal(logits[[0, 2]], before[[0, 2]])  # unconstrained rows untouched


def test_logit_columns_past_the_bitmask_vocabulary_are_forbidden():
    logits = torch.zeros(1, 40)  # a padded head: 40 columns, a 33-token bitmask vocabulary
    apply_grammar_bitmask(logits, pack([{1, 32}], 33)[:, :2], rows=[0])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [1, 32]


def test_unpacking_agrees_with_xgrammar_on_the_sign_bit():
    import xgrammar

    vocab = 64
    bitmask = pack([{31, 63, 0}], vocab)  # bit 31 is the int32 sign bit
    assert unpack_bitmask(bitmask, vocab)[0].nonzero()[0].tolist() == [0, 31, 63]
    ours, theirs = torch.randn(1, vocab), None
    theirs = ours.clone()
    apply_grammar_bitmask(ours, bitmask, rows=[0])
    xgrammar.apply_token_bitmask_inplace(theirs, torch.from_numpy(bitmask), backend="cpu")
    assert torch.equal(ours, theirs)


def test_half_precision_logits_take_the_torch_path():
    logits = torch.zeros(2, 40, dtype=torch.bfloat16)
    apply_grammar_bitmask(logits, pack([{3, 39}], 40), rows=[1])
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [3, 39]
    assert torch.isfinite(logits[0]).all()
