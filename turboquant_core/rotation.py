# SPDX-License-Identifier: Apache-2.0
"""Seeded random rotations of head vectors.

- Power-of-two dims: randomized Walsh-Hadamard, R = H D / sqrt(d) with D a seeded diagonal of
  +-1 (QuaRot/TurboQuant practice). Applying it costs O(d log d) (``fwht``); kernels use the
  matrix form, whose entries are exactly +-1 before the 1/sqrt(d) scale, so a bf16 tensor-core
  product with it is exact up to fp32 accumulation order.
- Other dims (80, 96, 112, ...): a Haar-random orthogonal matrix, the QR factor of a seeded
  Gaussian matrix with the sign fix of Mezzadri (2007).

A rotation is fully determined by (dim, seed), which is what a stored format records.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

SUPPORTED_HEAD_DIMS = (64, 80, 96, 112, 128, 192, 256, 512)


def is_power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def check_head_dim(dim: int) -> None:
    if dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"head_dim {dim} is not supported; supported head dims: {', '.join(map(str, SUPPORTED_HEAD_DIMS))}"
        )


def rotation_kind(dim: int) -> str:
    return "hadamard" if is_power_of_two(dim) else "orthogonal"


def _hadamard(n: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


@functools.lru_cache(maxsize=64)
def _rotation_np(dim: int, seed: int) -> tuple[np.ndarray, np.ndarray | None]:
    rng = np.random.default_rng(seed)
    if is_power_of_two(dim):
        signs = rng.choice(np.array([-1.0, 1.0]), size=dim)
        return _hadamard(dim) * signs[None, :] / math.sqrt(dim), signs
    g = rng.standard_normal((dim, dim))
    q, r = np.linalg.qr(g)
    q = q * np.sign(np.diag(r))[None, :]
    return q, None


def rotation_matrix(dim: int, seed: int, dtype=torch.float32, device=None) -> torch.Tensor:
    """The d x d orthogonal matrix R; a vector x rotates to ``R @ x`` (rows: ``x @ R.T``)."""
    check_head_dim(dim)
    return torch.tensor(_rotation_np(dim, seed)[0], dtype=dtype, device=device)


def hadamard_signs(dim: int, seed: int) -> torch.Tensor:
    """The +-1 diagonal D of the randomized Hadamard rotation (power-of-two dims only)."""
    if not is_power_of_two(dim):
        raise ValueError(f"hadamard rotation needs a power-of-two dim, got {dim}")
    return torch.tensor(_rotation_np(dim, seed)[1], dtype=torch.float32)


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalized fast Walsh-Hadamard transform over the last dim (O(d log d))."""
    d = x.shape[-1]
    if not is_power_of_two(d):
        raise ValueError(f"fwht needs a power-of-two size, got {d}")
    shape = x.shape
    y = x.reshape(-1, d)
    h = 1
    while h < d:
        y = y.view(-1, d // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return y.reshape(shape)


def rotate(x: torch.Tensor, seed: int) -> torch.Tensor:
    """R x over the last dim, in float32 (fast transform for power-of-two dims)."""
    d = x.shape[-1]
    check_head_dim(d)
    xf = x.float()
    if is_power_of_two(d):
        return fwht(xf * hadamard_signs(d, seed).to(xf.device)) / math.sqrt(d)
    return xf @ rotation_matrix(d, seed, device=xf.device).T


def unrotate(y: torch.Tensor, seed: int) -> torch.Tensor:
    """R^T y over the last dim, in float32."""
    d = y.shape[-1]
    check_head_dim(d)
    yf = y.float()
    if is_power_of_two(d):
        return fwht(yf) / math.sqrt(d) * hadamard_signs(d, seed).to(yf.device)
    return yf @ rotation_matrix(d, seed, device=yf.device)
