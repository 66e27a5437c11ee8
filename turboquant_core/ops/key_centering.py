# SPDX-License-Identifier: Apache-2.0
"""Key centering anchored in the first page of a sequence: tables and plain-torch references.

Why: the keys of a head share a large component before RoPE (its pre-RoPE mean), which RoPE turns into a
position-dependent one after it. TurboQuant spends its bits on the whole key, so that component takes
most of them. Quantizing k_t - RoPE_t(mu) instead, mu estimated from the sequence's own first tokens,
cut the KL of 3-bit keys 3-4x on SmolLM2 (``benchmarks/results/eval-ppl-cpu/key-research/``).

How, with no bytes beyond the format's and exact attention:
- the first page (tokens t < P, P = the block size) is stored plain;
- mu = mean over t = 1..P-1 of RoPE_t^-1 applied to the first page's *decoded* keys (token 0, often
  an attention sink, is left out). It depends only on that page's bytes, so kernels derive it from them
  (one small launch per layer and step; where the sums are kept across steps, it skips the requests whose
  first page did not change: ``ops.kv_store``) and every sequence sharing the page (prefix caching) gets
  the same;
- a token of page p >= 1 is stored as k_t - c_p and read back as k_hat_t + c_p, with one centre per
  page: c_p = RoPE_{m_p}(rho * mu), m_p = p * P + (P - 1) / 2 the page's middle, and per RoPE pair f
  rho_f = sin(P theta_f / 2) / (P sin(theta_f / 2)), the least-squares constant over the page for a
  pair turning by theta_f per token (1 for slow pairs, which carry the mean; ~0 for fast ones, where
  a constant cannot follow). Attention adds q . c_p to the logits of page p: one dot product per
  (query, page), not per token.

Whatever the tables hold, store and attention use the same ones, so the result is the attention over
k_hat + c_p exactly; the tables only decide how much of the mean is removed. They follow the model's
RoPE (theta per pair, rotate-half or interleaved pairs, partial rotary dims).

Natural-coordinate form used by the kernels: c_i = mu_i * PC[p, i] + mup_i * PS[p, i], PC = rho cos(m_p
theta_f(i)), PS = rho sin(m_p theta_f(i)) (row 0 zero; unrotated channels PC = 1, PS = 0) and
mup_i = sgn_i mu_partner(i), sgn = -1 on the first coordinate of a pair, +1 on the second.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KeyCentering:
    """Tables of one RoPE configuration at one page size (device tensors, fp32)."""

    page: int  # tokens per page = the cache's block size
    head_dim: int
    dim_pad: int  # kernel width (head_dim padded to a power of two)
    rot_half: int  # rotated pairs: channels < 2 * rot_half are rotated
    neox: bool  # pairs (f, f + rot_half) if True, else (2f, 2f + 1)
    theta: torch.Tensor  # [rot_half] float64, radians per token of each pair (CPU)
    page_cos: torch.Tensor  # [num_pages, dim_pad]: rho cos(m_p theta) per coordinate; row 0 zero
    page_sin: torch.Tensor  # [num_pages, dim_pad]
    page_cos16: torch.Tensor  # the same in fp16: attention's tensor-core operands
    page_sin16: torch.Tensor
    pos_cos: torch.Tensor  # [page, dim_pad]: cos(t theta) per coordinate for t < page (1 if unrotated)
    pos_sin: torch.Tensor  # [page, dim_pad]

    @property
    def num_pages(self) -> int:
        return self.page_cos.shape[0]

    def describe(self) -> str:
        style = "rotate-half" if self.neox else "interleaved"
        return (f"first page of {self.page} plain, {self.rot_half} {style} RoPE pairs of {self.head_dim} dims, "
                f"{self.num_pages} pages of centres")


def _pair_index(head_dim: int, rot_half: int, neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per natural coordinate: its pair f (-1 for unrotated ones) and sgn (-1 first, +1 second, 0 unrotated)."""
    i = torch.arange(head_dim)
    if neox:
        f = torch.where(i < rot_half, i, i - rot_half)
        sgn = torch.where(i < rot_half, -1.0, 1.0)
    else:
        f, sgn = i // 2, torch.where(i % 2 == 0, -1.0, 1.0)
    rotated = i < 2 * rot_half
    return torch.where(rotated, f, -1), torch.where(rotated, sgn, 0.0)


def _partner(head_dim: int, rot_half: int, neox: bool) -> torch.Tensor:
    i = torch.arange(head_dim)
    p = (torch.where(i < rot_half, i + rot_half, i - rot_half) if neox else i ^ 1)
    return torch.where(i < 2 * rot_half, p, i)


def key_centering_tables(theta: torch.Tensor, head_dim: int, block_size: int, max_positions: int, *,
                         neox: bool = True, device="cpu") -> KeyCentering:
    """Tables for RoPE angles ``theta`` [rot_half] (radians per token of each pair) at page size
    ``block_size``, covering positions < ``max_positions`` (later positions reuse the last page's centre,
    which stays exact, only less centred)."""
    theta = torch.as_tensor(theta, dtype=torch.float64).flatten().cpu()
    h = theta.numel()
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"key centering needs a power-of-two block size >= 16, got {block_size}")
    if not 0 < 2 * h <= head_dim:
        raise ValueError(f"{h} RoPE pairs do not fit head_dim {head_dim}")
    if max_positions < 1:
        raise ValueError(f"max_positions must be >= 1, got {max_positions}")
    dim_pad = 1 << (head_dim - 1).bit_length()
    f, _ = _pair_index(head_dim, h, neox)
    rotated = f >= 0
    fi = f.clamp_min(0)
    P = block_size
    num_pages = max(math.ceil(max_positions / P), 1) + 1
    # rho -> 1 as theta -> 0 (sin(P x) / (P sin x) with x = theta / 2)
    half = theta / 2
    rho = torch.where(half.abs() < 1e-12, torch.ones_like(theta), torch.sin(P * half) / (P * torch.sin(half)))
    mid = torch.arange(num_pages, dtype=torch.float64) * P + (P - 1) / 2
    ang = mid[:, None] * theta[None, :]  # [pages, h]
    pc = torch.zeros(num_pages, dim_pad, dtype=torch.float64)
    ps = torch.zeros(num_pages, dim_pad, dtype=torch.float64)
    pc[:, :head_dim] = torch.where(rotated[None, :], (rho * torch.cos(ang))[:, fi], 1.0)
    ps[:, :head_dim] = torch.where(rotated[None, :], (rho * torch.sin(ang))[:, fi], 0.0)
    pc[0], ps[0] = 0.0, 0.0  # the first page is stored plain
    t_ang = torch.arange(P, dtype=torch.float64)[:, None] * theta[None, :]
    qc = torch.zeros(P, dim_pad, dtype=torch.float64)
    qs = torch.zeros(P, dim_pad, dtype=torch.float64)
    qc[:, :head_dim] = torch.where(rotated[None, :], torch.cos(t_ang)[:, fi], 1.0)
    qs[:, :head_dim] = torch.where(rotated[None, :], torch.sin(t_ang)[:, fi], 0.0)
    dev = torch.device(device)
    return KeyCentering(
        page=P, head_dim=head_dim, dim_pad=dim_pad, rot_half=h, neox=neox, theta=theta,
        page_cos=pc.float().to(dev), page_sin=ps.float().to(dev), page_cos16=pc.half().to(dev),
        page_sin16=ps.half().to(dev), pos_cos=qc.float().to(dev),
        pos_sin=qs.float().to(dev))


def rope_theta_from_cos_sin_cache(cos_sin_cache: torch.Tensor, *, atol: float = 1e-2) -> torch.Tensor:
    """theta [rot_half] from a vLLM-style cache [max_pos, rotary_dim] (cos | sin halves per row).

    The angles are read at position 1 and the whole cache is checked against cos(t theta), sin(t theta)
    (after dividing out a per-pair magnitude such as YaRN's mscale); raises ValueError for a cache that
    is not a plain per-pair rotation (position-dependent scaling, multimodal RoPE sections). ``atol``
    leaves room for a cache computed in fp32 (t * theta rounded: up to 2e-3 rad at 40k positions)."""
    c = cos_sin_cache.detach().double().cpu()
    if c.dim() != 2 or c.shape[1] % 2 or c.shape[0] < 2:
        raise ValueError(f"cos_sin_cache must be [max_pos >= 2, 2 * rot_half], got {tuple(c.shape)}")
    h = c.shape[1] // 2
    cos, sin = c[:, :h], c[:, h:]
    mag = torch.sqrt(cos[0] ** 2 + sin[0] ** 2)
    if (mag <= 0).any():
        raise ValueError("cos_sin_cache has a zero row 0")
    theta = torch.atan2(sin[1] / mag, cos[1] / mag)
    t = torch.arange(c.shape[0], dtype=torch.float64)[:, None]
    err = max((cos / mag - torch.cos(t * theta)).abs().max().item(),
              (sin / mag - torch.sin(t * theta)).abs().max().item())
    if err > atol:
        raise ValueError(f"cos_sin_cache is not cos/sin(t * theta) per pair (max deviation {err:.2e})")
    return theta


def center_vectors_ref(sums: torch.Tensor, centering: KeyCentering) -> tuple[torch.Tensor, torch.Tensor]:
    """sums [..., 2, dim_pad] (U, V) -> (mu, mup) [..., dim_pad] float64."""
    d = centering.head_dim
    u, v = sums[..., 0, :].double(), sums[..., 1, :].double()
    p = _partner(d, centering.rot_half, centering.neox).to(sums.device)
    _, sgn = _pair_index(d, centering.rot_half, centering.neox)
    sgn = sgn.double().to(sums.device)
    mu, mup = torch.zeros_like(u), torch.zeros_like(u)
    mu[..., :d] = u[..., :d] - sgn * v[..., p]
    mup[..., :d] = sgn * u[..., p] + v[..., :d]
    return mu, mup


def page_center_rows(positions: torch.Tensor, centering: KeyCentering) -> tuple[torch.Tensor, torch.Tensor]:
    """(PC, PS) [n, dim_pad] float64: the page-table rows of tokens at ``positions`` [n]."""
    pg = (positions.long() // centering.page).clamp_max(centering.num_pages - 1)
    dev = positions.device
    return centering.page_cos.double().to(dev)[pg], centering.page_sin.double().to(dev)[pg]


def token_centers_ref(mu: torch.Tensor, mup: torch.Tensor, positions: torch.Tensor,
                      centering: KeyCentering) -> torch.Tensor:
    """Centres [n, ..., head_dim] float64 of tokens at ``positions`` [n]; mu, mup [n, ..., dim_pad]."""
    pc, ps = page_center_rows(positions, centering)
    shape = (pc.shape[0],) + (1,) * (mu.dim() - 2) + (centering.dim_pad,)
    return (mu * pc.view(shape) + mup * ps.view(shape))[..., : centering.head_dim]


def center_sums_from_keys_ref(first_page_keys: torch.Tensor, centering: KeyCentering) -> torch.Tensor:
    """(U, V) [..., 2, dim_pad] float64 from the decoded keys of one first page [..., page, head_dim]
    (row t at position t; row 0 is left out)."""
    d, P = centering.head_dim, centering.page
    k = first_page_keys.double()[..., 1:P, :]
    qc = centering.pos_cos.double().to(k.device)[1:P, :d]
    qs = centering.pos_sin.double().to(k.device)[1:P, :d]
    out = torch.zeros(*k.shape[:-2], 2, centering.dim_pad, dtype=torch.float64, device=k.device)
    out[..., 0, :d] = (k * qc).sum(-2) / (P - 1)
    out[..., 1, :d] = (k * qs).sum(-2) / (P - 1)
    return out


def request_positions(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Position of each of the batch's tokens [num_tokens] int64 (-1 past the last request): token
    q_start[r] + j of request r is at seq_lens[r] - query_len[r] + j."""
    qsl = query_start_loc.long()
    r = torch.searchsorted(qsl[1:], torch.arange(num_tokens, device=qsl.device), right=True)
    valid = r < seq_lens.shape[0]
    r = r.clamp_max(seq_lens.shape[0] - 1)
    pos = seq_lens.long()[r] - (qsl[r + 1] - qsl[r]) + (torch.arange(num_tokens, device=qsl.device) - qsl[r])
    return torch.where(valid, pos, -1)


__all__ = ["KeyCentering", "center_sums_from_keys_ref", "center_vectors_ref",
           "key_centering_tables", "page_center_rows", "request_positions", "rope_theta_from_cos_sin_cache",
           "token_centers_ref"]
