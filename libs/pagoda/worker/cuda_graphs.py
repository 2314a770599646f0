"""CUDA graphs for decode steps: capture once per batch size, replay every step.

A decode step of a small model is launch-bound: ~10 kernels per layer, each
costing more to launch from Python than to run. Replaying a captured graph
launches them all at once. vLLM's scheme:

- sizes 1, 2, 4, 8, 16, 24, ... up to `max_num_seqs` (`cuda_graph_sizes`);
- captured largest first, all into one shared memory pool, so each smaller graph
  reuses the largest one's intermediate buffers instead of adding its own;
- a batch of n decodes replays the smallest captured size >= n
  (`select_graph_size`), padded: padding rows have `seq_len 0` (attention writes
  zeros) and slot `-1` (the KV write skips them), and their outputs are dropped.

Graphs replay fixed device addresses, so every input lives in a static buffer that
`run` copies into, and the launch parameters may depend only on the batch size:
this holds for the Triton path (`pagoda.model.ops` on CUDA), whose launchers read
only host-side sizes; the torch path plans with host lists and cannot be captured.
`--enforce-eager` means: do not build this object.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence

import torch

from pagoda.model.attention_metadata import AttentionMetadata

logger = logging.getLogger(__name__)

# forward(input_ids [N], positions [N], attn_metadata) -> hidden [N, hidden]
DecodeForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def cuda_graph_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture, ascending: 1, 2, 4, then multiples of 8, capped at
    `max_num_seqs` (which is always included so every decode batch has a graph)."""
    assert max_num_seqs >= 1, f"max_num_seqs must be positive, got {max_num_seqs}"
    sizes = [s for s in (1, 2, 4) if s <= max_num_seqs]
    sizes += list(range(8, max_num_seqs + 1, 8))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


def select_graph_size(num_reqs: int, captured_sizes: Sequence[int]) -> int | None:
    """The smallest captured size >= `num_reqs` (sizes ascending), or None when the
    batch is larger than every captured size (run it eagerly)."""
    if num_reqs < 1:
        return None
    i = bisect.bisect_left(captured_sizes, num_reqs)
    return captured_sizes[i] if i < len(captured_sizes) else None


class DecodeCUDAGraphs:
    """One captured decode forward per batch size, sharing one memory pool.

    Invariants: static buffers are sized for the largest batch and never
    reallocated (graphs hold their addresses); rows >= the live batch always carry
    padding values before a replay; the tensor `run` returns is a view of graph
    memory, valid until the next `run`.
    """

    def __init__(self, forward: DecodeForward, sizes: Sequence[int], max_blocks_per_req: int,
                 max_seq_len: int, device: torch.device) -> None:
        self.forward = forward
        self.sizes = sorted(sizes)
        self.max_seq_len = max_seq_len
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        # Decodes only: request i owns token i, so query_start_loc never changes.
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_req, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def _metadata(self, size: int) -> AttentionMetadata:
        # Host fields describe the padded batch; max_seq_len is the longest context
        # the graph may ever see (it only steers the split-K heuristic).
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], query_start_loc=self.query_start_loc[:size + 1],
            seq_lens=self.seq_lens[:size], block_tables=self.block_tables[:size],
            num_decodes=size, max_query_len=1, max_seq_len=self.max_seq_len,
            query_start_loc_cpu=list(range(size + 1)), seq_lens_cpu=[self.max_seq_len] * size)

    def _call(self, size: int) -> torch.Tensor:
        return self.forward(self.input_ids[:size], self.positions[:size], self._metadata(size))

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up (compiles the Triton kernels outside capture) and capture every
        size, largest first, into one pool. Static buffers hold padding meanwhile,
        so the captured forwards touch no KV-cache slot."""
        self.pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self._call(size)  # warm-up: JIT compilation, cuBLAS workspaces
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[size] = self._call(size)
            self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    def can_run(self, attn_metadata: AttentionMetadata, num_tokens: int) -> bool:
        """Pure-decode batches no larger than the largest captured size, whose block
        tables fit the captured width (a draft model's lookahead slots can take a
        request one block past max_model_len: that step runs eagerly)."""
        md = attn_metadata
        return (bool(self.graphs) and md.num_decodes == md.num_reqs == num_tokens
                and select_graph_size(num_tokens, self.sizes) is not None
                and md.block_tables.shape[1] <= self.block_tables.shape[1])

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            attn_metadata: AttentionMetadata) -> torch.Tensor:
        """Replay the graph for this decode batch -> hidden [n, hidden] (graph memory)."""
        md = attn_metadata
        n = input_ids.shape[0]
        size = select_graph_size(n, self.sizes)
        assert size is not None and self.can_run(md, n), "not a capturable decode batch"
        width = md.block_tables.shape[1]
        assert width <= self.block_tables.shape[1], f"block table width {width} exceeds capture"
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(md.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(md.seq_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(md.block_tables, non_blocking=True)
        if size > n:  # padding rows: no KV write, empty context
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].zero_()
        self.graphs[size].replay()
        return self.outputs[size][:n]
