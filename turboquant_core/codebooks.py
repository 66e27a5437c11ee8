# SPDX-License-Identifier: Apache-2.0
"""Lloyd-Max scalar codebooks for the coordinates of a randomly rotated unit vector.

After a random rotation R, each coordinate z_i of R u (u a unit vector in R^d) has the density

    f_d(t) = Gamma(d/2) / (sqrt(pi) Gamma((d-1)/2)) * (1 - t^2)^((d-3)/2),   t in [-1, 1]

(TurboQuant, Zandieh et al., ICLR 2026, Lemma 1). Codebooks here are for the *scaled*
coordinate s = sqrt(d) * t, whose variance is exactly 1 and whose density tends to N(0, 1)
as d grows, so one set of numbers reads the same for every head size. The optimal scalar
quantizer for that density is found by Lloyd's algorithm (Max 1960, Lloyd 1982) on a fine
grid: no data, no randomness, identical on every machine.

The distortion of a codebook is E[(s - c(s))^2], which equals the expected squared error of
reconstructing the unit vector u (sum over d coordinates of t-errors): the numbers the paper
quotes (0.3634, 0.1175, 0.03454, 0.009497 for b = 1..4) are these.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from .index_polynomial import step_thresholds

SUPPORTED_BITS = (1, 2, 3, 4)
# Above this dimension the exact density and N(0, 1) agree to better than 1e-6 in the
# codebook values; the Gaussian is used and cached once.
GAUSSIAN_LIMIT_DIM = 4096
_GRID_POINTS = 400_001


@dataclass(frozen=True)
class Codebook:
    """Sorted centroids and the decision boundaries between them.

    ``centroids``: shape [2**bits], ascending. ``boundaries``: shape [2**bits - 1], the midpoints of
    neighbouring centroids rounded to fp16 values (``decision_boundaries``); a scaled coordinate s maps
    to index ``sum(s > boundaries)``.
    """

    bits: int
    dim: int | None
    centroids: tuple[float, ...]
    boundaries: tuple[float, ...]
    mse: float

    def as_numpy(self) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray(self.centroids), np.asarray(self.boundaries)


def _scaled_density(dim: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Grid and normalized density of s = sqrt(d) * t (Gaussian when dim is None)."""
    if dim is None:
        s = np.linspace(-12.0, 12.0, _GRID_POINTS)
        logp = -0.5 * s * s
    else:
        if dim < 3:
            raise ValueError(f"dim must be >= 3 for the sphere-coordinate density, got {dim}")
        r = math.sqrt(dim)
        s = np.linspace(-r, r, _GRID_POINTS)
        t = np.clip(s / r, -1.0, 1.0)
        with np.errstate(divide="ignore"):
            logp = 0.5 * (dim - 3) * np.log1p(-t * t)
    p = np.exp(logp - np.max(logp))
    p /= np.trapezoid(p, s)
    return s, p


def _lloyd_max(s: np.ndarray, p: np.ndarray, levels: int) -> np.ndarray:
    """Lloyd iterations on a grid; returns the centroids.

    Cell masses and first moments are cumulative trapezoid integrals interpolated linearly at the
    boundaries, so a boundary that moves by less than a grid step still moves the centroids:
    snapping boundaries to grid points stalls the (slowly contracting) iteration short of the
    fixed point, by ~7e-4 in the 4-bit centroids.
    """
    ds = s[1] - s[0]
    w = p * ds
    cw = np.concatenate([[0.0], np.cumsum(0.5 * (w[1:] + w[:-1]))])
    cws = np.concatenate([[0.0], np.cumsum(0.5 * (w[1:] * s[1:] + w[:-1] * s[:-1]))])
    # Start from quantiles: converges to the global optimum for log-concave densities.
    c = np.interp((np.arange(levels) + 0.5) / levels, cw / cw[-1], s)
    for _ in range(100_000):
        edges = np.concatenate([[s[0]], 0.5 * (c[1:] + c[:-1]), [s[-1]]])
        mass = np.diff(np.interp(edges, s, cw))
        new = np.diff(np.interp(edges, s, cws)) / np.maximum(mass, 1e-300)
        # Lloyd contracts slowly (factor near 1 at 16 levels): stop only when steps are at rounding level.
        if np.max(np.abs(new - c)) < 1e-14:
            c = new
            break
        c = new
    return c


def _distortion(s: np.ndarray, p: np.ndarray, c: np.ndarray, b: np.ndarray) -> float:
    """E[(s - c(s))^2] on the grid, c(s) the centroid whose cell under thresholds ``b`` holds s."""
    w = p * (s[1] - s[0])
    idx = np.searchsorted(b, s)
    return float(np.sum(w * (s - c[idx]) ** 2) / np.sum(w))


def decision_boundaries(centroids: np.ndarray, bits: int | None = None, dim: int | None = None) -> np.ndarray:
    """The encoder's thresholds: midpoints of neighbouring centroids, rounded to the nearest fp16 value.

    A threshold that is an fp16 number lets an encoder compare in packed fp16 pairs and still decide
    exactly as in fp32: rounding a coordinate toward zero to fp16 never crosses an fp16 threshold, so
    ``rz(|s|) >= b`` holds exactly when ``|s| >= b``. Rounding moves a threshold by at most 2^-11 of
    itself (under 0.0014 for every codebook here), which changes the distortion by under 1e-7: the
    optimum is flat to first order in the thresholds. Levels are untouched, so decoding is not affected.

    Where an index polynomial is stored for (bits, dim) (``index_polynomial``: 4 bits at d = 64, 128, 256)
    the positive thresholds are its step points instead, each within one fp16 step of the rounded
    midpoint (checked here), so that every encoder decides as that polynomial does.
    """
    b = (0.5 * (centroids[1:] + centroids[:-1])).astype(np.float16).astype(np.float64)
    steps = step_thresholds(bits, dim) if bits is not None and dim is not None else None
    if steps is not None:
        half = len(b) // 2
        pos = np.asarray(steps)
        ulp = np.spacing(b[half + 1 :].astype(np.float16)).astype(np.float64)
        if len(pos) != half or np.any(np.abs(pos - b[half + 1 :]) > ulp):
            raise ValueError(f"the index polynomial for {bits} bits, d = {dim} steps more than one fp16 value "
                             "away from the codebook's midpoints")
        b = np.concatenate([-pos[::-1], [0.0], pos])
    return b


@functools.cache
def lloyd_max_codebook(bits: int, dim: int | None = None) -> Codebook:
    """The Lloyd-Max codebook for ``bits`` bits and head dimension ``dim``.

    ``dim=None`` (or ``dim >= GAUSSIAN_LIMIT_DIM``) gives the N(0, 1) codebook.

    >>> cb = lloyd_max_codebook(3)
    >>> [round(v, 3) for v in cb.centroids[4:]]
    [0.245, 0.756, 1.344, 2.152]
    """
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"codebook bits must be one of {SUPPORTED_BITS}, got {bits!r}")
    if dim is not None and dim >= GAUSSIAN_LIMIT_DIM:
        dim = None
    s, p = _scaled_density(dim)
    c = _lloyd_max(s, p, 2**bits)
    # Symmetrize: the density is even, so the optimum is too; this removes grid asymmetry.
    c = 0.5 * (c - c[::-1])
    b = decision_boundaries(c, bits, dim)
    return Codebook(bits, dim, tuple(float(v) for v in c), tuple(float(v) for v in b), _distortion(s, p, c, b))


def codebook_tensors(bits: int, dim: int | None, device=None):
    """(centroids, boundaries) as float32 torch tensors on ``device``."""
    import torch

    cb = lloyd_max_codebook(bits, dim)
    return (
        torch.tensor(cb.centroids, dtype=torch.float32, device=device),
        torch.tensor(cb.boundaries, dtype=torch.float32, device=device),
    )
