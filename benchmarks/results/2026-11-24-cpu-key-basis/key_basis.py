# SPDX-License-Identifier: Apache-2.0
"""Shared pieces of the key-basis study: RoPE helpers, the basis calibration, the coder and a cache.

The key code (see ``key_basis_attention.py`` for the measure): x_j = R_{j - m(j)} (k_pre_j - mu), the
pre-RoPE key centred by its sequence's mean of tokens 1-15 and turned by RoPE over the distance to the
middle m(j) of its tile; y = U^T x in the eigenbasis of x's covariance (per layer and KV head, from a
calibration text); coordinates in decreasing variance get the bits of the layout (N(0, 1) Lloyd-Max
codebooks at scale g sigma_i, g = |y| / |sigma| per key); norm correction to |y|; one fp16 scale per key.
"""

from __future__ import annotations

import math

import torch

from turboquant_core.codebooks import codebook_tensors
from turboquant_core.integrations.transformers_cache import TurboQuantCache

CENTRE_TOKENS = 16  # mu from tokens 1..15, the served centring's first page
LAYOUTS = {"4/3/2": [4] * 16 + [3] * 32 + [2] * 16, "4/2": [4] * 32 + [2] * 32}


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], -1)


def rope(x, angles):
    """RoPE with pairs (i, i + d/2) by ``angles`` [T, d/2] (the model's convention)."""
    c, s = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)
    return x * c + rotate_half(x) * s


def tile_offset(pos, tile):
    """j - m(j): distance to the middle of the tile of ``tile`` positions holding j (0 when tile is 0)."""
    if not tile:
        return torch.zeros_like(pos, dtype=torch.float32)
    return pos.float() - ((pos // tile) * tile + (tile - 1) / 2)


def turned(kpre_c, inv_freq, tile):
    pos = torch.arange(kpre_c.shape[-2])
    return rope(kpre_c, tile_offset(pos, tile)[:, None] * inv_freq[None])


def basis_from(x):
    """[H, T, d] -> eigenvalues [H, d] (descending) and eigenvectors [H, d, d] of the covariance."""
    cov = torch.einsum("htd,hte->hde", x, x) / x.shape[1]
    ev, vec = torch.linalg.eigh(cov)
    return ev.flip(-1).clamp_min(1e-10), vec.flip(-1)


def code_in_basis(x, ev, vec, bits):
    """Quantize x [H, T, d] coordinate-wise in the basis vec with per-coordinate bits; returns x_hat."""
    y = x @ vec
    sig = ev.sqrt()[:, None, :]
    norm = y.norm(dim=-1, keepdim=True)
    g = (norm / sig.pow(2).sum(-1, keepdim=True).sqrt()).clamp_min(1e-12)
    z = y / (g * sig)
    out = torch.zeros_like(z)
    for b in sorted(set(bits)):
        idx = [i for i, bb in enumerate(bits) if bb == b]
        cent, bnd = codebook_tensors(b, None)
        out[..., idx] = cent[torch.bucketize(z[..., idx].contiguous(), bnd)]
    yh = out * sig
    yh = yh * (norm / yh.norm(dim=-1, keepdim=True).clamp_min(1e-12))
    return yh @ vec.transpose(-1, -2)


_ROT = {}


def served_quantizer(x, bits, seed=1):
    """Random rotation + Lloyd-Max codebook for dimension d + norm correction (the served quantizer)."""
    d = x.shape[-1]
    if d not in _ROT:
        g = torch.Generator().manual_seed(seed)
        _ROT[d] = torch.linalg.qr(torch.randn(d, d, generator=g))[0]
    r = _ROT[d]
    norm = x.norm(dim=-1, keepdim=True)
    t = x @ r.T * math.sqrt(d) / norm.clamp_min(1e-12)
    cent, bnd = codebook_tensors(bits, d)
    c = cent[torch.bucketize(t.contiguous(), bnd)]
    return (c * norm / c.norm(dim=-1, keepdim=True)) @ r


def capture(model, ids, d, nq, nkv):
    """Pre-RoPE q and k per layer: {layer: (q [Hq, T, d], k [Hkv, T, d])}."""
    cap, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        for name, n in (("q", nq), ("k", nkv)):
            proj = getattr(layer.self_attn, f"{name}_proj")
            hooks.append(proj.register_forward_hook(
                lambda m, a, o, i=i, name=name, n=n: cap.__setitem__(
                    (i, name), o[0].float().view(o.shape[1], n, d).transpose(0, 1))))
    model(ids)
    for h in hooks:
        h.remove()
    return {i: (cap[(i, "q")], cap[(i, "k")]) for i in range(len(model.model.layers))}



class KeyBasis:
    """Per layer: eigenvalues [H, d] and eigenvectors [H, d, d] of the turned, centred pre-RoPE keys."""

    def __init__(self, inv_freq, tile: int, layout: str):
        self.inv_freq, self.tile, self.bits = inv_freq, tile, LAYOUTS[layout]
        self._cov, self._count, self.tables = {}, {}, {}

    def add(self, layer: int, k_pre):
        """Accumulate one sequence's pre-RoPE keys [H, T, d] (positions 0..T-1)."""
        x = turned(k_pre - k_pre[:, 1:CENTRE_TOKENS].mean(1, keepdim=True), self.inv_freq, self.tile)
        x = x[:, CENTRE_TOKENS:]
        self._cov[layer] = self._cov.get(layer, 0) + torch.einsum("htd,hte->hde", x, x)
        self._count[layer] = self._count.get(layer, 0) + x.shape[1]

    def finish(self):
        for layer, cov in self._cov.items():
            ev, vec = torch.linalg.eigh(cov / self._count[layer])
            self.tables[layer] = (ev.flip(-1).clamp_min(1e-10), vec.flip(-1))

    def code(self, layer: int, kpre_c, pos):
        """Encode-decode centred pre-RoPE keys [H, T, d] at absolute positions ``pos`` [T]."""
        ev, vec = self.tables[layer]
        turn = tile_offset(pos, self.tile)[:, None] * self.inv_freq[None]
        xh = code_in_basis(rope(kpre_c, turn), ev, vec, self.bits)
        return rope(xh, -turn)


class KeyBasisCache(TurboQuantCache):
    """``TurboQuantCache`` (served values, served first page of keys) whose keys past the first page are
    read back from the key-basis code instead. ``fresh``: the current call's tokens are returned exact
    (a prompt attends to itself in full precision, as served); set it False for decode steps."""

    def __init__(self, *args, basis: KeyBasis, fresh: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.basis, self.fresh, self.coded, self.mu = basis, fresh, {}, {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        start = self.coded[layer_idx].shape[-2] if layer_idx in self.coded else 0
        n_new = key_states.shape[-2]
        pos = torch.arange(start, start + n_new)
        ang = pos.float()[:, None] * self.basis.inv_freq[None]
        k_pre = rope(key_states[0].float(), -ang)
        if layer_idx not in self.mu:
            if start != 0 or n_new < CENTRE_TOKENS:
                raise ValueError("the first call must hold the first page")
            self.mu[layer_idx] = k_pre[:, 1:CENTRE_TOKENS].mean(1, keepdim=True)
        mu = self.mu[layer_idx]
        rec = rope(self.basis.code(layer_idx, k_pre - mu, pos) + mu, ang)[None].to(keys.dtype)
        prev = self.coded.get(layer_idx)
        self.coded[layer_idx] = rec if prev is None else torch.cat([prev, rec], -2)
        stop = self.coded[layer_idx].shape[-2] - (n_new if self.fresh else 0)
        if stop > CENTRE_TOKENS:
            keys = keys.clone()
            keys[..., CENTRE_TOKENS:stop, :] = self.coded[layer_idx][..., CENTRE_TOKENS:stop, :]
        return keys, values


class ExactCentreCoder:
    """The control: the served quantizer (random rotation + Lloyd-Max, ``bits``) on k_j - RoPE_j(mu), the
    exact per-token centre that ``KeyBasis`` also uses (the served kernels use one centre per page)."""

    def __init__(self, inv_freq, bits: int = 3):
        self.inv_freq, self.bits = inv_freq, bits

    def code(self, layer: int, kpre_c, pos):
        ang = pos.float()[:, None] * self.inv_freq[None]
        return rope(served_quantizer(rope(kpre_c, ang), self.bits), -ang)
