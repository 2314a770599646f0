"""Pieces of benchmarks/gpu_check.py: random-weight Llama models, a greedy step loop
over pagoda's model, a timed decode loop, HF generate timing, the HBM roofline.

The loops drive `pagoda.model.architectures.llama.LlamaForCausalLM` directly with hand-built
`AttentionMetadata` (the layout of `attention_metadata.py`: decodes first, then
prefill chunks), so they measure the model + kernels + CUDA graphs without the
scheduler. Imports of pagoda happen inside functions: gpu_check.py sets up the
import path (and the Triton interpreter for --allow-cpu) first.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch

# Llama-architecture shapes: Llama 3.2 1B and Llama 3.1 8B, and a tiny one for
# greedy checks and CPU smoke runs.
MODEL_SPECS = {
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64,
               tie_word_embeddings=True, rope_theta=500000.0),
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128,
               tie_word_embeddings=False, rope_theta=500000.0),
    "tiny": dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                 tie_word_embeddings=False, rope_theta=10000.0),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_hf_model(spec: dict, dtype: torch.dtype, device: torch.device, seed: int = 0,
                   init_range: float = 0.02, norm_noise: float = 0.0):
    """A random-weight HF LlamaForCausalLM, initialised on `device` (fast for 8B)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    # No EOS: HF would stop at it (or, with min_new_tokens, suppress it) where pagoda's
    # loops run on, and greedy comparisons would drift apart for no real reason.
    config = LlamaConfig(**spec, max_position_embeddings=4096, rms_norm_eps=1e-5,
                         initializer_range=init_range, bos_token_id=1, eos_token_id=None,
                         pad_token_id=0)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if norm_noise and name.endswith("norm.weight"):
                p.copy_(1.0 + norm_noise * torch.randn_like(p))
    return model.to(dtype).eval()


def rope_theta_of(config) -> float:
    theta = getattr(config, "rope_theta", None)
    if theta is None:  # transformers >= 5 keeps it in rope_parameters
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return float(theta)


def build_pagoda_model(hf_model, dtype: torch.dtype, device: torch.device):
    """pagoda's LlamaForCausalLM holding the same weights as `hf_model`."""
    from pagoda.config import ModelArchConfig
    from pagoda.model.architectures.llama import LlamaForCausalLM

    c = hf_model.config
    arch = ModelArchConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps, rope_theta=rope_theta_of(c),
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=bool(c.tie_word_embeddings))
    with torch.device(device):
        model = LlamaForCausalLM(arch, dtype)
    model.load_weights(hf_model.state_dict().items())
    return model.eval()


def allocate_kv(arch, num_blocks: int, block_size: int, dtype, device):
    shape = (num_blocks, block_size, arch.num_key_value_heads, arch.head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(arch.num_hidden_layers)]


def make_graphs(model, kv, sizes, max_blocks_per_req, max_seq_len, device):
    from pagoda.worker.cuda_graphs import DecodeCUDAGraphs

    graphs = DecodeCUDAGraphs(lambda ids, pos, md: model(ids, pos, kv, md), sizes,
                              max_blocks_per_req, max_seq_len, device)
    graphs.capture()
    return graphs


@dataclass
class _Req:
    tokens: list[int]
    max_tokens: int
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)


@torch.inference_mode()
def greedy_generate(model, prompts: list[list[int]], max_tokens: int, chunk: int,
                    block_size: int, device: torch.device, use_graphs: bool) -> tuple[list[list[int]], int]:
    """Greedy tokens for each prompt, all requests batched every step: decodes first,
    then prefill chunks of at most `chunk` tokens (a long prompt is a chunked prefill
    over its own cached prefix while the others decode). Blocks come from a shuffled
    pool so block tables are not the identity. Returns (outputs, graph replays)."""
    from pagoda.model.attention_metadata import AttentionMetadata

    arch = model.arch
    max_len = max(len(p) for p in prompts) + max_tokens
    max_blocks = -(-max_len // block_size)
    pool = list(range(len(prompts) * max_blocks + 1))
    random.Random(0).shuffle(pool)
    kv = allocate_kv(arch, len(pool), block_size, model.dtype, device)
    graphs = None
    if use_graphs:
        sizes = [s for s in (1, 2, 4, 8, 16) if s < len(prompts)] + [len(prompts)]
        graphs = make_graphs(model, kv, sizes, max_blocks, max_len, device)
    reqs = [_Req(list(p), max_tokens) for p in prompts]
    replays = 0
    while active := [r for r in reqs if len(r.output) < r.max_tokens]:
        sched = [(r, 1 if len(r.tokens) - r.num_computed == 1
                  else min(chunk, len(r.tokens) - r.num_computed)) for r in active]
        sched.sort(key=lambda rn: rn[1] != 1)  # decodes first, stable otherwise
        ids, pos, slots, qsl, seq_lens = [], [], [], [0], []
        for r, n in sched:
            end = r.num_computed + n
            while len(r.blocks) * block_size < end:
                r.blocks.append(pool.pop())
            for p in range(r.num_computed, end):
                ids.append(r.tokens[p])
                pos.append(p)
                slots.append(r.blocks[p // block_size] * block_size + p % block_size)
            qsl.append(len(ids))
            seq_lens.append(end)
        tables = [r.blocks + [0] * (max_blocks - len(r.blocks)) for r, _ in sched]
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=device),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
            num_decodes=sum(n == 1 for _, n in sched),
            max_query_len=max(n for _, n in sched), max_seq_len=max(seq_lens),
            query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens)
        ids_t, pos_t = torch.tensor(ids, device=device), torch.tensor(pos, device=device)
        if graphs is not None and graphs.can_run(md, len(ids)):
            hidden = graphs.run(ids_t, pos_t, md)
            replays += 1
        else:
            hidden = model(ids_t, pos_t, kv, md)
        samplers = [i for i, (r, n) in enumerate(sched) if r.num_computed + n == len(r.tokens)]
        next_ids = []
        if samplers:
            next_ids = model.compute_logits(hidden[[qsl[i + 1] - 1 for i in samplers]]).argmax(-1).tolist()
        for r, n in sched:
            r.num_computed += n
        for i, token in zip(samplers, next_ids):
            sched[i][0].tokens.append(token)
            sched[i][0].output.append(token)
    return [r.output for r in reqs], replays


def hf_greedy(hf_model, prompts: list[list[int]], max_tokens: int, device) -> list[list[int]]:
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        with torch.no_grad():
            out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                    do_sample=False, pad_token_id=0)
        outputs.append(out[0, len(prompt):].tolist())
    return outputs


@torch.no_grad()
def divergence_gap(hf_model, prompt: list[int], expected: list[int], got: list[int], device) -> float:
    """At the first token where `got` leaves `expected`, HF's logit margin of its own
    choice over ours: ~0 means a near-tie that rounding may flip either way."""
    i = next(i for i, (a, b) in enumerate(zip(expected, got)) if a != b)
    logits = hf_model(torch.tensor([prompt + expected[:i]], device=device)).logits[0, -1].float()
    return float(logits[expected[i]] - logits[got[i]])


@torch.inference_mode()
def prefill_batch(model, kv, tokens: torch.Tensor, block_tables: torch.Tensor, block_size: int,
                  max_tokens_per_step: int = 8192) -> torch.Tensor:
    """Prefill `tokens [B, P]` in steps of whole requests; returns the first sampled ids [B]."""
    from pagoda.model.attention_metadata import AttentionMetadata

    batch, prompt_len = tokens.shape
    device = tokens.device
    per_step = max(1, max_tokens_per_step // prompt_len)
    firsts = []
    positions = torch.arange(prompt_len, device=device)
    for start in range(0, batch, per_step):
        rows = range(start, min(batch, start + per_step))
        n = len(rows)
        tables = block_tables[start:start + n]
        slots = (tables[:, positions // block_size].long() * block_size + positions % block_size).reshape(-1)
        qsl = [i * prompt_len for i in range(n + 1)]
        md = AttentionMetadata(
            slot_mapping=slots, query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            seq_lens=torch.full((n,), prompt_len, dtype=torch.int32, device=device),
            block_tables=tables, num_decodes=0, max_query_len=prompt_len, max_seq_len=prompt_len,
            query_start_loc_cpu=qsl, seq_lens_cpu=[prompt_len] * n)
        hidden = model(tokens[start:start + n].reshape(-1), positions.repeat(n), kv, md)
        firsts.append(model.compute_logits(hidden[[q - 1 for q in qsl[1:]]]).argmax(-1))
    return torch.cat(firsts)


@torch.inference_mode()
def time_decode(model, kv, graphs, batch: int, prompt_len: int, steps: int, warmup: int,
                block_size: int, max_blocks: int, device: torch.device) -> float:
    """Decode tokens/s of `batch` requests after a `prompt_len` prefill. Each step is
    what an engine does: metadata on device, forward (graph replay when `graphs`),
    logits, argmax, and the sampled ids copied to the host (a sync per step)."""
    from pagoda.model.attention_metadata import AttentionMetadata

    vocab = model.arch.vocab_size
    gen = torch.Generator(device=device).manual_seed(batch)
    tokens = torch.randint(3, vocab, (batch, prompt_len), generator=gen, device=device)
    block_tables = torch.arange(batch * max_blocks, dtype=torch.int32, device=device).view(batch, max_blocks)
    ids = prefill_batch(model, kv, tokens, block_tables, block_size)
    positions = torch.full((batch,), prompt_len, dtype=torch.int64, device=device)
    seq_lens = torch.full((batch,), prompt_len + 1, dtype=torch.int32, device=device)
    qsl_cpu = list(range(batch + 1))
    qsl = torch.tensor(qsl_cpu, dtype=torch.int32, device=device)
    rows = torch.arange(batch, device=device)
    seq_len = prompt_len + 1
    start = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            sync(device)
            start = time.perf_counter()
        slots = block_tables[rows, positions // block_size].long() * block_size + positions % block_size
        md = AttentionMetadata(slot_mapping=slots, query_start_loc=qsl, seq_lens=seq_lens,
                               block_tables=block_tables, num_decodes=batch, max_query_len=1,
                               max_seq_len=seq_len, query_start_loc_cpu=qsl_cpu,
                               seq_lens_cpu=[seq_len] * batch)
        if graphs is not None:
            hidden = graphs.run(ids, positions, md)
        else:
            hidden = model(ids, positions, kv, md)
        ids = model.compute_logits(hidden).argmax(-1)
        ids.tolist()  # the engine ships sampled ids to the scheduler every step
        positions += 1
        seq_lens += 1
        seq_len += 1
    sync(device)
    return batch * steps / (time.perf_counter() - start)


@torch.inference_mode()
def time_hf_decode(hf_model, batch: int, prompt_len: int, steps: int, device: torch.device) -> float:
    """HF generate decode tokens/s, timed inside one generate call: a logits
    processor stamps each step (HF syncs every step anyway for its stopping check),
    and the `steps` forwards between the first stamp (after prefill) and the last
    are the decode time."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class StepTimer(LogitsProcessor):
        def __init__(self) -> None:
            self.stamps: list[float] = []

        def __call__(self, input_ids, scores):
            sync(device)
            self.stamps.append(time.perf_counter())
            return scores

    vocab = hf_model.config.vocab_size
    gen = torch.Generator(device=device).manual_seed(batch)
    ids = torch.randint(3, vocab, (batch, prompt_len), generator=gen, device=device)
    timer = StepTimer()
    for new_tokens, processors in ((2, None), (1 + steps, LogitsProcessorList([timer]))):  # warm-up, timed
        hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          do_sample=False, pad_token_id=0, logits_processor=processors)
    assert len(timer.stamps) == 1 + steps, f"expected {1 + steps} generate steps, saw {len(timer.stamps)}"
    return batch * steps / (timer.stamps[-1] - timer.stamps[0])


def copy_bandwidth(device: torch.device, num_bytes: int = 2 << 30, iters: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus written."""
    if device.type != "cuda":
        num_bytes, iters = 64 << 20, 3
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    t = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    sync(device)
    elapsed = time.perf_counter() - t
    del src, dst
    return 2 * num_bytes * iters / elapsed


def decode_bytes_per_step(model, batch: int, mean_context: float) -> float:
    """Bytes one decode step must read from HBM: every weight once (the embedding
    table only as the tied LM head; otherwise just `batch` rows of it) plus each
    request's K and V over its context."""
    arch = model.arch
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if not arch.tie_word_embeddings:
        embed = model.model.embed_tokens.weight
        weights -= embed.numel() * embed.element_size()
    element = torch.empty((), dtype=model.dtype).element_size()
    kv_per_token = arch.num_hidden_layers * 2 * arch.num_key_value_heads * arch.head_dim * element
    return weights + batch * mean_context * kv_per_token
