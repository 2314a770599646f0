"""Our paged Llama gives HF transformers' logits however a sequence is batched.

Each sequence's tokens are fixed in advance (teacher forcing), so the logits of
every scheduled token must equal HF's logits at that position from one plain
forward over the whole sequence — whether it ran as one prefill, chunks,
decodes, mixed with other sequences, or on top of another sequence's cached blocks.
"""

from __future__ import annotations

import pytest
import torch

from pagoda.model.kv_cache import allocate_kv_caches

ATOL = 1e-4


def random_tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 49152, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def hf_logits(hf_tiny_llama):
    cache: dict[tuple[int, ...], torch.Tensor] = {}

    def logits(tokens: list[int]) -> torch.Tensor:
        key = tuple(tokens)
        if key not in cache:
            with torch.no_grad():
                cache[key] = hf_tiny_llama(torch.tensor([tokens])).logits[0]
        return cache[key]

    return logits


class Runner:
    """Runs scheduled chunks through our model and checks every row against HF."""

    def __init__(self, model, seqs, hf_logits, num_blocks: int):
        self.model, self.seqs, self.hf_logits = model, seqs, hf_logits
        self.kv_caches = allocate_kv_caches(model.arch, num_blocks, seqs.block_size,
                                            torch.float32, "cpu")

    def step(self, schedule: list[tuple[str, int]]) -> None:
        starts = [self.seqs.computed[s] for s, _ in schedule]
        input_ids, positions, md = self.seqs.step(schedule)
        with torch.inference_mode():
            logits = self.model.compute_logits(
                self.model(input_ids, positions, self.kv_caches, md))
        assert logits.shape == (len(input_ids), self.model.arch.vocab_size)
        assert logits.dtype == torch.float32
        row = 0
        for (seq_id, n), start in zip(schedule, starts):
            expected = self.hf_logits(self.seqs.tokens[seq_id])[start:start + n]
            torch.testing.assert_close(logits[row:row + n], expected, atol=ATOL, rtol=1e-4,
                                       msg=lambda m: f"{seq_id} positions {start}..: {m}")
            row += n


def test_full_prefill_matches_hf(tiny_llama, hf_logits, paged_sequences):
    seqs = paged_sequences(num_blocks=32, block_size=16)
    seqs.add("a", random_tokens(45, seed=1))
    Runner(tiny_llama, seqs, hf_logits, 32).step([("a", 45)])


def test_two_prefill_chunks_then_decodes_match_hf(tiny_llama, hf_logits, paged_sequences):
    seqs = paged_sequences(num_blocks=32, block_size=4)
    seqs.add("a", random_tokens(40, seed=2))
    runner = Runner(tiny_llama, seqs, hf_logits, 32)
    runner.step([("a", 13)])  # ends mid-block
    runner.step([("a", 22)])
    for _ in range(5):
        runner.step([("a", 1)])


@pytest.mark.parametrize("layout", ["ascending", "descending", "shuffled"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_mixed_batch_matches_hf(tiny_llama, hf_logits, paged_sequences, layout, block_size):
    seqs = paged_sequences(num_blocks=64, block_size=block_size, layout=layout, seed=block_size)
    prefix = random_tokens(2 * block_size, seed=3)
    seqs.add("a", random_tokens(31, seed=4))
    seqs.add("b", random_tokens(19, seed=5))
    seqs.add("donor", prefix + random_tokens(5, seed=6))
    runner = Runner(tiny_llama, seqs, hf_logits, 64)
    # Prefill a and b (allocating alternately, so their blocks interleave) and the donor.
    runner.step([("a", 7), ("b", 6), ("donor", 2 * block_size + 5)])
    runner.step([("a", 22), ("b", 12)])
    # c reuses the donor's two full blocks: its first step has a 2-block cached prefix.
    seqs.add("c", prefix + random_tokens(20, seed=7), share_blocks_of="donor", num_shared_blocks=2)
    seqs.add("d", random_tokens(26, seed=8))
    # Two decodes, a prefill chunk behind a cached prefix, and a fresh prefill chunk.
    runner.step([("a", 1), ("b", 1), ("c", 11), ("d", 9)])
    runner.step([("c", 1), ("a", 1), ("d", 17)])


def test_decodes_of_many_lengths_batch_together(tiny_llama, hf_logits, paged_sequences):
    # Decode contexts from 1 token (a one-token prompt) to several blocks, in one batch.
    seqs = paged_sequences(num_blocks=64, block_size=4)
    lengths = [1, 3, 4, 5, 17, 33]
    for i, n in enumerate(lengths):
        seqs.add(f"s{i}", random_tokens(n + 2, seed=10 + i))
    runner = Runner(tiny_llama, seqs, hf_logits, 64)
    runner.step([(f"s{i}", n) for i, n in enumerate(lengths) if n == 1]
                + [(f"s{i}", n) for i, n in enumerate(lengths) if n > 1])
    runner.step([(f"s{i}", 1) for i in range(len(lengths))])
    runner.step([(f"s{i}", 1) for i in range(len(lengths))])


def test_logits_depend_on_context(hf_logits):
    # Guards the comparisons above against a degenerate model: changing only the
    # first token must move the last position's logits by far more than ATOL.
    tokens = random_tokens(30, seed=9)
    changed = [tokens[0] + 1] + tokens[1:]
    assert (hf_logits(tokens)[-1] - hf_logits(changed)[-1]).abs().max() > 100 * ATOL
