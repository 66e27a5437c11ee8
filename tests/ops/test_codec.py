# SPDX-License-Identifier: Apache-2.0
"""Fused Triton encode/decode vs the plain-torch references (interpreter on CPU, kernels on CUDA)."""

import math

import pytest
import torch
import triton
import triton.language as tl

from turboquant_core.codebooks import codebook_tensors
from turboquant_core.index_polynomial import INDEX_POLYNOMIALS, magnitude_index
from turboquant_core.kernels.codec_jit import (
    _held_codebook,
    _pack_order_words,
    _pack_order_words_from_masks,
    _pack_order_words_from_polynomial,
)
from turboquant_core.ops.codec import (
    choose_encoder,
    decode,
    decode_ref,
    encode,
    encode_ref,
    packing_order_applies,
    unpack_segments,
)
from turboquant_core.ops.rotation_tables import (
    SQUARE_FRACTION_BITS,
    codec_tables,
    encoder_boundary_pairs,
    encoder_index_polynomial,
    packing_order,
    packing_order_rotation,
)
from turboquant_core.quantizer import split_segments
from turboquant_core.rotation import SUPPORTED_HEAD_DIMS, rotate

BITS = (2, 2.5, 3, 3.5, 4)
SEED = 0x7C01
# Kernel and reference compute the rotation in different orders; a scaled coordinate this close to
# a decision boundary may legitimately fall on either side.
BOUNDARY_EPS = 1e-4


def _rows(n, dim, seed, device, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    # Norms over six decades: the codec must not care.
    x = x * torch.logspace(-3, 3, n)[torch.randperm(n, generator=g)][:, None] if n > 1 else x
    return x.to(device=device, dtype=dtype)


def near_boundary(x: torch.Tensor, bits: float, seed: int) -> torch.Tensor:
    """[N, d] bool, rotated order: where the reference's scaled coordinate is within BOUNDARY_EPS of a boundary."""
    d = x.shape[-1]
    xf = x.float().reshape(-1, d)
    norm = xf.norm(dim=-1, keepdim=True)
    s = rotate(xf, seed) * torch.where(norm > 0, math.sqrt(d) / norm, torch.zeros_like(norm))
    parts, start = [], 0
    for n, b in split_segments(d, bits):
        _, bnd = codebook_tensors(b, d, xf.device)
        seg = s[:, start : start + n]
        parts.append((seg[..., None] - bnd).abs().amin(dim=-1) < BOUNDARY_EPS)
        start += n
    return torch.cat(parts, dim=-1)


def check_encode(x: torch.Tensor, bits: float, seed: int = SEED, norm_correction: bool = True, **launch):
    d = x.shape[-1]
    packed, scale = encode(x, bits, seed, norm_correction, **launch)
    ref_packed, ref_scale = encode_ref(x, bits, seed, norm_correction)
    assert packed.dtype == torch.uint8 and scale.dtype == torch.float16
    assert packed.shape == ref_packed.shape == (*x.shape[:-1], round(d * bits / 8))
    assert scale.shape == ref_scale.shape == x.shape[:-1]
    packed, scale = packed.reshape(-1, packed.shape[-1]), scale.reshape(-1)
    ref_packed, ref_scale = ref_packed.reshape(packed.shape), ref_scale.reshape(-1)

    near = near_boundary(x, bits, seed)
    differ = unpack_segments(packed, d, bits) != unpack_segments(ref_packed, d, bits)
    assert not (differ & ~near).any(), f"{int((differ & ~near).sum())} indices differ away from a boundary"
    clean = ~near.any(dim=-1)
    assert torch.equal(packed[clean], ref_packed[clean])
    # The scale is a norm ratio summed in another order: equal up to one fp16 rounding step.
    torch.testing.assert_close(scale[clean].float(), ref_scale[clean].float(), rtol=2**-10, atol=0)
    return packed, scale, ref_packed, ref_scale


def check_decode(packed, scale, dim, bits, seed=SEED, dtype=torch.float32):
    out = decode(packed, scale, dim, bits, seed, dtype)
    ref = decode_ref(packed, scale, dim, bits, seed, torch.float32)
    assert out.dtype == dtype and out.shape == (*packed.shape[:-1], dim)
    # Relative to each vector's norm (scale * ||c||, roughly scale * sqrt(d)).
    tol = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    atol = tol * scale.float().reshape(*scale.shape, 1) * math.sqrt(dim)
    err = (out.float() - ref).abs()
    assert torch.all(err <= atol + tol * ref.abs()), float((err - atol).max())
    return out


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dim", SUPPORTED_HEAD_DIMS)
def test_encode_decode_match_reference_every_dim_and_bits(device, dim, bits):
    n = 9 if dim == 512 else 37
    x = _rows(n, dim, seed=dim, device=device)
    _, _, ref_packed, ref_scale = check_encode(x, bits)
    check_decode(ref_packed, ref_scale, dim, bits)


@pytest.mark.parametrize("n", [1, 37, 97])
@pytest.mark.parametrize("dim,bits", [(80, 2.5), (128, 3), (128, 3.5), (192, 2)])
def test_odd_row_counts(device, n, dim, bits):
    x = _rows(n, dim, seed=n, device=device)
    _, _, ref_packed, ref_scale = check_encode(x, bits)
    check_decode(ref_packed, ref_scale, dim, bits)


@pytest.mark.parametrize("dim,bits", [(64, 3), (96, 3.5), (128, 4), (256, 2.5), (512, 3)])
def test_bf16_decode_single_product_stays_within_bf16_rounding(device, dim, bits):
    # bf16 outputs take one fp16 product for the inverse rotation (head dims <= 256): its error must stay
    # within bf16's own rounding of the fp32-path result (one ulp: Triton's interpreter truncates) plus
    # a small absolute term relative to the coordinates' RMS.
    x = _rows(64, dim, seed=5, device=device)
    packed, scale = encode(x, bits, SEED)
    f32 = decode(packed, scale, dim, bits, SEED, torch.float32)
    bf = decode(packed, scale, dim, bits, SEED, torch.bfloat16).float()
    coord_rms = f32.norm(dim=-1, keepdim=True) / math.sqrt(dim)
    assert torch.all((bf - f32).abs() <= 2**-7 * f32.abs() + 2**-9 * coord_rms)
    # fp16 outputs keep the hi/lo products: the fp32 result rounded to fp16 (half an ulp) plus fp16's
    # rounding at the coordinates' RMS scale. On an H100 the fp16-output kernel was measured up to
    # 2^-10.6 of the RMS away from the fp32 one at d = 256 (two segments), more than fp32 accumulation
    # order alone; the interpreter matches exactly.
    f16 = decode(packed, scale, dim, bits, SEED, torch.float16).float()
    assert torch.all((f16 - f32).abs() <= 2**-11 * f32.abs() + 2**-10 * coord_rms + 2**-24)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("dim,bits", [(64, 4), (112, 3.5), (128, 2), (256, 2.5)])
def test_input_and_output_dtypes(device, dtype, dim, bits):
    x = _rows(21, dim, seed=3, device=device).clamp(-6e4, 6e4).to(dtype)
    _, _, ref_packed, ref_scale = check_encode(x, bits)
    check_decode(ref_packed, ref_scale, dim, bits, dtype=dtype)


@pytest.mark.filterwarnings("error::RuntimeWarning")  # the interpreter's numpy flags an fp16 overflow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim,bits", [(64, 3), (128, 4), (256, 2.5)])
def test_16bit_inputs_over_their_whole_range(device, dtype, dim, bits):
    # 16-bit inputs with a Hadamard rotation take one exact fp16 product; bf16 rows are first scaled by a
    # power of two from their norm. Norms from near the bottom to near the top of each format (fp16 up to
    # its 65504 entries, bf16 from 1e-30 to 1e17: norms above ~1.8e19 overflow the fp32 sum of squares, in the
    # reference too), plus rows whose entries span many decades.
    g = torch.Generator().manual_seed(11)
    lo, hi = (-6, 4) if dtype == torch.float16 else (-30, 17)
    x = torch.randn(48, dim, generator=g) * torch.logspace(lo, hi, 48)[:, None]
    # entries over many decades; in bf16 the first rows' sum of squares underflows to 0
    x[:4] *= torch.logspace(-20 if dtype == torch.bfloat16 else -4, 0, dim)
    x = (x.clamp(-6e4, 6e4) if dtype == torch.float16 else x).to(device, dtype)
    # Rows whose reference scale rounds to a zero fp16 (norms below ~1e-7) decode to zero whatever their
    # indices, which then depend on denormal handling: GPUs flush squares below ~1e-38 to zero, the CPU not.
    zero = encode_ref(x.float(), bits, SEED)[1] == 0
    packed, scale = encode(x[zero], bits, SEED)
    assert torch.all(scale == 0) and torch.all(decode(packed, scale, dim, bits, SEED) == 0)
    check_encode(x[~zero], bits)


@pytest.mark.parametrize("bits", [2, 3.5, 4])
def test_without_norm_correction(device, bits):
    x = _rows(37, 96, seed=5, device=device)
    check_encode(x, bits, norm_correction=False)


@pytest.mark.parametrize("dim,bits", [(64, 2), (80, 3.5), (128, 3), (512, 2.5)])
def test_zero_vectors_encode_to_zero_scale_and_decode_to_zero(device, dim, bits):
    x = _rows(5, dim, seed=1, device=device)
    x[1] = 0
    x[4] = 0
    packed, scale = encode(x, bits, SEED)
    assert scale[1].item() == 0 and scale[4].item() == 0
    out = decode(packed, scale, dim, bits, SEED)
    assert torch.isfinite(out).all()
    assert torch.all(out[1] == 0) and torch.all(out[4] == 0)
    check_encode(x, bits)


def test_leading_dims_and_strided_rows(device):
    wide = _rows(3 * 5, 128 + 16, seed=2, device=device).reshape(3, 5, 144)
    x = wide[..., :128]  # rows 144 elements apart: the kernel must honour the row stride
    assert not x.is_contiguous()
    packed, scale, _, _ = check_encode(x, 3)
    packed3, scale3 = encode(x, 3, SEED)
    assert packed3.shape == (3, 5, 48) and scale3.shape == (3, 5)
    out = check_decode(packed3, scale3, 128, 3)
    assert out.shape == (3, 5, 128)


def test_empty_batch(device):
    x = torch.zeros(0, 128, device=device)
    packed, scale = encode(x, 3, SEED)
    assert packed.shape == (0, 48) and scale.shape == (0,)
    assert decode(packed, scale, 128, 3, SEED).shape == (0, 128)


def test_decode_round_trip_error_matches_quantizer_theory(device):
    # End to end through the kernels: relative squared error near the 4-bit Lloyd-Max value at d=128.
    x = _rows(512, 128, seed=7, device=device)
    packed, scale = encode(x, 4, SEED)
    out = decode(packed, scale, 128, 4, SEED)
    rel = ((out - x) ** 2).sum(-1) / (x**2).sum(-1)
    assert rel.mean().item() == pytest.approx(0.0093, rel=0.15)


def test_shape_errors(device):
    with pytest.raises(ValueError, match="expected 48 packed bytes for d=128, bits=3, got 40"):
        decode(torch.zeros(2, 40, dtype=torch.uint8, device=device), torch.zeros(2, device=device), 128, 3, SEED)
    with pytest.raises(ValueError, match="supported head dims"):
        encode(torch.zeros(2, 100, device=device), 3, SEED)
    with pytest.raises(ValueError, match="MSE bits must be one of"):
        encode(torch.zeros(2, 128, device=device), 5, SEED)


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("block_rows,num_warps", [(16, 2), (32, None), (128, 8)])
def test_launch_configuration_does_not_change_the_encoding(device, dim, block_rows, num_warps):
    # Rows are encoded independently: other tile sizes give the same indices (the fp16 scale may move by
    # one rounding step, the norm being summed in another order) and decode to the same values. d = 64 runs
    # the in-register transform, whose rows per program differ from the warps' threads here.
    x = _rows(70, dim, seed=3, device=device)
    packed, scale = encode(x, 3, SEED)
    p2, s2 = encode(x, 3, SEED, block_rows=block_rows, num_warps=num_warps)
    assert torch.equal(unpack_segments(p2, dim, 3), unpack_segments(packed, dim, 3))
    torch.testing.assert_close(s2.float(), scale.float(), rtol=2**-10, atol=0)
    out = decode(packed, scale, dim, 3, SEED)
    out2 = decode(packed, scale, dim, 3, SEED, block_rows=block_rows, num_warps=num_warps)
    torch.testing.assert_close(out2, out, rtol=1e-5, atol=1e-5)


def test_bad_launch_configuration(device):
    x = torch.zeros(2, 128, device=device)
    with pytest.raises(ValueError, match="block_rows must be a power of two >= 16, got 24"):
        encode(x, 3, SEED, block_rows=24)
    with pytest.raises(ValueError, match="num_warps must be one of 1, 2, 4, 8, 16, got 3"):
        encode(x, 3, SEED, num_warps=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [1, 2, 2.5, 3, 3.5, 4])
def test_encoder_matches_the_reference_at_head_dim_64(device, dtype, bits):
    # The products (fp32 rows, two-segment formats, 1 bit) and the packing-order encoder (16-bit rows, one
    # segment) against the reference, including an all-zero row (every coordinate 0: the reference's index H - 1).
    x = _rows(37, 64, seed=13, device=device).clamp(-6e4, 6e4).to(dtype)
    x[5] = 0
    check_encode(x, bits)


def test_encoder_choice():
    bf16, f32 = torch.bfloat16, torch.float32
    assert choose_encoder(codec_tables(128, 3, SEED), bf16) == "packing_order"
    assert choose_encoder(codec_tables(128, 3, SEED), torch.float16) == "packing_order"
    assert choose_encoder(codec_tables(128, 3, SEED), f32) == "products"  # fp32 rows: no exact 16-bit product
    assert choose_encoder(codec_tables(128, 3.5, SEED), bf16) == "products"  # two segments
    assert choose_encoder(codec_tables(64, 3, SEED), bf16) == "packing_order"
    assert choose_encoder(codec_tables(64, 3, SEED), f32) == "products"
    assert choose_encoder(codec_tables(64, 2.5, SEED), bf16) == "products"
    assert choose_encoder(codec_tables(96, 3, SEED), bf16) == "products"
    assert choose_encoder(codec_tables(256, 4, SEED), bf16) == "packing_order"
    assert choose_encoder(codec_tables(512, 4, SEED), bf16) == "products"
    assert [d for d in (64, 128, 256) for b in (2, 3, 4) if packing_order_applies(codec_tables(d, b, SEED), bf16)] \
        == [64] * 3 + [128] * 3 + [256] * 3


def test_packing_order_is_a_permutation_with_a_groups_slots_in_register_bits():
    for dim in (32, 64, 128, 256):
        order = packing_order(dim)
        assert sorted(order.tolist()) == list(range(dim))
        n = torch.arange(dim)
        slot, group = order // (dim // 8), order % (dim // 8)
        # The slot is a function of bits 0, 3, 4 of the column only; lane bits 1, 2 pick the group.
        assert torch.equal(slot, 4 * ((n >> 4) & 1) + 2 * ((n >> 3) & 1) + (n & 1))
        assert torch.equal(group // (dim // 32), 2 * ((n >> 2) & 1) + ((n >> 1) & 1))
    rot = packing_order_rotation(128, 3, SEED, "cpu", torch.bfloat16)
    assert rot.shape == (128, 128) and rot.dtype == torch.bfloat16
    assert torch.equal(rot.float().abs(), torch.ones(128, 128))
    with pytest.raises(ValueError, match="power-of-two dim >= 32, got 96"):
        packing_order(96)
    with pytest.raises(ValueError, match="one segment and a Hadamard rotation"):
        packing_order_rotation(128, 3.5, SEED, "cpu", torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_packing_order_encoder_matches_the_reference(device, dtype, dim, bits):
    # Rows over six decades of norms, an all-zero row, and a count that leaves the last tile partly empty.
    x = _rows(75, dim, seed=17, device=device).to(dtype)
    x[6] = 0
    assert choose_encoder(codec_tables(dim, bits, SEED), dtype) == "packing_order"
    packed, scale, _, _ = check_encode(x, bits)
    assert scale[6] == 0


@pytest.mark.parametrize("block_rows,num_warps", [(16, 2), (64, 4), (128, 8)])
def test_packing_order_encoder_launches_and_many_tiles_per_program(device, block_rows, num_warps):
    # On a GPU, 1100 rows in tiles of 16 are 69 tiles: programs loop over several (two programs per SM).
    x = _rows(1100 if device == "cuda" else 70, 128, seed=19, device=device).to(torch.bfloat16)
    check_encode(x, 3, block_rows=block_rows, num_warps=num_warps)


def _round_toward_zero_f16(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> the fp16 number next to x toward zero (PTX cvt.rz), as fp32."""
    h = x.half().float()
    over = h.abs() > x.abs()
    step = torch.nextafter(h.half(), torch.zeros_like(h).half()).float()
    return torch.where(over, step, h)


def test_round_toward_zero_fp16_compares_decide_as_fp32_against_the_thresholds():
    # The packed fp16 search rests on this: every threshold is an fp16 number, so rounding |s| toward zero
    # to fp16 never moves it across one. Coordinates right at and around every threshold, and random ones.
    for bits in (2, 3, 4):
        _, bnd = codebook_tensors(bits, 128)
        pos = bnd[bnd > 0]
        assert torch.equal(pos.half().float(), pos)
        ulp = torch.tensor(2.0**-23)
        near = (pos[:, None] * (1 + ulp * torch.arange(-64, 65))).flatten()
        s = torch.cat([near, torch.randn(100_000, generator=torch.Generator().manual_seed(3)).abs() * 1.5])
        a = _round_toward_zero_f16(s)
        assert torch.equal(a[:, None] >= pos, s[:, None] >= pos)
    with pytest.raises(ValueError, match="fp16 numbers"):
        encoder_boundary_pairs(torch.tensor([-0.1, 0.0, 0.1]))
    words = encoder_boundary_pairs(codebook_tensors(3, 128)[1])
    halves = torch.stack([words & 0xFFFF, words >> 16], -1).to(torch.int16).view(torch.float16).float()
    assert torch.equal(halves[:, 0], halves[:, 1]) and torch.equal(halves[:, 0], codebook_tensors(3, 128)[1][4:])


def _pair_masks(s: torch.Tensor, bnd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``codec_jit._pair_threshold_masks`` computes, per pair of a packing-order tile [BN, D]: (threshold
    masks [H-1, BN, 4, D/32, 2, 2], sign mask [BN, 4, D/32, 2, 2]) as int32 words, 0xFFFF per set 16-bit lane."""
    bn, d = s.shape
    s6 = s.reshape(bn, d // 32, 2, 2, 2, 2, 2).permute(0, 4, 5, 1, 2, 3, 6).reshape(bn, 4, d // 32, 2, 2, 2)
    a = _round_toward_zero_f16(s6)

    def word(lanes):
        w = lanes[..., 0].long() * 0xFFFF + lanes[..., 1].long() * 0xFFFF0000
        return (w - (w >= 2**31).long() * 2**32).int()

    pos = bnd[bnd > 0]
    return torch.stack([word(a.abs() >= b) for b in pos]).contiguous(), word(a <= 0).contiguous()


@triton.jit
def _paired_words_probe(S, MASKS, NEG, LEV, BND, WORD, WORD_REF, SUMSQ, SUMSQ_REF,
                        BN: tl.constexpr, D: tl.constexpr, B: tl.constexpr):
    r = tl.arange(0, BN)
    i = tl.arange(0, D)
    bnd, lev = _held_codebook(BND, LEV, 1 << B)
    word_ref, sumsq_ref = _pack_order_words(tl.load(S + r[:, None] * D + i[None, :]), bnd, lev, B)
    q = tl.arange(0, 4)[None, :, None, None, None] * (D // 8)
    n5 = tl.arange(0, D // 32)[None, None, :, None, None] * 4
    pair = r[:, None, None, None, None] * (D // 2) + q + n5 + tl.arange(0, 2)[None, None, None, :, None] * 2
    pair = pair + tl.arange(0, 2)[None, None, None, None, :]
    masks = ()
    for m in tl.static_range((1 << (B - 1)) - 1):
        masks = masks + (tl.load(MASKS + m * BN * D // 2 + pair).to(tl.uint32, bitcast=True),)
    neg = tl.load(NEG + pair).to(tl.uint32, bitcast=True)
    word, sumsq = _pack_order_words_from_masks(masks, neg, lev, B)
    g = tl.arange(0, D // 8)
    tl.store(WORD + r[:, None] * (D // 8) + g[None, :], word.to(tl.int32, bitcast=True))
    tl.store(WORD_REF + r[:, None] * (D // 8) + g[None, :], word_ref.to(tl.int32, bitcast=True))
    tl.store(SUMSQ + r, sumsq)
    tl.store(SUMSQ_REF + r, sumsq_ref)


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_packed_fp16_search_counts_and_packs_as_the_fp32_search(device, dim, bits):
    # The arithmetic after the packed compares (lane counts through carries, the sign flip, the field
    # merges, c^2 from threshold counts), fed the masks the compares make, against the fp32 search
    # (``_pack_order_words``, which the encoder tests check against the reference). Rows with every
    # coordinate in one cell, exact zeros, and scaled coordinates spread over all cells.
    tables = codec_tables(dim, bits, SEED)
    bn = 16
    s = torch.randn(bn, dim, generator=torch.Generator().manual_seed(5)) * 1.3
    s[0] = 3.5  # all in the outermost cell: every threshold passed by every coordinate
    s[1] = -3.5
    s[2] = 0.0
    s[3, ::3] = 0.0
    masks, neg = _pair_masks(s, tables.boundaries[0])
    dev = torch.device(device)
    out = {k: torch.empty(bn, dim // 8, dtype=torch.int32, device=dev) for k in ("word", "word_ref")}
    sumsq = {k: torch.empty(bn, device=dev) for k in ("sumsq", "sumsq_ref")}
    _paired_words_probe[(1,)](s.to(dev), masks.to(dev), neg.to(dev), tables.levels[0].to(dev),
                              tables.boundaries[0].to(dev), out["word"], out["word_ref"], sumsq["sumsq"],
                              sumsq["sumsq_ref"], BN=bn, D=dim, B=bits)
    assert torch.equal(out["word"], out["word_ref"])
    # Both against the sum of c^2 over the reference quantizer's indices (the kernels' c^2 are within 2^-20).
    centroids, thresholds = codebook_tensors(bits, dim)
    exact = (centroids[(s[..., None] > thresholds).sum(-1)] ** 2).sum(-1)
    torch.testing.assert_close(sumsq["sumsq"].cpu(), exact, rtol=2**-18, atol=0)
    if device == "cpu":
        # On an H200 the fp32 search's row sums came out wrong in this probe's tile layout (loaded rows, not
        # the encoder's product accumulator), rows mixed by the reduction over the permuted tile; its words
        # were right. The encoder itself, in the accumulator layout, matches the reference's scales.
        torch.testing.assert_close(sumsq["sumsq_ref"].cpu(), exact, rtol=2**-18, atol=0)


def _pair_tile_of(s: torch.Tensor) -> torch.Tensor:
    bn, d = s.shape
    return s.reshape(bn, d // 32, 2, 2, 2, 2, 2).permute(0, 4, 5, 1, 2, 3, 6).reshape(bn, 4, d // 32, 2, 2, 2)


def _lane_words(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    w = lo.long() + (hi.long() << 16)
    return (w - (w >= 2**31).long() * 2**32).int().contiguous()


def _polynomial_lanes(s: torch.Tensor, dim: int):
    """What ``codec_jit._index_polynomial_lanes`` computes, per pair of a packing-order tile [BN, D], from the
    stored polynomial and the codebook: (index lanes, g low bytes, g high bytes) as int32 words [BN, 4, D/32, 2, 2]."""
    a = _round_toward_zero_f16(_pair_tile_of(s)).double()
    k = torch.from_numpy(magnitude_index(a.abs().numpy(), INDEX_POLYNOMIALS[(4, dim)]))
    idx = torch.where(a <= 0, 7 - k, 8 + k)
    half = codebook_tensors(4, dim)[0].double()[8:]
    g = torch.round((half[k] ** 2 - half[0] ** 2) * 2**SQUARE_FRACTION_BITS).long()
    return (_lane_words(idx[..., 0], idx[..., 1]), _lane_words(g[..., 0] & 0xFF, g[..., 1] & 0xFF),
            _lane_words(g[..., 0] >> 8, g[..., 1] >> 8)), idx


@triton.jit
def _polynomial_words_probe(S, IDX, GLO, GHI, POLY, LEV, BND, WORD, WORD_REF, SUMSQ,
                            BN: tl.constexpr, D: tl.constexpr):
    r = tl.arange(0, BN)
    i = tl.arange(0, D)
    bnd, lev = _held_codebook(BND, LEV, 16)
    word_ref, _ = _pack_order_words(tl.load(S + r[:, None] * D + i[None, :]), bnd, lev, 4)
    q = tl.arange(0, 4)[None, :, None, None, None] * (D // 8)
    n5 = tl.arange(0, D // 32)[None, None, :, None, None] * 4
    pair = r[:, None, None, None, None] * (D // 2) + q + n5 + tl.arange(0, 2)[None, None, None, :, None] * 2
    pair = pair + tl.arange(0, 2)[None, None, None, None, :]
    idx = tl.load(IDX + pair).to(tl.uint32, bitcast=True)
    glo = tl.load(GLO + pair).to(tl.uint32, bitcast=True)
    ghi = tl.load(GHI + pair).to(tl.uint32, bitcast=True)
    word, sumsq = _pack_order_words_from_polynomial(idx, glo, ghi, tl.load(POLY + 10))
    g = tl.arange(0, D // 8)
    tl.store(WORD + r[:, None] * (D // 8) + g[None, :], word.to(tl.int32, bitcast=True))
    tl.store(WORD_REF + r[:, None] * (D // 8) + g[None, :], word_ref.to(tl.int32, bitcast=True))
    tl.store(SUMSQ + r, sumsq)


@pytest.mark.parametrize("dim", [64, 128, 256])
def test_index_polynomial_search_decides_counts_and_packs_as_the_thresholds(device, dim):
    # The polynomial's decisions (emulated in fp16 as the PTX computes them) are the reference quantizer's, and
    # the arithmetic after it (field merges, c^2 from the byte lanes) gives the fp32 search's words and the
    # rows' sum of c^2 within 2^-14 per coordinate. Rows in the outermost cells, exact zeros, and coordinates
    # spread over all cells, some right at the thresholds.
    tables = codec_tables(dim, 4, SEED)
    bn = 16
    s = torch.randn(bn, dim, generator=torch.Generator().manual_seed(7)) * 1.3
    s[0], s[1], s[2] = 3.5, -3.5, 0.0
    s[3, ::3] = 0.0
    thresholds = tables.boundaries[0]
    s[4, : thresholds.numel()] = thresholds
    s[5, : thresholds.numel()] = torch.nextafter(thresholds, torch.full_like(thresholds, -10.0))
    (idx, glo, ghi), lanes = _polynomial_lanes(s, dim)
    # Ties at a threshold count as reaching it here (the reference puts them below): row 4 is all ties.
    ref = (_pair_tile_of(s)[..., None] > thresholds).sum(-1)
    tie = (_pair_tile_of(s)[..., None] == thresholds[thresholds > 0]).any(-1)
    assert torch.equal(lanes[~tie], ref[~tie]) and torch.equal(lanes[tie], ref[tie] + 1)
    # The fp32 search puts ties inward on both sides: compare it on the ties moved outward by one step.
    s_ref = torch.where(torch.isin(s, thresholds[thresholds != 0]), torch.nextafter(s, 10.0 * torch.sign(s)), s)
    dev = torch.device(device)
    out = {k: torch.empty(bn, dim // 8, dtype=torch.int32, device=dev) for k in ("word", "word_ref")}
    sumsq = torch.empty(bn, device=dev)
    _polynomial_words_probe[(1,)](s_ref.to(dev), idx.to(dev), glo.to(dev), ghi.to(dev),
                                  tables.index_polynomial.to(dev), tables.levels[0].to(dev), thresholds.to(dev),
                                  out["word"], out["word_ref"], sumsq, BN=bn, D=dim)
    bad = (out["word"] != out["word_ref"]).any(1).nonzero().flatten().tolist()
    assert not bad, bad
    centroids = codebook_tensors(4, dim)[0].double()
    exact = (centroids[(s_ref[..., None] > thresholds).sum(-1)] ** 2).sum(-1)
    assert torch.all((sumsq.cpu().double() - exact).abs() <= dim * 2.0**-14 + exact * 2.0**-20)


def test_index_polynomial_tables_hold_the_coefficients_and_c_squared_bytes():
    for dim in (64, 128, 256):
        t = codec_tables(dim, 4, SEED)
        words = t.index_polynomial.long() & 0xFFFFFFFF
        assert t.index_polynomial.dtype == torch.int32 and words.shape == (11,)
        coeffs = INDEX_POLYNOMIALS[(4, dim)].coefficients()
        lo16 = (words[:6] & 0xFFFF).to(torch.int16).view(torch.float16).double()
        assert torch.equal(words[:6] >> 16, words[:6] & 0xFFFF) and lo16.tolist() == list(coeffs)
        g_bytes = torch.stack([(words[6:10] >> (8 * i)) & 0xFF for i in range(4)], 1)  # [word, byte]
        g = torch.cat([g_bytes[0], g_bytes[1]]) + 256 * torch.cat([g_bytes[2], g_bytes[3]])
        half = codebook_tensors(4, dim)[0].double()[8:]
        assert g[0] == 0
        torch.testing.assert_close(g.double() / 2**SQUARE_FRACTION_BITS, half**2 - half[0] ** 2, atol=2**-14, rtol=0)
        assert t.index_polynomial[10].view(torch.float32) == half[0].float() ** 2
    assert codec_tables(128, 3, SEED).index_polynomial is None and codec_tables(96, 4, SEED).index_polynomial is None
    assert codec_tables(128, 3.5, SEED).index_polynomial is None
    assert encoder_index_polynomial(4, 80, codebook_tensors(4, 80)[0]) is None
