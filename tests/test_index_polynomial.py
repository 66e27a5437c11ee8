# SPDX-License-Identifier: Apache-2.0
"""The 4-bit index polynomial: exact fp16 emulation, its step points as the codebooks' thresholds."""

import numpy as np
import pytest
import torch

from turboquant_core import index_polynomial as ip
from turboquant_core.codebooks import _distortion, _scaled_density, decision_boundaries, lloyd_max_codebook


def test_round_fp16_is_one_correct_rounding():
    # Against torch's float32 -> float16 cast where the float32 value is exact (one rounding either way), over
    # normals, subnormals and exact ties (which go to the even neighbour).
    x = torch.cat([torch.randn(20000, dtype=torch.float64) * 3, torch.randn(2000, dtype=torch.float64) * 1e-6])
    x32 = x.float().double()
    np.testing.assert_array_equal(ip.round_fp16(x32.numpy()), x32.half().double().numpy())
    ties = np.array([1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 2.0**-24 * 1.5, 1032.5, 1033.5])
    np.testing.assert_array_equal(ip.round_fp16(ties), [1.0, 1.0 + 2 * 2.0**-10, 2.0**-23, 1032.0, 1034.0])
    # float64 values whose cast through float32 would round twice
    x = np.array([1.0 + 2.0**-11 + 2.0**-40])
    assert ip.round_fp16(x)[0] == 1.0 + 2.0**-10


@pytest.mark.parametrize("dim", [64, 128, 256])
def test_stored_polynomials_step_at_the_codebook_thresholds(dim):
    cb = lloyd_max_codebook(4, dim)
    c, b = cb.as_numpy()
    a = ip.all_fp16_magnitudes()
    k = ip.magnitude_index(a, ip.INDEX_POLYNOMIALS[(4, dim)])
    # A staircase 0..7 over every fp16 magnitude, stepping exactly where |s| reaches a positive threshold.
    np.testing.assert_array_equal(k, np.searchsorted(b[8:], a, side="right"))
    assert k[0] == 0 and k[-1] == 7 and np.all(np.diff(k) >= 0)
    # The steps are within one fp16 value of the rounded midpoints; the distortion barely moves.
    mid = (0.5 * (c[1:] + c[:-1])).astype(np.float16)
    moved = np.abs(b - mid.astype(np.float64)) / np.spacing(mid).astype(np.float64)
    assert moved.max() <= 1 and moved.sum() >= 1  # some step is off the midpoint: why the thresholds follow it
    s, p = _scaled_density(dim)
    assert abs(cb.mse - _distortion(s, p, c, mid.astype(np.float64))) < 3e-7


def test_thresholds_without_a_polynomial_are_the_rounded_midpoints():
    for bits, dim in ((3, 128), (4, 96), (4, 512), (4, None)):
        c, b = lloyd_max_codebook(bits, dim).as_numpy()
        np.testing.assert_array_equal(b, (0.5 * (c[1:] + c[:-1])).astype(np.float16).astype(np.float64))
        assert ip.step_thresholds(bits, dim) is None


def test_a_polynomial_that_is_no_staircase_or_steps_far_from_the_midpoints_is_refused(monkeypatch):
    good = ip.INDEX_POLYNOMIALS[(4, 128)]
    c, _ = lloyd_max_codebook(4, 128).as_numpy()
    monkeypatch.setitem(ip.INDEX_POLYNOMIALS, (4, 128), ip.IndexPolynomial(-0.25, 0.0, 0.0, 3.9, -0.5, 2.875))
    ip.step_thresholds.cache_clear()
    with pytest.raises(ValueError, match="not a staircase"):
        decision_boundaries(c, 4, 128)
    monkeypatch.setitem(ip.INDEX_POLYNOMIALS, (4, 128), ip.IndexPolynomial(*good.coefficients()[:3], 3.875,
                                                                           *good.coefficients()[4:]))
    ip.step_thresholds.cache_clear()
    with pytest.raises(ValueError, match="more than one fp16 value away"):
        decision_boundaries(c, 4, 128)
    monkeypatch.undo()
    ip.step_thresholds.cache_clear()
    assert ip.step_thresholds(4, 128) is not None


def test_fit_starts_from_least_squares_and_only_improves():
    c, _ = lloyd_max_codebook(4, 128).as_numpy()
    mid = (0.5 * (c[9:] + c[8:-1])).astype(np.float16).astype(np.float64)
    start, start_misses = ip.fit(mid, 2.875, seconds=0.0)
    poly, misses = ip.fit(mid, 2.875, seconds=1.0, seed=1)
    assert misses <= start_misses < 40
    assert all(float(np.float16(v)) == v for v in poly.coefficients())
