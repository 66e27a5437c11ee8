# SPDX-License-Identifier: Apache-2.0
"""Fused TurboQuant MSE encode / decode of dense vectors (jit functions only).

Conventions shared with the paged-cache kernels:
- A component has one or two *segments* of rotated coordinates, each with its own bit width.
  Segment s has G_s = n_s / 8 groups, padded to GP_s (a power of two) for Triton shapes.
- ``ROT_HI``/``ROT_LO`` hold the rotation rows of both segments, padded and permuted so that
  row ``off_s + j*GP_s + g`` is rotated coordinate ``start_s + j*G_s + g`` (zero rows for g >= G_s),
  split in an fp16 pair (hi + lo == fp32 row to ~2^-22). Hadamard rows are exactly +-1, so
  ROT_LO is zero and unused (``EXACT_ROT``) and the 1/sqrt(d) lives in ``rot_scale``.
- Products run on fp16 tensor cores as hi/lo pairs, which keeps fp32-level accuracy. Operands
  are bounded first (unit vectors, codebook values < 3) so fp16 never overflows whatever the
  vector's norm. The exception is the encoder's common case, 16-bit rows and a Hadamard rotation:
  the rows as loaded times the +-1 rows in the same type (``ROT_BF16`` for bf16) are exact products.
- Packing is layout ``planar8`` (see ``turboquant_core.packing``).
"""

import triton
import triton.language as tl

from .codebook_lookup_jit import INTERPRETING, _codebook_registers, _dequant_words, _load_words


@triton.jit
def _split_f16(x):
    hi = x.to(tl.float16)
    lo = (x - hi.to(tl.float32)).to(tl.float16)
    return hi, lo


# Above a padded head dim of 256 a whole [D_PAD, P] rotation operand no longer fits in shared
# memory (512 x 512 fp16 = 512 KiB); the products then run over K chunks of 64 rows.


@triton.jit
def _chunk(x, c, BN: tl.constexpr, N: tl.constexpr, C: tl.constexpr):
    """Columns [c*C, (c+1)*C) of a [BN, N] register tile (a masked reduction: Triton cannot slice)."""
    x3 = tl.reshape(x, (BN, N // C, C))
    sel = (tl.arange(0, N // C) == c)[None, :, None]
    return tl.sum(tl.where(sel, x3, 0.0), axis=1)


@triton.jit
def _rotate_rows(x, ROT_HI, ROT_LO, row0, P: tl.constexpr, D_PAD: tl.constexpr, EXACT_ROT: tl.constexpr):
    """x [BN, D_PAD] fp32 -> x @ rows[row0:row0+P]^T, [BN, P] fp32."""
    p = tl.arange(0, P)
    if D_PAD <= 256:
        i = tl.arange(0, D_PAD)
        offs = (row0 + p)[None, :] * D_PAD + i[:, None]  # [D_PAD, P]: transposed view
        rh = tl.load(ROT_HI + offs)
        xh, xl = _split_f16(x)
        t = tl.dot(xh, rh) + tl.dot(xl, rh)
        if not EXACT_ROT:
            rl = tl.load(ROT_LO + offs)
            t += tl.dot(xh, rl)
    else:
        BN: tl.constexpr = x.shape[0]
        i = tl.arange(0, 64)
        t = tl.zeros((BN, P), dtype=tl.float32)
        for c in tl.static_range(D_PAD // 64):
            offs = (row0 + p)[None, :] * D_PAD + (c * 64 + i)[:, None]  # [64, P]
            rh = tl.load(ROT_HI + offs)
            xh, xl = _split_f16(_chunk(x, c, BN, D_PAD, 64))
            t += tl.dot(xh, rh) + tl.dot(xl, rh)
            if not EXACT_ROT:
                rl = tl.load(ROT_LO + offs)
                t += tl.dot(xh, rl)
    return t


@triton.jit
def _rotate_rows_exact(x16, ROT, row0, P: tl.constexpr, D_PAD: tl.constexpr):
    """x16 [BN, D_PAD] fp16 or bf16 as loaded -> x16 @ rows[row0:row0+P]^T, [BN, P] fp32, for Hadamard rows
    (exactly +-1) in x16's type: both operands are exact, so one product with fp32 accumulation does what
    the hi/lo pairs do for an fp32 operand. D_PAD <= 256."""
    p = tl.arange(0, P)
    i = tl.arange(0, D_PAD)
    r = tl.load(ROT + (row0 + p)[None, :] * D_PAD + i[:, None])  # [D_PAD, P]: transposed view
    if INTERPRETING and x16.dtype == tl.bfloat16:
        # Triton 3.6's interpreter multiplies bf16 operands wrongly; fp32 operands hold them exactly.
        return tl.dot(x16.to(tl.float32), r.to(tl.float32))
    return tl.dot(x16, r)


@triton.jit
def _unrotate_rows(y, ROT_HI, ROT_LO, row0, P: tl.constexpr, D_PAD: tl.constexpr, EXACT_ROT: tl.constexpr):
    """y [BN, P] fp32 (rotated coords of one segment) -> y @ rows[row0:row0+P], [BN, D_PAD] fp32."""
    i = tl.arange(0, D_PAD)
    if D_PAD <= 256 or P <= 64:
        p = tl.arange(0, P)
        offs = (row0 + p)[:, None] * D_PAD + i[None, :]  # [P, D_PAD]
        rh = tl.load(ROT_HI + offs)
        yh, yl = _split_f16(y)
        x = tl.dot(yh, rh) + tl.dot(yl, rh)
        if not EXACT_ROT:
            rl = tl.load(ROT_LO + offs)
            x += tl.dot(yh, rl)
    else:
        BN: tl.constexpr = y.shape[0]
        p = tl.arange(0, 64)
        x = tl.zeros((BN, D_PAD), dtype=tl.float32)
        for c in tl.static_range(P // 64):
            offs = (row0 + c * 64 + p)[:, None] * D_PAD + i[None, :]  # [64, D_PAD]
            rh = tl.load(ROT_HI + offs)
            yh, yl = _split_f16(_chunk(y, c, BN, P, 64))
            x += tl.dot(yh, rh) + tl.dot(yl, rh)
            if not EXACT_ROT:
                rl = tl.load(ROT_LO + offs)
                x += tl.dot(yh, rl)
    return x


@triton.jit
def _held_codebook(BND, LEVELS, NLEV: tl.constexpr):
    """A segment's encoder tables as scalars a program holds in registers: (the L/2 - 1 positive boundaries,
    the L/2 ``rotation_tables.encoder_levels`` words). Loaded once, before a loop over tiles (loads inside
    the loop would be pipelined through shared memory every iteration)."""
    H: tl.constexpr = NLEV // 2
    bnd = ()
    lev = (tl.load(LEVELS),)
    for m in tl.static_range(H - 1):
        bnd = bnd + (tl.load(BND + H + m),)
        lev = lev + (tl.load(LEVELS + m + 1),)
    return bnd, lev


@triton.jit
def _quantize_held(s, bnd, lev, NLEV: tl.constexpr):
    """Scaled coords -> (codebook index, c[idx]^2 within 2^-20), tables from ``_held_codebook``.

    The index is the number of boundaries strictly below s (ties at a boundary, a measure-zero case,
    may land one index apart on the negative side). The codebooks are exactly symmetric (c[L-1-i] ==
    -c[i], middle boundary 0; tested), so the search runs on |s| over the L/2 - 1 positive boundaries:
    one compare and one select per boundary, of a word (``rotation_tables.encoder_levels``) that holds
    both the half-index and c^2; the sign picks the half with one xor (H + m == m ^ H and
    H - 1 - m == m ^ (H - 1) for m < H, H a power of two)."""
    H: tl.constexpr = NLEV // 2
    a = tl.abs(s)
    w = tl.zeros(s.shape, dtype=tl.int32) + lev[0]
    for m in tl.static_range(H - 1):
        w = tl.where(a > bnd[m], lev[m + 1], w)
    idx = (w & (H - 1)) ^ tl.where(s > 0, H, H - 1)
    return idx, w.to(tl.float32, bitcast=True)


@triton.jit
def _quantize_segment(s, BND, LEVELS, NLEV: tl.constexpr):
    """``_quantize_held`` with the tables loaded here."""
    bnd, lev = _held_codebook(BND, LEVELS, NLEV)
    return _quantize_held(s, bnd, lev, NLEV)


@triton.jit
def _pack_store(idx, OUT, row_off, row_mask, byte0, BN: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                B: tl.constexpr):
    """idx [BN, 8*GP] int32 -> b bytes per group (planar8) at OUT[row_off + byte0 + k*G + g]."""
    idx3 = tl.reshape(idx, (BN, 8, GP))
    j = tl.arange(0, 8)
    word = tl.sum(idx3.to(tl.uint32) << (B * j)[None, :, None].to(tl.uint32), axis=1)  # [BN, GP]
    g = tl.arange(0, GP)
    m = row_mask[:, None] & (g < G)[None, :]
    for k in tl.static_range(B):
        byte = ((word >> (8 * k)) & 0xFF).to(tl.uint8)
        tl.store(OUT + row_off[:, None] + byte0 + k * G + g[None, :], byte, mask=m)


@triton.jit
def _load_unpack(IN, row_off, row_mask, byte0, BN: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                 B: tl.constexpr):
    """Inverse of _pack_store: [BN, 8*GP] int32 indices (padded groups read as 0)."""
    g = tl.arange(0, GP)
    m = row_mask[:, None] & (g < G)[None, :]
    word = tl.zeros((BN, GP), dtype=tl.uint32)
    for k in tl.static_range(B):
        byte = tl.load(IN + row_off[:, None] + byte0 + k * G + g[None, :], mask=m, other=0)
        word |= byte.to(tl.uint32) << (8 * k)
    j = tl.arange(0, 8)
    idx3 = (word[:, None, :] >> (B * j)[None, :, None].to(tl.uint32)) & ((1 << B) - 1)
    return tl.reshape(idx3, (BN, 8 * GP)).to(tl.int32)


@triton.jit
def _segment_valid(BN: tl.constexpr, G: tl.constexpr, GP: tl.constexpr):
    """[1, 8*GP] mask of real (non-padded) coordinates in a segment tile."""
    p = tl.arange(0, 8 * GP)
    return ((p % GP) < G)[None, :]


@triton.jit
def _encode_segment_exact(x, row_mul, ROT, row0, OUT, out_off, row_mask, byte0, LEVELS, BND,
                          D_PAD: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, B: tl.constexpr):
    """One segment of 16-bit rows with a Hadamard rotation: quantize, pack and store; returns the rows'
    sum of c^2 over the segment.

    With GP >= 16 (Triton's smallest product width) and BN >= 64 the segment is rotated one packing slot at
    a time, [D_PAD, GP] rows per product: the 8 slots' index tiles then share one register layout and pack
    with shifts and ors (one [BN, 8*GP] product would have to be reshaped across threads to pack), and c^2
    is summed over the slots in registers before a single row reduction. Blocks of fewer rows (the paged
    store's) keep one product: their slot products do not run as Hopper warpgroup products, and holding
    the 8 slots' rotation rows as register operands took the store kernel from about 180 to 255 registers
    (spilling) on sm_90."""
    BN: tl.constexpr = x.shape[0]
    g = tl.arange(0, GP)
    valid = (g < G)[None, :]
    if GP >= 16 and BN >= 64:
        word = tl.zeros((BN, GP), dtype=tl.uint32)
        c2 = tl.zeros((BN, GP), dtype=tl.float32)
        for j in tl.static_range(8):
            t = _rotate_rows_exact(x, ROT, row0 + j * GP, GP, D_PAD) * row_mul
            idx, sq = _quantize_segment(t, BND, LEVELS, 1 << B)
            c2 += sq
            word |= idx.to(tl.uint32) << (B * j)
        m = row_mask[:, None] & valid
        for k in tl.static_range(B):
            tl.store(OUT + out_off[:, None] + byte0 + k * G + g[None, :], ((word >> (8 * k)) & 0xFF).to(tl.uint8),
                     mask=m)
        return tl.sum(tl.where(valid, c2, 0.0), axis=1)
    else:
        t = _rotate_rows_exact(x, ROT, row0, 8 * GP, D_PAD) * row_mul
        idx, sq = _quantize_segment(t, BND, LEVELS, 1 << B)
        _pack_store(idx, OUT, out_off, row_mask, byte0, BN, G, GP, B)
        return tl.sum(tl.where(_segment_valid(BN, G, GP), sq, 0.0), axis=1)


@triton.jit
def _row_scale(norm, sumsq, sqrt_d, NORM_CORRECTION: tl.constexpr):
    """The stored per-row scale: |x| / |c| with norm correction (0 for rows of no codebook energy), else
    |x| / sqrt(d); clamped to the fp16 range."""
    if NORM_CORRECTION:
        scale = tl.where(sumsq > 0, norm / tl.sqrt(tl.maximum(sumsq, 1e-30)), 0.0)
    else:
        scale = norm / sqrt_d
    return tl.minimum(scale, 65504.0)


@triton.jit
def _mse_encode_rows(x, row_mask, OUT, out_off, ROT_HI, ROT_LO, ROT_BF16, LEV0, BND0, LEV1, BND1, rot_scale,
                     sqrt_d, D_PAD: tl.constexpr, G0: tl.constexpr, GP0: tl.constexpr, B0: tl.constexpr,
                     G1: tl.constexpr, GP1: tl.constexpr, B1: tl.constexpr,
                     NORM_CORRECTION: tl.constexpr, EXACT_ROT: tl.constexpr, BN: tl.constexpr):
    """x [BN, D_PAD] as loaded (fp16 / bf16 / fp32) -> packed indices stored at OUT[out_off + ...];
    returns the fp32 scale [BN] (already clamped to the fp16 range). Shared by ``tq_mse_encode_kernel``
    and the paged store. LEV*/BND*: ``rotation_tables.encoder_levels`` and the boundaries per segment.

    16-bit inputs with a Hadamard rotation are the products' operand as loaded, against the +-1 rows in
    the same type (ROT_HI for fp16, ROT_BF16 for bf16): exact products, fp32 sums, and 1 / |x| applied
    afterwards (``_encode_segment_exact``); otherwise the unit vector is rotated with the fp16 hi/lo pairs."""
    xf = x.to(tl.float32)
    norm = tl.sqrt(tl.sum(xf * xf, axis=1))
    inv_norm = tl.where(norm > 0, 1.0 / tl.maximum(norm, 1e-30), 0.0)
    s_mul = sqrt_d * rot_scale
    if EXACT_ROT and D_PAD <= 256 and x.dtype != tl.float32:
        if x.dtype == tl.bfloat16:
            rot = ROT_BF16
        else:
            rot = ROT_HI
        row_mul = (inv_norm * s_mul)[:, None]
        sumsq = _encode_segment_exact(x, row_mul, rot, 0, OUT, out_off, row_mask, 0, LEV0, BND0, D_PAD, G0, GP0, B0)
        if G1 > 0:
            sumsq += _encode_segment_exact(x, row_mul, rot, 8 * GP0, OUT, out_off, row_mask, B0 * G0, LEV1, BND1,
                                           D_PAD, G1, GP1, B1)
    else:
        u = xf * inv_norm[:, None]
        t0 = _rotate_rows(u, ROT_HI, ROT_LO, 0, 8 * GP0, D_PAD, EXACT_ROT) * s_mul
        idx0, sq0 = _quantize_segment(t0, BND0, LEV0, 1 << B0)
        sumsq = tl.sum(tl.where(_segment_valid(BN, G0, GP0), sq0, 0.0), axis=1)
        _pack_store(idx0, OUT, out_off, row_mask, 0, BN, G0, GP0, B0)
        if G1 > 0:
            t1 = _rotate_rows(u, ROT_HI, ROT_LO, 8 * GP0, 8 * GP1, D_PAD, EXACT_ROT) * s_mul
            idx1, sq1 = _quantize_segment(t1, BND1, LEV1, 1 << B1)
            sumsq += tl.sum(tl.where(_segment_valid(BN, G1, GP1), sq1, 0.0), axis=1)
            _pack_store(idx1, OUT, out_off, row_mask, B0 * G0, BN, G1, GP1, B1)
    return _row_scale(norm, sumsq, sqrt_d, NORM_CORRECTION)


# One rotation product per tile, its columns in packing order (the dense encoder for one-segment formats).
#
# The products above rotate a segment one packing slot at a time (8 products of [BN, d] x [d, G]) so that the
# 8 slots' index tiles share a register layout and pack with shifts; each product reads the row tile from shared
# memory again, and every program loads the whole rotation: the L1/TEX unit was the encoder's limit (90 % in
# Nsight Compute at d = 128). Here one product [BN, d] x [d, d] rotates a tile, against the rotation rows
# reordered so that product column n is rotated coordinate j(n) * G + g(n) with (``rotation_tables.packing_order``)
#   j = 4 b4 + 2 b3 + b0,   g = (2 b2 + b1) * d/32 + (n >> 5)      (b_i: bit i of n).
# In the accumulator layout of a Hopper warpgroup product, a thread holds columns 8i + 2q + e (q: its lane mod
# 4; e, i: its registers), so bits 0, 3, 4 and n >> 5 are register bits: reshaping the tile to [BN, G, 8] puts
# a group's 8 slots in one thread and packing is a reduction within registers, with no layout change. The row
# norm comes from the rotated tile (|R x| = |x|), so the rows only feed the product and are copied straight into
# shared memory; programs loop over tiles (as many as fit on the device) with the rotation loaded once and
# the next tiles' rows in flight. Needs one segment, a Hadamard rotation and 16-bit rows (exact products).


@triton.jit
def _pack_order_words(t, bnd, lev, B: tl.constexpr):
    """A tile [BN, D] of scaled rotated coordinates in packing order -> ([BN, D/8] uint32 words whose b-bit
    field j is slot j of group g, the rows' sum of c^2). 4-bit fields merge pairwise along the slot's three
    bits (b0, b3, b4), one shift-add per field; narrower ones as one shifted sum over the slots (each measured
    the faster there on an H200)."""
    BN: tl.constexpr = t.shape[0]
    D: tl.constexpr = t.shape[1]
    t7 = tl.reshape(t, (BN, D // 32, 2, 2, 2, 2, 2))  # (n >> 5, b4, b3, b2, b1, b0)
    t3 = tl.reshape(tl.permute(t7, (0, 4, 5, 1, 2, 3, 6)), (BN, D // 8, 2, 2, 2))  # (g, b4, b3, b0)
    idx, sq = _quantize_held(t3, bnd, lev, 1 << B)
    sumsq = tl.sum(tl.sum(tl.reshape(sq, (BN, D // 8, 8)), axis=2), axis=1)
    if B == 4:
        lo, hi = tl.split(idx.to(tl.uint32))  # b0: slots j and j + 1
        lo, hi = tl.split(lo + (hi << B))  # b3: j and j + 2
        lo, hi = tl.split(lo + (hi << (2 * B)))  # b4: j and j + 4
        return lo + (hi << (4 * B)), sumsq
    j = tl.arange(0, 8)  # slot j = 4 b4 + 2 b3 + b0: the reshape's order
    word = tl.sum(tl.reshape(idx, (BN, D // 8, 8)).to(tl.uint32) << (B * j)[None, None, :].to(tl.uint32), axis=2)
    return word, sumsq


def _pair_threshold_masks_asm(thresholds: int) -> str:
    """PTX for ``_pair_threshold_masks``: operands are the masks (two registers each: the mask and a copy
    that ptxas drops), then the two coordinates, then each threshold pair word (two registers each)."""
    o = 2 * (thresholds + 1)
    lines = ["{", ".reg .b32 h, a, z;",
             f"cvt.rz.f16x2.f32 h, ${o + 1}, ${o};",  # upper half: the odd column
             "abs.f16x2 a, h;", "mov.b32 z, 0;"]
    for k in range(thresholds):
        lines += [f"set.ge.u32.f16x2 ${2 * k}, a, ${o + 2 + 2 * k};", f"mov.b32 ${2 * k + 1}, ${2 * k};"]
    lines += [f"set.le.u32.f16x2 ${2 * thresholds}, h, z;", f"mov.b32 ${2 * thresholds + 1}, ${2 * thresholds};", "}"]
    return "\n".join(lines)


def _pair_threshold_masks_constraints(thresholds: int) -> str:
    return ",".join(["=r"] * (2 * thresholds + 2) + ["r"] * (2 * thresholds + 2))


_PAIR_MASKS_ASM_1 = tl.constexpr(_pair_threshold_masks_asm(1))
_PAIR_MASKS_ASM_3 = tl.constexpr(_pair_threshold_masks_asm(3))
_PAIR_MASKS_ASM_7 = tl.constexpr(_pair_threshold_masks_asm(7))
_PAIR_MASKS_CONSTRAINTS_1 = tl.constexpr(_pair_threshold_masks_constraints(1))
_PAIR_MASKS_CONSTRAINTS_3 = tl.constexpr(_pair_threshold_masks_constraints(3))
_PAIR_MASKS_CONSTRAINTS_7 = tl.constexpr(_pair_threshold_masks_constraints(7))


@triton.jit
def _pair_threshold_masks(s, bnd2, B: tl.constexpr):
    """Scaled coordinates [..., 2] (the pair: neighbouring register elements) -> (the L/2 - 1 threshold masks,
    the sign mask), uint32 [..., 2] with both elements of a pair alike. A mask holds the pair's two 16-bit
    lanes (even coordinate low): 0xFFFF where |s| >= threshold m (or s <= 0), else 0.

    One packed fp16 compare decides two coordinates. The pair is rounded toward zero to fp16, which never
    crosses a threshold that is itself an fp16 number (``codebooks.decision_boundaries``): the decisions are
    the fp32 ones. bnd2: ``rotation_tables.encoder_boundary_pairs`` as held scalars."""
    if B == 2:
        return tl.inline_asm_elementwise(_PAIR_MASKS_ASM_1, _PAIR_MASKS_CONSTRAINTS_1, [s, bnd2[0]],
                                         (tl.uint32, tl.uint32), is_pure=True, pack=2)
    elif B == 3:
        return tl.inline_asm_elementwise(_PAIR_MASKS_ASM_3, _PAIR_MASKS_CONSTRAINTS_3,
                                         [s, bnd2[0], bnd2[1], bnd2[2]], (tl.uint32, ) * 4, is_pure=True, pack=2)
    else:
        return tl.inline_asm_elementwise(_PAIR_MASKS_ASM_7, _PAIR_MASKS_CONSTRAINTS_7,
                                         [s, bnd2[0], bnd2[1], bnd2[2], bnd2[3], bnd2[4], bnd2[5], bnd2[6]],
                                         (tl.uint32, ) * 8, is_pure=True, pack=2)


@triton.jit
def _lane_count_total(mask_sum):
    """A uint32 sum of 16-bit lane masks (each lane 0xFFFF or 0) -> how many lanes were set, both lanes together.
    Summing words lets the low lane's 0xFFFFs carry into the high lane; the negated sum is exactly
    v = low + 2^16 (high - low) as an int32 (counts < 2^14), so the total is 2 (v & 0xFFFF) + (v >> 16)."""
    v = (0 - mask_sum).to(tl.int32, bitcast=True)
    return 2 * (v & 0xFFFF) + (v >> 16)


@triton.jit
def _pair_tile(t):
    """A tile [BN, D] in packing order -> [BN, 4, D/32, 2, 2, 2]: (2 b2 + b1, the thread that holds a row's
    columns in the product's accumulator layout; n >> 5; b4; b3; b0, the pair in neighbouring registers)."""
    BN: tl.constexpr = t.shape[0]
    D: tl.constexpr = t.shape[1]
    t7 = tl.reshape(t, (BN, D // 32, 2, 2, 2, 2, 2))  # (n >> 5, b4, b3, b2, b1, b0)
    return tl.reshape(tl.permute(t7, (0, 4, 5, 1, 2, 3, 6)), (BN, 4, D // 32, 2, 2, 2))


@triton.jit
def _pack_order_words_from_lanes(idx, B: tl.constexpr):
    """Pair words [BN, 4, D/32, 2, 2] whose two 16-bit lanes hold the B-bit indices of a pair (even
    coordinate low, nothing above bit B - 1 in a lane) -> [BN, D/8] uint32 words, b-bit field j = slot j."""
    BN: tl.constexpr = idx.shape[0]
    D: tl.constexpr = idx.shape[2] * 32
    if B == 3:
        pair = (idx | (idx >> (16 - B))) & ((1 << (2 * B)) - 1)  # slots j, j + 1 (b0)
        lo, hi = tl.split(pair)  # b3: j and j + 2
        pair = lo + (hi << (2 * B))
        lo, hi = tl.split(pair)  # b4: j and j + 4
        word = lo + (hi << (4 * B))
    else:
        # 2 and 4 bits: merge along b3 within the lanes, then along b4 as whole bytes (4B bits): the even
        # slots' fields from the low lanes, the odd ones' from the high lanes, shifted by B.
        lo, hi = tl.split(idx)  # b3
        x = lo + (hi << (2 * B))
        lo, hi = tl.split(x)  # b4
        even = (lo & 0xFFFF) | ((hi & 0xFFFF) << (4 * B))
        odd = (lo >> 16) | ((hi >> 16) << (4 * B))
        word = even + (odd << B)
    return tl.reshape(word, (BN, D // 8))


@triton.jit
def _pack_order_words_from_masks(masks, neg, lev, B: tl.constexpr):
    """Pair masks (``_pair_threshold_masks``, one element per pair: [BN, 4, D/32, 2, 2] each; ``masks`` the
    L/2 - 1 thresholds', ``neg`` the sign mask) -> what ``_pack_order_words`` returns for the same coordinates.

    A coordinate's half-index is the count of thresholds at or below |s|. The masks of a pair are summed as
    words; the negated sum is low + 2^16 (high - low) (see ``_lane_count_total``), and times 0x10001 it is
    the two counts in their lanes. The rows' sum of c^2 comes from how many coordinates pass each threshold,
    counted the same way within a thread: sum c^2 = n c_0^2 + sum_m (c_{m+1}^2 - c_m^2) #{|s| >= threshold m}."""
    BN: tl.constexpr = neg.shape[0]
    D: tl.constexpr = neg.shape[2] * 32
    H: tl.constexpr = 1 << (B - 1)
    M: tl.constexpr = (1 << B) - 1
    total = tl.zeros(neg.shape, dtype=tl.uint32)
    sumsq = tl.zeros((BN, 4), dtype=tl.float32) + (D // 4) * lev[0].to(tl.float32, bitcast=True)
    for m in tl.static_range(H - 1):
        total += masks[m]
        passed = _lane_count_total(tl.sum(tl.sum(tl.sum(masks[m], axis=4), axis=3), axis=2))  # within a thread
        step = lev[m + 1].to(tl.float32, bitcast=True) - lev[m].to(tl.float32, bitcast=True)
        sumsq += passed.to(tl.float32) * step
    # Lanes: H + count, or (sign mask set) H - 1 - count = (H + count) ^ (2H - 1): B clean bits each.
    idx = (total * 0xFFFEFFFF + H * 0x10001) ^ (neg & (M * 0x10001))  # 0xFFFEFFFF: -0x10001 mod 2^32
    return _pack_order_words_from_lanes(idx, B), tl.sum(sumsq, axis=1)


@triton.jit
def _pack_order_words_paired(t, bnd2, lev, B: tl.constexpr):
    """``_pack_order_words`` with the codebook search as packed fp16 compares, two coordinates per
    instruction (``_pair_threshold_masks``, then ``_pack_order_words_from_masks``). Decisions are the fp32
    ones but for an exact tie at a threshold (measure zero), which counts here as reaching it. GPU only."""
    H: tl.constexpr = 1 << (B - 1)
    masks = _pair_threshold_masks(_pair_tile(t), bnd2, B)
    neg, _ = tl.split(masks[H - 1])
    held = ()
    for m in tl.static_range(H - 1):
        mask, _ = tl.split(masks[m])
        held = held + (mask,)
    return _pack_order_words_from_masks(held, neg, lev, B)


def _index_polynomial_asm() -> str:
    """PTX for ``_index_polynomial_lanes`` (``index_polynomial``: the rule and why). Operands: three outputs
    (two registers each: the word and a copy that ptxas drops), the pair of coordinates, then the 10
    table words of ``rotation_tables.encoder_index_polynomial`` (two registers each)."""
    c4, c3, c2, c1, c0, clamp, tlo0, tlo1, thi0, thi1 = (f"${8 + 2 * i}" for i in range(10))
    return "\n".join([
        "{", ".reg .b32 h, a, u, f, n, t, sel;",
        "cvt.rz.f16x2.f32 h, $7, $6;",  # upper half: the odd column
        "abs.f16x2 a, h;",
        f"min.f16x2 a, a, {clamp};",
        f"fma.rn.f16x2 u, {c4}, a, {c3};",
        f"fma.rn.f16x2 u, u, a, {c2};",
        f"fma.rn.f16x2 u, u, a, {c1};",
        f"fma.rn.f16x2 u, u, a, {c0};",
        "mov.b32 t, 0x64086408;",  # 1032 in both halves
        "add.rn.f16x2 f, u, t;",  # lanes 0x6408 + k: k in bits 0-2, bit 3 set
        "mov.b32 t, 0;",
        "set.le.u32.f16x2 n, h, t;",  # 0xFFFF where s <= 0
        "xor.b32 n, f, n;",  # bits 0-3: 8 + k, or 7 - k where s <= 0
        "and.b32 $0, n, 0x000F000F;",
        "mov.b32 $1, $0;",
        "shr.b32 sel, f, 8;",  # selector: k of the low lane in bits 0-2, of the high lane in bits 8-10
        "and.b32 sel, sel, 0x0700;",
        "and.b32 t, f, 7;",
        "or.b32 sel, sel, t;",
        f"prmt.b32 $2, {tlo0}, {tlo1}, sel;",  # bytes 0, 2: low bytes of g_k; bytes 1, 3: g_0 = 0
        "mov.b32 $3, $2;",
        f"prmt.b32 $4, {thi0}, {thi1}, sel;",
        "mov.b32 $5, $4;",
        "}",
    ])


_INDEX_POLYNOMIAL_ASM = tl.constexpr(_index_polynomial_asm())
_INDEX_POLYNOMIAL_CONSTRAINTS = tl.constexpr(",".join(["=r"] * 6 + ["r"] * 22))


@triton.jit
def _index_polynomial_lanes(s, poly):
    """Scaled coordinates [..., 2] (the pair: neighbouring register elements) -> (index lanes, g low bytes,
    g high bytes), uint32 [..., 2] with both elements of a pair alike. Index lanes: the 4-bit index of each
    coordinate in its 16-bit lane (even coordinate low); g: c^2 - c_H^2 of each index in 2^-13 units, its
    low (high) byte in bits 0-7 (16-23). poly: ``rotation_tables.encoder_index_polynomial`` as held scalars.
    The decisions are those of the thresholds (``codebooks.decision_boundaries``: the polynomial's step
    points) but for an exact tie, which counts as reaching a threshold, and s = 0, which counts as
    negative; the rz rounding keeps them exact as in ``_pair_threshold_masks``."""
    return tl.inline_asm_elementwise(_INDEX_POLYNOMIAL_ASM, _INDEX_POLYNOMIAL_CONSTRAINTS,
                                     [s, poly[0], poly[1], poly[2], poly[3], poly[4], poly[5], poly[6], poly[7],
                                      poly[8], poly[9]], (tl.uint32, tl.uint32, tl.uint32), is_pure=True, pack=2)


@triton.jit
def _pack_order_words_from_polynomial(idx, glo, ghi, c0sq):
    """The index lanes and c^2 bytes of ``_index_polynomial_lanes`` (one element per pair: [BN, 4, D/32, 2, 2]
    each) -> what ``_pack_order_words`` returns for 4 bits. A thread's byte lanes are summed as words (at most
    32 bytes of 255 per 16-bit lane: no carry between lanes)."""
    D: tl.constexpr = idx.shape[2] * 32
    lo = tl.sum(tl.sum(tl.sum(glo, axis=4), axis=3), axis=2)  # within a thread
    hi = tl.sum(tl.sum(tl.sum(ghi, axis=4), axis=3), axis=2)
    g = (lo & 0xFFFF) + (lo >> 16) + ((hi & 0xFFFF) + (hi >> 16)) * 256
    sumsq = g.to(tl.float32) * (1.0 / 8192.0) + (D // 4) * c0sq.to(tl.float32, bitcast=True)  # 2^-13: see tables
    return _pack_order_words_from_lanes(idx, 4), tl.sum(sumsq, axis=1)


@triton.jit
def _pack_order_words_polynomial(t, poly):
    """``_pack_order_words`` for 4 bits with the search as the index polynomial (``index_polynomial``):
    two coordinates per packed fp16 instruction, c^2 by byte lookups. GPU only (CUDA sm_80+)."""
    idx, glo, ghi = _index_polynomial_lanes(_pair_tile(t), poly)
    idx, _ = tl.split(idx)
    glo, _ = tl.split(glo)
    ghi, _ = tl.split(ghi)
    return _pack_order_words_from_polynomial(idx, glo, ghi, poly[10])


@triton.jit
def _encode_tile_packing_order(X, stride_x, rot, OUT, stride_out, SCALE, N, tile, bnd, lev, bnd2, poly, sqrt_d,
                               rot_scale, D: tl.constexpr, B: tl.constexpr, NORM_CORRECTION: tl.constexpr,
                               BN: tl.constexpr, PAIRED: tl.constexpr, POLY: tl.constexpr):
    """Rows [tile*BN, tile*BN + BN) -> packed indices and fp16 scales; rot: [D, D] +-1 operand in packing order
    (the transposed view of ``rotation_tables.packing_order_rotation``). PAIRED: the search as packed fp16
    compares (``_pack_order_words_paired``), else as fp32 compares (``_pack_order_words``); POLY (4 bits): as
    the index polynomial (``_pack_order_words_polynomial``)."""
    i = tl.arange(0, D)
    rows = tile * BN + tl.arange(0, BN)
    rmask = rows < N
    x = tl.load(X + rows[:, None].to(tl.int64) * stride_x + i[None, :], mask=rmask[:, None], other=0.0)
    if INTERPRETING and x.dtype == tl.bfloat16:
        t = tl.dot(x.to(tl.float32), rot.to(tl.float32))  # Triton 3.6's interpreter: see _rotate_rows_exact
    else:
        t = tl.dot(x, rot)  # exact products, fp32 sums: t = sqrt(d) * R x
    ss = tl.sum(t * t, axis=1)  # d |x|^2
    row_mul = tl.where(ss > 0, sqrt_d * tl.rsqrt(tl.where(ss > 0, ss, 1.0)), 0.0)
    if POLY:
        word, sumsq = _pack_order_words_polynomial(t * row_mul[:, None], poly)
    elif PAIRED:
        word, sumsq = _pack_order_words_paired(t * row_mul[:, None], bnd2, lev, B)
    else:
        word, sumsq = _pack_order_words(t * row_mul[:, None], bnd, lev, B)
    G: tl.constexpr = D // 8
    g = tl.arange(0, G)
    out_off = rows.to(tl.int64) * stride_out
    for k in tl.static_range(B):
        tl.store(OUT + out_off[:, None] + k * G + g[None, :], ((word >> (8 * k)) & 0xFF).to(tl.uint8),
                 mask=rmask[:, None])
    norm = tl.sqrt(ss) * rot_scale
    tl.store(SCALE + rows, _row_scale(norm, sumsq, sqrt_d, NORM_CORRECTION).to(tl.float16), mask=rmask)


@triton.jit
def tq_mse_encode_packing_order_kernel(
    X, stride_x, ROT, LEV, BND, BND2, POLY_TABLE, OUT, stride_out, SCALE, N, rot_scale, sqrt_d,
    D: tl.constexpr, B: tl.constexpr, NORM_CORRECTION: tl.constexpr, BN: tl.constexpr, STAGES: tl.constexpr,
    PAIRED: tl.constexpr, POLY: tl.constexpr,
):
    """Vectors [N, D] (fp16 / bf16, D a power of two, 32..256) -> packed indices [N, D*B/8] + fp16 scale [N],
    one segment of B bits, tiles of BN rows looped over by every program. ROT: [D, D] +-1 rows in packing
    order, in X's type; BND2: ``rotation_tables.encoder_boundary_pairs`` (read when PAIRED, GPU only);
    POLY_TABLE: ``rotation_tables.encoder_index_polynomial`` (read when POLY, 4 bits, GPU only).
    (Triton's interpreter cannot loop over a run-time range: a program per tile there.)"""
    i = tl.arange(0, D)
    rot = tl.load(ROT + i[None, :] * D + i[:, None])  # [D (in), D (out)]: transposed view
    bnd, lev = _held_codebook(BND, LEV, 1 << B)
    bnd2 = ()
    if PAIRED:
        for m in tl.static_range((1 << (B - 1)) - 1):
            bnd2 = bnd2 + (tl.load(BND2 + m),)
    poly = ()
    if POLY:
        for m in tl.static_range(11):
            poly = poly + (tl.load(POLY_TABLE + m),)
    if INTERPRETING:
        _encode_tile_packing_order(X, stride_x, rot, OUT, stride_out, SCALE, N, tl.program_id(0), bnd, lev, bnd2,
                                   poly, sqrt_d, rot_scale, D, B, NORM_CORRECTION, BN, PAIRED, POLY)
    else:
        for tile in tl.range(tl.program_id(0), tl.cdiv(N, BN), tl.num_programs(0), num_stages=STAGES):
            _encode_tile_packing_order(X, stride_x, rot, OUT, stride_out, SCALE, N, tile, bnd, lev, bnd2, poly,
                                       sqrt_d, rot_scale, D, B, NORM_CORRECTION, BN, PAIRED, POLY)


@triton.jit
def tq_mse_encode_kernel(
    X, stride_x, ROT_HI, ROT_LO, ROT_BF16, LEV0, BND0, LEV1, BND1, OUT, stride_out, SCALE,
    N, rot_scale, sqrt_d,
    D: tl.constexpr, D_PAD: tl.constexpr,
    G0: tl.constexpr, GP0: tl.constexpr, B0: tl.constexpr,
    G1: tl.constexpr, GP1: tl.constexpr, B1: tl.constexpr,
    NORM_CORRECTION: tl.constexpr, EXACT_ROT: tl.constexpr, BN: tl.constexpr,
):
    """Vectors [N, D] -> packed indices [N, bytes] (uint8) + fp16 scale [N], the rotation as products per
    packing slot (any format; ``tq_mse_encode_packing_order_kernel`` serves the common one-segment case)."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    rmask = rows < N
    out_off = rows.to(tl.int64) * stride_out
    i = tl.arange(0, D_PAD)
    x = tl.load(X + rows[:, None].to(tl.int64) * stride_x + i[None, :],
                mask=rmask[:, None] & (i < D)[None, :], other=0.0)
    scale = _mse_encode_rows(x, rmask, OUT, out_off, ROT_HI, ROT_LO, ROT_BF16, LEV0, BND0, LEV1, BND1,
                             rot_scale, sqrt_d, D_PAD, G0, GP0, B0, G1, GP1, B1, NORM_CORRECTION, EXACT_ROT, BN)
    tl.store(SCALE + rows, scale.to(tl.float16), mask=rmask)


@triton.jit
def _unrotate_rows_hi(c, ROT_HI, row0, P: tl.constexpr, D_PAD: tl.constexpr):
    """c [BN, P] codebook values (fp32) -> c @ rows[row0:row0+P] with both operands rounded to fp16 once:
    one product instead of the hi/lo pairs. Error ~2^-11 / sqrt(3) of the coordinates' RMS, well below the
    rounding of a bf16 output; only for D_PAD <= 256."""
    p = tl.arange(0, P)
    i = tl.arange(0, D_PAD)
    rh = tl.load(ROT_HI + (row0 + p)[:, None] * D_PAD + i[None, :])
    return tl.dot(c.to(tl.float16), rh)


@triton.jit
def _unrotate_segment(c, ROT_HI, ROT_LO, row0, P: tl.constexpr, D_PAD: tl.constexpr, EXACT_ROT: tl.constexpr,
                      HI_ONLY: tl.constexpr):
    if HI_ONLY:
        return _unrotate_rows_hi(c, ROT_HI, row0, P, D_PAD)
    return _unrotate_rows(c, ROT_HI, ROT_LO, row0, P, D_PAD, EXACT_ROT)


@triton.jit
def _permuted_segment(IN, row_off, row_mask, byte0, CENT, G: tl.constexpr, GP: tl.constexpr, B: tl.constexpr,
                      BN: tl.constexpr):
    """A segment's codebook values [BN, 8*GP] fp32 in kernel order, looked up by byte permutes (fp16 values;
    the interpreter, which cannot run PTX, loads the same values)."""
    word = _load_words(IN, row_off, row_mask, byte0, G, GP, B)
    return _dequant_words(word, CENT, _codebook_registers(CENT, B), BN, GP, B)


@triton.jit
def _unrotate_f16_values(c, ROT_HI, ROT_LO, row0, P: tl.constexpr, D_PAD: tl.constexpr, EXACT_ROT: tl.constexpr,
                         HI_ONLY: tl.constexpr):
    """``_unrotate_segment`` for values that are exactly fp16 (``_permuted_segment``): their hi/lo split has a
    zero lo part, so the product with it is skipped."""
    if HI_ONLY or not (D_PAD <= 256 or P <= 64):
        return _unrotate_segment(c.to(tl.float32), ROT_HI, ROT_LO, row0, P, D_PAD, EXACT_ROT, HI_ONLY)
    p = tl.arange(0, P)
    i = tl.arange(0, D_PAD)
    offs = (row0 + p)[:, None] * D_PAD + i[None, :]
    x = tl.dot(c, tl.load(ROT_HI + offs))
    if not EXACT_ROT:
        x += tl.dot(c, tl.load(ROT_LO + offs))
    return x


@triton.jit
def _mse_decode_rows(IN, row_off, row_mask, ROT_HI, ROT_LO, CENT0, CENT1, D_PAD: tl.constexpr,
                     G0: tl.constexpr, GP0: tl.constexpr, B0: tl.constexpr,
                     G1: tl.constexpr, GP1: tl.constexpr, B1: tl.constexpr,
                     EXACT_ROT: tl.constexpr, BN: tl.constexpr, HI_ONLY: tl.constexpr,
                     PERMUTE: tl.constexpr):
    """Packed indices at IN[row_off + ...] -> R^T c[idx], [BN, D_PAD] fp32, before the per-row scale.
    Shared by ``tq_mse_decode_kernel``, the paged gather-dequant and the key-centering sums. ``HI_ONLY``: the
    inverse rotation as one fp16 product (``_unrotate_rows_hi``; D_PAD <= 256). ``PERMUTE`` (2- to 4-bit
    segments): codebook values by byte permutes in registers (``codebook_lookup_jit``; the interpreter loads
    them), as fp16, and ROT_* rows in kernel order (``rotation_tables.kernel_order_rotation``); otherwise
    gathered per index from the fp32 codebooks, rows in the codec's order."""
    if PERMUTE:
        x = _unrotate_f16_values(_permuted_segment(IN, row_off, row_mask, 0, CENT0, G0, GP0, B0, BN), ROT_HI,
                                 ROT_LO, 0, 8 * GP0, D_PAD, EXACT_ROT, HI_ONLY)
        if G1 > 0:
            x += _unrotate_f16_values(_permuted_segment(IN, row_off, row_mask, B0 * G0, CENT1, G1, GP1, B1, BN),
                                      ROT_HI, ROT_LO, 8 * GP0, 8 * GP1, D_PAD, EXACT_ROT, HI_ONLY)
        return x
    idx0 = _load_unpack(IN, row_off, row_mask, 0, BN, G0, GP0, B0)
    x = _unrotate_segment(tl.load(CENT0 + idx0), ROT_HI, ROT_LO, 0, 8 * GP0, D_PAD, EXACT_ROT, HI_ONLY)
    if G1 > 0:
        idx1 = _load_unpack(IN, row_off, row_mask, B0 * G0, BN, G1, GP1, B1)
        x += _unrotate_segment(tl.load(CENT1 + idx1), ROT_HI, ROT_LO, 8 * GP0, 8 * GP1, D_PAD, EXACT_ROT, HI_ONLY)
    return x


@triton.jit
def tq_mse_decode_kernel(
    IN, stride_in, SCALE, ROT_HI, ROT_LO, CENT0, CENT1, OUT, stride_out,
    N, rot_scale,
    D: tl.constexpr, D_PAD: tl.constexpr,
    G0: tl.constexpr, GP0: tl.constexpr, B0: tl.constexpr,
    G1: tl.constexpr, GP1: tl.constexpr, B1: tl.constexpr,
    EXACT_ROT: tl.constexpr, BN: tl.constexpr, HI_ONLY: tl.constexpr, PERMUTE: tl.constexpr,
):
    """Packed indices [N, bytes] + fp16 scale [N] -> vectors [N, D] in OUT's dtype.

    ``HI_ONLY`` (bf16 outputs, D_PAD <= 256): the inverse rotation runs as one fp16 product, whose
    error stays well below the output's own rounding; other outputs keep the hi/lo products."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    rmask = rows < N
    in_off = rows.to(tl.int64) * stride_in
    scale = tl.load(SCALE + rows, mask=rmask, other=0.0).to(tl.float32) * rot_scale

    x = _mse_decode_rows(IN, in_off, rmask, ROT_HI, ROT_LO, CENT0, CENT1, D_PAD, G0, GP0, B0, G1, GP1, B1,
                         EXACT_ROT, BN, HI_ONLY, PERMUTE) * scale[:, None]
    i = tl.arange(0, D_PAD)
    tl.store(OUT + rows[:, None].to(tl.int64) * stride_out + i[None, :], x.to(OUT.dtype.element_ty),
             mask=rmask[:, None] & (i < D)[None, :])
