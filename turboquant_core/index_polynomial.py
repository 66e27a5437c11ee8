# SPDX-License-Identifier: Apache-2.0
"""The 4-bit codebook search as one fp16 polynomial: the index of |s| from four packed fp16 FMAs.

Why: a 4-bit code has 7 positive thresholds. Deciding a coordinate by compares costs 7 compares plus
the adds that count them; an encoder that is bound by instructions (the packing-order encoder on an
H200) spends most of its loop there. A polynomial of |s| that steps from m - 1 to m exactly at
threshold m gives the index from a clamp, four packed fp16 FMAs (two coordinates each) and one add that
rounds to an integer in the low mantissa bits.

The rule, on fp16 numbers with IEEE round-to-nearest-even after every operation (as ``fma.rn.f16x2``
and ``add.rn.f16x2`` compute it):

    a = min(|s|, clamp)
    u = ((((c4 a + c3) a + c2) a + c1) a + c0      (each step one fused multiply-add, rounded to fp16)
    k = (u + 1032) - 1032                           (the add rounds u to an integer: the magnitude index 0..7)

The coefficients are fp16 numbers, fitted once per head size (least squares through the rounded
midpoints, then a seeded search over neighbouring fp16 values) and stored in ``INDEX_POLYNOMIALS``.
Fp16 rounding makes some step points land one fp16 value away from the rounded midpoint, so for these
codebooks the thresholds are defined as the polynomial's step points (``step_thresholds``):
``codebooks.decision_boundaries`` takes them, every encoder compares against them and decides exactly as
the polynomial does. They are within one fp16 step (2^-10 relative) of the midpoints, about the size of
the rounding to fp16 already applied to every threshold; the distortion moves by under 3e-7 (2e-5 of
itself).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import numpy as np

MAGIC = 1032.0  # 1024 + 8: fp16 spacing is 1 in [1024, 2048); the integer k lands in mantissa bits 0-2, bit 3 set


@dataclass(frozen=True)
class IndexPolynomial:
    """fp16 coefficients of the index rule above (each exactly an fp16 number)."""

    c4: float
    c3: float
    c2: float
    c1: float
    c0: float
    clamp: float

    def coefficients(self) -> tuple[float, ...]:
        return (self.c4, self.c3, self.c2, self.c1, self.c0, self.clamp)


# (bits, head dim) -> polynomial. Only 4-bit codes of the packing-order encoder's head sizes have one;
# other codebooks keep the rounded midpoints.
INDEX_POLYNOMIALS: dict[tuple[int, int], IndexPolynomial] = {
    (4, 64): IndexPolynomial(0.03173828125, -0.2529296875, 0.0271453857421875, 3.91015625, -0.498046875, 2.75),
    (4, 128): IndexPolynomial(0.035736083984375, -0.264404296875, 0.0275726318359375, 3.900390625,
                              -0.499755859375, 2.875),
    (4, 256): IndexPolynomial(0.034942626953125, -0.261474609375, 0.022308349609375, 3.89453125,
                              -0.499267578125, 2.875),
}


def round_fp16(x: np.ndarray) -> np.ndarray:
    """float64 -> the nearest fp16 value (ties to even), as float64; one rounding, subnormals included.
    (Casting float64 to float16 through float32 can round twice.)"""
    x = np.asarray(x, dtype=np.float64)
    _, e = np.frexp(x)  # |x| in [2^(e-1), 2^e)
    ulp = np.ldexp(1.0, np.maximum(e - 1, -14) - 10)
    return np.round(x / ulp) * ulp  # x / ulp is exact (a power-of-two scaling); np.round is half-to-even


def magnitude_index(a: np.ndarray, poly: IndexPolynomial) -> np.ndarray:
    """The rule above on fp16 magnitudes ``a`` (float64 holding fp16 values, >= 0): index 0..7 (int64)."""
    a = np.minimum(np.asarray(a, dtype=np.float64), poly.clamp)
    u = np.full_like(a, poly.c4)
    for c in (poly.c3, poly.c2, poly.c1, poly.c0):
        u = round_fp16(u * a + c)  # products of fp16 numbers and the sums here are exact in float64
    return (round_fp16(u + MAGIC) - MAGIC).astype(np.int64)


def all_fp16_magnitudes() -> np.ndarray:
    """Every finite non-negative fp16 value, ascending, as float64."""
    return np.arange(0, 0x7C00, dtype=np.uint16).view(np.float16).astype(np.float64)


@functools.cache
def step_thresholds(bits: int, dim: int) -> tuple[float, ...] | None:
    """The positive thresholds the polynomial of (bits, dim) decides by: for m = 1..7, the least fp16 value
    whose index is m. Checked over every fp16 value: the index starts at 0, never decreases and ends at 7.
    None where no polynomial is stored."""
    poly = INDEX_POLYNOMIALS.get((bits, dim))
    if poly is None:
        return None
    a = all_fp16_magnitudes()
    k = magnitude_index(a, poly)
    top = (1 << (bits - 1)) - 1
    if k[0] != 0 or k[-1] != top or np.any(np.diff(k) < 0) or np.any(np.diff(k) > 1):
        raise ValueError(f"the index polynomial for {bits} bits, d = {dim} is not a staircase 0..{top}")
    return tuple(float(a[np.argmax(k >= m)]) for m in range(1, top + 1))


def fit(midpoints: np.ndarray, clamp: float, seconds: float = 60.0, seed: int = 0) -> tuple[IndexPolynomial, int]:
    """How ``INDEX_POLYNOMIALS`` was made: c1..c4 by least squares of a (c1 + c2 a + c3 a^2 + c4 a^3) = m
    at the positive rounded midpoints t_m (c0 = -1/2, so u crosses m - 1/2 there), rounded to fp16; then a
    seeded random search over neighbouring fp16 coefficients for the fewest fp16 magnitudes decided
    differently from the midpoints. Returns the best polynomial and that count (0 would make the thresholds
    the midpoints themselves). Stored results are what counts: least squares may differ in its last bits
    between machines."""
    t = np.asarray(midpoints, dtype=np.float64)
    x = np.stack([t ** (j + 1) for j in range(4)], axis=1)
    c1, c2, c3, c4 = np.linalg.lstsq(x, np.arange(1, t.size + 1, dtype=np.float64), rcond=None)[0]
    a = all_fp16_magnitudes()
    near = np.unique(np.concatenate([np.arange(i - 40, i + 40) for i in np.searchsorted(a, t)]))
    want = np.searchsorted(t, a[near], side="right")

    def misses(p: IndexPolynomial) -> int:
        return int(np.sum(magnitude_index(a[near], p) != want))

    def nudge(v: float, steps: int) -> float:
        bits16 = np.array([v], dtype=np.float16).view(np.int16).astype(np.int32)[0]
        return float(np.array([bits16 + (steps if v >= 0 else -steps)], dtype=np.int16).view(np.float16)[0])

    f16 = lambda v: float(np.float16(v))  # noqa: E731
    best = IndexPolynomial(f16(c4), f16(c3), f16(c2), f16(c1), -0.5, f16(clamp))
    best_misses = misses(best)
    rng = np.random.default_rng(seed)
    end = time.monotonic() + seconds
    while best_misses and time.monotonic() < end:
        steps = rng.integers(-6, 7, 5)
        c = best.coefficients()
        trial = IndexPolynomial(*(nudge(v, int(s)) for v, s in zip(c[:5], steps)), c[5])
        m = misses(trial)
        if m <= best_misses:
            best, best_misses = trial, m
    return best, best_misses
