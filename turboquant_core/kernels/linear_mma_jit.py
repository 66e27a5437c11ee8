# SPDX-License-Identifier: Apache-2.0
"""Linear layers over TurboQuant weights with the decoded weight tile built in tensor-core registers (Gluon; jit
only, launcher: ``ops.linear``).

The weight plays the part the keys play in the register-tile decode attention (``paged_decode_jit``): one warp takes
BN output rows (BN / 16 MMA row tiles), and per group of 128 inputs loads the rows' packed planes straight into the
threads whose MMA A-operand fragments their fields fill (``key_word_layout``), looks the fields up in a register
codebook (4-bit ones through the codebook's symmetry about zero: ``codebook_lookup_jit.SYMMETRIC_LOOKUP8_ASM``) and
multiplies the [BN, 128] tile by the activation columns (``mma.sync`` m16n8k16, fp16 operands, fp32 accumulators): no
shared memory, no layout conversion. tq4 weights come as the served kernel words (``ops.weight_codec``): the words
the plane loads would be merged into, stored so, with sign-magnitude fields whose magnitude rank is their bits 0-2
(``codebook_lookup_jit.SIGN_MAGNITUDE_LOOKUP8_ASM``). The activation, NQ = 8, 16 or 32 rows per program as the MMA
columns, comes rotated from ``linear_jit.tq_rotate_fp16_kernel``: each group's rotated coordinates in this kernel's K
order (``ops.paged_decode.decode_key_order``), in fp16 times a power-of-two scale per (row, group). Each group's
product is scaled by the rows' group scales and the columns' activation scales and added to fp32 accumulators. When
the output tiles are too few to fill the GPU the groups are split over programs (split-K): each writes fp32 partial
sums, and the last program of a tile to arrive (an atomic counter per tile, which it resets to zero) adds them in a
fixed order and writes the output. With INT8 (kernel words) the fields become codebook bytes, four per byte permute
(``INT8_LOOKUP4_ASM``), the A operand of m16n8k32 integer products against the int8 activation of
``linear_jit.tq_rotate_int8_kernel``.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from .codebook_lookup_jit import SIGN_MAGNITUDE_LOOKUP8_ASM, SYMMETRIC_LOOKUP8_ASM
from .paged_decode_jit import _fields, _load_planes, _nibble_fields_lookup, _planes_to_words, key_word_layout
from .paged_decode_wgmma_jit import _grid_dependency_wait

SYMMETRIC_ASM = gl.constexpr(SYMMETRIC_LOOKUP8_ASM.value)
SIGN_MAGNITUDE_ASM = gl.constexpr(SIGN_MAGNITUDE_LOOKUP8_ASM.value)
# tq3 kernel words: a lane group's three slots -> its four group words, one field per nibble (``ops.weight_codec``)
SLOTS3_TO_NIBBLES_ASM = gl.constexpr(
    "{ .reg .b32 t, u; and.b32 $0, $4, 0x77777777; and.b32 $1, $5, 0x77777777; and.b32 $2, $6, 0x77777777; "
    "shr.b32 t, $4, 3; and.b32 t, t, 0x11111111; shr.b32 u, $5, 2; and.b32 u, u, 0x22222222; or.b32 t, t, u; "
    "shr.b32 u, $6, 1; and.b32 u, u, 0x44444444; or.b32 $3, t, u; }")
# The int8 product's lookups, four fields (one register of int8 A operand) per permute. Operands: $0, $1 fields 0-3 and
# 4-7 of the word as bytes; $2-$5 the word (the same one four times: one per output byte), $6-$9 and $10-$13 the
# codebook byte words t0, t1 (``ops.linear._codebook_int8_words``). tq4 kernel words (sign-magnitude fields): the
# magnitude's byte, complemented where the field's bit 3 is clear (prmt's sign-replicating mode turns bits 3 into
# byte masks, as in ``codebook_lookup_jit.SIGN_MAGNITUDE_LOOKUP8_ASM``). tq3 nibble words: the field's byte.
INT8_LOOKUP4_ASM = gl.constexpr(
    "{ .reg .b32 m, x4, q, s; and.b32 m, $2, 0x77777777; shl.b32 x4, $2, 4; "
    "prmt.b32 q, $6, $10, m; prmt.b32 s, $2, x4, 0x9D8C; lop3.b32 $0, q, s, 0, 0xC3; shr.b32 m, m, 16; "
    "prmt.b32 q, $6, $10, m; prmt.b32 s, $2, x4, 0xBFAE; lop3.b32 $1, q, s, 0, 0xC3; }")
INT8_LOOKUP3_ASM = gl.constexpr(
    "{ .reg .b32 m; prmt.b32 $0, $6, $10, $2; shr.b32 m, $2, 16; prmt.b32 $1, $6, $10, m; }")


@gluon.jit
def _store_rows(acc, Y, BIAS, rows, cols, row_ok, col_ok, stride_y, HAS_BIAS: gl.constexpr):
    if HAS_BIAS:
        acc = acc + gl.load(BIAS + rows, mask=row_ok, other=0.0).to(gl.float32)[:, None]
    ptr = Y + cols.to(gl.int64)[None, :] * stride_y + rows[:, None]
    gl.store(ptr, acc.to(Y.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@gluon.jit
def _write_tile(acc, Y, BIAS, PART, COUNT, rows, cols, row_ok, col_ok, num_rows, out_features, stride_y, pid_k, splits,
                tile, HAS_BIAS: gl.constexpr, SPLIT: gl.constexpr):
    """A program's products [rows, cols] into Y; with SPLIT, as partial sums into PART [splits, num_rows, out], the
    last of the tile's programs to arrive (COUNT[tile], which it resets to zero) adding them in a fixed order."""
    if SPLIT:
        ok = row_ok[:, None] & col_ok[None, :]
        part_ptr = PART + cols.to(gl.int64)[None, :] * out_features + rows[:, None]
        plane = num_rows.to(gl.int64) * out_features
        gl.store(part_ptr + pid_k.to(gl.int64) * plane, acc, mask=ok)
        gl.thread_barrier()  # every lane's partial sums are written before the release below
        arrived = gl.atomic_add(COUNT + tile, 1)  # acq_rel at GPU scope
        if arrived == splits - 1:
            total = gl.zeros_like(acc)
            for k in range(0, splits):
                total += gl.load(part_ptr + k * plane, mask=ok, other=0.0, cache_modifier=".cg")
            gl.atomic_xchg(COUNT + tile, 0)
            _store_rows(total, Y, BIAS, rows, cols, row_ok, col_ok, stride_y, HAS_BIAS)
    else:
        _store_rows(acc, Y, BIAS, rows, cols, row_ok, col_ok, stride_y, HAS_BIAS)


@gluon.jit
def _fields_symmetric(word, m0, m1, m2, m3, SIGN_MAGNITUDE: gl.constexpr, DT: gl.constexpr = gl.float16):
    """Words of 4-bit fields of a codebook symmetric about zero -> the codebook values of their 8 fields, as
    ``_fields`` returns them, by ``codebook_lookup_jit.SYMMETRIC_LOOKUP8_ASM`` (m0..m3: the magnitude words); with
    SIGN_MAGNITUDE the fields are sign-magnitude (kernel words) and their rank is read, not computed. ``DT``: the
    16-bit type (fp16 or bf16) whose bit patterns the magnitude words hold."""
    f0, f1, f2, f3, f4, f5, f6, f7 = gl.inline_asm_elementwise(
        SIGN_MAGNITUDE_ASM if SIGN_MAGNITUDE else SYMMETRIC_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r",
        [word, m0, m1, m2, m3],
        dtype=(gl.int16, gl.int16, gl.int16, gl.int16, gl.int16, gl.int16, gl.int16, gl.int16), is_pure=True, pack=1)
    f0, f1, f2, f3 = (f0.to(DT, bitcast=True), f1.to(DT, bitcast=True),
                      f2.to(DT, bitcast=True), f3.to(DT, bitcast=True))
    f4, f5, f6, f7 = (f4.to(DT, bitcast=True), f5.to(DT, bitcast=True),
                      f6.to(DT, bitcast=True), f7.to(DT, bitcast=True))
    return gl.join(gl.join(gl.join(f0, f1), gl.join(f2, f3)), gl.join(gl.join(f4, f5), gl.join(f6, f7)))


@gluon.jit
def _nibble_words_of_slots(s0, s1, s2):
    """tq3 kernel words: slots [..., L] -> the lane groups' four group words, one field per nibble, [..., L, 4]."""
    n0, n1, n2, n3 = gl.inline_asm_elementwise(SLOTS3_TO_NIBBLES_ASM, "=r,=r,=r,=r,r,r,r", [s0, s1, s2],
                                               dtype=(gl.uint32, gl.uint32, gl.uint32, gl.uint32), is_pure=True,
                                               pack=1)
    return gl.reshape(gl.join(gl.join(n0, n2), gl.join(n1, n3)), [s0.shape[0], s0.shape[1], 4])


@gluon.constexpr_function
def group_stride(bits: int, words: bool) -> int:
    """Elements of W between one group's packed weight and the next's, per output row: int32 kernel words (tq3: 12,
    tq4: 16) or planar8 bytes (16 per bit)."""
    return (12 if bits == 3 else 16) if words else 16 * bits


@gluon.jit
def _weight_pointers(W, prow, groups, kw_l: gl.constexpr, BITS: gl.constexpr, WORDS: gl.constexpr):
    """Each thread's pointers to group 0 of its output rows ``prow`` (``SliceLayout(1, SliceLayout(2, kw_l))``), in
    the word tile's layout ``kw_l`` [rows, 4 lane groups, 4]: tq3 kernel words, slots 3 l + i (i < 3) of lane group
    l; tq4 kernel words, slot 4 l + g, the thread's four adjacent; planar8, byte 4 l of each plane."""
    kp_l: gl.constexpr = gl.SliceLayout(2, kw_l)
    row = prow.to(gl.int64) * groups * group_stride(BITS, WORDS)
    if WORDS and BITS == 3:
        return W + row[:, None] + (gl.arange(0, 4, layout=gl.SliceLayout(0, kp_l)) * 3)[None, :]
    elif WORDS:
        wl = gl.arange(0, 4, layout=gl.SliceLayout(0, kp_l))
        wg = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, kw_l)))
        return W + row[:, None, None] + (wl * 4)[None, :, None] + wg[None, None, :]
    else:
        return W + row[:, None] + (gl.arange(0, 4, layout=gl.SliceLayout(0, kp_l)) * 4)[None, :]


@gluon.jit
def _tile_indices(W, row0, col0, out_features, num_rows, groups, stride_xs, kw_l: gl.constexpr, acc_l: gl.constexpr,
                  BM: gl.constexpr, NQ: gl.constexpr, BITS: gl.constexpr, WORDS: gl.constexpr):
    """A program's weight pointers (``_weight_pointers``, output rows row0 .. row0 + BM) and, in the accumulator's
    layout ``acc_l``, its output rows, which are in the layer, their scales' offsets, its activation rows (col0 ..
    col0 + NQ), which are in the batch, and their scales' offsets. Rows past the layer and activation rows past the
    batch read the last one (their products are never stored)."""
    prow = gl.minimum(row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, gl.SliceLayout(2, kw_l))), out_features - 1)
    rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, acc_l))
    cols = col0 + gl.arange(0, NQ, layout=gl.SliceLayout(0, acc_l))
    return (_weight_pointers(W, prow, groups, kw_l, BITS, WORDS), rows, rows < out_features,
            gl.minimum(rows, out_features - 1).to(gl.int64) * groups, cols, cols < num_rows,
            gl.minimum(cols, num_rows - 1).to(gl.int64) * stride_xs)


@gluon.jit
def _load_group(ptr, BITS: gl.constexpr, WORDS: gl.constexpr):
    """One group's packed weight at ``ptr`` (``_weight_pointers`` plus the group's offset), as loaded: tq3 kernel
    words three slots, tq4 kernel words one [rows, 4, 4] tile of words, planar8 four byte planes (unused ones repeat
    plane 0)."""
    if WORDS and BITS == 3:
        return (gl.load(ptr).to(gl.uint32, bitcast=True), gl.load(ptr + 1).to(gl.uint32, bitcast=True),
                gl.load(ptr + 2).to(gl.uint32, bitcast=True))
    elif WORDS:
        return (gl.load(ptr).to(gl.uint32, bitcast=True),)
    else:
        return _load_planes(ptr, 0, 0, 16, BITS, 4)


@gluon.jit
def _decode_group(words, c0, c1, c2, c3, c4, c5, c6, c7, kw_l: gl.constexpr, a_op: gl.constexpr,
                  BITS: gl.constexpr, WORDS: gl.constexpr, BN: gl.constexpr, DT: gl.constexpr = gl.float16):
    """A group's loaded weight (``_load_group``) -> its codebook values [BN, 128] in the A-operand layout ``a_op``
    (no data movement: ``kw_l`` is built so that the fields land in the operand's registers), of type ``DT`` (the
    codebook words' entries; bf16 for kernel words only)."""
    if WORDS and BITS == 3:
        kw = gl.convert_layout(_nibble_words_of_slots(words[0], words[1], words[2]), kw_l, assert_trivial=True)
    elif WORDS:
        kw = words[0]
    else:
        kw = gl.convert_layout(_planes_to_words(words[0], words[1], words[2], words[3], BITS, 4), kw_l,
                               assert_trivial=True)
    if BITS == 4:  # c0..c3 the magnitude words of the symmetric codebook
        kf = _fields_symmetric(kw, c0, c1, c2, c3, WORDS, DT)  # [BN, 4, GR, 2, 2, 2]
    elif WORDS:
        kf = _nibble_fields_lookup(kw, c0, c1, c2, c3, c4, c5, c6, c7, BITS, DT)
    else:
        kf = _fields(kw, c0, c1, c2, c3, c4, c5, c6, c7, BITS)
    return gl.convert_layout(gl.reshape(gl.permute(kf, [0, 2, 5, 4, 1, 3]), [BN, 128]), a_op, assert_trivial=True)


@gluon.jit
def _decode_group_int8(words, t0, t1, kw_l: gl.constexpr, a_op: gl.constexpr, BITS: gl.constexpr, BN: gl.constexpr):
    """A group's loaded kernel words (``_load_group``) -> its codebook bytes [BN, 128] in the int8 A-operand layout
    ``a_op`` (k_width 4): a word's fields 0-3 and 4-7 are one register each, K positions 4 gl + e and 16 more, the
    word's gr the K step (``ops.linear.int8_key_order``)."""
    if BITS == 3:
        kw = gl.convert_layout(_nibble_words_of_slots(words[0], words[1], words[2]), kw_l, assert_trivial=True)
    else:
        kw = words[0]
    w2 = gl.join(kw, kw)
    w4 = gl.reshape(gl.join(w2, w2), [BN, 4, 4, 4])  # the word once per byte of the register it fills
    lo, hi = gl.inline_asm_elementwise(INT8_LOOKUP4_ASM if BITS == 4 else INT8_LOOKUP3_ASM,
                                       "=r,=r,r,r,r,r,r,r,r,r,r,r,r,r", [w4, t0, t1], dtype=(gl.int8, gl.int8),
                                       is_pure=True, pack=4)
    kf = gl.permute(gl.join(lo, hi), [0, 2, 4, 1, 3])  # [BN, gr, 2, gl, 4]
    return gl.convert_layout(gl.reshape(kf, [BN, 128]), a_op, assert_trivial=True)


@gluon.jit
def _group_scales(S, srow, XS, SX, xcol, gi, INT8: gl.constexpr):
    """Group ``gi``'s scales: the rows' weight scales (fp16), the columns' activation scales and, with INT8, their
    int8 sums (else the activation scales again, not read)."""
    ws = gl.load(S + srow + gi)
    xs = gl.load(XS + xcol + gi)
    if INT8:
        sx = gl.load(SX + xcol + gi)
    else:
        sx = xs
    return ws, xs, sx


@gluon.jit(do_not_specialize=["num_rows"])
def tq_linear_mma_kernel(XQ, XS, SX, CB, W, S, BIAS, Y, PART, COUNT, num_rows, out_features, groups, groups_per_split,
                         stride_xq, stride_xs, stride_y, c0, c1, c2, c3, c4, c5, c6, c7,
                         BITS: gl.constexpr, BN: gl.constexpr, NQ: gl.constexpr, HAS_BIAS: gl.constexpr,
                         SPLIT: gl.constexpr, WORDS: gl.constexpr, INT8: gl.constexpr = False,
                         PDL: gl.constexpr = False, SCALES_AHEAD: gl.constexpr = False):
    """XQ fp16 [num_rows, groups * 128] (rotated, K order), XS fp32 [num_rows, groups] (its scales); W uint8
    [out, groups, 16 * BITS] (planar8 per group), or with WORDS the kernel words int32 [out, groups, 4 * BITS]
    (``ops.weight_codec``: no plane merge; 4-bit: each thread's four words one 16-byte load; 3-bit: its three slots,
    whose fields are already one per nibble); S fp16 [out, groups];
    c0..c7 the codebook's words (``ops.linear._codebook_words``); Y [num_rows, out]. Program (o, b, k): output
    rows BN o.. (a multiple of 16: BN / 16 MMA row tiles share each activation tile), activation rows NQ b.., groups
    k * groups_per_split.. (at most groups_per_split); with SPLIT, partial sums into PART fp32 [splits, num_rows,
    out], the last of a tile's programs (COUNT int32, one zero per tile) adding them into Y. With INT8 (kernel words
    only): XQ int8 in the int8 K order, XS its steps times the codebook's half unit and SX int32 [num_rows, groups]
    its sums (``linear_jit.tq_rotate_int8_kernel``), CB int32 [2] the codebook's byte words (``ops.linear``'s
    ``_codebook_int8_words``: loaded once, they stay in registers, where kernel arguments would be copied out of
    uniform registers at every permute); int8 products (m16n8k32) into int32, each group's 2 P + SX then scaled
    (``ops.weight_codec.tq_linear_int8_reference``). SX and CB are not read otherwise. ``PDL``: launched as a
    programmatic dependent of the activation's rotation; its first group's weight is loaded before it waits for that
    grid. ``SCALES_AHEAD``: each group's scales (``_group_scales``) are loaded a group ahead, with the next group's
    weight, instead of in its own iteration (the activation tile is loaded in its iteration either way: a carried
    int8 tile costs a byte permute per value)."""
    DP: gl.constexpr = 128
    KW: gl.constexpr = 4 if INT8 else 2
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=KW)
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=KW)
    kw_l: gl.constexpr = key_word_layout(DP, BN)

    pid_o = gl.program_id(0)
    pid_b = gl.program_id(1)
    pid_k = gl.program_id(2)
    g0 = pid_k * groups_per_split
    g1 = gl.minimum(g0 + groups_per_split, groups)

    wptr, rows, row_ok, srow, cols, col_ok, xcol = _tile_indices(W, pid_o * BN, pid_b * NQ, out_features, num_rows,
                                                                 groups, stride_xs, kw_l, mma, BN, NQ, BITS, WORDS)
    STRIDE: gl.constexpr = group_stride(BITS, WORDS)
    qd = gl.arange(0, DP, layout=gl.SliceLayout(1, b_op))
    qc = pid_b * NQ + gl.arange(0, NQ, layout=gl.SliceLayout(0, b_op))
    xq_ptr = XQ + (gl.minimum(qc, num_rows - 1).to(gl.int64) * stride_xq)[None, :] + qd[:, None]

    acc = gl.zeros([BN, NQ], gl.float32, layout=mma)
    if INT8:
        t0 = gl.load(CB)
        t1 = gl.load(CB + 1)
    # The next group's words (or planes) are loaded before this group's are decoded: two loads in flight per warp.
    nxt = _load_group(wptr + g0 * STRIDE, BITS, WORDS)
    if PDL:
        _grid_dependency_wait()  # the rotated activation
    if SCALES_AHEAD:
        ops = _group_scales(S, srow, XS, SX, xcol, g0, INT8)
    for gi in range(g0, g1):
        cur = nxt
        nxt = _load_group(wptr + gl.minimum(gi + 1, g1 - 1) * STRIDE, BITS, WORDS)
        xq = gl.load(xq_ptr + gi * DP)
        if SCALES_AHEAD:
            ws, xs, sx = ops
            ops = _group_scales(S, srow, XS, SX, xcol, gl.minimum(gi + 1, g1 - 1), INT8)
        else:
            ws, xs, sx = _group_scales(S, srow, XS, SX, xcol, gi, INT8)
        ws = ws.to(gl.float32)
        if INT8:
            kt = _decode_group_int8(cur, t0, t1, kw_l, a_op, BITS, BN)
            part = mma_v2(kt, xq, gl.zeros([BN, NQ], gl.int32, layout=mma))
            acc = acc + (2 * part + sx[None, :]).to(gl.float32) * ws[:, None] * xs[None, :]
        else:
            kt = _decode_group(cur, c0, c1, c2, c3, c4, c5, c6, c7, kw_l, a_op, BITS, WORDS, BN)
            part = mma_v2(kt, xq, gl.zeros([BN, NQ], gl.float32, layout=mma))
            acc = acc + part * ws[:, None] * xs[None, :]

    _write_tile(acc, Y, BIAS, PART, COUNT, rows, cols, row_ok, col_ok, num_rows, out_features, stride_y, pid_k,
                gl.num_programs(2), pid_o * gl.num_programs(1) + pid_b, HAS_BIAS, SPLIT)
