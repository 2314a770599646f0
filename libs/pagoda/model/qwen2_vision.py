"""Qwen2-VL's vision transformer (transformers' `Qwen2VisionTransformerPretrainedModel`):
dynamic resolution, 2-D rotary positions, 2x2 patch merging; and Qwen2.5-VL's variant
(`Qwen2_5_VisionTransformerPretrainedModel`): RMSNorm, a gated SiLU MLP, and window
attention (patches regrouped into `window_size`-pixel windows, attention within each
window except in the `fullatt_block_indexes` blocks, the merger's rows put back in order).

    pixel_values [patches, C * T * P * P] (the processor's order: each 2x2 merge window's
    four patches consecutive) -> Conv3d patch embedding -> blocks (LayerNorm, attention
    within each image frame with axial (h, w) RoPE, LayerNorm, MLP)
    -> merger: LayerNorm, four neighbours concatenated, Linear-GELU-Linear
    -> [patches / 4, text hidden]: one row per <|image_pad|> placeholder

Invariant: `forward(pixels, grid_thw)` returns one tensor per image, of
t * h * w / merge**2 rows, image order kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.model.vision_tower import activation


@dataclass(frozen=True)
class Qwen2VisionSettings:
    depth: int = 32
    embed_dim: int = 1280
    hidden_size: int = 3584  # the text model's hidden size (the merger's output)
    num_heads: int = 16
    mlp_ratio: float = 4.0
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    hidden_act: str = "quick_gelu"
    rope_theta: float = 10000.0
    # Qwen2.5-VL's: RMSNorm and a gated MLP of `intermediate_size`, window attention.
    qwen2_5: bool = False
    intermediate_size: int = 0
    window_size: int = 0
    fullatt_block_indexes: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, vision: dict) -> "Qwen2VisionSettings":
        plain = ("depth", "num_heads", "mlp_ratio", "patch_size", "temporal_patch_size",
                 "spatial_merge_size", "hidden_act", "intermediate_size", "window_size")
        values = {f: vision[f] for f in plain if f in vision}
        values["in_channels"] = vision.get("in_channels", vision.get("in_chans", 3))
        rope = vision.get("rope_parameters") or {}
        values["rope_theta"] = float(rope.get("rope_theta", 10000.0))
        if (vision.get("model_type") in ("qwen2_5_vl", "qwen2_5_vl_vision")
                or "out_hidden_size" in vision):
            values.update(qwen2_5=True, embed_dim=vision.get("hidden_size", 1280),
                          hidden_size=vision.get("out_hidden_size", 3584),
                          fullatt_block_indexes=tuple(vision.get("fullatt_block_indexes", ())))
            values.setdefault("hidden_act", "silu")
        else:
            values.update(embed_dim=vision.get("embed_dim", 1280),
                          hidden_size=vision.get("hidden_size", 3584))
        activation(values.get("hidden_act", "quick_gelu"))
        return cls(**values)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class _Attention(nn.Module):
    def __init__(self, s: Qwen2VisionSettings, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = s.num_heads
        self.qkv = nn.Linear(s.embed_dim, 3 * s.embed_dim, dtype=dtype)
        self.proj = nn.Linear(s.embed_dim, s.embed_dim, dtype=dtype)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        # HF rotates in fp32 and casts back.
        c, s_ = cos[:, None, :].float(), sin[:, None, :].float()
        q = (q.float() * c + _rotate_half(q.float()) * s_).to(x.dtype)
        k = (k.float() * c + _rotate_half(k.float()) * s_).to(x.dtype)
        out = torch.empty_like(q)
        head_dim = q.shape[-1]
        for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]):  # each frame attends to itself
            out[a:b] = F.scaled_dot_product_attention(
                q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1),
                scale=head_dim ** -0.5).transpose(0, 1)
        return self.proj(out.reshape(n, -1))


def _norm(s: Qwen2VisionSettings, dtype: torch.dtype) -> nn.Module:
    if s.qwen2_5:
        return nn.RMSNorm(s.embed_dim, eps=1e-6, dtype=dtype)
    return nn.LayerNorm(s.embed_dim, eps=1e-6, dtype=dtype)


class _Block(nn.Module):
    def __init__(self, s: Qwen2VisionSettings, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm1, self.norm2 = _norm(s, dtype), _norm(s, dtype)
        self.attn = _Attention(s, dtype)
        self.gated = s.qwen2_5
        d = s.embed_dim
        if self.gated:  # gate/up/down: `tower_name` maps the checkpoint's *_proj names
            self.mlp = nn.ModuleDict({"gate": nn.Linear(d, s.intermediate_size, dtype=dtype),
                                      "up": nn.Linear(d, s.intermediate_size, dtype=dtype),
                                      "down": nn.Linear(s.intermediate_size, d, dtype=dtype)})
        else:
            hidden = int(d * s.mlp_ratio)
            self.mlp = nn.ModuleDict({"fc1": nn.Linear(d, hidden, dtype=dtype),
                                      "fc2": nn.Linear(hidden, d, dtype=dtype)})
        self.act = activation(s.hidden_act)

    def forward(self, x, cu_seqlens, cos, sin):
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        h = self.norm2(x)
        if self.gated:
            return x + self.mlp["down"](self.act(self.mlp["gate"](h)) * self.mlp["up"](h))
        return x + self.mlp["fc2"](self.act(self.mlp["fc1"](h)))


class _Merger(nn.Module):
    def __init__(self, s: Qwen2VisionSettings, dtype: torch.dtype) -> None:
        super().__init__()
        self.hidden = s.embed_dim * s.spatial_merge_size ** 2
        self.ln_q = _norm(s, dtype)
        self.mlp = nn.Sequential(nn.Linear(self.hidden, self.hidden, dtype=dtype), nn.GELU(),
                                 nn.Linear(self.hidden, s.hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden))


class Qwen2VisionTransformer(nn.Module):
    """Checkpoint names under `visual.`: patch_embed.proj, blocks.N.{norm1,norm2,attn.qkv,
    attn.proj,mlp.fc1,mlp.fc2}, merger.{ln_q,mlp.0,mlp.2}."""

    def __init__(self, s: Qwen2VisionSettings, dtype: torch.dtype) -> None:
        super().__init__()
        self.settings = s
        kernel = (s.temporal_patch_size, s.patch_size, s.patch_size)
        self.patch_embed = nn.ModuleDict({"proj": nn.Conv3d(
            s.in_channels, s.embed_dim, kernel, stride=kernel, bias=False, dtype=dtype)})
        self.blocks = nn.ModuleList(_Block(s, dtype) for _ in range(s.depth))
        self.merger = _Merger(s, dtype)
        spatial = (s.embed_dim // s.num_heads) // 2
        inv_freq = 1.0 / (s.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float)
                                           / spatial))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, pixels: torch.Tensor, grid_thw: list[tuple[int, int, int]]
                ) -> list[torch.Tensor]:
        s = self.settings
        proj = self.patch_embed["proj"]
        x = proj(pixels.view(-1, s.in_channels, s.temporal_patch_size, s.patch_size,
                             s.patch_size).to(proj.weight.dtype)).view(-1, s.embed_dim)
        cos, sin = self._rotary(grid_thw, x.device)
        cu = [0]
        for t, h, w in grid_thw:
            cu.extend(cu[-1] + h * w * (i + 1) for i in range(t))
        window_cu, order = cu, None
        if s.qwen2_5:
            order, window_cu = _window_index(grid_thw, s)
            x, cos, sin = (_by_merge_unit(v, order, s) for v in (x, cos, sin))
        for i, block in enumerate(self.blocks):
            full = not s.qwen2_5 or i in s.fullatt_block_indexes
            x = block(x, cu if full else window_cu, cos, sin)
        merged = self.merger(x)
        if order is not None:
            merged = merged[torch.argsort(order)]
        sizes = [t * h * w // s.spatial_merge_size ** 2 for t, h, w in grid_thw]
        return list(torch.split(merged, sizes))

    def _rotary(self, grid_thw, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Axial (h, w) angles of every patch, in the processor's merge-window order."""
        m = self.settings.spatial_merge_size
        ids = []
        for t, h, w in grid_thw:
            hpos, wpos = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            shape = (h // m, m, w // m, m)
            hw = torch.stack([hpos.reshape(shape).transpose(1, 2).flatten(),
                              wpos.reshape(shape).transpose(1, 2).flatten()], dim=-1)
            ids.append(hw.repeat(t, 1))
        ids = torch.cat(ids).to(device)
        freqs = ids[..., None].float() * self.inv_freq  # [N, 2, dim / 4]
        freqs = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        freqs = torch.cat([freqs, freqs], dim=-1)
        return freqs.cos(), freqs.sin()


    @staticmethod
    def checkpoint_name(name: str) -> str:
        """A checkpoint name under `visual.` -> ours (Qwen2.5-VL's gated MLP names would
        collide with the text model's fused gate_up_proj)."""
        for ours in ("gate", "up", "down"):
            name = name.replace(f".mlp.{ours}_proj.", f".mlp.{ours}.")
        return name


def _by_merge_unit(x: torch.Tensor, order: torch.Tensor, s: Qwen2VisionSettings) -> torch.Tensor:
    """Rows regrouped by merge unit (m*m consecutive patches) in `order`."""
    unit = s.spatial_merge_size ** 2
    return x.reshape(x.shape[0] // unit, unit, -1)[order].reshape(x.shape[0], -1)


def _window_index(grid_thw, s: Qwen2VisionSettings) -> tuple[torch.Tensor, list[int]]:
    """transformers' `get_vision_window_index`: merge units regrouped window by window,
    and the cumulative patch counts of the windows."""
    merge, unit = s.spatial_merge_size, s.spatial_merge_size ** 2
    size = s.window_size // merge // s.patch_size
    order, cu, base = [], [0], 0
    for t, h, w in grid_thw:
        gh, gw = h // merge, w // merge
        index = torch.arange(t * gh * gw).reshape(t, gh, gw)
        pad_h, pad_w = size - gh % size, size - gw % size
        nh, nw = (gh + pad_h) // size, (gw + pad_w) // size
        padded = F.pad(index, (0, pad_w, 0, pad_h), "constant", -100)
        padded = padded.reshape(t, nh, size, nw, size).permute(0, 1, 3, 2, 4).reshape(
            t, nh * nw, size, size)
        seqlens = (padded != -100).sum([2, 3]).reshape(-1)
        flat = padded.reshape(-1)
        order.append(flat[flat != -100] + base)
        for n in (seqlens.cumsum(0) * unit + cu[-1]).tolist():
            if n != cu[-1]:
                cu.append(n)
        base += t * gh * gw
    return torch.cat(order), cu
