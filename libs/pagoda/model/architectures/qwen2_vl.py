"""Qwen2-VL (`Qwen2VLForConditionalGeneration`) and Qwen2.5-VL
(`Qwen2_5_VLForConditionalGeneration`, whose vision transformer adds RMSNorm, a gated
MLP and window attention): dynamic-resolution images through
`qwen2_vision.Qwen2VisionTransformer`, and Qwen2's text model with M-RoPE.

M-RoPE: every position is three numbers (temporal, height, width). Text tokens carry
three equal ones; an image's placeholder rows carry (start, start + row, start + col)
over its merged grid, and the text after it continues at start + max(h, w) / merge.
The rotary half-dimension is split by `mrope_section` ([16, 24, 24] in the 7B), each
section rotating by one of the three. A generated token at sequence position p has
p + delta in all three, delta = (largest prompt position + 1) - prompt length
(transformers' `get_rope_index`). The model runner asks `mrope_positions` for each
request once and passes [3, T] positions (`pagoda.worker.mm_inputs`).

Checkpoint layouts: the hub's (`model.layers.*`, `model.embed_tokens`, `visual.*`,
`lm_head`) and current transformers' module names (`model.language_model.*`,
`model.visual.*`, `lm_head`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from pagoda.config import ModelArchConfig
from pagoda.distributed.parallel_state import ParallelContext
from pagoda.model.arch_spec import ModelArchitecture, family_settings
from pagoda.model.architectures.qwen2 import Qwen2ForCausalLM, qwen2_arch_config
from pagoda.model.multimodal_lm import MultiModalLM, single_device_only
from pagoda.model.qwen2_vision import Qwen2VisionSettings, Qwen2VisionTransformer
from pagoda.model.rotary import RotaryEmbedding


@dataclass(frozen=True)
class Qwen2VLSettings:
    vision: Qwen2VisionSettings = field(default_factory=Qwen2VisionSettings)
    mrope_section: tuple[int, ...] = (16, 24, 24)
    image_token_id: int = 151655

    @property
    def max_tokens_per_mm_item(self) -> int:
        return 0  # dynamic resolution: the processor's max_pixels decides (multimodal_args)

    @classmethod
    def from_hf_config(cls, hf_config: dict, arch: ModelArchConfig) -> "Qwen2VLSettings":
        text = hf_config.get("text_config") or hf_config
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        section = rope.get("mrope_section")
        if not section:
            raise ValueError("Qwen2VLForConditionalGeneration needs rope mrope_section")
        if sum(section) * 2 != arch.head_dim:
            raise ValueError(f"mrope_section {section} does not cover head_dim {arch.head_dim}")
        return cls(Qwen2VisionSettings.from_hf(hf_config.get("vision_config") or {}),
                   tuple(section), int(hf_config.get("image_token_id", 151655)))


class MRotaryEmbedding(RotaryEmbedding):
    """positions [T] (text: all three equal) or [3, T] -> (cos, signed_sin) [T, head_dim],
    each rotary section taking its angles from one of the three positions."""

    def __init__(self, arch: ModelArchConfig, section: Sequence[int]) -> None:
        super().__init__(arch.head_dim, arch.rope_theta, None, arch.max_position_embeddings)
        self.section = list(section)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        if positions.dim() == 1:
            positions = positions.expand(3, -1)
        freqs = positions[..., None].float() * self.inv_freq  # [3, T, half]
        cos, sin = freqs.cos(), freqs.sin()
        cos = torch.cat([m[i % 3] for i, m in enumerate(cos.split(self.section, dim=-1))], -1)
        sin = torch.cat([m[i % 3] for i, m in enumerate(sin.split(self.section, dim=-1))], -1)
        cos, sin = cos.to(dtype), sin.to(dtype)
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


class Qwen2VLForConditionalGeneration(MultiModalLM, Qwen2ForCausalLM):
    """Qwen2 text model + vision transformer; single device only (TP/PP refused)."""

    uses_mrope = True

    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype,
                 parallel: ParallelContext | None = None) -> None:
        parallel = single_device_only(arch, parallel)
        self.settings = family_settings(arch, Qwen2VLSettings)
        super().__init__(arch, dtype, parallel)
        self.visual = Qwen2VisionTransformer(self.settings.vision, dtype)

    def make_rotary_embeddings(self):
        return MRotaryEmbedding(self.arch, self.settings.mrope_section), None

    def embed_multimodal(self, items: list[Mapping[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each item's rows: `image_embeds` as given (vLLM's embedding input), or the
        vision transformer over the `pixel_values` items, run as one batch."""
        device = self.model.embed_tokens.weight.device
        out: list[torch.Tensor | None] = [None] * len(items)
        encode = [i for i, d in enumerate(items) if "image_embeds" not in d]
        for i, d in enumerate(items):
            if "image_embeds" in d:
                out[i] = d["image_embeds"].to(device, self.dtype)
        if encode:
            pixels = torch.cat([items[i]["pixel_values"] for i in encode]).to(device, self.dtype)
            grids = [tuple(int(v) for v in items[i]["image_grid_thw"]) for i in encode]
            for i, rows in zip(encode, self.visual(pixels, grids)):
                out[i] = rows
        return out

    def mrope_positions(self, prompt_token_ids: Sequence[int], features) -> tuple[torch.Tensor,
                                                                                   int]:
        """([3, prompt length] positions, delta for the generated tokens after them)."""
        merge = self.settings.vision.spatial_merge_size
        parts, cur, i = [], 0, 0
        for f in features:
            n = f.offset - i
            parts.append(torch.arange(n).expand(3, -1) + cur)
            cur += n
            t, h, w = (int(v) for v in f.data["image_grid_thw"])
            gt, gh, gw = torch.meshgrid(torch.arange(t), torch.arange(h // merge),
                                        torch.arange(w // merge), indexing="ij")
            parts.append(torch.stack([gt, gh, gw]).reshape(3, -1) + cur)
            cur += max(h, w) // merge
            i = f.end
        parts.append(torch.arange(len(prompt_token_ids) - i).expand(3, -1) + cur)
        table = torch.cat(parts, dim=1)
        return table, int(table.max()) + 1 - len(prompt_token_ids)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def renamed():
            for name, tensor in weights:
                if name.startswith("model.visual."):
                    name = name.removeprefix("model.")
                elif name.startswith("model.language_model."):
                    name = "model." + name.removeprefix("model.language_model.")
                if name.startswith("visual."):
                    name = Qwen2VisionTransformer.checkpoint_name(name)
                yield name, tensor

        super().load_weights(renamed())


ARCHITECTURES = (
    ModelArchitecture("Qwen2VLForConditionalGeneration", Qwen2VLForConditionalGeneration,
                      update_arch_config=qwen2_arch_config, settings=Qwen2VLSettings,
                      text_config_key="text_config",
                      refuse_quantization="the vision transformer loads unquantized weights "
                                          "only"),
    ModelArchitecture("Qwen2_5_VLForConditionalGeneration", Qwen2VLForConditionalGeneration,
                      update_arch_config=qwen2_arch_config, settings=Qwen2VLSettings,
                      text_config_key="text_config",
                      refuse_quantization="the vision transformer loads unquantized weights "
                                          "only"),
)
