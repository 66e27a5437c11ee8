# SPDX-License-Identifier: Apache-2.0
import math

import pytest
import torch

from turboquant_core.codebooks import lloyd_max_codebook
from turboquant_core.quantizer import FP8_MAX, FP8Quantizer, MSEQuantizer, QJLQuantizer, split_segments
from turboquant_core.rotation import SUPPORTED_HEAD_DIMS

N_VECTORS = 20_000  # enough for a 3% check at d=128 (standard error of the mean MSE is ~0.3%)


def _unit(n, d, seed):
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(seed))
    return x / x.norm(dim=-1, keepdim=True)


def _theory(d, bits):
    return sum(n * lloyd_max_codebook(b, d).mse for n, b in split_segments(d, bits)) / d


@pytest.fixture(scope="module")
def unit128():
    return _unit(N_VECTORS, 128, seed=1)


def test_split_segments():
    assert split_segments(128, 3) == ((128, 3),)
    assert split_segments(128, 2.5) == ((64, 3), (64, 2))
    assert split_segments(80, 3.5) == ((40, 4), (40, 3))
    assert split_segments(96, 1.5) == ((48, 2), (48, 1))
    with pytest.raises(ValueError, match="1, 1.5, 2, 2.5, 3, 3.5, 4"):
        split_segments(128, 5)


@pytest.mark.parametrize("bits", [2, 2.5, 3, 3.5, 4])
@pytest.mark.parametrize("norm_correction", [False, True])
def test_mse_matches_lloyd_max_theory_at_d128(unit128, bits, norm_correction):
    q = MSEQuantizer(128, bits, norm_correction=norm_correction, seed=3)
    mse = ((q.dequantize(q.quantize(unit128)) - unit128) ** 2).sum(-1).mean().item()
    assert mse == pytest.approx(_theory(128, bits), rel=0.03)


def test_mse_theory_values_at_d128_are_the_papers():
    # ~0.1175 / 0.0345 / 0.0095 (Gaussian limit); the exact d=128 values sit slightly below.
    for bits, paper in ((2, 0.1175), (3, 0.0345), (4, 0.0095)):
        assert _theory(128, bits) == pytest.approx(paper, rel=0.03)


def test_plain_mse_quantizer_error_is_not_norm_dependent(unit128):
    q = MSEQuantizer(128, 3, norm_correction=False, seed=3)
    x = unit128[:2000] * 37.5
    rel = ((q.dequantize(q.quantize(x)) - x) ** 2).sum(-1).mean().item() / 37.5**2
    assert rel == pytest.approx(_theory(128, 3), rel=0.05)


@pytest.mark.parametrize("dim", SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("bits", [2, 3.5])
def test_norm_correction_preserves_norm_to_fp16(dim, bits):
    x = torch.randn(257, dim, generator=torch.Generator().manual_seed(dim)) * torch.logspace(-3, 3, 257)[:, None]
    q = MSEQuantizer(dim, bits, norm_correction=True, seed=1)
    x_hat = q.dequantize(q.quantize(x))
    ratio = x_hat.norm(dim=-1) / x.norm(dim=-1)
    torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=2**-10, rtol=0)


def test_without_norm_correction_norm_shrinks(unit128):
    # Lloyd-Max reconstructions have E||c||^2 = d (1 - D): the plain quantizer loses energy.
    q = MSEQuantizer(128, 2, norm_correction=False, seed=3)
    sq = q.dequantize(q.quantize(unit128)).pow(2).sum(-1).mean().item()
    assert sq == pytest.approx(1 - _theory(128, 2), rel=0.01)


def test_quantize_outputs_and_zero_vector():
    q = MSEQuantizer(96, 2.5, seed=0)
    x = torch.randn(4, 96)
    x[2] = 0
    m = q.quantize(x)
    assert m.idx.dtype == torch.uint8 and m.idx.shape == (4, 96)
    assert int(m.idx[..., :48].max()) < 8 and int(m.idx[..., 48:].max()) < 4
    assert m.scale.shape == (4,) and m.scale[2] == 0
    assert torch.equal(m.scale, m.scale.half().float())  # the stored value is an fp16
    x_hat = q.dequantize(m)
    assert torch.all(x_hat[2] == 0) and torch.isfinite(x_hat).all()


def test_rotated_values_identity_for_inner_products(unit128):
    # <q, x_hat> = scale * <R q, c[idx]>: attention can stay in the rotated domain.
    from turboquant_core.rotation import rotate

    qz = MSEQuantizer(128, 3, seed=5)
    m = qz.quantize(unit128[:100])
    queries = torch.randn(100, 128)
    direct = (queries * qz.dequantize(m)).sum(-1)
    rotated = (rotate(queries, 5) * qz.rotated_values(m)).sum(-1)
    torch.testing.assert_close(direct, rotated, atol=1e-5, rtol=1e-5)


def test_quantizer_rejects_wrong_dims():
    with pytest.raises(ValueError, match="supported head dims"):
        MSEQuantizer(100, 3)
    with pytest.raises(ValueError, match="expected last dim 128, got 64"):
        MSEQuantizer(128, 3).quantize(torch.zeros(2, 64))
    with pytest.raises(ValueError, match="QJL bits must be one of 2, 3, 4"):
        QJLQuantizer(128, 1)


def _ip_error_z(x_hat, x, q):
    e = ((x_hat - x) * q).sum(-1).double()
    return e.mean().item(), e.mean().item() / (e.std().item() / math.sqrt(len(e)))


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_qjl_inner_products_are_unbiased_and_mse_ones_are_not(unit128, bits):
    y = _unit(N_VECTORS, 128, seed=2)
    q = unit128 + y
    q = q / q.norm(dim=-1, keepdim=True)  # <q, x> ~ 0.7, so a multiplicative bias shows
    qjl = QJLQuantizer(128, bits, seed=1)
    mean, z = _ip_error_z(qjl.dequantize(qjl.quantize(unit128)), unit128, q)
    assert abs(z) < 4, (mean, z)
    mq = MSEQuantizer(128, bits, norm_correction=False, seed=1)
    mse_mean, mse_z = _ip_error_z(mq.dequantize(mq.quantize(unit128)), unit128, q)
    # The plain MSE quantizer shrinks inner products by about D <q, x>.
    assert mse_z < -20
    assert mse_mean == pytest.approx(-_theory(128, bits) * 0.7, rel=0.1)


def test_qjl_outputs():
    qjl = QJLQuantizer(64, 3, seed=0)
    x = torch.randn(5, 64)
    out = qjl.quantize(x)
    assert out.idx.shape == out.signs.shape == (5, 64)
    assert set(out.signs.unique().tolist()) <= {0, 1}
    assert int(out.idx.max()) < 4  # 2-bit MSE part
    torch.testing.assert_close(out.norm, x.norm(dim=-1))
    assert qjl.dequantize(out).shape == (5, 64)


@pytest.mark.parametrize("dim", [64, 80, 128, 512])
def test_fp8_round_trip(dim):
    x = torch.randn(300, dim, generator=torch.Generator().manual_seed(0))
    q = FP8Quantizer(dim, seed=2)
    code = q.quantize(x)
    assert code.dtype == torch.uint8 and code.shape == (300, dim)  # one byte per coordinate
    x_hat = q.dequantize(code)
    rel = ((x_hat - x) ** 2).sum(-1) / (x**2).sum(-1)
    # e4m3 keeps 3 mantissa bits: relative error per coordinate <= 2^-4, mean squared ~ 2^-8 / 3.
    assert rel.max().item() < 2**-8
    assert rel.mean().item() == pytest.approx(2**-8 / 3 * 1.0, rel=0.5)


def test_fp8_clamps_instead_of_overflowing():
    q = FP8Quantizer(64, seed=0)
    x = torch.full((1, 64), 1e6)
    x_hat = q.dequantize(q.quantize(x))
    assert torch.isfinite(x_hat).all()
    from turboquant_core.rotation import rotate

    assert rotate(x_hat, 0).abs().max().item() == pytest.approx(FP8_MAX, rel=1e-5)
