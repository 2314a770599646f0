"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention and a MoE with shared experts.

The stack is Llama's shape (`model.embed_tokens`, `model.layers.N`, `model.norm`,
`lm_head`, pre-norm blocks); what differs:

- attention is `mla_attention.MultiHeadLatentAttention`: the KV cache holds one latent
  of kv_lora_rank + qk_rope_head_dim values per token and layer
  (`ModelArchConfig.kv_latent_dim`), so a block of DeepSeek-V3 costs 576 values per
  token and layer where expanded K/V would cost 40960;
- RoPE rotates only the qk_rope_head_dim part of each query and the shared rope key,
  in DeepSeek's interleaved pair layout (V3's `rope_interleave: false` means
  rotate-half); yarn's mscale_all_dim also scales the softmax scale (squared);
- layers `first_k_dense_replace` and on, every `moe_layer_freq`-th, run
  `deepseek_moe.DeepseekMoE` (routed experts + shared experts); the others a dense
  `GatedMLP` of `intermediate_size`. (transformers 5 ignores `moe_layer_freq`; vLLM and
  DeepSeek's own code use it; every released checkpoint has 1, where all agree.)
- routing: V2 softmax with `greedy` or `group_limited_greedy`; V3 sigmoid with
  `e_score_correction_bias` and group-limited top-k (`noaux_tc`); both scaled by
  `routed_scaling_factor`. `norm_topk_prob` renormalises the top-k weights in both
  (DeepSeek's code and vLLM; transformers 5's V2 ignores it, so V2 parity holds for the
  released V2 configs, which all have it false).

Parallelism: tensor parallelism splits MLA by query head (the latent cache is
replicated, `mla_attention.py`) and the experts like any `FusedMoE`;
`--enable-expert-parallel` places whole experts per rank; pipeline parallelism splits
the layers. All three give transformers' greedy tokens
(`tests/model/architectures/test_deepseek_parallel.py`;
layer-level logits at TP=2/4: `tests/distributed/test_deepseek_tensor_parallel.py`).

Refused at load, by name: fp8/other quantized checkpoints (DeepSeek-V3's own fp8 block
format included: serve a bf16 conversion) and `--quantization`.

MTP layers (`num_nextn_predict_layers`, stored as `model.layers.<num_hidden_layers + i>.*`):
without MTP speculation they are not read, and the loader logs that it ignores them.
Under `{"method": "mtp"}` (`with_mtp_drafts`) the model also builds the first one
(`pagoda.model.deepseek_mtp`) at index num_hidden_layers of `model.layers`, keeps the
decoder's pre-norm hidden state for it, and reads its tensors; later MTP layers are
named as ignored (vLLM runs only the first, reused for every draft). An MTP layer
without `embed_tokens` or `shared_head.head` takes the model's (logged).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pagoda.config import ModelArchConfig, MoEConfig
from pagoda.model.arch_spec import ModelArchitecture, family_settings
from pagoda.model.architectures.llama import LlamaForCausalLM
from pagoda.model.decoder_layer import DecoderLayer, GatedMLP
from pagoda.model.deepseek_moe import DeepseekMoE, DeepseekRouting
from pagoda.model.deepseek_mtp import DeepseekMTPLayer
from pagoda.model.mla_attention import MLADims, MultiHeadLatentAttention
from pagoda.model.moe import expert_held_elsewhere
from pagoda.model.rotary import RotaryEmbedding

logger = logging.getLogger(__name__)


# Why no quantization method runs these models (the engine config refuses them early).
NOT_QUANTIZABLE = ("MLA's kv_b_proj is read as a dense matrix, and MoE experts run "
                   "unquantized")


@dataclasses.dataclass(frozen=True)
class DeepseekSettings:
    """DeepSeek's own config.json fields (transformers' names)."""

    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_interleave: bool = True
    n_shared_experts: int = 0
    routing: DeepseekRouting | None = None  # None: no MoE layer
    num_nextn_predict_layers: int = 0
    # The MTP layer's MLP is MoE (vLLM's rule for layer num_hidden_layers: past
    # first_k_dense_replace, every moe_layer_freq-th).
    mtp_layer_moe: bool = False
    # Build the first MTP layer as a draft head (`with_mtp_drafts`); off: ignore MTP tensors.
    mtp_drafts: bool = False

    @classmethod
    def from_hf_config(cls, hf_config: dict, arch: ModelArchConfig) -> DeepseekSettings:
        v3 = arch.architecture == "DeepseekV3ForCausalLM"
        routing = None
        if arch.moe is not None:
            routing = DeepseekRouting(
                num_experts=arch.moe.num_experts, top_k=arch.moe.num_experts_per_tok,
                scoring_func="sigmoid" if v3 else hf_config.get("scoring_func", "softmax"),
                topk_method="noaux_tc" if v3 else hf_config.get("topk_method") or "greedy",
                n_group=hf_config.get("n_group") or 1,
                topk_group=hf_config.get("topk_group") or 1,
                norm_topk_prob=arch.moe.norm_topk_prob,
                routed_scaling_factor=float(hf_config.get("routed_scaling_factor", 1.0)))
        n = arch.num_hidden_layers
        mtp_layer_moe = (routing is not None and n >= (hf_config.get("first_k_dense_replace") or 0)
                         and n % (hf_config.get("moe_layer_freq") or 1) == 0)
        return cls(q_lora_rank=hf_config.get("q_lora_rank"),
                   kv_lora_rank=hf_config["kv_lora_rank"],
                   qk_nope_head_dim=hf_config["qk_nope_head_dim"],
                   qk_rope_head_dim=hf_config["qk_rope_head_dim"],
                   v_head_dim=hf_config["v_head_dim"],
                   rope_interleave=bool(hf_config.get("rope_interleave", True)) if v3 else True,
                   n_shared_experts=hf_config.get("n_shared_experts") or 0,
                   routing=routing,
                   num_nextn_predict_layers=hf_config.get("num_nextn_predict_layers") or 0,
                   mtp_layer_moe=mtp_layer_moe)

    @property
    def dims(self) -> MLADims:
        return MLADims(self.q_lora_rank, self.kv_lora_rank, self.qk_nope_head_dim,
                       self.qk_rope_head_dim, self.v_head_dim)


def softmax_scale(settings: DeepseekSettings, rope_scaling: dict | None) -> float:
    """qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim) squared under yarn
    (transformers' `yarn_apply_mscale`)."""
    scale = settings.dims.qk_head_dim ** -0.5
    if rope_scaling and rope_scaling.get("mscale_all_dim"):
        factor = rope_scaling["factor"]
        if factor > 1:
            mscale = 0.1 * rope_scaling["mscale_all_dim"] * math.log(factor) + 1.0
            scale *= mscale * mscale
    return scale


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    """DeepSeek-V2/V3 on Llama's stack: MLA attention, dense or DeepSeek MoE MLPs.

    Invariant: every checkpoint tensor is consumed, except the MTP layers' when MTP drafts
    are off and the MTP layers after the first when they are on (`needs_checkpoint_tensor`
    and `load_weights` drop those and log how many).
    """

    # q_proj stays unfused (MLA has no k/v projections to stack it with).
    packed_modules_mapping = {"gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype, parallel=None) -> None:
        self.settings = family_settings(arch, DeepseekSettings)
        if arch.quantization_config:  # --quantization on a bf16 checkpoint lands here
            method = arch.quantization_config.get("quant_method", "the requested")
            raise ValueError(f"{method} quantization of {arch.architecture} is not supported "
                             f"({NOT_QUANTIZABLE}): serve it without --quantization")
        super().__init__(arch, dtype, parallel)
        if self.settings.mtp_drafts:
            self.model.layers.append(self.make_mtp_layer())
            self.model.keep_pre_norm_hidden = True

    @property
    def mtp_layer(self) -> DeepseekMTPLayer:
        """The MTP draft layer (built only under `mtp_drafts`)."""
        return self.model.layers[self.arch.num_hidden_layers]

    def make_mtp_layer(self) -> DeepseekMTPLayer:
        arch, settings = self.arch, self.settings
        index = arch.num_hidden_layers
        if settings.mtp_layer_moe:
            mlp = DeepseekMoE(settings.routing, arch.hidden_size, arch.moe.intermediate_size,
                              settings.n_shared_experts, self.dtype, self.parallel,
                              arch.hidden_act)
        else:
            mlp = GatedMLP(arch.hidden_size, arch.intermediate_size, self.dtype, self.parallel,
                           arch.hidden_act)
        return DeepseekMTPLayer(self.make_attention(index), mlp, arch, self.dtype,
                                self.parallel)

    def make_rotary_embeddings(self) -> tuple[RotaryEmbedding, None]:
        arch = self.arch
        return RotaryEmbedding(self.settings.qk_rope_head_dim, arch.rope_theta,
                               arch.rope_scaling, arch.max_position_embeddings, None,
                               arch.max_model_len), None

    def make_attention(self, layer_idx: int) -> nn.Module:
        return MultiHeadLatentAttention(
            self.arch, self.settings.dims, self.dtype, self.parallel,
            scale=softmax_scale(self.settings, self.arch.rope_scaling),
            rope_interleave=self.settings.rope_interleave)

    def make_decoder_layer(self, layer_idx: int) -> nn.Module:
        arch, moe, settings = self.arch, self.arch.moe, self.settings
        if moe is None or layer_idx in moe.dense_mlp_layers:
            mlp = GatedMLP(arch.hidden_size, arch.intermediate_size, self.dtype, self.parallel,
                           arch.hidden_act)
        else:
            mlp = DeepseekMoE(settings.routing, arch.hidden_size, moe.intermediate_size,
                              settings.n_shared_experts, self.dtype, self.parallel,
                              arch.hidden_act)
        return DecoderLayer(self.make_attention(layer_idx), mlp, arch, self.dtype)

    def is_mtp_tensor(self, name: str) -> bool:
        """A tensor of the multi-token-prediction layers stored after the decoder's."""
        return _mtp_index(name, self.arch.num_hidden_layers) is not None

    def is_read_mtp_tensor(self, name: str) -> bool:
        """A tensor of the MTP layer this model runs as a draft head (the first one)."""
        return self.settings.mtp_drafts and _mtp_index(name, self.arch.num_hidden_layers) == 0

    def held_elsewhere(self, name: str) -> bool:
        return super().held_elsewhere(name) or expert_held_elsewhere(self, name)

    def needs_checkpoint_tensor(self, name: str) -> bool:
        if self.is_mtp_tensor(name):
            return self.is_read_mtp_tensor(name) and not expert_held_elsewhere(self, name)
        return super().needs_checkpoint_tensor(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._mtp_filtered(weights))

    def _mtp_filtered(self, weights: Iterable[tuple[str, torch.Tensor]]
                      ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors less the MTP ones this model does not run (counted
        and logged); the run MTP layer's missing embedding or head taken from the model's."""
        n = self.arch.num_hidden_layers
        ignored, seen, shared = 0, set(), {}
        for name, tensor in weights:
            if self.is_mtp_tensor(name) and not self.is_read_mtp_tensor(name):
                ignored += 1
                continue
            seen.add(name)
            if self.settings.mtp_drafts and name in ("model.embed_tokens.weight", "lm_head.weight"):
                shared[name] = tensor
            yield name, tensor
        if ignored and self.settings.mtp_drafts:
            logger.info("Ignoring %d tensors of the checkpoint's MTP layers after the first "
                        "(model.layers.%d.* on): MTP drafts run the first MTP layer for every "
                        "draft position, as vLLM does", ignored, n + 1)
        elif ignored:
            logger.info("Ignoring %d tensors of the checkpoint's %d MTP layer(s) "
                        "(model.layers.%d.* on; num_nextn_predict_layers): they run only as "
                        "drafts, under --speculative-config '{\"method\": \"mtp\"}'", ignored,
                        self.settings.num_nextn_predict_layers, n)
        if not self.settings.mtp_drafts:
            return
        head = shared.get("lm_head.weight", shared.get("model.embed_tokens.weight"))
        for own, fallback, what in (
                (f"model.layers.{n}.embed_tokens.weight",
                 shared.get("model.embed_tokens.weight"), "model.embed_tokens"),
                (f"model.layers.{n}.shared_head.head.weight", head, "the model's LM head")):
            if own not in seen and fallback is not None:
                logger.info("The checkpoint's MTP layer has no %s: it uses %s", own, what)
                yield own, fallback


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """The same network; V3's router (sigmoid, correction bias) comes from its settings."""


_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")


def _mtp_index(name: str, num_hidden_layers: int) -> int | None:
    """i for a tensor of MTP layer i (`model.layers.<num_hidden_layers + i>.*`), else None."""
    match = _LAYER_INDEX.match(name)
    if match is None or int(match.group(1)) < num_hidden_layers:
        return None
    return int(match.group(1)) - num_hidden_layers


def with_mtp_drafts(arch: ModelArchConfig) -> ModelArchConfig:
    """`arch` whose model also builds its first MTP layer as a draft head; ValueError
    when the checkpoint has none."""
    settings = family_settings(arch, DeepseekSettings)
    if settings.num_nextn_predict_layers < 1:
        raise ValueError(f"{arch.architecture} has no MTP heads (config.json has no "
                         "num_nextn_predict_layers)")
    return dataclasses.replace(arch, family_settings=dataclasses.replace(settings,
                                                                         mtp_drafts=True))


def deepseek_arch_config(hf_config: dict, arch: ModelArchConfig) -> ModelArchConfig:
    """The latent cache width, every head its own "KV head" (config.json may say 128
    KV heads whatever the model), and the MoE layers; refuses quantized checkpoints."""
    quant = hf_config.get("quantization_config")
    if quant:
        raise ValueError(f"{arch.architecture} checkpoints quantized with "
                         f"{quant.get('quant_method', quant)!r} are not supported (DeepSeek's "
                         "fp8 block format included): serve a bf16 conversion of the checkpoint")
    num_experts = (hf_config.get("n_routed_experts") or hf_config.get("num_local_experts")
                   or hf_config.get("num_experts") or 0)
    first_dense = hf_config.get("first_k_dense_replace") or 0
    freq = hf_config.get("moe_layer_freq") or 1
    moe = None
    if num_experts:
        dense = tuple(i for i in range(arch.num_hidden_layers)
                      if i < first_dense or i % freq != 0)
        moe = MoEConfig(num_experts=num_experts,
                        num_experts_per_tok=hf_config["num_experts_per_tok"],
                        intermediate_size=hf_config["moe_intermediate_size"],
                        norm_topk_prob=bool(hf_config.get("norm_topk_prob", False)),
                        dense_mlp_layers=dense)
    return dataclasses.replace(
        arch, num_key_value_heads=arch.num_attention_heads,
        head_dim=hf_config["qk_nope_head_dim"] + hf_config["qk_rope_head_dim"],
        kv_latent_dim=hf_config["kv_lora_rank"] + hf_config["qk_rope_head_dim"], moe=moe)


ARCHITECTURES = (
    ModelArchitecture("DeepseekV2ForCausalLM", DeepseekV2ForCausalLM,
                      update_arch_config=deepseek_arch_config, settings=DeepseekSettings,
                      refuse_quantization=NOT_QUANTIZABLE),
    ModelArchitecture("DeepseekV3ForCausalLM", DeepseekV3ForCausalLM,
                      update_arch_config=deepseek_arch_config, settings=DeepseekSettings,
                      refuse_quantization=NOT_QUANTIZABLE, enable_mtp=with_mtp_drafts),
)
