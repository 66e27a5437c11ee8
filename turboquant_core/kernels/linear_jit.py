# SPDX-License-Identifier: Apache-2.0
"""Linear layers over TurboQuant weights (jit only; launcher: ``ops.linear.tq_linear``).

y[b, o] = sqrt(2) * sum_g s[o, g] * < x[b, g] M, c[idx[o, g]] >, with M the group's rotation, unnormalised
(entries +-1) and divided by 16 (both exact), its columns in the kernel order of ``codebook_lookup_jit``
(position 8 q + r of a group holds rotated coordinate bitrev3(r) * 16 + q), the order the lookups build the weight's
codebook values in; sqrt(128) / 16 = sqrt(2) is put back once at the end.

``tq_linear_kernel`` (few activation rows): one program takes BLOCK_O output rows x BLOCK_B activation rows x a
range of groups. Per group it rotates the activation tile with one tensor-core product against M (held in
registers for the whole range), decodes the [BLOCK_O, 128] weight tile in registers in the activation's type
(bf16 or fp16), and adds the second product, scaled by the rows' group scales, to fp32 accumulators. Nothing is
decoded to memory and the activation is rotated where it is used, so a product is one launch. When the output
tiles are too few to fill the GPU the groups are split over programs (split-K): each writes fp32 partial sums, and
the last program of a tile to arrive (an atomic counter per tile, which it resets to zero) adds them in a fixed
order and writes the output.

``tq_dequant_kernel`` (many rows): writes sqrt(2) * s * c[idx] per group, the weight in the rotated domain and in
kernel order, for a tensor-core GEMM against the rotated activation.
"""

import triton
import triton.language as tl

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
def _add_group(acc, gi, X, W, S, TABLE, cb, rot, w_row, x_row, row_mask, b_mask, d, in_features,
               BITS: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_B: tl.constexpr, DT: tl.constexpr,
               ROTATED: tl.constexpr, FMA: tl.constexpr):
    """acc + (activation tile of group gi, rotated) x (decoded weight tile of group gi)^T, scaled per output row.
    ROTATED: X holds the rotated activation already (``tq_rotate_kernel``). FMA: the product by multiply-adds and
    row sums in the decoded tile's own layout, one activation row at a time, instead of a tensor-core product."""
    word = _load_words(W, (w_row + gi) * (16 * BITS), row_mask, 0, 16, 16, BITS)
    w_tile = _dequant_words(word, TABLE, cb, BLOCK_O, 16, BITS, DT)  # [BLOCK_O, 128], kernel order
    s = tl.load(S + w_row + gi, mask=row_mask, other=0.0).to(tl.float32)
    col = gi * GROUP + d
    if FMA:
        wf = w_tile.to(tl.float32)
        bi = tl.arange(0, BLOCK_B)
        for b in tl.static_range(BLOCK_B):
            xb = tl.load(X + tl.sum(tl.where(bi == b, x_row, 0)) + col,
                         mask=tl.sum(tl.where(bi == b, b_mask.to(tl.int32), 0)) > 0, other=0.0).to(tl.float32)
            p = tl.sum(wf * xb[None, :], axis=1) * s
            acc = tl.where((bi == b)[:, None], acc + p[None, :], acc)
        return acc
    else:
        x_tile = tl.load(X + x_row[:, None] + col[None, :], mask=b_mask[:, None] & (col < in_features)[None, :],
                         other=0.0)
        if ROTATED:
            xr = x_tile
        else:
            xr = _dot(x_tile, rot).to(DT)  # [BLOCK_B, 128] rotated / sqrt(2), kernel order
        part = _dot(xr, tl.trans(w_tile))  # [BLOCK_B, BLOCK_O] fp32
        return acc + part * s[None, :]


@triton.jit
def _store_output(acc, Y, BIAS, rows, bs, row_mask, b_mask, stride_y, HAS_BIAS: tl.constexpr):
    y = acc * SQRT2
    if HAS_BIAS:
        y += tl.load(BIAS + rows, mask=row_mask, other=0.0).to(tl.float32)[None, :]
    ptr = Y + bs.to(tl.int64)[:, None] * stride_y + rows[None, :]
    tl.store(ptr, y.to(Y.dtype.element_ty), mask=b_mask[:, None] & row_mask[None, :])


@triton.jit
def tq_linear_kernel(X, ROT, W, S, TABLE, BIAS, Y, PART, COUNT, num_rows, in_features, out_features, groups,
                     groups_per_split, stride_x, stride_y, BITS: tl.constexpr, BLOCK_O: tl.constexpr,
                     BLOCK_B: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, ROTATED: tl.constexpr,
                     FMA: tl.constexpr):
    """X [num_rows, in_features] bf16 or fp16 (rows stride_x apart); ROT [128, 128] the rotation M / 16 in X's type;
    W uint8 [out, groups, 16 * BITS] (planar8 per group); S fp16 [out, groups]; TABLE the codebook (2 ** BITS
    fp32); Y [num_rows, out] (rows stride_y apart). Program (o, b, k) sums groups k * groups_per_split onwards (at
    most groups_per_split of them); with SPLIT, into PART fp32 [splits, num_rows, out], the last of a tile's
    programs (COUNT int32, one zero per tile) adding the partial sums into Y."""
    DT: tl.constexpr = X.dtype.element_ty
    pid_o = tl.program_id(0)
    pid_b = tl.program_id(1)
    pid_k = tl.program_id(2)
    g0 = pid_k * groups_per_split
    g1 = tl.minimum(g0 + groups_per_split, groups)
    rows = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
    row_mask = rows < out_features
    bs = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    b_mask = bs < num_rows
    d = tl.arange(0, GROUP)
    if ROTATED:
        rot = 0
    else:
        rot = tl.load(ROT + d[:, None] * GROUP + d[None, :])
    cb = _codebook_registers(TABLE, BITS, DT)
    w_row = rows.to(tl.int64) * groups
    x_row = bs.to(tl.int64) * stride_x
    acc = tl.zeros((BLOCK_B, BLOCK_O), tl.float32)
    if INTERPRETING:
        # The interpreter cannot take run-time bounds in range() (its scalars are 1-element arrays).
        gi = g0
        while gi < g1:
            acc = _add_group(acc, gi, X, W, S, TABLE, cb, rot, w_row, x_row, row_mask, b_mask, d, in_features, BITS,
                             BLOCK_O, BLOCK_B, DT, ROTATED, FMA)
            gi += 1
    else:
        for gi in range(g0, g1):
            acc = _add_group(acc, gi, X, W, S, TABLE, cb, rot, w_row, x_row, row_mask, b_mask, d, in_features, BITS,
                             BLOCK_O, BLOCK_B, DT, ROTATED, FMA)
    if SPLIT:
        splits = tl.num_programs(2)
        out_mask = b_mask[:, None] & row_mask[None, :]
        part = PART + bs.to(tl.int64)[:, None] * out_features + rows[None, :]
        tl.store(part + pid_k.to(tl.int64) * num_rows * out_features, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial sums are written before the release below
        tile = pid_o * tl.num_programs(1) + pid_b
        arrived = tl.atomic_add(COUNT + tile, 1)  # acq_rel at GPU scope
        if arrived == splits - 1:
            acc = tl.zeros((BLOCK_B, BLOCK_O), tl.float32)
            if INTERPRETING:
                k = 0
                while k < splits:
                    acc += tl.load(part + k * num_rows * out_features, mask=out_mask, other=0.0)
                    k += 1
            else:
                for k in range(0, splits):
                    acc += tl.load(part + k.to(tl.int64) * num_rows * out_features, mask=out_mask, other=0.0,
                                   cache_modifier=".cg")
            tl.atomic_xchg(COUNT + tile, 0)
            _store_output(acc, Y, BIAS, rows, bs, row_mask, b_mask, stride_y, HAS_BIAS)
    else:
        _store_output(acc, Y, BIAS, rows, bs, row_mask, b_mask, stride_y, HAS_BIAS)


@triton.jit
def tq_rotate_kernel(X, ROT, XR, num_rows, in_features, stride_x, stride_xr, BLOCK_B: tl.constexpr):
    """XR [num_rows, groups * 128] (XR's type) = each group of X (zero past in_features) times ROT (M / 16): the
    rotated activation in kernel order, for BLOCK_B rows (program 0) and one group (program 1)."""
    bs = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    gi = tl.program_id(1)
    d = tl.arange(0, GROUP)
    col = gi * GROUP + d
    b_mask = bs < num_rows
    x = tl.load(X + bs.to(tl.int64)[:, None] * stride_x + col[None, :],
                mask=b_mask[:, None] & (col < in_features)[None, :], other=0.0)
    rot = tl.load(ROT + d[:, None] * GROUP + d[None, :])
    xr = _dot(x, rot)
    tl.store(XR + bs.to(tl.int64)[:, None] * stride_xr + col[None, :], xr.to(XR.dtype.element_ty),
             mask=b_mask[:, None])


@triton.jit
def tq_rotate_fp16_kernel(X, ROT, XQ, XS, num_rows, in_features, stride_x, stride_xq, stride_xs,
                          BLOCK_B: tl.constexpr):
    """For ``linear_mma_jit``: XQ fp16 [num_rows, groups * 128] and XS fp32 [num_rows, groups] such that
    XS * XQ = R x per group (R the format's rotation; ROT [128, 128] in X's type the unnormalised rotation, +-1,
    its columns in the MMA kernel's K order), XQ scaled by a power of two per (row, group) into [-2^14, 2^14]:
    fp16 keeps its 11 bits there whatever the activation's range. BLOCK_B rows (program 0), one group
    (program 1)."""
    bs = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    gi = tl.program_id(1)
    d = tl.arange(0, GROUP)
    col = gi * GROUP + d
    b_mask = bs < num_rows
    x = tl.load(X + bs.to(tl.int64)[:, None] * stride_x + col[None, :],
                mask=b_mask[:, None] & (col < in_features)[None, :], other=0.0)
    rot = tl.load(ROT + d[:, None] * GROUP + d[None, :])
    xr = _dot(x, rot)  # sqrt(128) R x, exact products, fp32 sums
    amax = tl.max(tl.abs(xr), axis=1)
    scale = tl.exp2(tl.ceil(tl.log2(tl.maximum(amax, 1e-30))) - 14.0)
    tl.store(XQ + bs.to(tl.int64)[:, None] * stride_xq + col[None, :], (xr / scale[:, None]).to(tl.float16),
             mask=b_mask[:, None])
    tl.store(XS + bs.to(tl.int64) * stride_xs + gi, scale * 0.08838834764831845, mask=b_mask)  # / sqrt(128)


@triton.jit
def tq_dequant_kernel(W, S, TABLE, OUT, out_features, groups, stride_out, BITS: tl.constexpr, BLOCK_O: tl.constexpr):
    """OUT [out, groups * 128] (OUT's type, rows stride_out apart) = sqrt(2) * s * c[idx] of group (program 1) for
    BLOCK_O rows (program 0), in kernel order."""
    DT: tl.constexpr = OUT.dtype.element_ty
    rows = tl.program_id(0) * BLOCK_O + tl.arange(0, BLOCK_O)
    gi = tl.program_id(1)
    row_mask = rows < out_features
    w_row = rows.to(tl.int64) * groups
    word = _load_words(W, (w_row + gi) * (16 * BITS), row_mask, 0, 16, 16, BITS)
    w_tile = _dequant_words(word, TABLE, _codebook_registers(TABLE, BITS, tl.float16), BLOCK_O, 16, BITS)
    s = tl.load(S + w_row + gi, mask=row_mask, other=0.0).to(tl.float32) * SQRT2
    d = tl.arange(0, GROUP)
    ptr = OUT + rows.to(tl.int64)[:, None] * stride_out + gi * GROUP + d[None, :]
    tl.store(ptr, (w_tile.to(tl.float32) * s[:, None]).to(DT), mask=row_mask[:, None])
