# SPDX-License-Identifier: Apache-2.0
import math

import numpy as np
import pytest
import torch

from turboquant_core.codebooks import SUPPORTED_BITS, codebook_tensors, lloyd_max_codebook
from turboquant_core.index_polynomial import step_thresholds
from turboquant_core.rotation import SUPPORTED_HEAD_DIMS

# Lloyd-Max quantizers of N(0, 1) (Max 1960, table I; TurboQuant table of distortions).
GAUSSIAN_POSITIVE_CENTROIDS = {
    1: (0.7979,),
    2: (0.4528, 1.5104),
    3: (0.2451, 0.7560, 1.3440, 2.1520),
    4: (0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6181, 2.0690, 2.7326),
}
GAUSSIAN_MSE = {1: 0.3634, 2: 0.1175, 3: 0.03455, 4: 0.009501}


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_gaussian_codebook_matches_known_values(bits):
    cb = lloyd_max_codebook(bits)
    positive = cb.centroids[2 ** (bits - 1):]
    np.testing.assert_allclose(positive, GAUSSIAN_POSITIVE_CENTROIDS[bits], atol=1.5e-4)
    assert cb.mse == pytest.approx(GAUSSIAN_MSE[bits], rel=1e-3)


def _gaussian_cell_means(centroids):
    """E[s | s in cell i] for s ~ N(0, 1), cells cut at the midpoints: closed form with erf."""
    edges = [-math.inf] + [0.5 * (a + b) for a, b in zip(centroids, centroids[1:])] + [math.inf]

    def pdf(t):
        return 0.0 if math.isinf(t) else math.exp(-0.5 * t * t) / math.sqrt(2 * math.pi)

    def cdf(t):
        return 0.5 * (1 + math.erf(t / math.sqrt(2)))

    return [(pdf(a) - pdf(b)) / (cdf(b) - cdf(a)) for a, b in zip(edges, edges[1:])]


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_gaussian_codebook_is_a_lloyd_max_fixed_point(bits):
    # Optimality: every centroid is the conditional mean of its cell (up to the grid's accuracy).
    c = lloyd_max_codebook(bits).centroids
    np.testing.assert_allclose(_gaussian_cell_means(c), c, atol=2e-6)


def test_three_bit_gaussian_centroids_to_three_decimals():
    cb = lloyd_max_codebook(3)
    assert [round(c, 3) for c in cb.centroids] == [-2.152, -1.344, -0.756, -0.245, 0.245, 0.756, 1.344, 2.152]
    assert cb.mse == pytest.approx(0.03455, abs=5e-5)


def test_one_bit_gaussian_is_the_mean_of_the_half_normal():
    # E[|s|] for s ~ N(0, 1) is sqrt(2/pi); the distortion is 1 - 2/pi.
    cb = lloyd_max_codebook(1)
    assert cb.centroids[1] == pytest.approx(math.sqrt(2 / math.pi), abs=1e-5)
    assert cb.mse == pytest.approx(1 - 2 / math.pi, abs=1e-5)


@pytest.mark.parametrize("dim", SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_exact_dim_codebook_is_symmetric_sorted_with_fp16_midpoint_boundaries(bits, dim):
    cb = lloyd_max_codebook(bits, dim)
    c, b = cb.as_numpy()
    assert len(c) == 2**bits and len(b) == 2**bits - 1
    assert np.all(np.diff(c) > 0)
    np.testing.assert_allclose(c, -c[::-1], atol=1e-12)
    # Thresholds: the midpoints rounded to the nearest fp16 value (an fp16 number, within half an fp16 step);
    # where an index polynomial is stored, its step points, within one fp16 step of those.
    mid = 0.5 * (c[1:] + c[:-1])
    rounded = mid.astype(np.float16).astype(np.float64)
    assert np.array_equal(b.astype(np.float16).astype(np.float64), b)
    if step_thresholds(bits, dim) is None:
        np.testing.assert_array_equal(b, rounded)
        assert np.all(np.abs(b - mid) <= 2.0**-11 * np.abs(mid))
    else:
        np.testing.assert_array_equal(b[2 ** (bits - 1):], step_thresholds(bits, dim))
        np.testing.assert_array_equal(b, -b[::-1])
        assert np.all(np.abs(b - rounded) <= np.spacing(rounded.astype(np.float16)).astype(np.float64))
    # Scaled coordinates live in [-sqrt(d), sqrt(d)].
    assert c[-1] < math.sqrt(dim)


@pytest.mark.parametrize("dim", [None, *SUPPORTED_HEAD_DIMS])
@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_kernel_tables_are_exactly_symmetric(bits, dim):
    # The encoder searches |s| over the positive boundaries and reads |c| from the upper half: that is
    # the reference's index only if the float32 tables are mirror images bit for bit, middle boundary 0.
    c, b = codebook_tensors(bits, dim)
    assert torch.equal(c, -c.flip(0)) and torch.equal(b, -b.flip(0))
    assert b[len(b) // 2].item() == 0.0


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_mse_increases_with_dim_toward_gaussian(bits):
    # Finite-d coordinates have lighter tails than N(0, 1): lower distortion, approaching it from below.
    mses = [lloyd_max_codebook(bits, d).mse for d in SUPPORTED_HEAD_DIMS]
    gaussian = lloyd_max_codebook(bits).mse
    assert all(a < b for a, b in zip(mses, mses[1:]))
    assert mses[-1] < gaussian
    assert gaussian - mses[-1] < 0.01 * gaussian
    assert gaussian - mses[0] > 0.01 * gaussian


def test_exact_dim_centroids_approach_gaussian():
    g = np.asarray(lloyd_max_codebook(3).centroids)
    errs = [np.max(np.abs(np.asarray(lloyd_max_codebook(3, d).centroids) - g)) for d in (64, 128, 512)]
    assert errs[0] > errs[1] > errs[2]
    assert errs[2] < 0.01


def test_mse_decreases_with_bits():
    for dim in (None, 128):
        mses = [lloyd_max_codebook(b, dim).mse for b in SUPPORTED_BITS]
        assert all(a > b for a, b in zip(mses, mses[1:]))


def test_codebook_mse_matches_monte_carlo_on_the_sphere():
    # Coordinates of a random unit vector in R^128, scaled by sqrt(d), quantized with the codebook.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4000, 128, generator=g, dtype=torch.float64)
    s = (x / x.norm(dim=-1, keepdim=True) * math.sqrt(128)).flatten()
    cent, bnd = codebook_tensors(3, 128)
    err = ((s - cent.double()[torch.bucketize(s.float(), bnd)]) ** 2).mean().item()
    assert err == pytest.approx(lloyd_max_codebook(3, 128).mse, rel=0.02)


def test_large_dim_uses_gaussian_codebook():
    assert lloyd_max_codebook(2, 8192) == lloyd_max_codebook(2)


def test_codebook_tensors_are_float32_on_device():
    c, b = codebook_tensors(4, 128, "cpu")
    assert c.dtype == b.dtype == torch.float32
    assert c.shape == (16,) and b.shape == (15,)
    assert c.tolist() == pytest.approx(lloyd_max_codebook(4, 128).centroids, abs=1e-6)


@pytest.mark.parametrize("bits", [0, 5, 8, 2.5, "3"])
def test_bad_bits_raise_naming_the_choices(bits):
    with pytest.raises(ValueError, match=r"\(1, 2, 3, 4\)"):
        lloyd_max_codebook(bits)


def test_tiny_dim_rejected():
    with pytest.raises(ValueError, match="dim must be >= 3"):
        lloyd_max_codebook(2, 2)
