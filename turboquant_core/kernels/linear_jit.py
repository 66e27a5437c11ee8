# SPDX-License-Identifier: Apache-2.0
"""Linear layers over TurboQuant weights: the Triton kernels around the products (jit only; launcher:
``ops.linear``; the decode-sized product itself is ``linear_mma_jit``).

Both rotate the activation rather than the weight: y[b, o] = sum_g s[o, g] * < R x[b, g], c[idx[o, g]] >.

- ``tq_rotate_kernel``: x_g @ (M / 16), M the group's rotation unnormalised (entries +-1) with its columns in the
  kernel order of ``codebook_lookup_jit`` (position 8 q + r of a group holds rotated coordinate bitrev3(r) * 16 + q):
  R x_g / sqrt(2), exact products, fp32 sums, in the activation's type.
- ``tq_dequant_kernel``: sqrt(2) * s * c[idx] per group, the weight in the rotated domain and in the same order,
  for a GEMM (cuBLAS) against the rotated activation: the prefill-sized product. Reads planar8 bytes, or with WORDS
  the served kernel words (``ops.weight_codec``: one int32 per slot, sign-magnitude fields looked up in a table
  reordered to match).
- ``tq_rotate_fp16_kernel``: the activation operand of ``linear_mma_jit`` (its own K order, fp16 with a power-of-two
  scale per row and group), rotated by sign flips and butterflies: a decode batch's rotation reads no matrix.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from .codebook_lookup_jit import INTERPRETING, _codebook_registers, _dequant_words, _load_words

GROUP = tl.constexpr(128)
SQRT2 = tl.constexpr(1.4142135623730951)


@triton.jit
def _dot(a, b):
    """tl.dot; in the interpreter in fp32, whose bf16 products are wrong (Triton 3.6)."""
    if INTERPRETING:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        return tl.dot(a, b)


@triton.jit
def _rotated_group(X, ROT, num_rows, in_features, stride_x, BLOCK_B: tl.constexpr):
    """This program's BLOCK_B rows (program 0) of group program 1 of X, zero past in_features, times ROT: exact
    products (ROT's entries are powers of two), fp32 sums. Returns (rows, group, columns, row mask, product)."""
    bs = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    gi = tl.program_id(1)
    d = tl.arange(0, GROUP)
    col = gi * GROUP + d
    b_mask = bs < num_rows
    x = tl.load(X + bs.to(tl.int64)[:, None] * stride_x + col[None, :],
                mask=b_mask[:, None] & (col < in_features)[None, :], other=0.0)
    rot = tl.load(ROT + d[:, None] * GROUP + d[None, :])
    return bs, gi, col, b_mask, _dot(x, rot)


# The row count is a step's token count, any number past the CUDA-graph sizes, and only masks rows: unspecialized,
# every prefill runs the variant the engine's start-up compiled. Specialized, a count that 16 does not divide needs
# a variant of its own, which no start-up run makes where the capture sizes past ops.linear.MMA_MAX_ROWS and
# max_num_batched_tokens are all multiples of 16.
@triton.jit(do_not_specialize=["num_rows"])
def tq_rotate_kernel(X, ROT, XR, num_rows, in_features, stride_x, stride_xr, BLOCK_B: tl.constexpr):
    """XR [num_rows, groups * 128] (XR's type) = each group of X (zero past in_features) times ROT (M / 16): the
    rotated activation in kernel order, for BLOCK_B rows (program 0) and one group (program 1)."""
    bs, gi, col, b_mask, xr = _rotated_group(X, ROT, num_rows, in_features, stride_x, BLOCK_B)
    tl.store(XR + bs.to(tl.int64)[:, None] * stride_xr + col[None, :], xr.to(XR.dtype.element_ty),
             mask=b_mask[:, None])


@triton.jit
def _butterfly(x, H: tl.constexpr):
    """One stage of the Walsh-Hadamard transform of x [GROUP]: coordinates c and c + H (c's bit H clear) become
    their sum and difference."""
    a, b = tl.split(tl.permute(tl.reshape(x, [GROUP // (2 * H), 2, H]), [0, 2, 1]))
    return tl.reshape(tl.permute(tl.join(a + b, a - b), [0, 2, 1]), [GROUP])


@triton.jit
def _fwht(x):
    """x [GROUP] -> its unnormalised Walsh-Hadamard transform (``rotation.fwht``, Sylvester order): seven butterfly
    stages, 7 * GROUP additions instead of a GROUP x GROUP product."""
    for s in tl.static_range(7):
        x = _butterfly(x, 1 << s)
    return x


@triton.jit
def _butterfly_rotated_group(X, SIGNS, in_features, stride_x, PDL: tl.constexpr):
    """(row, group, coordinates, sqrt(128) R x) of the program's row (program 0) and group (program 1) of X, the last
    group zero-padded: exact sign flips, fp32 butterflies. With ``PDL`` the dependent product may launch at once."""
    if PDL:
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    gi = tl.program_id(1)
    d = tl.arange(0, GROUP)
    col = gi * GROUP + d
    x = tl.load(X + row * stride_x + col, mask=col < in_features, other=0.0).to(tl.float32)
    return row, gi, d, _fwht(x * tl.load(SIGNS + d))


@triton.jit
def _power_of_two_step(xr, bits: tl.constexpr):
    """The group's absolute maximum rounded up to a power of two, over 2^bits."""
    return tl.exp2(tl.ceil(tl.log2(tl.maximum(tl.max(tl.abs(xr), axis=0), 1e-30))) - bits)


# Rows and groups are the grid: nothing is specialized, one variant serves every decode batch.
@triton.jit
def tq_rotate_fp16_kernel(X, SIGNS, POS, XQ, XS, in_features, stride_x, stride_xq, stride_xs,
                          PDL: tl.constexpr = False, UNSCALED: tl.constexpr = False):
    """For ``linear_mma_jit``: XQ fp16 [rows, groups * 128] and XS fp32 [rows, groups] such that XS * XQ = R x per
    group (R = H D / sqrt(128) the format's rotation: SIGNS [128] D's diagonal, +-1 fp32, H the Sylvester Hadamard
    matrix; POS [128] int32 the MMA kernel's K position of each rotated coordinate), XQ scaled by a power of two per
    (row, group) into [-2^14, 2^14]: fp16 keeps its 11 bits there whatever the activation's range. One row (program
    0) and group (program 1) per program, one warp: the butterflies' partners are in the same thread or lane.
    ``PDL``: the product after it may launch at once (it waits for this grid before it reads XQ and XS); this grid
    is a few programs, all resident by then. ``UNSCALED``: XQ (X's type) = R x itself, XS not written (the warpgroup
    kernel's scaled operands)."""
    row, gi, d, xr = _butterfly_rotated_group(X, SIGNS, in_features, stride_x, PDL)
    if UNSCALED:
        tl.store(XQ + row * stride_xq + gi * GROUP + tl.load(POS + d),
                 (xr * 0.08838834764831845).to(XQ.dtype.element_ty))
    else:
        scale = _power_of_two_step(xr, 14.0)
        tl.store(XQ + row * stride_xq + gi * GROUP + tl.load(POS + d), (xr / scale).to(tl.float16))
        tl.store(XS + row * stride_xs + gi, scale * 0.08838834764831845)  # / sqrt(128)


# Rows and groups are the grid, as for the fp16 rotation.
@triton.jit
def tq_rotate_int8_kernel(X, SIGNS, POS, XQ, XS, SX, in_features, unit, stride_x, stride_xq, stride_xs,
                          PDL: tl.constexpr = False):
    """For the int8 product of ``linear_mma_jit``: XQ int8 [rows, groups * 128] (POS [128] int32 the K position of
    each rotated coordinate), the group's unnormalised rotation sqrt(128) R x rounded at a power-of-two step (its
    absolute maximum rounded up to a power of two, over 128; |XQ| <= 127); XS fp32 [rows, groups] that step times
    ``unit`` (the weight codebook's half unit over sqrt(128)); SX int32 [rows, groups] the sum of the group's XQ, which
    the weight bytes' half units multiply. ``ops.weight_codec.int8_activation`` is the reference. ``PDL`` as for
    ``tq_rotate_fp16_kernel``."""
    row, gi, d, xr = _butterfly_rotated_group(X, SIGNS, in_features, stride_x, PDL)
    step = _power_of_two_step(xr, 7.0)
    q = tl.minimum(tl.maximum(tl.floor(xr / step + 0.5), -127.0), 127.0)
    tl.store(XQ + row * stride_xq + gi * GROUP + tl.load(POS + d), q.to(tl.int8))
    tl.store(XS + row * stride_xs + gi, step * unit)
    tl.store(SX + row * stride_xs + gi, tl.sum(q.to(tl.int32), axis=0))


@triton.jit
def _words_of_3bit_slots(row_ptr, row_mask):
    """tq3 kernel words (``ops.weight_codec``: a lane group's four words in slots 3l..3l+2, row_ptr [BO, 1] at a
    group's 12) -> its 16 group words, one field per nibble, [BO, 16] uint32 (word 4l + i)."""
    lg = tl.arange(0, 4)[None, :] * 3
    m = row_mask[:, None]
    s0 = tl.load(row_ptr + lg, mask=m, other=0).to(tl.uint32)
    s1 = tl.load(row_ptr + lg + 1, mask=m, other=0).to(tl.uint32)
    s2 = tl.load(row_ptr + lg + 2, mask=m, other=0).to(tl.uint32)
    n3 = ((s0 >> 3) & 0x11111111) | ((s1 >> 2) & 0x22222222) | ((s2 >> 1) & 0x44444444)
    n = tl.join(tl.join(s0 & 0x77777777, s2 & 0x77777777), tl.join(s1 & 0x77777777, n3))  # [BO, 4, 2, 2]: i = 2a + b
    return tl.reshape(n, (row_ptr.shape[0], 16))


@triton.jit
def tq_dequant_kernel(W, S, TABLE, OUT, out_features, groups, stride_out, BITS: tl.constexpr, BLOCK_O: tl.constexpr,
                      WORDS: tl.constexpr = False):
    """OUT [out, groups * 128] (OUT's type, rows stride_out apart) = sqrt(2) * s * c[idx] of group (program 1) for
    BLOCK_O rows (program 0), in kernel order. W: planar8 bytes, or with WORDS kernel words (``ops.weight_codec``:
    int32 [out, groups, 4 * BITS]) and TABLE indexed by their nibble fields (16 entries)."""
    DT: tl.constexpr = OUT.dtype.element_ty
    rows = tl.program_id(0) * BLOCK_O + tl.arange(0, BLOCK_O)
    gi = tl.program_id(1)
    row_mask = rows < out_features
    w_row = rows.to(tl.int64) * groups
    FB: tl.constexpr = 4 if WORDS else BITS  # kernel words hold one field per nibble
    if WORDS and BITS == 3:
        word = _words_of_3bit_slots(W + (w_row + gi)[:, None] * 12, row_mask)
    elif WORDS:
        slot = tl.arange(0, 16)
        word = tl.load(W + (w_row + gi)[:, None] * 16 + slot[None, :], mask=row_mask[:, None], other=0).to(tl.uint32)
    else:
        word = _load_words(W, (w_row + gi) * (16 * BITS), row_mask, 0, 16, 16, BITS)
    w_tile = _dequant_words(word, TABLE, _codebook_registers(TABLE, FB, tl.float16), BLOCK_O, 16, FB)
    s = tl.load(S + w_row + gi, mask=row_mask, other=0.0).to(tl.float32) * SQRT2
    d = tl.arange(0, GROUP)
    ptr = OUT + rows.to(tl.int64)[:, None] * stride_out + gi * GROUP + d[None, :]
    tl.store(ptr, (w_tile.to(tl.float32) * s[:, None]).to(DT), mask=row_mask[:, None])
