# SPDX-License-Identifier: Apache-2.0
import math

import pytest
import torch

from turboquant_core.rotation import (
    SUPPORTED_HEAD_DIMS,
    check_head_dim,
    fwht,
    hadamard_signs,
    is_power_of_two,
    rotate,
    rotation_kind,
    rotation_matrix,
    unrotate,
)


def _hadamard(n):
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@pytest.mark.parametrize("dim", SUPPORTED_HEAD_DIMS)
def test_rotation_is_orthogonal(dim):
    r = rotation_matrix(dim, seed=11, dtype=torch.float64)
    eye = torch.eye(dim, dtype=torch.float64)
    torch.testing.assert_close(r @ r.T, eye, atol=1e-12, rtol=0)
    torch.testing.assert_close(r.T @ r, eye, atol=1e-12, rtol=0)


@pytest.mark.parametrize("dim", SUPPORTED_HEAD_DIMS)
def test_rotation_is_determined_by_dim_and_seed(dim):
    a = rotation_matrix(dim, seed=5)
    assert torch.equal(a, rotation_matrix(dim, seed=5))
    assert not torch.allclose(a, rotation_matrix(dim, seed=6))


def test_rotation_kind_by_dim():
    assert [rotation_kind(d) for d in SUPPORTED_HEAD_DIMS] == [
        "hadamard" if is_power_of_two(d) else "orthogonal" for d in SUPPORTED_HEAD_DIMS
    ]
    assert rotation_kind(80) == "orthogonal" and rotation_kind(128) == "hadamard"


@pytest.mark.parametrize("dim", [d for d in SUPPORTED_HEAD_DIMS if is_power_of_two(d)])
def test_hadamard_rotation_is_signed_hadamard(dim):
    # R = H D / sqrt(d): entries exactly +-1/sqrt(d), the kernels rely on that.
    r = rotation_matrix(dim, seed=3, dtype=torch.float64)
    d = torch.diag(hadamard_signs(dim, 3).double())
    torch.testing.assert_close(r, _hadamard(dim) @ d / math.sqrt(dim), atol=1e-15, rtol=0)
    assert set(hadamard_signs(dim, 3).tolist()) <= {-1.0, 1.0}


@pytest.mark.parametrize("n", [1, 2, 8, 64, 512])
def test_fwht_matches_hadamard_matrix(n):
    x = torch.randn(7, n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    torch.testing.assert_close(fwht(x), x @ _hadamard(n).T, atol=1e-10, rtol=0)


def test_fwht_keeps_leading_dims_and_is_its_own_inverse_up_to_scale():
    x = torch.randn(3, 5, 32, dtype=torch.float64)
    y = fwht(x)
    assert y.shape == x.shape
    torch.testing.assert_close(fwht(y) / 32, x)


def test_fwht_rejects_non_power_of_two():
    with pytest.raises(ValueError, match="power-of-two"):
        fwht(torch.zeros(2, 96))


@pytest.mark.parametrize("dim", SUPPORTED_HEAD_DIMS)
def test_rotate_matches_matrix_and_unrotate_inverts(dim):
    x = torch.randn(37, dim, generator=torch.Generator().manual_seed(dim))
    r = rotation_matrix(dim, seed=9)
    y = rotate(x, seed=9)
    torch.testing.assert_close(y, x @ r.T, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(unrotate(y, seed=9), x, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), atol=1e-4, rtol=1e-5)


def test_rotate_accepts_half_precision_and_leading_dims():
    x = torch.randn(2, 3, 128).to(torch.bfloat16)
    y = rotate(x, seed=1)
    assert y.dtype == torch.float32 and y.shape == (2, 3, 128)
    torch.testing.assert_close(y, x.float() @ rotation_matrix(128, 1).T, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dim", SUPPORTED_HEAD_DIMS)
def test_rotation_spreads_a_spike_over_all_coordinates(dim):
    # Why rotate: an outlier channel becomes d coordinates of size ~1/sqrt(d) that the codebook covers.
    spike = torch.zeros(1, dim)
    spike[0, dim // 3] = 1.0
    s = rotate(spike, seed=4)[0] * math.sqrt(dim)
    if is_power_of_two(dim):
        torch.testing.assert_close(s.abs(), torch.ones(dim), atol=1e-5, rtol=0)
    else:
        assert s.abs().max().item() < 4.5
        assert s.pow(2).mean().item() == pytest.approx(1.0, rel=1e-4)


@pytest.mark.parametrize("dim", [0, 63, 100, 127, 1024])
def test_unsupported_dim_message_lists_supported(dim):
    with pytest.raises(ValueError, match=r"supported head dims: 64, 80, 96, 112, 128, 192, 256, 512"):
        check_head_dim(dim)
    with pytest.raises(ValueError, match=f"head_dim {dim} is not supported"):
        rotation_matrix(dim, seed=0)


def test_hadamard_signs_need_power_of_two():
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard_signs(80, 0)
