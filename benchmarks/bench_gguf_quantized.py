"""What keeping weights quantized costs on the CPU: GGUF blocks, int4 (AWQ/GPTQ), FP8.
(not a pytest file)

    .venv/bin/python benchmarks/bench_gguf_quantized.py [--gguf FILE] [--tokens 1,8,64]
        [--dtype bfloat16] [--repeats 20] [--threads N]

Pagoda dequantizes a GGUF file's Q4_0/Q4_1/Q8_0 weights once, at load time
(`gguf_loader`), and multiplies dense weights. The alternative keeps each weight's raw
llama.cpp blocks in memory and dequantizes them tile by tile inside every forward
(`quantization.base.tiled_linear`, the CPU path of the AWQ/GPTQ/FP8 layers). This
runs every quantized matrix of the file (all layers' projections and the tied LM head)
once per "step" both ways, for a few token counts, and prints the median step time and
the weight memory of each. The same matrices, requantized to the in-memory forms of
AWQ/GPTQ (packed int4, groups of 32) and FP8 (per channel), run through those layers'
CPU path too: what `--quantization` checkpoints cost on the CPU. The default file is the default model, SmolLM2-135M Q4_1
(its embedding / LM head is Q8_0). Attention, norms and sampling are the same either
way and are left out.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

# llama.cpp block layouts: (bytes per 32 weights, dequantize [n, blocks, bytes] -> [n, K]).
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    return blocks[..., start:start + 2].contiguous().view(torch.float16).float()


def dequantize_blocks(kind: str, blocks: torch.Tensor) -> torch.Tensor:
    """Raw blocks uint8 [n, K/32, bytes] -> fp32 [n, K] (llama.cpp's formulas)."""
    n = blocks.shape[0]
    d = _half(blocks, 0)
    if kind == "Q8_0":
        q = blocks[..., 2:].contiguous().view(torch.int8).float()
        return (q * d).view(n, -1)
    first = 4 if kind == "Q4_1" else 2
    qs = blocks[..., first:]
    q = torch.cat([qs & 0xF, qs >> 4], dim=-1).float()  # element j: low nibble, j+16: high
    w = q * d + _half(blocks, 2) if kind == "Q4_1" else (q - 8) * d
    return w.view(n, -1)


class BlockLinear:
    """A weight kept as its raw GGUF blocks; x @ W^T dequantizes a tile of rows at a time."""

    def __init__(self, kind: str, raw: np.ndarray, num_columns: int) -> None:
        self.kind = kind
        rows = torch.from_numpy(np.array(raw, copy=True))  # a writable copy of the mmap
        self.blocks = rows.view(rows.shape[0], num_columns // 32, BLOCK_BYTES[kind])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from pagoda.model.quantization.base import tiled_linear

        return tiled_linear(x, self.blocks.shape[0],
                            lambda s, e: dequantize_blocks(self.kind, self.blocks[s:e]).to(x.dtype),
                            None, rows_per_column=self.blocks.shape[1] * 32)

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()


class Int4Layer:
    """W requantized to int4 (groups of 32 input rows), in `quantization.int4`'s layout."""

    def __init__(self, w: torch.Tensor) -> None:
        from pagoda.model.quantization.int4 import pack_rows

        n, k = w.shape
        groups = w.float().T.reshape(k // 32, 32, n)
        lo, hi = groups.amin(1).clamp(max=0), groups.amax(1).clamp(min=0)
        scales = ((hi - lo) / 15).clamp(min=1e-8).half().float()
        zeros = torch.round(-lo / scales).clamp(0, 15)
        q = (torch.round(groups / scales[:, None]) + zeros[:, None]).clamp(0, 15)
        self.qweight = pack_rows(q.reshape(k, n).to(torch.int32))
        self.scales, self.zeros = scales, zeros.to(torch.uint8)
        self.g_idx, self.group_size = None, 32

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from pagoda.model.quantization.int4 import apply_int4

        return apply_int4(self, x, None)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zeros))


class Fp8Layer:
    """W requantized to float8_e4m3fn with one scale per output row."""

    def __init__(self, w: torch.Tensor) -> None:
        from pagoda.model.quantization.fp8 import Fp8LinearMethod

        scale = (w.float().abs().amax(dim=1, keepdim=True) / 448).clamp(min=1e-12)
        self.weight = (w.float() / scale).to(torch.float8_e4m3fn)
        self.weight_scale, self.fp8_block_k = scale, w.shape[1]
        self.method = Fp8LinearMethod("channel", None, "weight_scale")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() + self.weight_scale.numel() * 4


def load_matrices(path: str, dtype: torch.dtype):
    """[(name, dense W in dtype, BlockLinear)] for every Q4_0/Q4_1/Q8_0 matrix of the file."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    out = []
    for t in GGUFReader(path).tensors:
        kind = t.tensor_type.name
        if kind not in BLOCK_BYTES or len(t.shape) != 2:
            continue
        dense = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
        block = BlockLinear(kind, t.data, dense.shape[1])
        # The on-the-fly dequantization must be llama.cpp's (gguf's reference) exactly.
        assert torch.equal(dequantize_blocks(kind, block.blocks[:4]), dense[:4]), t.name
        out.append((t.name, dense.to(dtype), block))
    return out


def time_step(fn, repeats: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", default=None, help="default: SmolLM2-135M-Instruct Q4_1")
    parser.add_argument("--tokens", default="1,8,64")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from pagoda.model.loader import default_model_path

    dtype = getattr(torch, args.dtype)
    matrices = load_matrices(args.gguf or default_model_path(), dtype)
    forms = {"dense": [(w, lambda x, w=w: F.linear(x, w)) for _, w, _ in matrices],
             "gguf": [(w, b) for _, w, b in matrices],
             "int4": [(w, Int4Layer(w)) for _, w, _ in matrices],
             "fp8": [(w, Fp8Layer(w)) for _, w, _ in matrices]}
    mib = {"dense": sum(w.numel() * w.element_size() for _, w, _ in matrices)}
    for name in ("gguf", "int4", "fp8"):
        mib[name] = sum(layer.nbytes for _, layer in forms[name])
    print(f"{len(matrices)} matrices, {torch.get_num_threads()} threads, activations "
          f"{args.dtype}. Weights in memory (MiB): "
          + ", ".join(f"{name} {size / 2**20:.0f}" for name, size in mib.items()))
    print("dense: dequantized at load; the others dequantize per forward (ms per step, "
          "and x dense)")
    print("tokens    dense    gguf blocks        int4         fp8")
    with torch.inference_mode():
        for num_tokens in (int(n) for n in args.tokens.split(",")):
            xs = {w.shape[1]: torch.randn(num_tokens, w.shape[1]).to(dtype)
                  for _, w, _ in matrices}
            times = {name: time_step(lambda f=f: [layer(xs[w.shape[1]]) for w, layer in f],
                                     args.repeats) for name, f in forms.items()}
            cells = [f"{times[n]:7.1f} ({times[n] / times['dense']:4.1f}x)"
                     for n in ("gguf", "int4", "fp8")]
            print(f"{num_tokens:>6}  {times['dense']:7.1f}  " + "  ".join(cells))


if __name__ == "__main__":
    main()
