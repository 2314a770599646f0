"""Idefics3 / SmolVLM (`Idefics3ForConditionalGeneration`): a SigLIP-like vision
transformer over variable patch grids, a pixel-shuffle connector, and the Llama text
model.

    one image -> frames [F, 3, S, S] (tiles row-major + the global image; processor)
      -> patch conv (stride = patch) + position embeddings bucketed onto the tower's
         (image_size / patch)^2 grid (NaViT's fractional coordinates: a frame whose
         patch grid differs from the tower's still spans all of it)
      -> encoder layers (SigLIP's: pre-norm attention + MLP, bidirectional) -> post_layernorm
      -> pixel shuffle by scale_factor (seq / s^2 rows of s^2 * D) -> proj (no bias)
      -> F * image_seq_len rows, one per `<image>` position of the item's run (its
         `is_embed` positions; the tile markers keep their text embeddings)

The text model is `LlamaForCausalLM` unchanged; images enter only through
`inputs_embeds` (`pagoda.worker.mm_inputs`), as in `llava.py`.

Checkpoint names: transformers' `model.vision_model.*`, `model.connector.*`,
`model.text_model.*`, `lm_head.*`: the only layout in use (SmolVLM's and Idefics3's hub
checkpoints were written by this class, whose module names have not changed since it
appeared in transformers 4.46; transformers keeps no key renames for it). Every tensor
is consumed; an unknown name is an error naming it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from pagoda.config import ModelArchConfig
from pagoda.distributed.parallel_state import ParallelContext
from pagoda.model.arch_spec import ModelArchitecture, family_settings
from pagoda.model.architectures.llama import LlamaForCausalLM
from pagoda.model.multimodal_lm import MultiModalLM, single_device_only
from pagoda.model.vision_tower import VisionEncoderLayer, VisionTowerSettings, activation

_TEXT_MODEL_TYPES = ("llama",)
# The processor's tile markers go up to <row_6_col_6>: at most 6 x 6 tiles + the global.
_MAX_FRAMES = 6 * 6 + 1


@dataclass(frozen=True)
class Idefics3Settings:
    """config.json's multi-modal fields, as plain values."""

    # transformers' `Idefics3VisionConfig` defaults (a config.json omits what equals them)
    vision: VisionTowerSettings = field(default_factory=lambda: VisionTowerSettings(
        "siglip_vision_model", 1152, 3072, 12, 16, 224, 32, 3, 1e-6, "gelu_pytorch_tanh"))
    scale_factor: int = 2
    image_token_id: int = 128257
    # config.json's top-level `tie_word_embeddings` (transformers ties Idefics3's LM head
    # by it, not by text_config's, which `save_pretrained` writes as True by default)
    tie_word_embeddings: bool = False

    @property
    def image_seq_len(self) -> int:
        side = self.vision.image_size // self.vision.patch_size
        return side * side // self.scale_factor ** 2

    @property
    def max_tokens_per_mm_item(self) -> int:
        """Encoder rows of the largest image (6 x 6 tiles + the global image)."""
        return _MAX_FRAMES * self.image_seq_len

    @classmethod
    def from_hf_config(cls, hf_config: dict, arch: ModelArchConfig) -> "Idefics3Settings":
        text_type = (hf_config.get("text_config") or {}).get("model_type", "llama")
        if text_type not in _TEXT_MODEL_TYPES:
            raise ValueError(f"Idefics3ForConditionalGeneration with a {text_type!r} text "
                             f"model is not supported; supported: {', '.join(_TEXT_MODEL_TYPES)}")
        vision = dict(hf_config.get("vision_config") or {})
        defaults = cls().vision
        values = {f: vision.get(f, getattr(defaults, f))
                  for f in VisionTowerSettings.__dataclass_fields__}
        values["model_type"] = "siglip_vision_model"  # the layer is SigLIP's
        activation(values["hidden_act"])
        s = cls(VisionTowerSettings(**values), int(hf_config.get("scale_factor", 2)),
                int(hf_config.get("image_token_id", 128257)),
                bool(hf_config.get("tie_word_embeddings", False)))
        side = s.vision.image_size // s.vision.patch_size
        if side % s.scale_factor:
            raise ValueError(f"a {side}x{side} patch grid does not pixel-shuffle by "
                             f"scale_factor {s.scale_factor}")
        return s


class Idefics3VisionEmbeddings(nn.Module):
    """Patch conv + bucketed position embeddings (transformers'
    `Idefics3VisionEmbeddings` for unpadded frames: every patch is real)."""

    def __init__(self, s: VisionTowerSettings, dtype: torch.dtype) -> None:
        super().__init__()
        self.patch_size = s.patch_size
        self.side = s.image_size // s.patch_size
        self.patch_embedding = nn.Conv2d(s.num_channels, s.hidden_size, s.patch_size,
                                         stride=s.patch_size, dtype=dtype)
        self.position_embedding = nn.Embedding(self.side * self.side, s.hidden_size,
                                               dtype=dtype)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype))
        rows, cols = x.shape[2], x.shape[3]
        x = x.flatten(2).transpose(1, 2)
        return x + self.position_embedding(self._position_ids(rows, cols, x.device))

    def _position_ids(self, rows: int, cols: int, device: torch.device) -> torch.Tensor:
        """HF's fractional-coordinate bucketing, in float32 as HF computes it."""
        boundaries = torch.arange(1 / self.side, 1.0, 1 / self.side, device=device)

        def buckets(n: int) -> torch.Tensor:
            frac = torch.arange(n, device=device, dtype=torch.float32) * (1.0 / torch.tensor(
                float(n), device=device))
            return torch.bucketize(frac.clamp(max=1.0 - 1e-6), boundaries, right=True)

        return (buckets(rows)[:, None] * self.side + buckets(cols)[None, :]).reshape(-1)


class Idefics3VisionTransformer(nn.Module):
    """Embeddings -> SigLIP encoder layers -> post_layernorm (last hidden state)."""

    def __init__(self, s: VisionTowerSettings, dtype: torch.dtype) -> None:
        super().__init__()
        self.embeddings = Idefics3VisionEmbeddings(s, dtype)
        self.layers = nn.ModuleList(VisionEncoderLayer(s, dtype)
                                    for _ in range(s.num_hidden_layers))
        self.post_layernorm = nn.LayerNorm(s.hidden_size, s.layer_norm_eps, dtype=dtype)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixels)
        for layer in self.layers:
            x = layer(x)
        return self.post_layernorm(x)


class Idefics3Connector(nn.Module):
    """Pixel shuffle by `scale_factor`, then `modality_projection.proj` (no bias)."""

    def __init__(self, vision_hidden: int, text_hidden: int, scale_factor: int,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.scale_factor = scale_factor
        self.modality_projection = nn.Module()
        self.modality_projection.proj = nn.Linear(vision_hidden * scale_factor ** 2,
                                                  text_hidden, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.modality_projection.proj(pixel_shuffle(x, self.scale_factor))


def pixel_shuffle(x: torch.Tensor, s: int) -> torch.Tensor:
    """[N, side*side, D] -> [N, side*side / s^2, D * s^2] (HF's `Idefics3Connector.pixel_shuffle`:
    each output row holds an s x s block of neighbouring patches)."""
    n, seq, d = x.shape
    side = int(seq ** 0.5)
    x = x.view(n, side, side // s, d * s).permute(0, 2, 1, 3)
    x = x.reshape(n, side // s, side // s, d * s * s).permute(0, 2, 1, 3)
    return x.reshape(n, seq // (s * s), d * s * s)


class Idefics3ForConditionalGeneration(MultiModalLM, LlamaForCausalLM):
    """Llama text model + Idefics3 vision transformer + connector.

    Invariant: `embed_multimodal` returns, per item, frames x image_seq_len rows in the
    processor's frame order, which is the order of the `<image>` positions of the
    item's run (`pagoda.multimodal.idefics3_processing`). Single device only.
    """


    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype,
                 parallel: ParallelContext | None = None) -> None:
        parallel = single_device_only(arch, parallel)
        s = family_settings(arch, Idefics3Settings)
        arch = dataclasses.replace(arch, tie_word_embeddings=s.tie_word_embeddings)
        super().__init__(arch, dtype, parallel)
        self.settings = s
        self.vision_model = Idefics3VisionTransformer(s.vision, dtype)
        self.connector = Idefics3Connector(s.vision.hidden_size, arch.hidden_size,
                                           s.scale_factor, dtype)


    def embed_multimodal(self, items: list[Mapping[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each item's rows [frames * image_seq_len, hidden] from `pixel_values`
        [frames, 3, S, S]; the frames of all items of one size run as one batch."""
        device = self.connector.modality_projection.proj.weight.device
        frames = [data["pixel_values"] for data in items]
        out: list[torch.Tensor | None] = [None] * len(items)
        by_shape: dict[tuple, list[int]] = {}
        for i, f in enumerate(frames):
            by_shape.setdefault(tuple(f.shape[1:]), []).append(i)
        for indices in by_shape.values():
            pixels = torch.cat([frames[i] for i in indices]).to(device, self.dtype)
            rows = self.connector(self.vision_model(pixels))
            for i, chunk in zip(indices, rows.split([frames[i].shape[0] for i in indices])):
                out[i] = chunk.reshape(-1, chunk.shape[-1])
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Checkpoint names -> ours (the text model's become Llama's `model.*`); the
        rest is Llama's loader, which raises on an unknown or missing name. A
        `position_ids` buffer (older saves) is not a weight and is skipped."""
        super().load_weights((_rename(name), tensor) for name, tensor in weights
                             if not name.endswith("embeddings.position_ids"))


def _rename(name: str) -> str:
    """A checkpoint name -> ours. Only transformers' names are ours to read; any other
    keeps its name under `checkpoint.` so the loader refuses it by that name."""
    if name.startswith("model.text_model."):
        return "model." + name.removeprefix("model.text_model.")
    if name.startswith("model.vision_model.encoder.layers."):
        name = name.replace("model.vision_model.encoder.layers.", "vision_model.layers.", 1)
        for proj in ("q", "k", "v"):
            name = name.replace(f".self_attn.{proj}_proj.", f".self_attn.{proj}.")
        return name
    if name.startswith(("model.vision_model.", "model.connector.")):
        return name.removeprefix("model.")
    if name.startswith("lm_head."):
        return name
    return "checkpoint." + name


ARCHITECTURES = (
    ModelArchitecture("Idefics3ForConditionalGeneration", Idefics3ForConditionalGeneration,
                      settings=Idefics3Settings, text_config_key="text_config",
                      refuse_quantization="the vision model and connector load unquantized "
                                          "weights only"),
)
