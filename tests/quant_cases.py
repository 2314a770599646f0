"""Quantized checkpoints built by hand from a model directory, in the exact on-disk formats,
plus the dense checkpoint of their dequantized weights (the reference).

Written from the formats' definitions (AutoAWQ's and AutoGPTQ's packing loops, the FP8
scale layouts), not with Pagoda's own unpacking code, so a wrong unpacking order in
Pagoda cannot cancel out. Every quantized weight W [N, K] becomes integers or fp8 values
and scales, and the reference holds exactly `dequantize(stored)` in fp32.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def is_quantized_linear(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in LINEARS


# ------------------------------------------------------------------ int4 (AWQ, GPTQ)
def quantize_int4(w: torch.Tensor, group: int, g_idx: torch.Tensor):
    """Asymmetric 4-bit per group of input rows: (q [K, N], zeros [G, N], scales fp16 [G, N],
    dequantized W [N, K] fp32). `g_idx[k]` is the group of input column k of W."""
    n, k = w.shape
    num_groups = int(g_idx.max()) + 1
    q = torch.empty(k, n, dtype=torch.int32)
    zeros = torch.empty(num_groups, n, dtype=torch.int32)
    scales = torch.empty(num_groups, n, dtype=torch.float16)
    for g in range(num_groups):
        cols = (g_idx == g).nonzero().flatten()
        block = w[:, cols].T  # [rows of group, N]
        lo, hi = block.min(0).values.clamp(max=0), block.max(0).values.clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-5).half()
        zero = torch.round(-lo / scale.float()).clamp(0, 15).to(torch.int32)
        q[cols] = (torch.round(block / scale.float()) + zero).clamp(0, 15).to(torch.int32)
        zeros[g], scales[g] = zero, scale
    deq = ((q - zeros[g_idx]).float() * scales[g_idx].float()).T.contiguous()
    return q, zeros, scales, deq


def _pack_awq(values: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's GEMM packing: [R, N] -> [R, N/8], column 8c + ORDER[i] in nibble i."""
    packed = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int32)
    for col in range(values.shape[1] // 8):
        for i in range(8):
            packed[:, col] |= values[:, col * 8 + AWQ_ORDER[i]] << (4 * i)
    return packed


def _pack_gptq_rows(q: torch.Tensor) -> torch.Tensor:
    """AutoGPTQ: [K, N] -> [K/8, N], input row 8r + j in nibble j of word r."""
    packed = torch.zeros(q.shape[0] // 8, q.shape[1], dtype=torch.int32)
    for r in range(packed.shape[0]):
        for j in range(8):
            packed[r] |= q[8 * r + j] << (4 * j)
    return packed


def _pack_gptq_columns(values: torch.Tensor) -> torch.Tensor:
    packed = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int32)
    for c in range(packed.shape[1]):
        for j in range(8):
            packed[:, c] |= (values[:, 8 * c + j] & 0xF) << (4 * j)
    return packed


def awq_tensors(prefix: str, w: torch.Tensor, group: int):
    k = w.shape[1]
    q, zeros, scales, deq = quantize_int4(w, group, torch.arange(k) // group)
    return {f"{prefix}.qweight": _pack_awq(q), f"{prefix}.qzeros": _pack_awq(zeros),
            f"{prefix}.scales": scales}, deq


def gptq_tensors(prefix: str, w: torch.Tensor, group: int, act_order: bool, seed: int):
    k = w.shape[1]
    if act_order:  # rows quantized in a random order: groups are not contiguous
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
        g_idx = torch.empty(k, dtype=torch.int64)
        g_idx[perm] = torch.arange(k) // group
    else:
        g_idx = torch.arange(k) // group
    q, zeros, scales, deq = quantize_int4(w, group, g_idx)
    # The v1 ("gptq") format stores zero - 1.
    return {f"{prefix}.qweight": _pack_gptq_rows(q), f"{prefix}.qzeros": _pack_gptq_columns(zeros - 1),
            f"{prefix}.scales": scales, f"{prefix}.g_idx": g_idx.to(torch.int32)}, deq


# ------------------------------------------------------------------ fp8
FP8_MAX = 448.0


def fp8_tensors(prefix: str, w: torch.Tensor, scheme: str, block=(16, 32),
                scale_name: str = "weight_scale"):
    """scheme: tensor (scale []), channel ([N, 1]) or block ([N/bn, K/bk])."""
    n, k = w.shape
    if scheme == "tensor":
        scale = (w.abs().max() / FP8_MAX).reshape(())
        full = scale.expand(n, k)
    elif scheme == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
        full = scale.expand(n, k)
    else:
        bn, bk = block
        blocks = w.reshape(n // bn, bn, k // bk, bk)
        scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX
        full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    tensors = {f"{prefix}.weight": q, f"{prefix}.{scale_name}": scale.float().contiguous()}
    if scheme == "tensor":  # a static activation scale, as AutoFP8 writes (unused by Pagoda)
        tensors[f"{prefix}.input_scale"] = torch.tensor(0.05)
    return tensors, q.float() * full


# ------------------------------------------------------------------ checkpoints
FORMATS = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
            "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False,
             "sym": False, "checkpoint_format": "gptq"},
    "gptq-act-order": {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True,
                       "sym": False, "checkpoint_format": "gptq"},
    "fp8-tensor": {"quant_method": "fp8", "activation_scheme": "static"},
    "fp8-block": {"quant_method": "fp8", "activation_scheme": "dynamic",
                  "weight_block_size": [16, 32]},
    "ct-channel": {"quant_method": "compressed-tensors", "format": "float-quantized",
                   "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                       "num_bits": 8, "type": "float", "symmetric": True,
                       "strategy": "channel"}}}, "ignore": ["lm_head"]},
    "ct-tensor": {"quant_method": "compressed-tensors", "format": "float-quantized",
                  "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                      "num_bits": 8, "type": "float", "symmetric": True,
                      "strategy": "tensor"}}}, "ignore": ["lm_head"]},
}


def quantize_tensor(fmt: str, name: str, w: torch.Tensor, seed: int):
    prefix = name.removesuffix(".weight")
    if fmt == "awq":
        return awq_tensors(prefix, w, 32)
    if fmt.startswith("gptq"):
        return gptq_tensors(prefix, w, 32, fmt == "gptq-act-order", seed)
    if fmt == "fp8-tensor":
        return fp8_tensors(prefix, w, "tensor")
    if fmt == "fp8-block":
        return fp8_tensors(prefix, w, "block", scale_name="weight_scale_inv")
    if fmt == "ct-channel":
        return fp8_tensors(prefix, w, "channel")
    if fmt == "ct-tensor":
        t, deq = fp8_tensors(prefix, w, "tensor")
        t[f"{prefix}.weight_scale"] = t[f"{prefix}.weight_scale"].reshape(1)  # stored as [1]
        return t, deq
    raise ValueError(fmt)


def _input_seed(name: str) -> int:
    """One act-order permutation per layer input: q/k/v share theirs, gate/up theirs (GPTQ
    derives the order from the input's statistics)."""
    layer, proj = name.split(".")[2], name.split(".")[-2]
    shared = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}.get(proj, proj)
    return int(layer) * 10 + LINEARS.index(shared)


def save_quantized(src_dir: str, fmt: str, out_dir: str, ref_dir: str) -> None:
    """`out_dir`: src_dir's model with every q/k/v/o/gate/up/down weight quantized in `fmt`;
    `ref_dir`: the same model with those weights replaced by their dequantized values."""
    weights = load_file(os.path.join(src_dir, "model.safetensors"))
    quantized, reference = {}, {}
    for name, w in sorted(weights.items()):
        if is_quantized_linear(name):
            tensors, deq = quantize_tensor(fmt, name, w.float(), seed=_input_seed(name))
            quantized.update(tensors)
            reference[name] = deq
        else:
            quantized[name] = reference[name] = w
    for directory, tensors in ((out_dir, quantized), (ref_dir, reference)):
        os.makedirs(directory, exist_ok=True)
        for f in os.listdir(src_dir):
            if not f.endswith(".safetensors"):
                shutil.copy(os.path.join(src_dir, f), directory)
        save_file({k: v.contiguous() for k, v in tensors.items()},
                  os.path.join(directory, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["quantization_config"] = FORMATS[fmt]
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
