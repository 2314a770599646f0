"""The ViT vision towers of LLaVA-style models: CLIP's and SigLIP's (transformers'
`CLIPVisionTransformer`, `SiglipVisionTransformer`), run up to the deepest layer the
model reads.

    pixels [N, 3, H, W] -> patches (conv, stride = patch) [N, P, D]
      CLIP:   [CLS] + patches + positions, then `pre_layrnorm`
      SigLIP: patches + positions (no CLS, no pre-norm)
    -> encoder layers (pre-norm attention + MLP, bidirectional over the image)
    hidden_states[0] = embeddings, hidden_states[i] = after layer i (HF's indexing)

Invariant: `forward` returns the hidden states of `feature_layers` (HF indices, negative
ones counted from the end as HF does), each [N, seq, D], in that order; the tower holds
only the layers up to the deepest of them, and `tower_name` names every other tower
tensor as ignored (the later layers, `post_layernorm`, SigLIP's pooling `head`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

TOWER_TYPES = ("clip_vision_model", "siglip_vision_model")
_ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


def activation(name: str):
    """The activation transformers calls `name`; ValueError for one not implemented."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; supported: "
                         f"{', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


@dataclass(frozen=True)
class VisionTowerSettings:
    """A tower's config.json `vision_config`, as plain values (pickled to every rank)."""

    model_type: str = "clip_vision_model"
    hidden_size: int = 1024
    intermediate_size: int = 4096
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    image_size: int = 336
    patch_size: int = 14
    num_channels: int = 3
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"

    @classmethod
    def from_hf(cls, vision: dict) -> "VisionTowerSettings":
        model_type = vision.get("model_type", "clip_vision_model")
        if model_type not in TOWER_TYPES:
            raise ValueError(f"vision tower {model_type!r} is not supported; supported: "
                             f"{', '.join(TOWER_TYPES)}")
        clip = model_type == "clip_vision_model"
        defaults = cls() if clip else cls(model_type, 768, 3072, 12, 12, 224, 16, 3, 1e-6,
                                          "gelu_pytorch_tanh")
        values = {f: vision.get(f, getattr(defaults, f)) for f in cls.__dataclass_fields__}
        values["model_type"] = model_type
        activation(values["hidden_act"])
        return cls(**values)

    @property
    def has_cls(self) -> bool:
        return self.model_type == "clip_vision_model"

    def layer_index(self, feature_layer: int) -> int:
        """HF's hidden_states index (negative: from the end) -> 0..num_hidden_layers."""
        index = feature_layer if feature_layer >= 0 else self.num_hidden_layers + 1 + feature_layer
        if not 0 <= index <= self.num_hidden_layers:
            raise ValueError(f"vision_feature_layer {feature_layer} is outside the tower's "
                             f"{self.num_hidden_layers} layers")
        return index


class _Attention(nn.Module):
    def __init__(self, s: VisionTowerSettings, dtype: torch.dtype) -> None:
        super().__init__()
        d = s.hidden_size
        self.num_heads = s.num_attention_heads
        self.head_dim = d // self.num_heads
        # q/k/v, not q_proj/...: the text model's loader fuses names with `.q_proj.`
        # (`packed_modules_mapping`); `tower_name` maps the checkpoint's names here.
        self.q, self.k, self.v, self.out_proj = (nn.Linear(d, d, dtype=dtype) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape

        def heads(proj: nn.Linear) -> torch.Tensor:
            return proj(x).view(n, t, self.num_heads, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q), heads(self.k), heads(self.v),
                                             scale=self.head_dim ** -0.5)
        return self.out_proj(out.transpose(1, 2).reshape(n, t, d))


class _MLP(nn.Module):
    def __init__(self, s: VisionTowerSettings, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc1 = nn.Linear(s.hidden_size, s.intermediate_size, dtype=dtype)
        self.fc2 = nn.Linear(s.intermediate_size, s.hidden_size, dtype=dtype)
        self.act = activation(s.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _EncoderLayer(nn.Module):
    def __init__(self, s: VisionTowerSettings, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(s.hidden_size, s.layer_norm_eps, dtype=dtype)
        self.self_attn = _Attention(s, dtype)
        self.layer_norm2 = nn.LayerNorm(s.hidden_size, s.layer_norm_eps, dtype=dtype)
        self.mlp = _MLP(s, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


# SigLIP's encoder layer, for towers that share it (Idefics3's vision transformer).
VisionEncoderLayer = _EncoderLayer


class _Embeddings(nn.Module):
    def __init__(self, s: VisionTowerSettings, dtype: torch.dtype) -> None:
        super().__init__()
        self.has_cls = s.has_cls
        num_patches = (s.image_size // s.patch_size) ** 2
        self.patch_embedding = nn.Conv2d(s.num_channels, s.hidden_size, s.patch_size,
                                         stride=s.patch_size, bias=not s.has_cls, dtype=dtype)
        if s.has_cls:
            self.class_embedding = nn.Parameter(torch.empty(s.hidden_size, dtype=dtype))
        self.position_embedding = nn.Embedding(num_patches + int(s.has_cls), s.hidden_size,
                                               dtype=dtype)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype))
        x = patches.flatten(2).transpose(1, 2)
        if self.has_cls:
            cls = self.class_embedding.expand(x.shape[0], 1, -1)
            x = torch.cat([cls, x], dim=1)
        if x.shape[1] != self.position_embedding.num_embeddings:
            raise ValueError(f"image gives {x.shape[1]} positions; the tower has "
                             f"{self.position_embedding.num_embeddings} (wrong image size)")
        return x + self.position_embedding.weight


class VisionTower(nn.Module):
    """A CLIP or SigLIP vision transformer, held up to its deepest read layer."""

    def __init__(self, s: VisionTowerSettings, feature_layers: Sequence[int],
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.settings = s
        self.feature_indices = [s.layer_index(i) for i in feature_layers]
        self.num_layers = max(self.feature_indices)
        self.embeddings = _Embeddings(s, dtype)
        if s.has_cls:  # CLIP's spelling
            self.pre_layrnorm = nn.LayerNorm(s.hidden_size, s.layer_norm_eps, dtype=dtype)
        self.layers = nn.ModuleList(_EncoderLayer(s, dtype) for _ in range(self.num_layers))

    def forward(self, pixels: torch.Tensor) -> list[torch.Tensor]:
        x = self.embeddings(pixels)
        if self.settings.has_cls:
            x = self.pre_layrnorm(x)
        states = [x]
        for layer in self.layers:
            x = layer(x)
            states.append(x)
        return [states[i] for i in self.feature_indices]

    def tower_name(self, name: str) -> str | None:
        """A checkpoint name under the tower (prefix stripped) -> our parameter name, or
        None for a tensor the tower does not read (a later layer, post_layernorm, head)."""
        name = name.removeprefix("vision_model.")
        if name.startswith("encoder.layers."):
            index = int(name.split(".")[2])
            if index >= self.num_layers:
                return None
            for proj in ("q", "k", "v"):
                name = name.replace(f".self_attn.{proj}_proj.", f".self_attn.{proj}.")
            return name.removeprefix("encoder.")
        if name.startswith(("post_layernorm.", "head.")) or name.endswith("position_ids"):
            return None
        return name
