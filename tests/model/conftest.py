"""Helpers for model tests: a miniature block manager + input builder, and HF references."""

from __future__ import annotations

import random

import pytest
import torch

from pagoda.model.attention_metadata import AttentionMetadata


class PagedSequences:
    """Hands out KV blocks and flattens scheduled chunks the way the model runner does.

    `layout` chooses which free block each new allocation takes: "ascending"
    (contiguous per sequence when allocated alone), "descending", or "shuffled".
    Block 0 is a real block here, so attention that trusts padded table entries
    (also 0) would read another sequence's keys and fail the comparison.
    """

    def __init__(self, num_blocks: int, block_size: int, layout: str = "shuffled", seed: int = 0):
        free = list(range(num_blocks))
        if layout == "descending":
            free.reverse()
        elif layout == "shuffled":
            random.Random(seed).shuffle(free)
        self.free = free
        self.block_size = block_size
        self.tokens: dict[str, list[int]] = {}
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}

    def add(self, seq_id: str, token_ids: list[int], share_blocks_of: str | None = None,
            num_shared_blocks: int = 0) -> None:
        """A new sequence; optionally a prefix-cache hit on the first `num_shared_blocks`
        full blocks of `share_blocks_of` (same token ids, so their KV is reused as is)."""
        self.tokens[seq_id] = list(token_ids)
        self.blocks[seq_id] = []
        self.computed[seq_id] = 0
        if share_blocks_of is not None:
            shared = num_shared_blocks * self.block_size
            assert self.tokens[share_blocks_of][:shared] == token_ids[:shared]
            assert self.computed[share_blocks_of] >= shared
            self.blocks[seq_id] = self.blocks[share_blocks_of][:num_shared_blocks]
            self.computed[seq_id] = shared

    def step(self, schedule: list[tuple[str, int]], device="cpu"):
        """(seq_id, num_tokens) chunks, decodes (1 token) first -> (input_ids, positions, md)."""
        ids, positions, slots, tables = [], [], [], []
        qsl, seq_lens = [0], []
        for seq_id, n in schedule:
            start = self.computed[seq_id]
            end = start + n
            assert end <= len(self.tokens[seq_id]), f"{seq_id} has no token {end - 1}"
            blocks = self.blocks[seq_id]
            while len(blocks) * self.block_size < end:
                blocks.append(self.free.pop(0))
            ids += self.tokens[seq_id][start:end]
            positions += range(start, end)
            slots += [blocks[p // self.block_size] * self.block_size + p % self.block_size
                      for p in range(start, end)]
            qsl.append(qsl[-1] + n)
            seq_lens.append(end)
            tables.append(list(blocks))
            self.computed[seq_id] = end
        num_decodes = 0
        while num_decodes < len(schedule) and schedule[num_decodes][1] == 1:
            num_decodes += 1
        width = max(len(t) for t in tables)
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                      dtype=torch.int32, device=device),
            num_decodes=num_decodes,
            max_query_len=max(n for _, n in schedule),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
        )
        return (torch.tensor(ids, dtype=torch.int64, device=device),
                torch.tensor(positions, dtype=torch.int64, device=device), md)


@pytest.fixture
def paged_sequences():
    return PagedSequences


@pytest.fixture(scope="session")
def hf_tiny_llama(tiny_llama_dir):
    """transformers' own model on the tiny checkpoint, fp32: the reference."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_llama(tiny_llama_dir):
    """Our model on the tiny checkpoint, fp32, with its arch config."""
    from pagoda.model.loader import load_arch_config, load_model

    arch = load_arch_config(tiny_llama_dir)
    return load_model(tiny_llama_dir, arch, torch.float32)
