"""The "paths" section of benchmarks/gpu_check.py: the CUDA paths beside the dense model.

    quant_matmul   int4_matmul (AWQ, GPTQ, GPTQ act-order checkpoints, repacked by the
                   loaders' own code) and fp8_matmul (per channel, 128-column blocks)
                   against x @ W^T in fp32 from the checkpoint's integers; timings
                   against a bf16 torch matmul at M = 16 (INFO)
    fused_moe      fused_experts against a per-expert loop in fp32 (all experts held,
                   and an expert-parallel share)
    lora           add_lora (bgmv; rows of several adapters and rows without one)
                   against an einsum; rows without an adapter unchanged bit for bit
    fp8_kv         ops.write_kv_cache / ops.paged_attention on an fp8 cache (what a
                   model with --kv-cache-dtype fp8 calls) against fp32 attention over
                   the dequantized cache
    xgrammar       sample.grammar._apply_with_xgrammar on device logits against the
                   torch/numpy path of the same bitmask, exactly
    kv_dist        DistTransport (PagodaDistConnector) in two processes: a pair group
                   (NCCL on CUDA, gloo on CPU), blocks received byte for byte, GB/s
    host_kv_tier   HostKVTier offload / onload (sync and the async loader): pinned?,
                   a round trip changes no byte, GB/s and us per block (INFO)

Every case runs in its own try/except and lands as PASS/FAIL/SKIP/INFO rows.
Relative error is max|a-e|/max|e| on fresh random inputs. `small=True`: the CPU
smoke run (tiny shapes, Triton interpreter); its timings mean nothing.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

SECTION = "paths"
# Relative error allowed, by activation dtype: the kernels round W (and the output)
# to it and accumulate in fp32; the reference is fp32 throughout.
GEMM_TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}
ATTENTION_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
# Two chained GEMMs with bf16 intermediates (gate_up, then silu_and_mul's output).
MOE_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
PAIR_TIMEOUT_S = 30.0  # the two-process exchange, from the children's start


def check_paths(report, device: torch.device, small: bool, only: set[str] | None = None) -> None:
    """`only`: the case names to run (quant_matmul, fused_moe, lora, fp8_kv, xgrammar,
    kv_dist, host_kv_tier); None runs them all."""
    for case in (_quant_matmul, _fused_moe, _lora, _fp8_kv, _xgrammar, _kv_dist, _host_kv_tier):
        if only and case.__name__.lstrip("_") not in only:
            continue
        try:
            case(report, device, small)
        except Exception as exc:  # noqa: BLE001 - every failure is reported, then the next case
            report.error(SECTION, case.__name__.lstrip("_"), exc)
        if device.type == "cuda":
            torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- helpers
def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.float()
    scale = expected.abs().max().clamp_min(1e-6)
    return float((actual.float() - expected).abs().max() / scale)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_us(fn, device: torch.device, iters: int) -> float:
    """Median microseconds of `fn()` after one warm-up call."""
    fn()
    _sync(device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2] * 1e6


def _gen(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


# ----------------------------------------------------------------------------- 1. GEMMs
def _int4_checkpoint(fmt: str, k: int, n: int, group: int, device, seed: int):
    """(the int4 layer the loader builds from a `fmt` checkpoint, W [n, k] fp32 from
    the checkpoint's integers). fmt: awq, gptq, gptq_act_order."""
    from pagoda.model.quantization import int4
    from pagoda.model.quantization.awq import AWQLinearMethod
    from pagoda.model.quantization.gptq import GPTQConfig, GPTQLinearMethod

    g = _gen(device, seed)
    num_groups = k // group
    q = torch.randint(0, 16, (k, n), generator=g, device=device, dtype=torch.int32)
    # AWQ stores zero points 0..15; GPTQ v1 stores z - 1, so its zero points are 1..16.
    low = 0 if fmt == "awq" else 1
    zeros = torch.randint(low, low + 16, (num_groups, n), generator=g, device=device,
                          dtype=torch.int32)
    scales = (torch.rand(num_groups, n, generator=g, device=device) * 0.02 + 0.002).half().float()
    rows = torch.arange(k, device=device, dtype=torch.int32) // group
    if fmt == "gptq_act_order":
        rows = rows[torch.randperm(k, generator=g, device=device)]
    w = ((q - zeros[rows.long()]).float() * scales[rows.long()]).t().contiguous()  # [n, k]
    layer = torch.nn.Module()
    param = lambda t: torch.nn.Parameter(t, requires_grad=False)  # noqa: E731
    layer.scales = param(scales)
    if fmt == "awq":
        layer.qweight = param(int4.pack_columns(q, int4.AWQ_PACK_ORDER))
        layer.qzeros = param(int4.pack_columns(zeros, int4.AWQ_PACK_ORDER))
        layer.awq_group = group
        AWQLinearMethod(group).process_weights_after_loading(layer)
    else:  # GPTQ v1: stored zeros are one less (zero_offset 1)
        act_order = fmt == "gptq_act_order"
        layer.qweight = param(int4.pack_rows(q))
        layer.qzeros = param(int4.pack_columns(zeros - 1, int4.SEQUENTIAL_ORDER))
        layer.g_idx = param(rows)
        layer.gptq_group = group
        config = GPTQConfig(group_size=group, desc_act=act_order, zero_offset=1)
        GPTQLinearMethod(config).process_weights_after_loading(layer)
    return layer, w


def _fp8_checkpoint(block_k: int | None, k: int, n: int, device, seed: int):
    g = _gen(device, seed)
    # Clamped: past +-448 the cast gives NaN (1 in ~1e5 of these draws; an 8B layer has 6e7).
    weight = (torch.randn(n, k, generator=g, device=device) * 100).clamp(-448, 448).to(
        torch.float8_e4m3fn)
    block = block_k or k
    scale = torch.rand(n, -(-k // block), generator=g, device=device) * 0.001 + 1e-4
    w = weight.float() * scale.repeat_interleave(block, dim=1)[:, :k]
    return SimpleNamespace(weight=weight, scale=scale, block_k=block), w


def _quant_matmul(report, device, small: bool) -> None:
    from pagoda.kernels.quant_matmul import fp8_matmul, int4_matmul

    k, n, group = (96, 80, 32) if small else (4096, 14336, 128)  # 8B's up_proj
    rows = (1, 5, 33) if small else (1, 16, 256)
    dtypes = (torch.bfloat16, torch.float32)
    cases = [(f"int4_{fmt}", fmt) for fmt in ("awq", "gptq", "gptq_act_order")] + \
            [("fp8_per_channel", None), ("fp8_block128", 32 if small else 128)]
    for i, (name, what) in enumerate(cases):
        for dtype in dtypes:
            label = f"quant_matmul/{name}/{str(dtype)[6:]}"
            try:
                if name.startswith("int4"):
                    layer, w = _int4_checkpoint(what, k, n, group, device, seed=i)
                    run = lambda x, L=layer: int4_matmul(x, L.qweight, L.scales, L.zeros,  # noqa: E731
                                                         L.g_idx, L.group_size)
                else:
                    layer, w = _fp8_checkpoint(what, k, n, device, seed=i)
                    run = lambda x, L=layer: fp8_matmul(x, L.weight, L.scale, L.block_k)  # noqa: E731
                errs = []
                for m in rows:
                    x = torch.randn(m, k, generator=_gen(device, m), device=device).to(dtype)
                    out = run(x)
                    expected = x.double() @ w.double().t()  # no TF32 whatever the flags
                    errs.append(_relative_error(out, expected))
                err = max(errs)
                tol = GEMM_TOL[dtype]
                report.check(SECTION, label, err, tol, err <= tol,
                             f"K={k} N={n} M={','.join(map(str, rows))}")
            except Exception as exc:  # noqa: BLE001
                report.error(SECTION, label, exc)
    _gemm_timings(report, device, small, k, n, group)


def _gemm_timings(report, device, small: bool, k: int, n: int, group: int) -> None:
    from pagoda.kernels.quant_matmul import fp8_matmul, int4_matmul

    label = "quant_matmul/time_m16"
    try:
        m = 16
        x = torch.randn(m, k, generator=_gen(device, 7), device=device).to(torch.bfloat16)
        int4_layer, w = _int4_checkpoint("gptq", k, n, group, device, seed=7)
        fp8_layer, _ = _fp8_checkpoint(128 if not small else 32, k, n, device, seed=8)
        w_bf16 = w.to(torch.bfloat16)
        iters = 3 if small else 50
        base = _time_us(lambda: x @ w_bf16.t(), device, iters)
        t_int4 = _time_us(lambda: int4_matmul(x, int4_layer.qweight, int4_layer.scales,
                                              int4_layer.zeros, None, group), device, iters)
        t_fp8 = _time_us(lambda: fp8_matmul(x, fp8_layer.weight, fp8_layer.scale,
                                            fp8_layer.block_k), device, iters)
        report.check(SECTION, "quant_matmul/time_m16_bf16_torch_us", base, "-", None, f"K={k} N={n}")
        report.check(SECTION, "quant_matmul/time_m16_int4_us", t_int4, "-", None,
                     f"{base / t_int4:.2f}x bf16 torch")
        report.check(SECTION, "quant_matmul/time_m16_fp8_us", t_fp8, "-", None,
                     f"{base / t_fp8:.2f}x bf16 torch")
    except Exception as exc:  # noqa: BLE001
        report.error(SECTION, label, exc)


# ----------------------------------------------------------------------------- 2. MoE
def _moe_reference(x, topk_ids, w13, w2, expert_start):
    """fp32, one expert at a time: rows of pairs routed to it, zero rows elsewhere."""
    top_k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    out = torch.zeros(flat.numel(), x.shape[1], dtype=torch.float32, device=x.device)
    for local in range(w13.shape[0]):
        pairs = (flat == expert_start + local).nonzero().flatten()
        if pairs.numel() == 0:
            continue
        tokens = x[pairs // top_k].double()  # fp64: no TF32 whatever the flags
        gate, up = (tokens @ w13[local].double().t()).chunk(2, dim=-1)
        out[pairs] = ((torch.nn.functional.silu(gate) * up) @ w2[local].double().t()).float()
    return out


def _fused_moe(report, device, small: bool) -> None:
    from pagoda.kernels.fused_moe import fused_experts

    # Qwen3-30B-A3B's experts: hidden 2048, 768 per expert, 128 experts, top 8.
    hidden, inter, num_experts, top_k = (48, 40, 6, 2) if small else (2048, 768, 128, 8)
    token_counts = (1, 9) if small else (1, 16, 256)
    dtype = torch.bfloat16
    g = _gen(device, 11)
    w13_all = (torch.randn(num_experts, 2 * inter, hidden, generator=g, device=device)
               * hidden ** -0.5).to(dtype)
    w2_all = (torch.randn(num_experts, hidden, inter, generator=g, device=device)
              * inter ** -0.5).to(dtype)
    shares = [("all_experts", 0, num_experts), ("ep_share", num_experts // 4, num_experts // 2)]
    for name, start, count in shares:
        label = f"fused_moe/{name}/bfloat16"
        try:
            w13, w2 = w13_all[start:start + count].contiguous(), w2_all[start:start + count].contiguous()
            errs, zero_rows_ok = [], True
            for t in token_counts:
                x = torch.randn(t, hidden, generator=g, device=device).to(dtype)
                ids = torch.rand(t, num_experts, generator=g, device=device).topk(top_k, dim=-1).indices
                out = fused_experts(x, ids, w13, w2, start)
                expected = _moe_reference(x, ids, w13, w2, start)
                flat = ids.reshape(-1)
                held = (flat >= start) & (flat < start + count)
                zero_rows_ok &= bool((out[~held] == 0).all())
                errs.append(_relative_error(out, expected))
            err = max(errs)
            tol = MOE_TOL[dtype]
            report.check(SECTION, label, err, tol, err <= tol and zero_rows_ok,
                         f"H={hidden} I={inter} experts {start}..{start + count - 1} of {num_experts} "
                         f"top{top_k} T={','.join(map(str, token_counts))}"
                         + ("" if zero_rows_ok else "; rows of other ranks' experts NOT zero"))
        except Exception as exc:  # noqa: BLE001
            report.error(SECTION, label, exc)


# ----------------------------------------------------------------------------- 3. LoRA
def _lora(report, device, small: bool) -> None:
    from pagoda.kernels.lora import add_lora

    num_slots, rank, k, n = (3, 12, 40, 72) if small else (4, 16, 4096, 4096)
    token_counts = (7,) if small else (1, 16, 256)
    for dtype in (torch.bfloat16, torch.float32):
        label = f"lora/bgmv_mixed_slots/{str(dtype)[6:]}"
        try:
            g = _gen(device, 21)
            a = (torch.randn(num_slots, rank, k, generator=g, device=device) * k ** -0.5).to(dtype)
            b = (torch.randn(num_slots, n, rank, generator=g, device=device) * 0.5).to(dtype)
            errs, base_ok = [], True
            for t in token_counts:
                slots = torch.randint(-1, num_slots, (t,), generator=g, device=device)
                slots[0] = -1 if t > 1 else slots[0]
                x = torch.randn(t, k, generator=g, device=device).to(dtype)
                base = torch.randn(t, n, generator=g, device=device).to(dtype)
                got = add_lora(base.clone(), x, a, b, slots)
                has = slots >= 0
                safe = slots.clamp_min(0)
                y = torch.einsum("tk,trk->tr", x.double(), a[safe].double())  # fp64: no TF32
                delta = torch.einsum("tr,tnr->tn", y, b[safe].double())
                expected = base.double() + delta * has[:, None]
                base_ok &= torch.equal(got[~has], base[~has])
                errs.append(_relative_error(got, expected))
            err = max(errs)
            tol = GEMM_TOL[dtype]
            report.check(SECTION, label, err, tol, err <= tol and base_ok,
                         f"slots {num_slots} (+ -1) rank {rank} K={k} N={n} "
                         f"T={','.join(map(str, token_counts))}"
                         + ("" if base_ok else "; rows without adapter CHANGED"))
        except Exception as exc:  # noqa: BLE001
            report.error(SECTION, label, exc)


# ----------------------------------------------------------------------------- 4. fp8 KV
def _fp8_kv(report, device, small: bool) -> None:
    from pagoda.kernels import reference as ref
    from pagoda.kernels.testing import random_paged_batch
    from pagoda.model import ops
    from pagoda.model.fp8_kv_cache import FP8_KV_DTYPE

    if small:
        requests, heads, kv_heads, dim = [(9, 1), (30, 1), (5, 7), (0, 12)], 4, 2, 16
    else:
        requests = [(c, 1) for c in (1, 17, 300, 1024, 2047, 4000)] * 4 + [(512, 77), (0, 300)]
        heads, kv_heads, dim = 32, 8, 128
    label = "fp8_kv/write_and_attention/bfloat16"
    b = random_paged_batch(requests, heads, kv_heads, dim, 16, torch.bfloat16, device, seed=5)
    md = b.attn_metadata
    k8, v8 = b.key_cache.to(FP8_KV_DTYPE), b.value_cache.to(FP8_KV_DTYPE)
    ops.write_kv_cache(b.key, b.value, k8, v8, md.slot_mapping)
    slots = md.slot_mapping.long()
    write_ok = all(torch.equal(cache.view(torch.uint8).view(-1, kv_heads, dim)[slots],
                               x.to(FP8_KV_DTYPE).view(torch.uint8))
                   for cache, x in ((k8, b.key), (v8, b.value)))
    scale = dim ** -0.5
    got = ops.paged_attention(b.query, k8, v8, md, scale)
    want = ref.paged_attention(b.query.float(), k8.float(), v8.float(), md, scale)
    err = _relative_error(got, want)
    tol = ATTENTION_TOL[torch.bfloat16]
    report.check(SECTION, label, err, tol, err <= tol and write_ok,
                 f"{len(requests)} reqs, max ctx {md.max_seq_len}"
                 + ("; written bytes equal x.to(fp8)" if write_ok else "; written bytes DIFFER"))


# ----------------------------------------------------------------------------- 5. xgrammar
def _xgrammar(report, device, small: bool) -> None:
    label = "xgrammar/gpu_mask"
    try:
        import xgrammar  # noqa: F401
    except ImportError as exc:
        report.skip(SECTION, label, f"xgrammar not importable ({exc})")
        return
    import numpy as np

    from pagoda.sample.grammar import _apply_with_xgrammar, apply_grammar_bitmask

    vocab = 1000 if small else 128256  # Llama 3's vocabulary
    num_rows = 8 if small else 64
    rng = np.random.default_rng(3)
    for name, padded in (("exact_vocab", vocab), ("padded_logits", vocab + 64)):
        for dtype in (torch.float32, torch.bfloat16):
            case = f"{label}/{name}/{str(dtype)[6:]}"
            try:
                words = -(-vocab // 32)
                bits = rng.integers(0, 2 ** 32, size=(num_rows // 2, words), dtype=np.uint64)
                bitmask = bits.astype(np.uint32).view(np.int32)
                rows = sorted(rng.choice(num_rows, size=num_rows // 2, replace=False).tolist())
                logits = torch.randn(num_rows, padded, generator=_gen(device, 4), device=device).to(dtype)
                got = logits.clone()
                used = _apply_with_xgrammar(got, bitmask, rows)
                if not used:
                    report.skip(SECTION, case, "_apply_with_xgrammar returned False")
                    continue
                want = logits.cpu().float()
                apply_grammar_bitmask(want, bitmask, rows)  # the numpy path
                got = got.cpu().float()
                covered = words * 32
                bad = int((got[:, :covered] != want[:, :covered]).sum())
                past = int((got[:, covered:] != want[:, covered:]).sum())
                report.check(SECTION, case, bad, 0, bad == 0,
                             f"{num_rows} rows ({len(rows)} masked), logits {padded} cols, "
                             f"bitmask {vocab} tokens: logits that differ")
                if past:  # the bitmask's own words are all right; only columns past it differ
                    report.check(SECTION, f"{case}_past_bitmask", past, 0, None,
                                 f"logits past the bitmask's {covered} columns left unmasked by "
                                 "xgrammar, masked by the torch path (apply_grammar_bitmask's "
                                 "contract); unreachable while logits are arch.vocab_size wide")
            except Exception as exc:  # noqa: BLE001
                report.error(SECTION, case, exc)


# ----------------------------------------------------------------------------- 6. kv_dist
def _import_kv_dist():
    """`pagoda.services.gpu_worker.kv_dist` from an install or a plain checkout (then
    services/_proto must have been generated: tools/gen_protos.py)."""
    from gpu_check import map_subpackage  # benchmarks/ is on sys.path (this module is)

    map_subpackage("services")
    from pagoda.services.gpu_worker import kv_dist

    return kv_dist


class _GroupOnlyTransport:
    """Used only when kv_dist cannot be imported (no grpc or no generated protos): the
    torch.distributed part of DistTransport (its store and pair group, from
    `pagoda.distributed.process_group`, and its send/recv calls) with plain requests."""

    def __init__(self, device: torch.device, bind_host: str) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.device, self.device_type, self.bind_host = device, device.type, bind_host
        self._joining = ThreadPoolExecutor(max_workers=1)
        self._served = {}

    @staticmethod
    def request(**fields):
        return SimpleNamespace(**fields)

    def open(self, request):
        import datetime

        from pagoda.distributed.process_group import create_master_store, pair_group

        store = create_master_store(self.bind_host, 2, request.timeout_s)
        self._served[request.group_id] = (store, self._joining.submit(
            pair_group, store, request.group_id, 0, self.device_type,
            datetime.timedelta(seconds=request.timeout_s)))
        return SimpleNamespace(store_port=store.port)

    def send(self, request, blocks: torch.Tensor) -> None:
        import datetime

        group = self._served[request.group_id][1].result(timeout=request.timeout_s)
        data = blocks.contiguous().view(torch.uint8).reshape(-1)
        group.send([data], 1, request.tag).wait(datetime.timedelta(seconds=request.timeout_s))

    def pair(self, source_address, source_epoch, stub, timeout_s):
        import datetime
        import itertools

        import torch.distributed as dist

        from pagoda.distributed.process_group import pair_group

        reply = stub.OpenDistGroup(self.request(group_id="kv-pair", epoch=source_epoch,
                                                timeout_s=timeout_s), timeout=timeout_s)
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(self.bind_host, reply.store_port, 2, is_master=False, timeout=timeout)
        return SimpleNamespace(group=pair_group(store, "kv-pair", 1, self.device_type, timeout),
                               group_id="kv-pair", tags=itertools.count(1))

    def receive(self, pair, stub, request, remote_ids, shape, deadline):
        import datetime

        buffer = torch.empty(len(remote_ids) * shape.nbytes, dtype=torch.uint8, device=self.device)
        tag = next(pair.tags)
        work = pair.group.recv([buffer], 0, tag)
        remaining = max(deadline - time.monotonic(), 0.001)
        sent = stub.SendBlocks.future(self.request(group_id=pair.group_id, block_ids=remote_ids,
                                                   tag=tag, timeout_s=remaining))
        work.wait(datetime.timedelta(seconds=remaining))
        sent.result(timeout=remaining)
        return buffer.view(shape.dtype).view(shape.dims(len(remote_ids)))


def _pair_transport():
    """(transport class, request factory, how the row says it was driven)."""
    try:
        kv_dist = _import_kv_dist()
    except Exception as exc:  # noqa: BLE001 - no grpc, no generated protos, a protobuf mismatch
        return (_GroupOnlyTransport, _GroupOnlyTransport.request,
                f"torch.distributed part only: kv_dist not importable ({type(exc).__name__}: {exc})"[:300])
    pb = kv_dist.pb
    factories = {"FetchBlocksRequest": pb.FetchBlocksRequest}
    return (kv_dist.DistTransport, lambda kind="FetchBlocksRequest", **f: factories[kind](**f),
            "DistTransport open/pair/send/receive, gRPC replaced by a pipe")


def _pair_shape(small: bool):
    from pagoda.kv_transfer.block_shares import BlockShape

    if small:
        return BlockShape(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8,
                          dtype=torch.float32), 6, 2
    # Llama 3.1 8B: 2 MiB per block; SEND_BATCH (64) blocks per transfer.
    return BlockShape(num_layers=32, block_size=16, num_kv_heads=8, head_dim=128,
                      dtype=torch.bfloat16), 64, 5


def _pair_blocks(shape, count: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randn(shape.dims(count), generator=g).to(shape.dtype).to(device)


def _pair_device(device_name: str) -> torch.device:
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def _pair_source(conn, device_name: str, small: bool) -> None:
    """Rank 0 (the worker holding the blocks): transport.open/send on the requests from
    the pipe, as the gRPC handlers call them."""
    device = _pair_device(device_name)
    transport_class, _, _ = _pair_transport()
    shape, count, _ = _pair_shape(small)
    blocks = _pair_blocks(shape, count, device)
    transport = transport_class(device, "127.0.0.1")
    conn.send(("ready", None))
    while True:
        kind, packed = conn.recv()
        if kind == "stop":
            return
        try:
            request = _unpack(packed)
            if kind == "open":
                conn.send(("ok", _pack(transport.open(request))))
            elif kind == "send":
                transport.send(request, blocks[list(request.block_ids)])
                conn.send(("ok", _pack(None)))
        except Exception as exc:  # noqa: BLE001 - the puller reports it
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


def _pack(message):
    """Protobuf messages cross the pipe as bytes (their classes do not pickle by name)."""
    if hasattr(message, "SerializeToString"):
        return ("pb", type(message).__name__, message.SerializeToString())
    return ("obj", message)


def _unpack(packed):
    if packed[0] == "pb":
        return getattr(_import_kv_dist().pb, packed[1]).FromString(packed[2])
    return packed[1]


class _PipeStub:
    """The two RPCs the pulling side makes, over a pipe to the source process
    (requests and replies are picklable: protobuf messages or namespaces)."""

    def __init__(self, conn) -> None:
        self.conn = conn
        self.SendBlocks = SimpleNamespace(future=self._send_future)

    def _reply(self, timeout):
        if not self.conn.poll(timeout):
            raise TimeoutError("the source process did not answer")
        status, payload = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"source: {payload}")
        return _unpack(payload)

    def OpenDistGroup(self, request, timeout=None):  # noqa: N802 - the RPC's name
        self.conn.send(("open", _pack(request)))
        return self._reply(timeout)

    def _send_future(self, request, timeout=None):
        self.conn.send(("send", _pack(request)))
        return SimpleNamespace(result=lambda timeout=None: self._reply(timeout))


class _TimedGroup:
    """Delegates to a pair group, timing the host side of each recv() call: a recv()
    that blocks (e.g. an NCCL communicator set up lazily, waiting for the peer, which
    sends only when asked after recv() returns) shows up in the row's detail."""

    def __init__(self, group) -> None:
        self.group, self.recv_s = group, []

    def recv(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.group.recv(*args, **kwargs)
        finally:
            self.recv_s.append(time.perf_counter() - start)

    def __getattr__(self, name):
        return getattr(self.group, name)


def _pair_puller(conn, results, device_name: str, small: bool) -> None:
    """Rank 1 (the decode worker): transport.pair/receive, as kv_transfer.py calls them;
    puts ("ok", equal, seconds per transfer, bytes per transfer, how) or an error."""
    timed = None
    try:
        device = _pair_device(device_name)
        transport_class, request, how = _pair_transport()
        shape, count, reps = _pair_shape(small)
        expected = _pair_blocks(shape, count, device)
        if not conn.poll(PAIR_TIMEOUT_S):
            raise TimeoutError("the source process did not start")
        conn.recv()  # ("ready", None)
        stub = _PipeStub(conn)
        transport = transport_class(device, "127.0.0.1")
        pair = transport.pair("127.0.0.1:0", "epoch-1", stub, timeout_s=PAIR_TIMEOUT_S / 2)
        timed = pair.group = _TimedGroup(pair.group)
        fetch = request(source_epoch="epoch-1", lease_id="lease")
        ids = list(range(count))
        equal, times = True, []
        for rep in range(reps + 1):
            start = time.perf_counter()
            got = transport.receive(pair, stub, fetch, ids, shape,
                                    time.monotonic() + PAIR_TIMEOUT_S / 2)
            _sync(device)
            if rep:  # the first one also sets up the communicator
                times.append(time.perf_counter() - start)
            equal &= torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
        times.sort()
        results.put(("ok", equal, times[len(times) // 2], count * shape.nbytes, how))
    except BaseException as exc:  # noqa: BLE001
        blocked = ""
        if timed is not None and timed.recv_s:
            blocked = f"[group.recv() itself took {max(timed.recv_s):.1f}s on the host] "
        results.put(("error", blocked + f"{type(exc).__name__}: {exc}".replace("\n", " ")[:400]))
    finally:
        try:
            conn.send(("stop", None))
        except Exception:  # noqa: BLE001 - the source is gone already
            pass


def _kv_dist(report, device, small: bool) -> None:
    import multiprocessing as mp
    import queue

    label = "kv_dist/pair_exchange"
    if device.type == "cuda":
        devices = ["cuda:0", "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"]
    else:
        devices = ["cpu", "cpu"]
    ctx = mp.get_context("spawn")  # CUDA in the children needs spawn
    source_end, puller_end = ctx.Pipe()
    results = ctx.Queue()
    procs = [ctx.Process(target=_pair_source, args=(source_end, devices[0], small), daemon=True),
             ctx.Process(target=_pair_puller, args=(puller_end, results, devices[1], small),
                         daemon=True)]
    for p in procs:
        p.start()
    try:
        result = results.get(timeout=PAIR_TIMEOUT_S + 15)
    except queue.Empty:
        result = ("error", f"no result within {PAIR_TIMEOUT_S + 15:.0f}s (a hung pair: killed)")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    where = f"ranks on {devices[0]} and {devices[1]}"
    if result[0] != "ok":
        detail = result[1]
        if devices[0] == devices[1] != "cpu" and ("duplicate gpu" in detail.lower()
                                                   or "invalid usage" in detail.lower()):
            report.skip(SECTION, label, "NCCL (>= 2.5) refuses two ranks of one communicator on "
                        f"one GPU; needs two GPUs ({where}): {detail[:200]}")
        else:
            report.check(SECTION, label, "error", "bytes equal", False, f"{where}: {detail}")
        return
    _, equal, seconds, nbytes, how = result
    backend = "nccl" if device.type == "cuda" else "gloo"
    report.check(SECTION, label, "equal" if equal else "DIFFER", "bytes equal", equal,
                 f"{backend}, {where}, {how}")
    report.check(SECTION, "kv_dist/transfer_gbps", nbytes / seconds / 1e9, "-", None,
                 f"{nbytes / 2**20:.2f} MiB per transfer, {seconds * 1e3:.2f} ms (median)")


# ----------------------------------------------------------------------------- 7. host tier
def _host_kv_tier(report, device, small: bool) -> None:
    from pagoda.messages import KVOffload, KVOnload
    from pagoda.worker.host_kv_tier import HostKVTier

    layers, block, heads, dim = (2, 4, 2, 8) if small else (32, 16, 8, 128)  # 8B: 2 MiB/block
    dtype = torch.bfloat16
    count = 4 if small else 64
    num_blocks, num_slots = 3 * count, 2 * count
    g = _gen(device, 31)
    kv = [tuple(torch.randn(num_blocks, block, heads, dim, generator=g, device=device).to(dtype)
                for _ in range(2)) for _ in range(layers)]
    tier = HostKVTier(kv, num_slots)
    try:
        if device.type == "cuda":
            pinned = bool(tier.rows.is_pinned())
            report.check(SECTION, "host_kv_tier/pinned", pinned, True, pinned,
                         f"{tier.block_bytes / 2**20:.2f} MiB per block")
        src = list(range(count))
        slots = list(range(count, 2 * count))
        dst = list(range(count, 2 * count))
        hashes = [bytes([i % 256, i // 256]) for i in range(count)]
        offloads = [KVOffload(block_id=b, slot=s, block_hash=h) for b, s, h in zip(src, slots, hashes)]

        def onloads(targets):
            return [KVOnload(req_id="r", block_index=i, slot=s, block_id=d, block_hash=h)
                    for i, (s, d, h) in enumerate(zip(slots, targets, hashes))]

        nbytes = count * tier.block_bytes
        for _ in range(2):  # the second round is timed (the first warms the copy paths)
            start = time.perf_counter()
            tier.offload(kv, offloads)
            t_off = time.perf_counter() - start
            start = time.perf_counter()
            failed = tier.onload(kv, onloads(dst))
            t_on = time.perf_counter() - start
        # Each slot holds its block, and each onloaded block equals its source.
        in_slots = all(torch.equal(h[slots].view(torch.uint8), d[src].cpu().view(torch.uint8))
                       for dev_pair, host_pair in zip(kv, tier.tensors)
                       for d, h in zip(dev_pair, host_pair))
        same = in_slots and not failed and all(
            torch.equal(k[dst].view(torch.uint8), k[src].view(torch.uint8)) for pair in kv for k in pair)
        # The asynchronous loader (its own stream and thread) into a third set of blocks.
        dst2 = list(range(2 * count, 3 * count))
        start = time.perf_counter()
        tier.onloader.submit(kv, onloads(dst2))
        finished, invalid = tier.poll(wait_s=60.0)
        t_async = time.perf_counter() - start
        same_async = finished == {"r"} and not invalid and all(
            torch.equal(k[dst2].view(torch.uint8), k[src].view(torch.uint8)) for pair in kv for k in pair)
        report.check(SECTION, "host_kv_tier/round_trip_bytes", "equal" if same else "DIFFER",
                     "equal", same, f"{count} blocks offloaded then onloaded (sync path)"
                     + ("" if in_slots else "; host slots do NOT hold their blocks")
                     + (f"; {len(failed)} onloads failed their hash/CRC" if failed else ""))
        report.check(SECTION, "host_kv_tier/async_onload_bytes", "equal" if same_async else "DIFFER",
                     "equal", same_async, f"AsyncOnloader: finished {sorted(finished)}, "
                     f"invalid {len(invalid)}")
        for name, seconds in (("offload", t_off), ("onload", t_on), ("async_onload", t_async)):
            report.check(SECTION, f"host_kv_tier/{name}_gbps", nbytes / seconds / 1e9, "-", None,
                         f"{seconds / count * 1e6:.0f} us/block, {count} blocks of "
                         f"{tier.block_bytes / 2**20:.2f} MiB (offload/onload include the CRC-32 per slot)")
    finally:
        tier.onloader.close()
