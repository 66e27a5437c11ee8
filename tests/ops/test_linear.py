# SPDX-License-Identifier: Apache-2.0
"""TurboQuant linear layers (ops.linear.tq_linear: kernels/linear_mma_jit.py for decode-sized batches on a GPU,
kernels/linear_wgmma_jit.py for the larger ones on sm_90, kernels/linear_jit.py's decoded weight + GEMM otherwise)
against the plain-torch rotated-domain product (ops.weight_codec.tq_linear_reference; the register-tile kernel's
int8 product against ops.weight_codec.tq_linear_int8_reference, its activation kernel bit for bit against
int8_activation in the interpreter): both formats and every path,
1 to 73 activation rows (8, 16 and 32 per register-tile program, 8 to 64 per warpgroup program), output sizes that do
not fill a tile, bias, bf16 activations with outliers beyond fp16's range, products split over ranges of groups, an
input dimension whose last group is padded. In Triton's interpreter on the CPU (the decoded path: the Gluon kernels
run PTX the interpreter cannot), compiled on a GPU. On the CPU for an sm_90 target: every variant compiles without
spills, and prefills of any size launch only variants vLLM's start-up compiled."""

import json

import pytest
import torch

from turboquant_core.formats import get_weight_format
from turboquant_core.ops import linear as linear_ops
from turboquant_core.ops.linear import MMA_MAX_ROWS, _split_counters, rotation_operand, tq_linear
from turboquant_core.ops.weight_codec import (
    int8_activation,
    int8_codebook,
    quantize_weight,
    served_layout,
    tq_linear_int8_reference,
    tq_linear_reference,
)


def _case(out, inp, rows, seed, device, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out, inp, generator=g) * 0.05
    x = torch.randn(rows, inp, generator=g)
    return weight.to(device), x.to(device=device, dtype=dtype)


def _take_path(path, device, monkeypatch):
    """Make the launcher run ``path`` for every row count up to MMA_MAX_ROWS (skip where it cannot); the
    register-tile and warpgroup kernels in fp16 ("register-tile", "warpgroup") or, over kernel words, in int8 (the
    same with "-int8"), the warpgroup kernel's scaled operands ("warpgroup-scaled", kernel words)."""
    if path != "decoded" and device != "cuda":
        pytest.skip("the Gluon kernels run PTX the interpreter cannot")
    if path.startswith("warpgroup") and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the warpgroup kernel needs sm_90a")
    int8 = path.endswith("-int8")
    monkeypatch.setattr(linear_ops, "MMA_MAX_ROWS", 0 if path == "decoded" else MMA_MAX_ROWS)
    monkeypatch.setattr(linear_ops, "WGMMA_MIN_ROWS", 1 if path.startswith("warpgroup") else MMA_MAX_ROWS + 1)
    monkeypatch.setattr(linear_ops, "MMA_INT8", int8)
    monkeypatch.setattr(linear_ops, "WGMMA_INT8_MAX_ROWS", MMA_MAX_ROWS if int8 else 0)
    monkeypatch.setattr(linear_ops, "WGMMA_SCALED_FROM_ROWS", 1 if path.endswith("-scaled") else MMA_MAX_ROWS + 1)


@pytest.mark.parametrize("path", ["register-tile", "register-tile-int8", "warpgroup", "warpgroup-int8",
                                  "warpgroup-scaled", "decoded"])
@pytest.mark.parametrize("fmt,served", [("tq4", True), ("tq4", False), ("tq3", True), ("tq3", False)],
                         ids=["tq4-served", "tq4-planar8", "tq3-served", "tq3-planar8"])
@pytest.mark.parametrize("out,inp,rows", [(64, 128, 1), (80, 256, 3), (40, 384, 16), (72, 256, 17), (64, 1152, 2),
                                          (48, 576, 3), (96, 320, 40), (136, 256, 64)])
def test_kernel_matches_the_rotated_reference(fmt, served, out, inp, rows, path, device, monkeypatch):
    """Every way the launcher runs a product: the register-tile kernel (GPUs) and the warpgroup kernel (sm_90), each
    in fp16 and in int8, and the decoded weight + GEMM, over weights as served (kernel words) and as stored (planar8:
    the int8 products take kernel words only, so these run in fp16)."""
    _take_path(path, device, monkeypatch)
    weight, x = _case(out, inp, rows, out + inp + rows, device)
    w = quantize_weight(weight, fmt)
    if served:
        w = served_layout(w)
        assert w.kernel_words
    bias = torch.randn(out, generator=torch.Generator().manual_seed(3)).to(device)
    got = tq_linear(x, w, bias)
    assert got.shape == (rows, out) and got.dtype == x.dtype
    if path.endswith("-int8") and served:
        # the same integers from the activation in the compute type (fp16), float32 scaling in another order, the
        # sum rounded to fp16 as the kernels store it: at most one fp16 unit apart
        want = tq_linear_int8_reference(x.half(), w, bias).half().to(x.dtype)
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4 * want.abs().max().item())
        return
    want = tq_linear_reference(x, w, bias)
    # fp16 operands (the activation rounded before and after its rotation), fp32 accumulation
    torch.testing.assert_close(got, want, rtol=2e-3, atol=3e-3 * want.abs().max().item())


@pytest.mark.parametrize("served", [False, True], ids=["planar8", "served"])
def test_leading_dims_bf16_and_outliers_beyond_fp16(served, device):
    """A bf16 activation with an entry fp16 cannot hold, in fp16 (as stored) and, over kernel words on a GPU, in int8:
    finite, and near the exact product."""
    weight, _ = _case(48, 256, 1, 11, device)
    w = quantize_weight(weight, "tq4")
    if served:
        w = served_layout(w)
    x = torch.randn(2, 3, 256, generator=torch.Generator().manual_seed(4)).to(device)
    x[0, 1, 7] = 3.0e5  # a bf16 activation fp16 cannot hold
    x = x.to(torch.bfloat16)
    got = tq_linear(x, w)
    want = tq_linear_reference(x, w)
    assert got.shape == (2, 3, 48) and got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2 * want.abs().amax(-1, keepdim=True).max().item())


@pytest.mark.parametrize("fmt", ["tq4", "tq3"])
def test_int8_lookup_gives_each_fields_codebook_byte(fmt):
    """``INT8_LOOKUP4_ASM`` / ``INT8_LOOKUP3_ASM`` run instruction by instruction on the CPU over kernel words (tq4:
    sign-magnitude fields, ``weight_codec.sign_magnitude``; tq3: the index in bits 0-2 of each nibble) with the
    launcher's byte words: fields 0-3 and 4-7 come back as the bytes of ``int8_codebook``, every index in every
    field."""
    from tests.ops.test_codebook_lookup import _run_ptx
    from turboquant_core.kernels.linear_mma_jit import INT8_LOOKUP3_ASM, INT8_LOOKUP4_ASM
    from turboquant_core.ops.weight_codec import sign_magnitude

    n = 16 if fmt == "tq4" else 8
    table, _ = int8_codebook(fmt)
    t0, t1 = linear_ops._codebook_int8_words(fmt)
    fields = torch.randint(0, n, (64, 8), generator=torch.Generator().manual_seed(n))
    fields[:n] = torch.arange(n)[:, None]
    stored = sign_magnitude(fields) if fmt == "tq4" else fields
    asm = (INT8_LOOKUP4_ASM if fmt == "tq4" else INT8_LOOKUP3_ASM).value
    for f, st in zip(fields.tolist(), stored.tolist()):
        word = sum(v << (4 * j) for j, v in enumerate(st))
        lo, hi = _run_ptx(asm, [word] * 4 + [t0] * 4 + [t1] * 4, 2)
        got = [((lo if j < 4 else hi) >> (8 * (j % 4))) & 0xFF for j in range(8)]
        assert got == [int(table[i]) & 0xFF for i in f]


def test_int8_key_order_fills_the_int8_operand_registers():
    """A permutation of 128 where a group word's fields 0-3 (and 4-7) are four consecutive K positions, one int8
    register of the m16n8k32 A operand: lanes' gl at 4 gl, the second four 16 further, the word's gr 32 apart."""
    pos_of = torch.empty(128, dtype=torch.long)
    pos_of[linear_ops.int8_key_order(128)] = torch.arange(128)
    assert sorted(pos_of.tolist()) == list(range(128))
    for gl in range(4):
        for gr in range(4):
            g = 4 * gl + gr
            fields = [int(pos_of[j * 16 + g]) for j in range(8)]
            assert fields == [32 * gr + 4 * gl + e for e in range(4)] + [32 * gr + 16 + 4 * gl + e for e in range(4)]


@pytest.mark.parametrize("fmt", ["tq4", "tq3"])
@pytest.mark.parametrize("rows,inp", [(1, 256), (5, 300)])
def test_int8_rotation_kernel_equals_int8_activation(fmt, rows, inp, device):
    """``tq_rotate_int8_kernel`` against ``weight_codec.int8_activation`` of the unnormalised rotation: the same
    int8 values at the int8 K positions, the step times the half unit, the sums of the stored values; a last group
    zero past the input and an all-zero group."""
    from turboquant_core.kernels.linear_jit import tq_rotate_int8_kernel
    from turboquant_core.ops.linear import mma_rotation_tables
    from turboquant_core.rotation import fwht, hadamard_signs

    f = get_weight_format(fmt)
    x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(rows)) * 3
    x[-1, :128] = 0.0
    x = x.to(device)
    groups = -(-inp // 128)
    xq = torch.empty(rows, groups * 128, dtype=torch.int8, device=device)
    xs = torch.empty(rows, groups, device=device)
    sx = torch.empty(rows, groups, dtype=torch.int32, device=device)
    unit = 0.125
    signs, pos = mma_rotation_tables(fmt, device, int8=True)
    tq_rotate_int8_kernel[(rows, groups)](x, signs, pos, xq, xs, sx, inp, unit, x.stride(0), xq.stride(0),
                                          xs.stride(0), num_warps=1)
    xg = torch.nn.functional.pad(x.float().cpu(), (0, groups * 128 - inp)).view(rows, groups, 128)
    want, step = int8_activation(fwht(xg * hadamard_signs(128, f.seed)))
    got = xq.cpu().view(rows, groups, 128)[..., pos.cpu().long()].float()  # coordinate d from its K position
    assert torch.equal(got, want)
    assert torch.equal(xs.cpu(), step * unit)
    assert torch.equal(sx.cpu(), got.sum(-1).int())
    assert not got[-1, 0].any()


def test_rotation_operand_is_the_groups_rotation_in_kernel_order():
    """x @ M / 16 equals R x (the codec's rotation) times sqrt(128) / 16, coordinates in kernel order; entries are
    +-1/16, exact in both activation types."""
    from turboquant_core.ops.rotation_tables import codec_tables, kernel_coordinate_order
    from turboquant_core.rotation import rotate

    fmt = get_weight_format("tq3")
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1))
    order = kernel_coordinate_order(codec_tables(128, fmt.bits, fmt.seed, "cpu"))
    m = rotation_operand("tq3", "cpu", torch.float32)
    torch.testing.assert_close(x @ m, rotate(x, fmt.seed)[:, order] * (128 ** 0.5 / 16), rtol=1e-5, atol=1e-5)
    assert set(m.abs().unique().tolist()) == {1 / 16}
    assert torch.equal(rotation_operand("tq3", "cpu", torch.bfloat16).float(), m)


@pytest.mark.parametrize("fmt", ["tq4", "tq3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,inp", [(1, 256), (5, 300), (17, 128)])
def test_decode_rotation_butterflies_equal_the_rotation_operand(fmt, dtype, rows, inp, device):
    """The register-tile product's activation (``tq_rotate_fp16_kernel``: sign flips, seven butterfly stages,
    positions from ``mma_rotation_tables``) is x_g @ M / sqrt(128) (M the unnormalised rotation as a matrix, its
    columns in the kernel's K order, ``ops.paged_decode.decode_key_order``) to fp16's precision, with a power-of-two
    scale per row and group; a last group zero past the input, and a bf16 value fp16 cannot hold."""
    from turboquant_core.kernels.linear_jit import tq_rotate_fp16_kernel
    from turboquant_core.ops.linear import mma_rotation_tables
    from turboquant_core.ops.paged_decode import decode_key_order
    from turboquant_core.rotation import fwht, hadamard_signs

    x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(rows)) * 3
    x[0, 0] = 3.0e5 if dtype == torch.bfloat16 else 6.0e4
    x = x.to(device=device, dtype=dtype)
    groups = -(-inp // 128)
    xq = torch.empty(rows, groups * 128, dtype=torch.float16, device=device)
    xs = torch.empty(rows, groups, device=device)
    tq_rotate_fp16_kernel[(rows, groups)](x, *mma_rotation_tables(fmt, device), xq, xs, inp, x.stride(0),
                                          xq.stride(0), xs.stride(0), num_warps=1)
    xg = torch.nn.functional.pad(x.float(), (0, groups * 128 - inp)).view(rows, groups, 128)
    m = fwht(torch.eye(128) * hadamard_signs(128, get_weight_format(fmt).seed))[:, decode_key_order(128)]
    want = xg @ m.to(device) / 128 ** 0.5
    exponent = torch.log2(xs * 128 ** 0.5)
    assert ((exponent - exponent.round()).abs() < 1e-5).all()  # powers of two
    got = xq.float().view(rows, groups, 128) * xs[..., None]
    assert ((got - want).abs() <= 2 ** -11 * want.abs().amax(-1, keepdim=True)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("path,rows", [("register-tile", 2), ("warpgroup", 24)])
@pytest.mark.parametrize("fmt", ["tq4", "tq3"])
def test_split_products_leave_the_counters_zero_and_repeat_exactly(fmt, path, rows, monkeypatch):
    """A product split over ranges of groups (one output tile, 16 groups in 8 ranges) and summed by its last
    program: the same bits on a second call, and the arrival counters back at zero."""
    _take_path(path, "cuda", monkeypatch)
    weight, x = _case(32, 2048, rows, 9, "cuda", torch.bfloat16)
    w = quantize_weight(weight, fmt)
    first = tq_linear(x, w)
    assert torch.equal(tq_linear(x, w), first)
    assert not _split_counters("cuda", torch.cuda.current_stream().cuda_stream).any()
    torch.testing.assert_close(first.float(), tq_linear_reference(x, w), rtol=1e-2,
                               atol=1e-2 * first.float().abs().max().item())


@pytest.mark.parametrize("fmt", ["tq4", "tq3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_many_rows_take_the_decoded_weight(fmt, dtype, device):
    """Above MMA_MAX_ROWS rows: the weight decoded to a workspace in the rotated domain and one GEMM, against the
    reference and, row for row, against the products of 16 rows (the register-tile kernel on a GPU); a padded last
    group and a bias included."""
    weight, x = _case(96, 320, MMA_MAX_ROWS + 9, 8, device, dtype)
    w = quantize_weight(weight, fmt)
    bias = torch.randn(96, generator=torch.Generator().manual_seed(2)).to(device, dtype)
    got = tq_linear(x, w, bias)
    want = tq_linear_reference(x, w, bias)
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
    few = torch.cat([tq_linear(x[i:i + 16], w, bias) for i in range(0, x.shape[0], 16)])
    torch.testing.assert_close(got.float(), few.float(), rtol=1e-2, atol=1e-2 * want.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 5, 8])
def test_decode_int8_off_takes_the_fp16_product(rows, monkeypatch):
    """``decode_int8=False`` (``--no-tq-weights-decode-int8``): over kernel words, the same bits as the fp16
    products, the register-tile kernel's and (8 rows, sm_90) the warpgroup kernel's."""
    weight, x = _case(96, 640, rows, 29, "cuda", torch.bfloat16)
    w = served_layout(quantize_weight(weight, "tq4"))
    got = tq_linear(x, w, decode_int8=False)
    monkeypatch.setattr(linear_ops, "MMA_INT8", False)
    monkeypatch.setattr(linear_ops, "WGMMA_INT8_MAX_ROWS", 0)
    assert torch.equal(got, tq_linear(x, w))


@pytest.mark.gpu
@pytest.mark.parametrize("min_bits", [3, 5])
@pytest.mark.parametrize("fmt,served,rows", [("tq4", True, 1), ("tq4", True, 5), ("tq3", True, 2), ("tq4", False, 3)],
                         ids=["tq4-served-1", "tq4-served-5", "tq3-served-2", "tq4-planar8-3"])
def test_scales_ahead_give_the_same_bits(fmt, served, rows, min_bits, monkeypatch):
    """The register-tile kernel with each group's scales loaded a group ahead or in the group's own iteration: the
    same arithmetic in the same order, so the same bits (int8 over kernel words, fp16 as stored), split products
    included."""
    _take_path("register-tile-int8" if served else "register-tile", "cuda", monkeypatch)
    weight, x = _case(200, 1152, rows, 21, "cuda", torch.bfloat16)
    w = quantize_weight(weight, fmt)
    if served:
        w = served_layout(w)
    want = tq_linear(x, w)
    monkeypatch.setattr(linear_ops, "MMA_SCALES_AHEAD_MIN_BITS", min_bits)
    assert torch.equal(tq_linear(x, w), want)


SCALES_AHEAD_PROBE = r'''
import torch
from tests.ops import sm90_probe

sm90_probe.install_printer()
from turboquant_core.ops import linear as linear_ops
from turboquant_core.ops.weight_codec import quantize_weight, served_layout

linear_ops._gluon_runs = lambda device: True  # as on a GPU: the register-tile kernel
linear_ops._pdl_runs = lambda device: True
weights = [served_layout(quantize_weight(torch.randn(64, 2048), fmt)) for fmt in ("tq4", "tq3")]
for min_bits in (3, 5):
    linear_ops.MMA_SCALES_AHEAD_MIN_BITS = min_bits
    for w in weights:
        for rows in (1, 16):
            linear_ops.tq_linear(torch.randn(rows, 2048, dtype=torch.bfloat16), w)
'''


@pytest.mark.slow
def test_scales_ahead_compile_for_sm90_without_spills():
    """The register-tile kernel with the scales in the group's iteration or a group ahead, int8 over tq4 and tq3
    kernel words at 8 and 16 columns: compiled for sm_90 without spills; at 8 columns (the 1-7 rows it serves on
    sm_90) in at most 128 registers, so that ``MMA_PROGRAMS_PER_SM`` one-warp programs stay resident."""
    from tests.ops import sm90_probe

    res = [r for r in sm90_probe.run_probe(SCALES_AHEAD_PROBE) if r[0] == "tq_linear_mma_kernel"]
    assert len(res) == 8, res
    assert all(stack == 0 for _, _, stack, _ in res), res
    assert all(regs * 32 * linear_ops.MMA_PROGRAMS_PER_SM <= 65536 for _, regs, _, _ in res[::2]), res


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["tq4", "tq3"])
@pytest.mark.parametrize("rows", [9, 24, 64])
def test_scaled_operands_in_bf16(fmt, rows, monkeypatch):
    """The warpgroup kernel's scaled operands with a bf16 activation: its tile and the scaled codebook values in
    bf16 (the prefill path's precision), near the exact product; split products included."""
    _take_path("warpgroup-scaled", "cuda", monkeypatch)
    weight, x = _case(200, 1152, rows, 23, "cuda", torch.bfloat16)
    w = served_layout(quantize_weight(weight, fmt))
    got = tq_linear(x, w)
    want = tq_linear_reference(x, w)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=1e-2 * want.abs().max().item())


SCALED_PROBE = r'''
import json
import torch
from tests.ops import sm90_probe

seen = sm90_probe.install_wgmma_reports("tq_linear_wgmma_kernel")
from turboquant_core.ops import linear as linear_ops
from turboquant_core.ops.weight_codec import quantize_weight, served_layout

linear_ops._gluon_runs = lambda device: True
linear_ops._wgmma_runs = lambda device: True
linear_ops.WGMMA_SCALED_FROM_ROWS = 9
for fmt in ("tq4", "tq3"):
    w = served_layout(quantize_weight(torch.randn(64, 2048), fmt))
    for dtype in (torch.bfloat16, torch.float16):
        for rows in (16, 32, 64):
            linear_ops.tq_linear(torch.randn(rows, 2048, dtype=dtype), w)
print(json.dumps(seen))
'''


@pytest.mark.slow
def test_scaled_operands_keep_a_product_in_flight():
    """The warpgroup kernel's scaled operands, tq4 and tq3, bf16 and fp16 activations, 16 to 64 columns, compiled
    for sm_90: ptxas keeps each group's product in flight beside the next group's decode (no serialization note,
    the group's 8 warpgroup MMAs behind one fence), that decode writes none of the A registers the product in flight
    reads, no spills, and the programs per SM the launcher plans fit."""
    from tests.ops import sm90_probe

    res = json.loads(sm90_probe.run_script(SCALED_PROBE).strip().splitlines()[-1])
    assert len(res) == 12, res
    assert not any(r["serialized"] for r in res), res
    assert all(r["hgmma"] >= 8 * r["arrive"] and r["stack"] == 0 for r in res), res
    assert not any(r["hazards"] for r in res), res  # the product in flight keeps its A registers
    for i, r in enumerate(res):  # 16, 32 and 64 columns in turn
        per_sm = linear_ops.WGMMA_PROGRAMS_PER_SM if i % 3 == 0 else linear_ops.WGMMA_WIDE_PROGRAMS_PER_SM
        assert per_sm * 128 * r["regs"] <= 64 * 1024 and per_sm * (r["shared"] + 1024) <= 228 * 1024, (i, r)


def test_wrong_activation_width_is_named(device):
    weight, _ = _case(16, 256, 1, 0, device)
    with pytest.raises(ValueError, match="activation has 255 features, the weight 256"):
        tq_linear(torch.zeros(1, 255, device=device), quantize_weight(weight, "tq4"))


PROBE = r'''
import torch
from tests.ops import sm90_probe

sm90_probe.install_printer()

from turboquant_core.ops import linear as linear_ops
from turboquant_core.ops.linear import MMA_MAX_ROWS, tq_linear
from turboquant_core.ops.weight_codec import quantize_weight, served_layout

weights = [quantize_weight(torch.randn(64, 2048), fmt) for fmt in ("tq4", "tq3")]
weights += [served_layout(w) for w in weights]  # as served: kernel words
for w in weights:
    for dtype in (torch.bfloat16, torch.float16):
        tq_linear(torch.randn(MMA_MAX_ROWS + 1, 2048, dtype=dtype), w)
linear_ops._gluon_runs = lambda device: True  # as on a GPU: the register-tile kernel, 8, 16 and 32 columns
linear_ops._pdl_runs = lambda device: True  # as on an H100: the product launched as the rotation's dependent
for w in weights:
    for rows in (3, 16, 40):
        tq_linear(torch.randn(rows, 2048, dtype=torch.bfloat16), w)
linear_ops._wgmma_runs = lambda device: True  # as on an H100: the warpgroup kernel, 8 to 64 columns
linear_ops.WGMMA_MIN_ROWS = 1
for w in weights:
    for rows in (3, 16, 17, 40):
        tq_linear(torch.randn(rows, 2048, dtype=torch.bfloat16), w)
'''


@pytest.mark.slow
def test_kernel_compiles_for_sm90_without_spills():
    """Every variant (both formats, as stored and as served, and both activation types; the decoded weight and its
    rotation; the register-tile kernel with 8, 16 and 32 columns, in int8 over kernel words, the warpgroup kernel
    with 8, 16, 32 and 64, in int8 up to 8, and their rotation) compiles for sm_90, the register codebook lookups
    the interpreter cannot run included, with no register spills."""
    from tests.ops import sm90_probe

    res = sm90_probe.run_probe(PROBE)
    want = (["tq_rotate_kernel", "tq_dequant_kernel"] * 8 + ["tq_rotate_fp16_kernel", "tq_linear_mma_kernel"] * 6
            + ["tq_rotate_int8_kernel", "tq_linear_mma_kernel"] * 6  # kernel words: the int8 product
            + ["tq_rotate_fp16_kernel", "tq_linear_wgmma_kernel"] * 8  # as stored: fp16
            + (["tq_rotate_int8_kernel", "tq_linear_wgmma_kernel"]  # kernel words: int8 up to 8 rows
               + ["tq_rotate_fp16_kernel", "tq_linear_wgmma_kernel"] * 3) * 2)
    assert [r[0] for r in res] == want, res
    assert all(stack == 0 for _, _, stack, _ in res), res


VARIANTS_PROBE = r'''
import json
import torch
from tests.ops import sm90_probe

seen = []
sm90_probe.install(lambda launch: seen.append([launch.name, launch.key]))

from turboquant_core.ops import linear as linear_ops
from turboquant_core.ops.linear import tq_linear
from turboquant_core.ops.weight_codec import quantize_weight

linear_ops._gluon_runs = lambda device: True  # as on an H100: up to MMA_MAX_ROWS rows, the Gluon kernels
linear_ops._wgmma_runs = lambda device: True
weights = [quantize_weight(torch.randn(64, n), fmt) for n in (4096, 12288) for fmt in ("tq4", "tq3")]


def step(rows):
    for w in weights:
        tq_linear(torch.empty(rows, w.in_features, dtype=torch.bfloat16), w)


# vLLM's start-up: the profile run at max_num_batched_tokens (8192), then each CUDA-graph capture size
for rows in (8192, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1):
    step(rows)
warm = {tuple(s) for s in seen}
seen.clear()
# Steps past the largest capture size run eagerly at their own token count: 7 prompts of 256 tokens beside a decode
# (1,793 rows), a chunk's remainder, any prefill.
for rows in [*range(513, 560), 1793, 2000, 2047, 2048, 3000, 8191]:
    step(rows)
serve = {tuple(s) for s in seen}
print(json.dumps(dict(missing=sorted(serve - warm), kernels=sorted({k for k, _ in serve}))))
'''


def test_prefill_of_any_size_runs_a_variant_the_startup_compiled():
    """A step past the CUDA-graph sizes (eager, its own row count) launches only kernel variants that vLLM's start-up
    runs (profile run, graph capture; rows all multiples of 16) compiled: Triton's specialization keys for an sm_90
    target, from its own binder."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(root))
    p = subprocess.run([sys.executable, "-c", VARIANTS_PROBE], env=env, capture_output=True, text=True, timeout=900,
                       cwd=root)
    assert p.returncode == 0, p.stderr[-4000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["kernels"] == ["tq_dequant_kernel", "tq_rotate_kernel"]
    assert res["missing"] == [], f"variants compiled only while serving: {res['missing'][:2]}"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["tq4", "tq3"])
def test_cuda_graph_replay_equals_eager(fmt):
    """Captured once (after a first call made the tables), replayed on new activations: what vLLM's graphs do."""
    weight, x = _case(96, 512, 8, 5, "cuda", torch.bfloat16)
    w = quantize_weight(weight, fmt)
    tq_linear(x, w)
    static_x = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = tq_linear(static_x, w)
    for seed in (6, 7):
        new = torch.randn(8, 512, generator=torch.Generator().manual_seed(seed)).to("cuda", torch.bfloat16)
        static_x.copy_(new)
        graph.replay()
        torch.testing.assert_close(static_y, tq_linear(new, w), rtol=0, atol=0)
