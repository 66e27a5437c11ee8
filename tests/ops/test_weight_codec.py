# SPDX-License-Identifier: Apache-2.0
"""TurboQuant weight storage and its reference codec (turboquant_core/ops/weight_codec.py): exact bytes, the
rotated-domain product against decode-then-matmul, the error the codebook promises, what rotation + codebook
buy over round-to-nearest at the same bytes, and how far the decode batches' int8 product is from the exact one."""

import math

import pytest
import torch

from turboquant_core.formats import WEIGHT_FORMATS, get_format, get_weight_format
from turboquant_core.ops.weight_codec import (
    TQWeight,
    dequantize_weight,
    from_kernel_words,
    int8_codebook,
    quantize_weight,
    rotated_weight,
    served_layout,
    sign_magnitude,
    to_kernel_words,
    tq_linear_int8_reference,
    tq_linear_reference,
)
from turboquant_core.packing import unpack_indices

FORMATS = list(WEIGHT_FORMATS)


def _weight(out=96, inp=384, seed=0, heavy=False):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * 0.02
    if heavy:  # a few outlier input channels, as trained layers have
        w[:, torch.randperm(inp, generator=g)[:4]] *= 25
    return w


def test_format_rows():
    tq4, tq3 = get_weight_format("tq4"), get_weight_format("tq3")
    assert (tq4.bytes_per_group(), tq3.bytes_per_group()) == (66, 50)  # 128 x bits / 8 + an fp16 scale
    assert (tq4.bits_per_weight(), tq3.bits_per_weight()) == (4.125, 3.125)
    assert tq4.fraction_of_bf16() <= 0.30 and tq3.fraction_of_bf16() <= 0.23
    assert tq4.weight_bytes(4096, 12288) == 4096 * 96 * 66
    with pytest.raises(ValueError, match="valid formats: tq4, tq3"):
        get_weight_format("tq5")
    assert tq4.groups(576) == 5 and tq4.weight_bytes(16, 576) == 16 * 5 * 66  # the last group zero-padded
    with pytest.raises(ValueError, match="input dimension must be positive"):
        tq4.weight_bytes(16, 0)
    assert all(name not in WEIGHT_FORMATS for name in ("turboquant_k3v4_nc", get_format("turboquant_4bit_nc").name))


@pytest.mark.parametrize("name", FORMATS)
def test_storage_is_the_documented_bytes(name):
    fmt = get_weight_format(name)
    w = quantize_weight(_weight(), name)
    w.check()
    assert w.packed.dtype == torch.uint8 and w.packed.shape == (96, 3, 16 * fmt.bits)
    assert w.scales.dtype == torch.float16 and w.scales.shape == (96, 3)
    assert w.nbytes() == fmt.weight_bytes(96, 384)
    # every group: the format's own quantizer on that group, packed planar8
    code = fmt.quantizer().quantize(_weight()[5, 128:256])
    assert torch.equal(unpack_indices(w.packed[5, 1], fmt.bits, 128), code.idx)
    assert w.scales[5, 1].item() == code.scale.item()


@pytest.mark.parametrize("name", FORMATS)
def test_rotated_product_equals_decode_then_matmul(name):
    w = quantize_weight(_weight(), name)
    x = torch.randn(5, 7, 384, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(96, generator=torch.Generator().manual_seed(2))
    want = x @ dequantize_weight(w).T + bias
    got = tq_linear_reference(x, w, bias)
    assert got.shape == (5, 7, 96)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("name,bound", [("tq4", 0.105), ("tq3", 0.19)])
def test_error_is_the_codebooks(name, bound):
    """Relative Frobenius error of the decoded weight: sqrt of the Lloyd-Max distortion (about 0.0095 at 4 bits
    and 0.034 at 3 bits per unit variance), whatever the weight's scale."""
    for scale in (1.0, 1e-3):
        w = _weight(out=256, inp=512) * scale
        err = (dequantize_weight(quantize_weight(w, name)) - w).norm() / w.norm()
        assert err < bound, (scale, err)


def _rtn(w: torch.Tensor, bits: int, group: int = 128) -> torch.Tensor:
    """Round-to-nearest symmetric uniform quantizer, one fp16 absmax scale per group: the same bytes."""
    g = w.reshape(w.shape[0], -1, group)
    levels = 2 ** (bits - 1) - 1
    s = (g.abs().amax(-1, keepdim=True) / levels).half().float().clamp_min(1e-12)
    return (torch.round(g / s).clamp(-levels - 1, levels) * s).reshape(w.shape)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("heavy", [False, True])
def test_beats_round_to_nearest_at_the_same_bytes(name, heavy):
    fmt = get_weight_format(name)
    w = _weight(out=256, inp=512, heavy=heavy)
    ours = (dequantize_weight(quantize_weight(w, name)) - w).norm()
    rtn = (_rtn(w, fmt.bits) - w).norm()
    assert ours < rtn, (ours.item(), rtn.item())


@pytest.mark.parametrize("fmt", ["tq4", "tq3"])
def test_int8_codebook_is_the_codebook_on_a_symmetric_byte_grid(fmt):
    """Each entry within half a unit of its byte's (b + 0.5) u, the largest magnitude exactly 127.5 u, a negative
    entry's byte the complement of its mirror's, every byte an int8."""
    from turboquant_core.codebooks import codebook_tensors

    f = get_weight_format(fmt)
    table, unit = int8_codebook(fmt)
    cb = codebook_tensors(f.bits, f.group_size)[0].double()
    assert table.numel() == cb.numel() == 2 ** f.bits
    assert ((table.double() + 0.5) * unit - cb).abs().max() <= unit / 2 + 1e-12
    assert table[-1] == 127 and table[0] == -128 and torch.equal(table.flip(0), -table - 1)
    assert torch.equal(table.sort().values, table)


@pytest.mark.parametrize("name", FORMATS)
def test_int8_product_stays_within_a_percent_of_the_exact_one(name):
    """The decode batches' int8 product (activation rounded per group at a power-of-two step of at most 2 max / 128,
    codebook bytes within half a unit) against the exact rotated-domain product, over activations with outlier
    channels: under 1 % relative RMS (0.6-0.7 % here), a tenth or less of what 3 or 4 bits cost the weight itself;
    the served layout (kernel words) gives the same result."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(16, 1024, generator=g)
    x[:, ::97] *= 20
    w = quantize_weight(_weight(out=256, inp=1024, seed=5), name)
    exact = tq_linear_reference(x, w)
    got = tq_linear_int8_reference(x, w)
    err = ((got - exact).pow(2).mean() / exact.pow(2).mean()).sqrt()
    assert 0.002 < err < 0.015, err.item()
    assert torch.equal(tq_linear_int8_reference(x, served_layout(w)), got)


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="2-D float weight"):
        quantize_weight(torch.zeros(4, 128, dtype=torch.int32), "tq4")
    w = quantize_weight(_weight(), "tq3")
    with pytest.raises(ValueError, match="activation has 383 features"):
        tq_linear_reference(torch.zeros(2, 383), w)
    bad = TQWeight("tq3", w.packed[:, :, :-1], w.scales, 384)
    with pytest.raises(ValueError, match=r"packed indices must be uint8 \(96, 3, 48\)"):
        bad.check()
    with pytest.raises(ValueError, match=r"scales must be float16"):
        TQWeight("tq3", w.packed, w.scales.float(), 384).check()


@pytest.mark.parametrize("name", FORMATS)
def test_an_input_dimension_groups_do_not_divide_pads_the_last_group(name):
    """576 inputs (SmolLM2's hidden size): 4 groups and one of 64 weights + 64 zeros; the padded group is the
    format's code of the zero-padded vector, the product ignores the padding, the decoded weight has 576 columns."""
    fmt = get_weight_format(name)
    w = _weight(out=40, inp=576, seed=3)
    q = quantize_weight(w, name)
    assert q.packed.shape == (40, 5, 16 * fmt.bits) and q.nbytes() == fmt.weight_bytes(40, 576)
    padded = torch.cat([w[7, 512:], torch.zeros(64)])
    code = fmt.quantizer().quantize(padded)
    assert torch.equal(unpack_indices(q.packed[7, 4], fmt.bits, 128), code.idx)
    dq = dequantize_weight(q)
    assert dq.shape == (40, 576)
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(9))
    want = x @ dq.T
    torch.testing.assert_close(tq_linear_reference(x, q), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert (dq - w).norm() / w.norm() < (0.11 if fmt.bits == 4 else 0.2)


def test_zero_groups_stay_zero_and_rotated_values_carry_the_scale():
    w = _weight()
    w[3, :128] = 0
    q = quantize_weight(w, "tq4")
    assert q.scales[3, 0].item() == 0 and torch.count_nonzero(dequantize_weight(q)[3, :128]) == 0
    r = rotated_weight(q)  # |s c[idx]| = |w| per group (norm correction)
    torch.testing.assert_close(r.norm(dim=-1), w.reshape(96, 3, 128).norm(dim=-1), rtol=2e-3, atol=0)
    assert math.isclose(r.shape[-1], 128)


@pytest.mark.gpu
@pytest.mark.parametrize("name", FORMATS)
def test_an_encoded_weight_holds_only_its_bytes_on_the_gpu(name):
    """Encoding on the GPU leaves the packed indices and scales allocated, nothing cached beside them: what vLLM
    reports as model memory for ``--quantization`` is the format table's bytes (a layer of the Qwen3-8B shape), up to
    the caching allocator's rounding of each of the two tensors (a block it does not split, under 1 MiB)."""
    import gc

    quantize_weight(torch.randn(256, 4096, device="cuda", dtype=torch.bfloat16), name)  # codebook and rotation tables
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    w = quantize_weight(torch.randn(12288, 4096, device="cuda", dtype=torch.bfloat16), name)
    gc.collect()
    torch.cuda.synchronize()
    assert w.nbytes() == get_weight_format(name).weight_bytes(12288, 4096)
    assert 0 <= torch.cuda.memory_allocated() - before - w.nbytes() < 2 << 20


def test_sign_magnitude_fields_rank_the_magnitudes():
    """Bits 0-2 of a sign-magnitude field rank |c| (0 the smallest), bit 3 marks the positive half; the relabelling
    is its own inverse."""
    from turboquant_core.codebooks import codebook_tensors

    c = codebook_tensors(4, 128, "cpu")[0].float()
    i = torch.arange(16)
    f = sign_magnitude(i)
    assert torch.equal(sign_magnitude(f), i)
    magnitudes = c[8:]  # ascending
    assert torch.equal(c[i].abs(), magnitudes[f & 7]) and torch.equal(c[i] > 0, (f & 8) > 0)


def _served(weight, fmt, words_per_group):
    """(stored, served) of ``weight`` in ``fmt``: the served weight as kernel words, int32 [out, groups,
    words_per_group], the same bytes and scales, back to planar8 exactly."""
    w = quantize_weight(weight, fmt)
    served = served_layout(w)
    served.check()
    assert served.kernel_words and served.packed.dtype == torch.int32
    assert served.packed.shape == (*w.packed.shape[:2], words_per_group)
    assert served.nbytes() == w.nbytes() and served.scales is w.scales
    assert torch.equal(from_kernel_words(served.packed), w.packed)
    return w, served


def test_kernel_words_are_the_planes_merged_per_slot():
    """Served tq4 (``served_layout``): word w of a group holds byte w of each plane (plane k in byte k), its fields
    in sign-magnitude form; the same bytes, decoded alike, and back to planar8 exactly."""
    w, served = _served(_weight(heavy=True), "tq4", 16)
    words = served.packed.view(torch.uint8).reshape(96, 3, 16, 4)  # little-endian bytes of each word
    planes = w.packed.reshape(96, 3, 4, 16)
    lo, hi = planes & 0xF, planes >> 4
    want = (sign_magnitude(lo) | (sign_magnitude(hi) << 4)).transpose(-1, -2)
    assert torch.equal(words, want)
    assert torch.equal(dequantize_weight(served), dequantize_weight(w))
    assert served_layout(served) is served


def test_tq3_kernel_words_hold_each_lane_groups_four_words_in_three():
    """Served tq3: with N_w the group word w (byte k: plane k's byte w) spread to one 3-bit field per nibble, slot
    3l + i holds N_{4l+i} with bit i of N_{4l+3}'s fields in the nibbles' bit 3; the same bits, decoded alike, and
    back to planar8 exactly (every byte value of every plane)."""
    w, served = _served(_weight(heavy=True), "tq3", 12)
    assert torch.equal(dequantize_weight(served), dequantize_weight(w))
    planes = w.packed.to(torch.int64).reshape(96, 3, 3, 16)
    word = planes[:, :, 0] | (planes[:, :, 1] << 8) | (planes[:, :, 2] << 16)  # [96, 3, 16]
    nib = sum(((word >> (3 * j)) & 7) << (4 * j) for j in range(8)).reshape(96, 3, 4, 4)
    slots = (served.packed.to(torch.int64) & 0xFFFFFFFF).reshape(96, 3, 4, 3)
    for i in range(3):
        assert torch.equal(slots[..., i] & 0x77777777, nib[..., i])
        assert torch.equal((slots[..., i] >> 3) & 0x11111111, (nib[..., 3] >> i) & 0x11111111)
    every = torch.arange(256, dtype=torch.uint8).repeat(3, 1).reshape(2, 8, 48)  # each byte in each plane position
    assert torch.equal(from_kernel_words(to_kernel_words(every)), every)
    assert served_layout(served) is served


def test_kernel_words_refuse_what_they_do_not_hold():
    w = quantize_weight(_weight(), "tq4")
    with pytest.raises(ValueError, match="4-bit or 3-bit planar8 groups"):
        to_kernel_words(w.packed[..., :32])
    with pytest.raises(ValueError, match="expected kernel words int32"):
        from_kernel_words(w.packed)
    with pytest.raises(ValueError, match=r"packed indices must be int32 \(96, 3, 12\), got int32 \(96, 3, 16\)"):
        TQWeight("tq3", to_kernel_words(w.packed), w.scales, 384).check()
    with pytest.raises(ValueError, match=r"packed indices must be int32 \(96, 3, 16\), got int32 \(96, 2, 16\)"):
        TQWeight("tq4", to_kernel_words(w.packed)[:, :2], w.scales, 384).check()

