"""gpt-oss (OpenAI's open-weight MoE), as transformers' `modeling_gpt_oss.py`.

What differs from Llama:
- attention: q/k/v/o biases (`attention_bias`, true by default) and attention sinks, a
  learned logit per head that joins each softmax's denominator (`sinks`: see
  `pagoda.model.attention`); layers alternate between a sliding window (`layer_types`:
  even layers by default) and full attention; yarn RoPE as configured;
- every MLP is a mixture of experts (`GptOssMoE`): the router has a bias, picks the
  top k logits and takes the softmax over those k only; each expert has biases and a
  clamped SwiGLU, `(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)` with
  g = clamp(gate, max=l) (`GptOssSettings`: alpha 1.702, l 7.0).

Checkpoint layout (one stacked tensor per projection, `mlp.experts.`):
    gate_up_proj [E, H, 2I]  columns interleaved: gate 0, up 0, gate 1, up 1, ...
    gate_up_proj_bias [E, 2I]  (interleaved the same way)
    down_proj [E, I, H], down_proj_bias [E, H]
Real checkpoints store the two weights as MXFP4 (`<name>_blocks`, `<name>_scales`, in
[E, out, in] order): `load_weights` dequantizes them (`quantization.mxfp4`) into the
layout above. The experts are held in the model dtype, gate rows then up rows, like
`moe.FusedMoE`, but run as a torch loop over the chosen experts on every device (no
fused kernel for the biases and the clamped SwiGLU). The sink attention runs on the
torch path or the Triton kernels (verified under the Triton interpreter; not on a GPU).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelArchConfig, MoEConfig
from pagoda.distributed.communication import all_reduce
from pagoda.distributed.parallel_state import ParallelContext, expert_range
from pagoda.model.arch_spec import ModelArchitecture, family_settings
from pagoda.model.architectures.llama import LlamaForCausalLM
from pagoda.model.decoder_layer import DecoderLayer, PagedSelfAttention
from pagoda.model.layers import empty_parameter
from pagoda.model.quantization import current_quant_config, quantized_construction
from pagoda.model.quantization.mxfp4 import Mxfp4Config, dequantize_mxfp4


@dataclass(frozen=True)
class GptOssSettings:
    """The experts' clamped SwiGLU: sigmoid gain `swiglu_alpha`, clamp `swiglu_limit`."""

    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    @classmethod
    def from_hf_config(cls, hf_config: dict, arch: ModelArchConfig) -> GptOssSettings:
        return cls(float(hf_config.get("swiglu_alpha", cls.swiglu_alpha)),
                   float(hf_config.get("swiglu_limit", cls.swiglu_limit)))


class GptOssExperts(nn.Module):
    """This rank's experts: `w13 [E_local, 2 I_local, H]` (gate rows, then up rows),
    `w13_bias`, `w2 [E_local, H, I_local]`, `w2_bias [E_local, H]`. Sharded like
    `moe.FusedMoE` (TP: every expert, a slice of its intermediate rows; EP: experts
    [e0, e1) whole). Each rank's output is a partial sum, so the down bias is added by
    one rank per expert: the one holding it under EP, TP rank 0 otherwise."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 settings: GptOssSettings, dtype: torch.dtype, parallel: ParallelContext) -> None:
        super().__init__()
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.intermediate_size = intermediate_size
        self.alpha, self.limit = settings.swiglu_alpha, settings.swiglu_limit
        self.expert_start, self.expert_end = expert_range(num_experts, parallel)
        split = 1 if parallel.enable_expert_parallel else parallel.tp_size
        if intermediate_size % split:
            raise ValueError(f"gpt-oss intermediate size ({intermediate_size}) must be "
                             f"divisible by tensor parallel size ({split})")
        self.local_intermediate = intermediate_size // split
        self.intermediate_start = (0 if parallel.enable_expert_parallel
                                   else parallel.tp_rank * self.local_intermediate)
        self.adds_down_bias = parallel.enable_expert_parallel or parallel.tp_rank == 0
        local, inter = self.expert_end - self.expert_start, self.local_intermediate
        self.w13 = empty_parameter(local, 2 * inter, hidden_size, dtype=dtype)
        self.w13_bias = empty_parameter(local, 2 * inter, dtype=dtype)
        self.w2 = empty_parameter(local, hidden_size, inter, dtype=dtype)
        self.w2_bias = empty_parameter(local, hidden_size, dtype=dtype)

    def checkpoint_tensors(self) -> dict[str, tuple[int, ...]]:
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        return {"gate_up_proj": (e, h, 2 * i), "gate_up_proj_bias": (e, 2 * i),
                "down_proj": (e, i, h), "down_proj_bias": (e, h)}

    @torch.no_grad()
    def load_checkpoint_tensor(self, suffix: str, full: torch.Tensor) -> None:
        """Copy this rank's experts and intermediate slice of one stacked HF tensor."""
        full = full[self.expert_start:self.expert_end]
        start, rows = self.intermediate_start, self.local_intermediate
        if suffix == "down_proj":  # [E, I, H] -> [E, H, I_local]
            self.w2.copy_(full.narrow(1, start, rows).transpose(1, 2))
        elif suffix == "down_proj_bias":
            self.w2_bias.copy_(full)
        else:  # gate_up_proj [E, H, 2I] / its bias [E, 2I]: de-interleave the columns
            gate, up = full[..., 0::2], full[..., 1::2]
            both = torch.cat([gate.narrow(-1, start, rows), up.narrow(-1, start, rows)], -1)
            (self.w13_bias if suffix.endswith("bias") else self.w13).copy_(
                both if suffix.endswith("bias") else both.transpose(1, 2))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], routing weights and expert ids [T, k] -> this rank's partial [T, H].
        Pairs sorted by expert; one gate/up and one down matmul per local expert with
        tokens (its counts are read on the host: the CPU path)."""
        top_k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        starts = (torch.cumsum(counts, 0) - counts).tolist()
        counts = counts.tolist()
        pair_out = x.new_zeros(flat.shape[0], x.shape[1])
        inter = self.local_intermediate
        for local in range(self.expert_end - self.expert_start):
            expert = self.expert_start + local
            if counts[expert] == 0:
                continue
            pairs = order[starts[expert]:starts[expert] + counts[expert]]
            gate_up = F.linear(x[pairs // top_k], self.w13[local], self.w13_bias[local])
            gate = gate_up[:, :inter].clamp(max=self.limit)
            up = gate_up[:, inter:].clamp(min=-self.limit, max=self.limit)
            hidden = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
            bias = self.w2_bias[local] if self.adds_down_bias else None
            pair_out[pairs] = F.linear(hidden, self.w2[local], bias)
        out = pair_out * weights.reshape(-1, 1).to(x.dtype)
        return out.view(x.shape[0], top_k, -1).sum(dim=1)


class GptOssRouter(nn.Module):
    """Router logits x W^T + b (replicated on every rank)."""

    def __init__(self, num_experts: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = empty_parameter(num_experts, hidden_size, dtype=dtype)
        self.bias = empty_parameter(num_experts, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class GptOssMoE(nn.Module):
    """`mlp.router` and `mlp.experts`: the top-k logits, softmax over those k (in the
    logits' dtype, as HF), the experts weighted by them, reduced over the TP group."""

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype, parallel: ParallelContext):
        super().__init__()
        moe = arch.moe
        self.top_k, self.parallel = moe.num_experts_per_tok, parallel
        self.router = GptOssRouter(moe.num_experts, arch.hidden_size, dtype)
        self.experts = GptOssExperts(moe.num_experts, arch.hidden_size, moe.intermediate_size,
                                     family_settings(arch, GptOssSettings), dtype, parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top_logits, ids = torch.topk(self.router(x), self.top_k, dim=-1)
        out = self.experts(x, torch.softmax(top_logits, dim=-1), ids)
        if self.parallel.tp_size > 1:
            out = all_reduce(out, self.parallel.tp_group)
        return out


class GptOssForCausalLM(LlamaForCausalLM):
    """Llama's stack with sink attention and `GptOssMoE` MLPs (module doc)."""

    # The experts' loop reads each expert's token count on the host (`GptOssExperts`):
    # a sync that a CUDA graph capture forbids, so the runner keeps decodes eager.
    supports_cuda_graphs = False

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype,
                 parallel: ParallelContext | None = None) -> None:
        quant = current_quant_config()
        if quant is not None and not isinstance(quant, Mxfp4Config):
            raise ValueError(f"gpt-oss runs unquantized or from MXFP4 checkpoints, not with "
                             f"{quant.name} quantization")
        # The MXFP4 experts are dequantized by `load_weights`; every linear layer is plain.
        with quantized_construction(None):
            super().__init__(arch, dtype, parallel)

    def make_attention(self, layer_idx: int) -> nn.Module:
        bias = self.arch.attention_bias
        return PagedSelfAttention(self.arch, self.dtype, bias, bias, self.parallel,
                                  sliding_window=self.arch.layer_sliding_window(layer_idx),
                                  sinks=True)

    def make_decoder_layer(self, layer_idx: int) -> nn.Module:
        return DecoderLayer(self.make_attention(layer_idx),
                            GptOssMoE(self.arch, self.dtype, self.parallel), self.arch,
                            self.dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._hf_weights(weights))

    def _hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]
                    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint as HF's unquantized names and shapes: MXFP4 pairs dequantized,
        each layer's sinks cut to this rank's heads."""
        pending: dict[str, torch.Tensor] = {}  # the half of an MXFP4 pair seen first
        for name, tensor in weights:
            if name.endswith(("_blocks", "_scales")):
                base, _, part = name.rpartition("_")
                other = pending.pop(f"{base}_{'scales' if part == 'blocks' else 'blocks'}", None)
                if other is None:
                    pending[name] = tensor
                    continue
                if self.held_elsewhere(base):  # another pipeline stage's experts
                    continue
                blocks, scales = (tensor, other) if part == "blocks" else (other, tensor)
                # [E, out, in] -> HF's [E, in, out]
                yield base, dequantize_mxfp4(blocks, scales, self.dtype).transpose(1, 2)
            elif name.endswith(".self_attn.sinks") and not self.held_elsewhere(name):
                heads = self.model.layers[int(name.split(".")[2])].self_attn.num_heads
                yield name, tensor.narrow(0, self.parallel.tp_rank * heads, heads)
            else:
                yield name, tensor
        if pending:
            raise ValueError(f"MXFP4 tensors without their pair: {', '.join(sorted(pending))}")


def gpt_oss_arch_config(hf_config: dict, arch: ModelArchConfig) -> ModelArchConfig:
    """The MoE shape, q/k/v/o biases (on unless config.json says otherwise) and
    transformers' default layer pattern (even layers slide) when `layer_types` is absent."""
    sliding = arch.sliding_window
    if sliding is not None and sliding.layer_types is None:
        sliding = dataclasses.replace(sliding, layer_types=tuple(
            SLIDING_ATTENTION if (i + 1) % 2 else FULL_ATTENTION
            for i in range(arch.num_hidden_layers)))
    moe = MoEConfig(num_experts=hf_config.get("num_local_experts", hf_config.get("num_experts")),
                    num_experts_per_tok=hf_config["num_experts_per_tok"],
                    intermediate_size=hf_config["intermediate_size"], norm_topk_prob=True)
    return dataclasses.replace(arch, sliding_window=sliding, moe=moe,
                               attention_bias=hf_config.get("attention_bias", True))


ARCHITECTURES = (
    ModelArchitecture("GptOssForCausalLM", GptOssForCausalLM,
                      update_arch_config=gpt_oss_arch_config, settings=GptOssSettings),
)
