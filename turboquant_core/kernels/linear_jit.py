# SPDX-License-Identifier: Apache-2.0
"""Linear layer over a TurboQuant weight (jit only; launcher: ``ops.linear.tq_linear``).

y[b, o] = sum_g s[o, g] * < xr[b, g], c[idx[o, g]] >, xr the activation rotated per group of 128 and permuted
to the kernel order of ``codebook_lookup_jit`` (position 8 q + r of a group holds coordinate bitrev3(r) * 16 + q),
the order its lookups build the weight's codebook values in. One program: BLOCK_O output rows x BLOCK_B
activation rows x a range of groups (split-K, so that few output tiles still spread over every SM); per group it
decodes the [BLOCK_O, 128] fp16 weight tile in registers, takes one tensor-core product with the [BLOCK_B, 128]
activation tile and adds it, scaled by the rows' group scales, to fp32 accumulators. The weight is read once per
batch tile; nothing is decoded to memory.
"""

import triton
import triton.language as tl

from .codebook_lookup_jit import INTERPRETING, _codebook_registers, _dequant_words, _load_words

GROUP = tl.constexpr(128)


@triton.jit
def _add_group(acc, gi, X, W, S, TABLE, cb, w_row, x_row, row_mask, b_mask, d, group_bytes: tl.constexpr,
               BITS: tl.constexpr, BLOCK_O: tl.constexpr):
    """acc + (activation tile of group gi) x (decoded weight tile of group gi)^T, scaled per output row."""
    word = _load_words(W, (w_row + gi) * group_bytes, row_mask, 0, 16, 16, BITS)
    w_tile = _dequant_words(word, TABLE, cb, BLOCK_O, 16, BITS)  # [BLOCK_O, 128] fp16, kernel order
    x_tile = tl.load(X + x_row[:, None] + gi * GROUP + d[None, :], mask=b_mask[:, None], other=0.0)
    part = tl.dot(x_tile, tl.trans(w_tile))  # [BLOCK_B, BLOCK_O] fp32
    s = tl.load(S + w_row + gi, mask=row_mask, other=0.0).to(tl.float32)
    return acc + part * s[None, :]


@triton.jit
def tq_linear_kernel(X, W, S, TABLE, Y, num_rows, out_features, groups, groups_per_split, stride_x, stride_y,
                     stride_split, BITS: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_B: tl.constexpr):
    """X fp16 [num_rows, groups * 128] (rotated, kernel order); W uint8 [out, groups, 16 * BITS] (planar8 per
    group); S fp16 [out, groups]; TABLE the codebook (2 ** BITS fp32); Y fp32 [splits, num_rows, out]: program
    (o, b, k) sums groups k * groups_per_split onwards (at most groups_per_split of them) into Y[k]."""
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
    cb = _codebook_registers(TABLE, BITS)
    group_bytes: tl.constexpr = 16 * BITS
    w_row = rows.to(tl.int64) * groups
    x_row = bs.to(tl.int64) * stride_x
    acc = tl.zeros((BLOCK_B, BLOCK_O), tl.float32)
    if INTERPRETING:
        # The interpreter cannot take run-time bounds in range() (its scalars are 1-element arrays).
        gi = g0
        while gi < g1:
            acc = _add_group(acc, gi, X, W, S, TABLE, cb, w_row, x_row, row_mask, b_mask, d, group_bytes, BITS,
                             BLOCK_O)
            gi += 1
    else:
        for gi in range(g0, g1):
            acc = _add_group(acc, gi, X, W, S, TABLE, cb, w_row, x_row, row_mask, b_mask, d, group_bytes, BITS,
                             BLOCK_O)
    y = Y + pid_k.to(tl.int64) * stride_split + bs.to(tl.int64)[:, None] * stride_y + rows[None, :]
    tl.store(y, acc, mask=b_mask[:, None] & row_mask[None, :])
