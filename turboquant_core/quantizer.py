# SPDX-License-Identifier: Apache-2.0
"""TurboQuant quantizers (Zandieh et al., ICLR 2026), reference implementations in plain torch.

All three work on head vectors x in R^d along the last dim:

- ``MSEQuantizer``: rotate, quantize each scaled coordinate with the Lloyd-Max codebook,
  keep one fp16 scale. With norm correction (``nc``) the scale makes ||x_hat|| = ||x|| exactly.
  Fractional rates (2.5, 3.5 bits) split the rotated coordinates in two halves, the first at
  ceil(b) bits and the second at floor(b) (after rotation all coordinates are identically
  distributed, so the split needs no calibration).
- ``QJLQuantizer``: the paper's inner-product variant, (b-1)-bit MSE plus a 1-bit QJL sketch of
  the residual; <q, x_hat> is an unbiased estimate of <q, x>.
- ``FP8Quantizer``: rotated coordinates stored as float8 e4m3 (the K half of ``k8v4``).

Reconstruction identity the kernels rely on (MSE): x_hat = R^T (scale * c[idx]), so
<q, x_hat> = scale * <R q, c[idx]>: attention can run entirely in the rotated domain.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .codebooks import codebook_tensors
from .rotation import check_head_dim, rotate, unrotate

FP8_MAX = 448.0  # largest finite float8 e4m3fn value
FP16_MAX = 65504.0


def split_segments(dim: int, bits: float) -> tuple[tuple[int, int], ...]:
    """(coordinates, bits) per segment of the rotated vector, first segment first."""
    if bits in (1, 2, 3, 4):
        return ((dim, int(bits)),)
    if bits in (1.5, 2.5, 3.5):
        hi = int(math.ceil(bits))
        return ((dim // 2, hi), (dim - dim // 2, hi - 1))
    raise ValueError(f"MSE bits must be one of 1, 1.5, 2, 2.5, 3, 3.5, 4; got {bits!r}")


@dataclass
class MSEQuantized:
    idx: torch.Tensor  # [..., d] uint8 codebook indices (rotated coordinate order)
    scale: torch.Tensor  # [...] float32, the value stored as fp16


class MSEQuantizer:
    """Rotation + Lloyd-Max codebook quantizer with optional norm correction.

    >>> q = MSEQuantizer(128, 3, norm_correction=True, seed=0)
    >>> x = torch.randn(4, 128)
    >>> x_hat = q.dequantize(q.quantize(x))
    """

    def __init__(self, dim: int, bits: float, norm_correction: bool = True, seed: int = 0):
        check_head_dim(dim)
        self.dim, self.bits, self.norm_correction, self.seed = dim, bits, norm_correction, seed
        self.segments = split_segments(dim, bits)

    def quantize(self, x: torch.Tensor) -> MSEQuantized:
        d = self.dim
        if x.shape[-1] != d:
            raise ValueError(f"expected last dim {d}, got {x.shape[-1]}")
        xf = x.float()
        norm = xf.norm(dim=-1)
        t = rotate(xf, self.seed)
        inv = torch.where(norm > 0, math.sqrt(d) / norm, torch.zeros_like(norm))
        s = t * inv.unsqueeze(-1)
        idx_parts, c_parts, start = [], [], 0
        for n, b in self.segments:
            cent, bnd = codebook_tensors(b, d, x.device)
            i = torch.bucketize(s[..., start : start + n].contiguous(), bnd)
            idx_parts.append(i)
            c_parts.append(cent[i])
            start += n
        idx = torch.cat(idx_parts, dim=-1).to(torch.uint8)
        c = torch.cat(c_parts, dim=-1)
        if self.norm_correction:
            scale = norm / c.norm(dim=-1)
        else:
            scale = norm / math.sqrt(d)
        scale = scale.clamp(max=FP16_MAX).to(torch.float16).float()
        return MSEQuantized(idx, scale)

    def rotated_values(self, q: MSEQuantized) -> torch.Tensor:
        """scale * c[idx]: the reconstruction in the rotated domain, float32."""
        parts, start = [], 0
        for n, b in self.segments:
            cent, _ = codebook_tensors(b, self.dim, q.idx.device)
            parts.append(cent[q.idx[..., start : start + n].long()])
            start += n
        return torch.cat(parts, dim=-1) * q.scale.unsqueeze(-1)

    def dequantize(self, q: MSEQuantized) -> torch.Tensor:
        return unrotate(self.rotated_values(q), self.seed)


@dataclass
class QJLQuantized:
    idx: torch.Tensor  # [..., d] uint8, (b-1)-bit MSE indices
    signs: torch.Tensor  # [..., d] uint8 in {0, 1}: sign bits of S r
    norm: torch.Tensor  # [...] ||x||
    residual_norm: torch.Tensor  # [...] ||r|| of the unit-vector residual


class QJLQuantizer:
    """TurboQuant_prod: (b-1)-bit MSE + 1-bit QJL on the residual; unbiased inner products."""

    def __init__(self, dim: int, bits: int, seed: int = 0):
        if bits not in (2, 3, 4):
            raise ValueError(f"QJL bits must be one of 2, 3, 4 (MSE part gets bits-1), got {bits!r}")
        self.dim, self.bits, self.seed = dim, bits, seed
        self.mse = MSEQuantizer(dim, bits - 1, norm_correction=False, seed=seed)
        g = torch.Generator().manual_seed(seed + 0x51C)
        self.sketch = torch.randn(dim, dim, generator=g)  # S, rows ~ N(0, I)

    def quantize(self, x: torch.Tensor) -> QJLQuantized:
        xf = x.float()
        norm = xf.norm(dim=-1)
        m = self.mse.quantize(xf)
        safe = torch.where(norm > 0, norm, torch.ones_like(norm)).unsqueeze(-1)
        z = rotate(xf, self.seed) / safe
        z_hat = self.mse.rotated_values(m) / safe
        r = z - z_hat
        proj = r @ self.sketch.to(x.device).T
        return QJLQuantized(m.idx, (proj >= 0).to(torch.uint8), norm, r.norm(dim=-1))

    def rotated_unit(self, q: QJLQuantized) -> torch.Tensor:
        d = self.dim
        cent, _ = codebook_tensors(self.bits - 1, d, q.idx.device)
        z_hat = cent[q.idx.long()] / math.sqrt(d)
        sgn = q.signs.float() * 2 - 1
        corr = math.sqrt(math.pi / 2) / d * q.residual_norm.unsqueeze(-1) * (sgn @ self.sketch.to(sgn.device))
        return z_hat + corr

    def dequantize(self, q: QJLQuantized) -> torch.Tensor:
        return unrotate(self.rotated_unit(q) * q.norm.unsqueeze(-1), self.seed)


class FP8Quantizer:
    """Rotated coordinates as float8 e4m3fn (1 byte each), clamped to +-448."""

    def __init__(self, dim: int, seed: int = 0):
        check_head_dim(dim)
        self.dim, self.seed = dim, seed

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        t = rotate(x.float(), self.seed).clamp(-FP8_MAX, FP8_MAX)
        return t.to(torch.float8_e4m3fn).view(torch.uint8)

    def dequantize(self, q: torch.Tensor) -> torch.Tensor:
        return unrotate(q.view(torch.float8_e4m3fn).float(), self.seed)
