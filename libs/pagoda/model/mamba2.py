"""The Mamba2 mixer of hybrid models, in pure torch, over a per-request state pool.

transformers' `GraniteMoeHybridMambaLayer` torch path is the reference: in_proj splits
into (gate, xBC, dt); xBC runs a causal depthwise conv + SiLU, then the selective scan
(chunked SSD for a prefill or prefill chunk, the one-step recurrence for a decode), a
gated grouped RMSNorm, out_proj. HF's numerics are kept: the scan in float32, dt
clamped to `time_step_limit` in the chunked form only (HF's recurrence does not).

State (`kv_cache.recurrent_state_shapes`): the layer's "KV cache" pair is its pool,
conv states `[slots, conv_dim, conv_kernel - 1]` (the last conv inputs of the request)
and SSM states `[slots, heads, head_dim, state_size]` (float32); request i of the step
uses slot `md.state_slots[i]`. Invariant: a slot holds the state after exactly the
request's computed tokens (the model runner zeroes it when the request starts at
token 0), so every token of a sequence passes through each Mamba layer exactly once
and in order. Tensor parallelism is not implemented (the family refuses TP > 1).

Prefix caching (`pagoda.core.state_checkpoints`): `md.state_saves[i]` = (n, at) splits
request i's tokens after the first n (a chunk boundary like any other) and copies its
state there into pool index `at`, a checkpoint slot a later prefix hit is restored from.

Speculative decoding: a request verifying d drafts feeds its last known token and the
d drafts; `md.state_checkpoints[i]` (d + 1) asks for the state after each of those
tokens, computed one token at a time with the decode recurrence (as plain decoding
would). The slot is left holding the state after all of them; `keep_checkpoint`, called
by the model runner once the drafts are verified, puts back the state after the last
accepted token, so a rejected draft leaves no trace in the recurrent state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.config import MambaConfig
from pagoda.model.attention_metadata import AttentionMetadata


class GatedRMSNorm(nn.Module):
    """RMSNorm of `x * silu(gate)` per group of `group_size` channels (HF's
    `RMSNormGated`, norm after gating), in float32."""

    def __init__(self, size: int, group_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.group_size, self.eps = group_size, eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float() * F.silu(gate.float())
        groups = x.view(*x.shape[:-1], -1, self.group_size)
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * groups.view(x.shape).to(dtype)


class Mamba2Mixer(nn.Module):
    """One Mamba2 block (HF names: in_proj, conv1d, dt_bias, A_log, D, norm, out_proj)."""

    def __init__(self, hidden_size: int, m: MambaConfig, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.m = m
        inner = m.intermediate_size
        self.in_proj = nn.Linear(hidden_size, inner + m.conv_dim + m.num_heads, bias=m.proj_bias,
                                 dtype=dtype)
        self.conv1d = nn.Conv1d(m.conv_dim, m.conv_dim, m.conv_kernel, groups=m.conv_dim,
                                bias=m.conv_bias, dtype=dtype)
        self.dt_bias = nn.Parameter(torch.empty(m.num_heads, dtype=dtype))
        self.A_log = nn.Parameter(torch.empty(m.num_heads, dtype=dtype))
        self.D = nn.Parameter(torch.empty(m.num_heads, dtype=dtype))
        self.norm = GatedRMSNorm(inner, inner // m.n_groups, eps, dtype)
        self.out_proj = nn.Linear(inner, hidden_size, bias=m.proj_bias, dtype=dtype)
        # slot -> (conv pool, ssm pool, conv states, ssm states after each checkpointed
        # token) of this step's draft-verifying requests, until `keep_checkpoint`.
        self.checkpoints: dict[int, tuple] = {}

    def forward(self, hidden: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor],
                md: AttentionMetadata) -> torch.Tensor:
        """hidden [T, hidden] (requests flattened as in `md`) -> [T, hidden]; advances
        each request's slot of `state` past its tokens of this step."""
        m = self.m
        projected = self.in_proj(hidden)
        gate, xbc, dt = projected.split([m.intermediate_size, m.conv_dim, m.num_heads], dim=-1)
        conv_states, ssm_states = state
        qsl, slots = md.query_start_loc_cpu, md.state_slots
        out = torch.empty(hidden.shape[0], m.intermediate_size, dtype=hidden.dtype,
                          device=hidden.device)
        self.checkpoints.clear()
        wanted = md.state_checkpoints or [0] * len(slots)
        saves = md.state_saves or [None] * len(slots)
        for i, slot in enumerate(slots):
            a, b = qsl[i], qsl[i + 1]
            if wanted[i]:
                if saves[i] is not None:  # never planned: saves fall within a prefill
                    raise RuntimeError("a state checkpoint save in a draft-verifying step")
                out[a:b] = self._checkpointed(xbc[a:b], dt[a:b], state, slot, wanted[i])
                continue
            if saves[i] is not None:  # the state after the first `n` tokens, kept at `at`
                n, at = saves[i]
                x = self._conv(xbc[a:a + n], conv_states, slot)
                out[a:a + n] = self._scan(x, dt[a:a + n], ssm_states, slot)
                conv_states[at].copy_(conv_states[slot])
                ssm_states[at].copy_(ssm_states[slot])
                a += n
                if a == b:
                    continue
            x = self._conv(xbc[a:b], conv_states, slot)
            out[a:b] = self._scan(x, dt[a:b], ssm_states, slot)
        return self.out_proj(self.norm(out, gate))

    def _checkpointed(self, xbc: torch.Tensor, dt: torch.Tensor,
                      state: tuple[torch.Tensor, torch.Tensor], slot: int,
                      num_checkpoints: int) -> torch.Tensor:
        """One request's tokens a token at a time (the decode path), remembering the
        (conv, SSM) state after each of the last `num_checkpoints`."""
        conv_states, ssm_states = state
        conv_snaps, ssm_snaps, ys = [], [], []
        for t in range(xbc.shape[0]):
            x = self._conv(xbc[t:t + 1], conv_states, slot)
            ys.append(self._scan(x, dt[t:t + 1], ssm_states, slot))
            if t >= xbc.shape[0] - num_checkpoints:
                conv_snaps.append(conv_states[slot].clone())
                ssm_snaps.append(ssm_states[slot].clone())
        self.checkpoints[slot] = (conv_states, ssm_states, conv_snaps, ssm_snaps)
        return torch.cat(ys)

    def keep_checkpoint(self, slot: int, index: int) -> None:
        """Set `slot` to its state after checkpointed token `index` of this step (the
        last known token is 0, draft j is j)."""
        conv_states, ssm_states, conv_snaps, ssm_snaps = self.checkpoints.pop(slot)
        conv_states[slot] = conv_snaps[index]
        ssm_states[slot] = ssm_snaps[index]

    def _conv(self, xbc: torch.Tensor, conv_states: torch.Tensor, slot: int) -> torch.Tensor:
        """Causal depthwise conv of one request's tokens [L, conv_dim], preceded by its
        last conv_kernel - 1 inputs (zeros at the start); keeps the new last inputs."""
        length, keep = xbc.shape[0], self.m.conv_kernel - 1
        full = torch.cat([conv_states[slot], xbc.t().to(conv_states.dtype)], dim=-1)
        conv_states[slot] = full[:, -keep:]
        out = F.conv1d(full.unsqueeze(0).to(self.conv1d.weight.dtype), self.conv1d.weight,
                       self.conv1d.bias, groups=self.m.conv_dim)[0, :, -length:]
        return F.silu(out).t().to(xbc.dtype)

    def _scan(self, xbc: torch.Tensor, dt: torch.Tensor, ssm_states: torch.Tensor,
              slot: int) -> torch.Tensor:
        """The selective scan of one request's conv outputs [L, conv_dim] from its SSM
        state; the final state is written back. -> y [L, intermediate]."""
        m = self.m
        length = xbc.shape[0]
        x, B, C = xbc.split([m.intermediate_size, m.n_groups * m.state_size,
                             m.n_groups * m.state_size], dim=-1)
        A = -torch.exp(self.A_log.float())
        dt = F.softplus(dt + self.dt_bias.to(dt.dtype))  # [L, H]
        x = x.reshape(length, m.num_heads, m.head_dim)
        B = B.reshape(length, m.n_groups, m.state_size)
        C = C.reshape(length, m.n_groups, m.state_size)
        if length == 1:
            y = _recurrent_step(ssm_states, slot, x[0], dt[0], A, B[0], C[0], self.D)
            return y.reshape(1, -1).to(xbc.dtype)
        dt = torch.clamp(dt, min=m.time_step_limit[0], max=m.time_step_limit[1])
        y, final = chunk_scan(x, dt, A, B, C, self.D, m.chunk_size, ssm_states[slot])
        ssm_states[slot] = final
        return y.reshape(length, -1).to(xbc.dtype)


def _recurrent_step(ssm_states: torch.Tensor, slot: int, x: torch.Tensor, dt: torch.Tensor,
                    A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                    D: torch.Tensor) -> torch.Tensor:
    """One token (HF's `selective_state_update`): x [H, P], dt [H], B/C [G, N] ->
    y [H, P]; state[slot] = state * exp(dt A) + dt B x."""
    heads, groups = x.shape[0], B.shape[0]
    B = B.repeat_interleave(heads // groups, dim=0)  # [H, N]
    C = C.repeat_interleave(heads // groups, dim=0)
    dt = dt[:, None]  # [H, 1]
    dA = torch.exp(dt.float() * A[:, None].float())  # [H, 1]
    dBx = (dt[..., None] * B[:, None, :]) * x[..., None]  # [H, P, N]
    state = ssm_states[slot] * dA[..., None] + dBx.float()
    ssm_states[slot] = state
    y = torch.einsum("hpn,hn->hp", state.to(C.dtype), C)
    return y + x * D[:, None]


def chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
               C: torch.Tensor, D: torch.Tensor, chunk_size: int,
               initial_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked SSD scan of one sequence (HF's `mamba2_chunk_scan`, batch of one):
    x [L, H, P], dt [L, H], A [H], B/C [L, G, N], initial_state [H, P, N] ->
    (y [L, H, P] float32, final state [H, P, N] float32)."""
    length, heads, _ = x.shape
    reps = heads // B.shape[1]
    x = x.float()
    B = B.float().repeat_interleave(reps, dim=1)
    C = C.float().repeat_interleave(reps, dim=1)
    pad = (chunk_size - length % chunk_size) % chunk_size
    d_residual = D.float()[:, None] * x
    x = x * dt[..., None].float()
    A = A.float() * dt.float()  # [L, H]

    def chunks(t: torch.Tensor) -> torch.Tensor:
        t = F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad))
        return t.reshape(-1, chunk_size, *t.shape[1:])

    x, A, B, C = chunks(x), chunks(A), chunks(B), chunks(C)  # [c, l, ...]
    A = A.permute(2, 0, 1)  # [H, c, l]
    A_cumsum = torch.cumsum(A, dim=-1)
    L = torch.exp(_segment_sum(A))  # [H, c, l, s]
    G = torch.einsum("clhn,cshn->clsh", C, B)
    M = G * L.permute(1, 2, 3, 0)
    y_diag = torch.einsum("clsh,cshp->clhp", M, x)
    decay_states = torch.exp(A_cumsum[:, :, -1:] - A_cumsum)  # [H, c, l]
    B_decay = B * decay_states.permute(1, 2, 0)[..., None]
    states = torch.einsum("clhn,clhp->chpn", B_decay, x)
    states = torch.cat([initial_state[None].float(), states], dim=0)  # [c+1, H, P, N]
    decay_chunk = torch.exp(_segment_sum(F.pad(A_cumsum[:, :, -1], (1, 0))))  # [H, c+1, c+1]
    new_states = torch.einsum("hzc,zhpn->chpn", decay_chunk.transpose(1, 2), states)
    states, final = new_states[:-1], new_states[-1]
    C_times_states = torch.einsum("clhn,chpn->clhp", C, states)
    y_off = C_times_states * torch.exp(A_cumsum).permute(1, 2, 0)[..., None]
    y = (y_diag + y_off).reshape(-1, heads, x.shape[-1])[:length]
    return y + d_residual, final


def _segment_sum(t: torch.Tensor) -> torch.Tensor:
    """[..., T] -> [..., T, T]: out[..., i, j] = sum(t[..., j+1 : i+1]) for j <= i, else
    -inf (HF's stable `segment_sum`)."""
    size = t.shape[-1]
    t = t[..., None].expand(*t.shape, size)
    mask = torch.tril(torch.ones(size, size, dtype=torch.bool, device=t.device), diagonal=-1)
    t = torch.cumsum(t.masked_fill(~mask, 0), dim=-2)
    mask = torch.tril(torch.ones(size, size, dtype=torch.bool, device=t.device), diagonal=0)
    return t.masked_fill(~mask, -torch.inf)
