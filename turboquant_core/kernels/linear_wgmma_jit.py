# SPDX-License-Identifier: Apache-2.0
"""Linear layers over TurboQuant weights for decode batches of many rows, through Hopper warpgroup MMA (Gluon,
sm_90a; jit only, launcher ``ops.linear``, reference ``ops.weight_codec.tq_linear_reference``).

The register-tile kernel (``linear_mma_jit``) gives each warp its own output rows and activation columns, so past
its 32 columns a second program decodes the same weight tile again, and every warp loads the activation for
itself. Here one warpgroup takes 64 output rows and all the batch's rows (up to 64, the MMA's N): each warp decodes
its 16 output rows of a group straight into the A-operand registers of ``warpgroup_mma`` (the register-tile
kernel's decode, the same fields in the same registers), and the group's activation tile [N, 128] is copied once
into shared memory (asynchronously, a group ahead) as the B operand all four warps read. Each group's product is
scaled by the rows' group scales and the columns' activation scales and added to fp32 accumulators; the groups
split over programs as in the register-tile kernel (``linear_mma_jit._write_tile``). With INT8 (kernel words), the
register-tile kernel's int8 product: codebook bytes (``linear_mma_jit._decode_group_int8``) against the int8
activation tile, k32 integer warpgroup MMAs into int32. With SCALED (kernel words, the launcher's larger batches),
the scaling moves into the operands instead: each decoded tile times its rows' scales, against the rotated
activation itself, so the groups' products add up in the MMA's accumulator, one in flight while the next group is
decoded into a second set of A registers.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from .linear_mma_jit import _decode_group, _decode_group_int8, _load_group, _tile_indices, _write_tile, group_stride
from .paged_decode_jit import key_word_layout


@gluon.jit
def _scaled_issue(acc, cur, pos, g0, g1, valid, x_smem, x_ptr, S, srow, c0, c1, c2, c3, c4, c5, c6, c7,
                  kw_l: gl.constexpr, a_op: gl.constexpr, BITS: gl.constexpr, STAGES: gl.constexpr, XT: gl.constexpr):
    """One group of SCALED's loop, the ``pos``-th from g0 (the group min(pos, g1 - 1); with ``valid`` 0 its rows'
    scales are zeroed, so that a range of odd length adds nothing for its padding): its codebook values ``cur``
    decoded times its rows' scales (the A operand in XT), the next group's activation tile copied into the stage
    after its own, and its MMA issued into ``acc``. Returns (acc, the A operand, which must stay in its registers
    until the wait that retires this MMA)."""
    BM: gl.constexpr = 64
    DP: gl.constexpr = 128
    gi = gl.minimum(pos, g1 - 1)
    kt = _decode_group(cur, c0, c1, c2, c3, c4, c5, c6, c7, kw_l, a_op, BITS, True, BM, XT)
    kt = kt * (gl.load(S + srow + gi) * valid).to(XT)[:, None]
    async_copy.wait_group(0)  # this group's activation tile
    fence_async_shared()
    # every thread's copies are in, and every warp's product two groups back, which read the stage the next copy
    # takes, is done (each waited for all its products but the last)
    gl.thread_barrier()
    async_copy.async_copy_global_to_shared(x_smem.index((pos - g0 + 1) % STAGES),
                                           x_ptr + gl.minimum(pos + 1, g1 - 1) * DP)
    async_copy.commit_group()
    acc = warpgroup_mma(kt, x_smem.index((pos - g0) % STAGES).permute((1, 0)), acc, is_async=True)
    return acc, kt


@gluon.jit
def _scaled_groups(x_smem, x_ptr, wptr, S, row0, out_features, groups, g0, g1, c0, c1, c2, c3, c4, c5, c6, c7,
                   kw_l: gl.constexpr, a_op: gl.constexpr, mma: gl.constexpr, ws_l: gl.constexpr, BITS: gl.constexpr,
                   NQ: gl.constexpr, STAGES: gl.constexpr, XT: gl.constexpr):
    """SCALED's loop over groups g0..g1: each group's codebook values times its rows' scales (the A operand, in
    registers, in XT), against its activation tile (copied a group ahead), accumulated by the MMA; the product of
    one group stays in flight while the next is decoded, so STAGES = 3 tiles: the one it reads, the current one and
    the next. An MMA in flight reads its A registers until the wait that retires it, so the groups go in pairs with
    two operands, ``ka`` (even positions) and ``kb`` (odd), each kept live up to that wait: a loop of one operand
    would decode the next group into the registers the last product is still reading. Returns the accumulator
    [64, NQ]."""
    BM: gl.constexpr = 64
    DP: gl.constexpr = 128
    STRIDE: gl.constexpr = group_stride(BITS, True)
    srow = gl.minimum(row0 + gl.arange(0, BM, layout=ws_l), out_features - 1).to(gl.int64) * groups
    async_copy.async_copy_global_to_shared(x_smem.index(0), x_ptr + g0 * DP)
    async_copy.commit_group()
    acc = gl.zeros([BM, NQ], gl.float32, layout=mma)
    kb = gl.zeros([BM, DP], XT, layout=a_op)
    nxt = _load_group(wptr + g0 * STRIDE, BITS, True)
    for pos in range(g0, g1, 2):
        cur = nxt
        nxt = _load_group(wptr + gl.minimum(pos + 1, g1 - 1) * STRIDE, BITS, True)
        acc, ka = _scaled_issue(acc, cur, pos, g0, g1, 1.0, x_smem, x_ptr, S, srow, c0, c1, c2, c3, c4, c5, c6, c7,
                                kw_l, a_op, BITS, STAGES, XT)
        acc, ka, kb = warpgroup_mma_wait(1, deps=(acc, ka, kb))  # the last odd group's product is done
        cur = nxt
        nxt = _load_group(wptr + gl.minimum(pos + 2, g1 - 1) * STRIDE, BITS, True)
        acc, kb = _scaled_issue(acc, cur, pos + 1, g0, g1, (pos + 1 < g1).to(gl.float32), x_smem, x_ptr, S, srow,
                                c0, c1, c2, c3, c4, c5, c6, c7, kw_l, a_op, BITS, STAGES, XT)
        acc, ka, kb = warpgroup_mma_wait(1, deps=(acc, ka, kb))  # this even group's product is done
    acc, kb = warpgroup_mma_wait(0, deps=(acc, kb))
    async_copy.wait_group(0)
    return acc


@gluon.jit(do_not_specialize=["num_rows"])
def tq_linear_wgmma_kernel(XQ, XS, SX, CB, W, S, BIAS, Y, PART, COUNT, num_rows, out_features, groups,
                           groups_per_split, stride_xq, stride_xs, stride_y, c0, c1, c2, c3, c4, c5, c6, c7,
                           BITS: gl.constexpr, NQ: gl.constexpr, HAS_BIAS: gl.constexpr, SPLIT: gl.constexpr,
                           WORDS: gl.constexpr, INT8: gl.constexpr = False, SCALED: gl.constexpr = False):
    """The arguments of ``linear_mma_jit.tq_linear_mma_kernel`` (XQ rotated activation fp16 [num_rows, groups *
    128] in K order, XS its fp32 scales [num_rows, groups], W the packed weight, S its fp16 scales [out, groups],
    c0..c7 the codebook words, Y [num_rows, out]), one warpgroup per program. Program (o, k): output rows 64 o..,
    all num_rows <= NQ activation rows (NQ a multiple of 8, at most 64), groups k * groups_per_split.. (at most
    groups_per_split); with SPLIT, partial sums into PART fp32 [splits, num_rows, out], the last of a tile's programs
    (COUNT int32, one zero per tile) adding them into Y. INT8, SX and CB as for ``tq_linear_mma_kernel``. With
    SCALED (kernel words): XQ is R x itself in X's type (bf16 or fp16; ``linear_jit.tq_rotate_fp16_kernel``'s
    UNSCALED), XS not read, c0..c7 the codebook words in that type; each decoded tile is multiplied by its rows'
    scales, so the groups' products add up in the MMA's accumulator, one in flight while the next is decoded (three
    activation stages)."""
    gl.static_assert(gl.num_warps() == 4, "one warpgroup")
    gl.static_assert(NQ % 8 == 0 and NQ <= 64, "the activation rows are the MMA's N")
    DP: gl.constexpr = 128
    BM: gl.constexpr = 64  # output rows: 16 per warp
    gl.static_assert(not (INT8 and SCALED), "int8 products are scaled per group")
    KB: gl.constexpr = 8 if INT8 else 16  # bits per operand
    XT: gl.constexpr = XQ.dtype.element_ty
    STAGES: gl.constexpr = 3 if SCALED else 2
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, NQ, 256 // KB])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=32 // KB)
    kw_l: gl.constexpr = key_word_layout(DP, 16, 4)
    x_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=KB, rank=2)
    ws_l: gl.constexpr = gl.SliceLayout(1, a_op)
    x_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])  # [NQ, 128] copies, 8 values per thread

    pid_o = gl.program_id(0)
    pid_k = gl.program_id(1)
    g0 = pid_k * groups_per_split
    g1 = gl.minimum(g0 + groups_per_split, groups)

    wptr, rows, row_ok, srow, cols, col_ok, xcol = _tile_indices(W, pid_o * BM, 0, out_features, num_rows, groups,
                                                                 stride_xs, kw_l, mma, BM, NQ, BITS, WORDS)
    STRIDE: gl.constexpr = group_stride(BITS, WORDS)
    # the activation copies read the batch's last row past it, as _tile_indices' columns do
    xr = gl.minimum(gl.arange(0, NQ, layout=gl.SliceLayout(1, x_l)), num_rows - 1)
    x_ptr = XQ + (xr.to(gl.int64) * stride_xq)[:, None] + gl.arange(0, DP, layout=gl.SliceLayout(0, x_l))[None, :]
    x_smem = gl.allocate_shared_memory(XT, [STAGES, NQ, DP], x_sl)
    if INT8:
        t0 = gl.load(CB)
        t1 = gl.load(CB + 1)

    if SCALED:
        acc = _scaled_groups(x_smem, x_ptr, wptr, S, pid_o * BM, out_features, groups, g0, g1, c0, c1, c2, c3, c4, c5,
                             c6, c7, kw_l, a_op, mma, ws_l, BITS, NQ, STAGES, XT)
    else:
        async_copy.async_copy_global_to_shared(x_smem.index(0), x_ptr + g0 * DP)
        async_copy.commit_group()
        acc = gl.zeros([BM, NQ], gl.float32, layout=mma)
        nxt = _load_group(wptr + g0 * STRIDE, BITS, WORDS)
        for gi in range(g0, g1):
            s = (gi - g0) % 2
            cur = nxt
            nxt = _load_group(wptr + gl.minimum(gi + 1, g1 - 1) * STRIDE, BITS, WORDS)
            if INT8:
                kt = _decode_group_int8(cur, t0, t1, kw_l, a_op, BITS, BM)
            else:
                kt = _decode_group(cur, c0, c1, c2, c3, c4, c5, c6, c7, kw_l, a_op, BITS, WORDS, BM)
            async_copy.wait_group(0)  # this group's activation tile
            fence_async_shared()
            # every thread's copies are in, and every warp is done with the last group's product, which read the other
            # stage, before the next group's copies go there
            gl.thread_barrier()
            async_copy.async_copy_global_to_shared(x_smem.index(1 - s), x_ptr + gl.minimum(gi + 1, g1 - 1) * DP)
            async_copy.commit_group()
            part = warpgroup_mma(kt, x_smem.index(s).permute((1, 0)),
                                 gl.zeros([BM, NQ], gl.int32 if INT8 else gl.float32, layout=mma), use_acc=False,
                                 is_async=True)
            if INT8:  # the wait takes no 8-bit operands; ptxas keeps the A registers until it
                part = warpgroup_mma_wait(0, deps=(part,))
            else:
                part, kt = warpgroup_mma_wait(0, deps=(part, kt))
            ws = gl.load(S + srow + gi).to(gl.float32)
            xs = gl.load(XS + xcol + gi)
            if INT8:
                sx = gl.load(SX + xcol + gi)
                acc = acc + (2 * part + sx[None, :]).to(gl.float32) * ws[:, None] * xs[None, :]
            else:
                acc = acc + part * ws[:, None] * xs[None, :]
    async_copy.wait_group(0)

    _write_tile(acc, Y, BIAS, PART, COUNT, rows, cols, row_ok, col_ok, num_rows, out_features, stride_y, pid_k,
                gl.num_programs(1), pid_o, HAS_BIAS, SPLIT)
