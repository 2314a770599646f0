"""LLaVA (`LlavaForConditionalGeneration`): a CLIP or SigLIP vision tower, a two-layer
projector, and the Llama text model.

    image -> vision tower -> hidden_states[vision_feature_layer(s)]
          -> "default" strategy: drop the tower's first position (CLIP's CLS)
          -> concat over the feature layers -> linear_1 -> act -> linear_2
          -> one row per <image> placeholder position of the prompt

The text model is `LlamaForCausalLM` unchanged (its decoder stack is `self.model`, so
the worker's paged attention, CUDA graphs and logits path see a Llama); images enter
only through `inputs_embeds`: the model runner scatters `embed_multimodal`'s rows over
the text embeddings at the placeholder positions (`pagoda.worker.mm_inputs`).

Two checkpoint layouts load: current transformers' names (`model.vision_tower.*`,
`model.multi_modal_projector.*`, `model.language_model.*`, `lm_head.*`) and the hub's
older llava-hf names (`vision_tower.[vision_model.]*`, `multi_modal_projector.*`,
`language_model.model.*`, `language_model.lm_head.*`). Every tensor is consumed or
named as ignored (`VisionTower.tower_name`); anything else is an error.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from pagoda.config import ModelArchConfig
from pagoda.distributed.parallel_state import ParallelContext
from pagoda.model.arch_spec import ModelArchitecture, family_settings
from pagoda.model.architectures.llama import LlamaForCausalLM
from pagoda.model.multimodal_lm import MultiModalLM, single_device_only
from pagoda.model.vision_tower import VisionTower, VisionTowerSettings, activation

# The text models LLaVA checkpoints pair with that Pagoda verifies (Vicuna/Llama).
_TEXT_MODEL_TYPES = ("llama",)


@dataclass(frozen=True)
class LlavaSettings:
    """config.json's multi-modal fields, as plain values."""

    vision: VisionTowerSettings = field(default_factory=VisionTowerSettings)
    feature_layers: tuple[int, ...] = (-2,)
    select_strategy: str = "default"
    projector_hidden_act: str = "gelu"
    projector_bias: bool = True
    image_token_id: int = 32000

    @property
    def max_tokens_per_mm_item(self) -> int:
        """Placeholder run of one image (fixed size after the processor's resize/crop)."""
        side = self.vision.image_size // self.vision.patch_size
        n = side * side + int(self.vision.has_cls)
        return n - 1 if self.select_strategy == "default" else n

    @classmethod
    def from_hf_config(cls, hf_config: dict, arch: ModelArchConfig) -> "LlavaSettings":
        text_type = (hf_config.get("text_config") or {}).get("model_type", "llama")
        if text_type not in _TEXT_MODEL_TYPES:
            raise ValueError(f"LlavaForConditionalGeneration with a {text_type!r} text model "
                             f"is not supported; supported: {', '.join(_TEXT_MODEL_TYPES)}")
        layers = hf_config.get("vision_feature_layer", -2)
        strategy = hf_config.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {strategy!r} is not supported "
                             "(expected 'default' or 'full')")
        act = hf_config.get("projector_hidden_act", "gelu")
        activation(act)
        return cls(VisionTowerSettings.from_hf(hf_config.get("vision_config") or {}),
                   tuple(layers) if isinstance(layers, list) else (int(layers),), strategy,
                   act, bool(hf_config.get("multimodal_projector_bias", True)),
                   int(hf_config.get("image_token_index", hf_config.get("image_token_id", 32000))))


class LlavaProjector(nn.Module):
    """linear_1 -> act -> linear_2 (transformers' `LlavaMultiModalProjector`)."""

    def __init__(self, in_features: int, hidden: int, act: str, bias: bool,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_features, hidden, bias=bias, dtype=dtype)
        self.linear_2 = nn.Linear(hidden, hidden, bias=bias, dtype=dtype)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(MultiModalLM, LlamaForCausalLM):
    """Llama text model + vision tower + projector.

    Invariant: `embed_multimodal` returns, per item, exactly as many rows as the item's
    placeholder run (`pagoda.multimodal.llava_processing`); `forward` with
    `inputs_embeds` runs the Llama stack on them instead of looking up `input_ids`.
    Single device only (tensor/pipeline parallel groups are refused: the tower is not
    split, and the worker group's wire does not carry the image tensors).
    """


    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype,
                 parallel: ParallelContext | None = None) -> None:
        parallel = single_device_only(arch, parallel)
        super().__init__(arch, dtype, parallel)
        s = family_settings(arch, LlavaSettings)
        self.settings = s
        self.vision_tower = VisionTower(s.vision, s.feature_layers, dtype)
        self.multi_modal_projector = LlavaProjector(
            s.vision.hidden_size * len(s.feature_layers), arch.hidden_size,
            s.projector_hidden_act, s.projector_bias, dtype)


    def embed_multimodal(self, items: list[Mapping[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each item's encoder output [rows, hidden]: `image_embeds` as given, or the
        tower + projector over `pixel_values` [3, H, W] (items of one size run batched)."""
        out: list[torch.Tensor | None] = [None] * len(items)
        by_shape: dict[tuple, list[int]] = {}
        for i, data in enumerate(items):
            if "image_embeds" in data:
                out[i] = data["image_embeds"].to(self.dtype)
            else:
                by_shape.setdefault(tuple(data["pixel_values"].shape), []).append(i)
        device = self.multi_modal_projector.linear_1.weight.device
        for indices in by_shape.values():
            pixels = torch.stack([items[i]["pixel_values"] for i in indices]).to(device)
            for i, rows in zip(indices, self._encode_images(pixels)):
                out[i] = rows
        return out

    def _encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        states = self.vision_tower(pixels.to(self.dtype))
        if self.settings.select_strategy == "default":
            states = [s[:, 1:] for s in states]
        return self.multi_modal_projector(torch.cat(states, dim=-1))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Either layout's names -> ours; the tower's unread tensors are skipped by name
        (`VisionTower.tower_name`); the rest is Llama's loader (unknown or missing
        names raise there)."""
        def renamed():
            for name, tensor in weights:
                part, rest = _route(name)
                if part == "vision_tower":
                    ours = self.vision_tower.tower_name(rest)
                    if ours is not None:
                        yield f"vision_tower.{ours}", tensor
                else:
                    yield rest, tensor

        super().load_weights(renamed())


def _route(name: str) -> tuple[str, str]:
    """A checkpoint name (either layout) -> (part, our name): the tower's name under
    `vision_tower.`, the projector's `multi_modal_projector.*`, and Llama's text names
    (`model.*`, `lm_head.*`)."""
    if name.startswith("model.") and name.split(".")[1] in (
            "vision_tower", "multi_modal_projector", "language_model"):
        name = name.removeprefix("model.")
    if name.startswith("vision_tower."):
        return "vision_tower", name.removeprefix("vision_tower.")
    if name.startswith("language_model."):
        rest = name.removeprefix("language_model.")
        return "text", rest if rest.startswith(("model.", "lm_head.")) else "model." + rest
    return "other", name


ARCHITECTURES = (
    ModelArchitecture("LlavaForConditionalGeneration", LlavaForConditionalGeneration,
                      settings=LlavaSettings, text_config_key="text_config",
                      refuse_quantization="the vision tower and projector load unquantized "
                                          "weights only"),
)
