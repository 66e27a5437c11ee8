# SPDX-License-Identifier: Apache-2.0
"""MLA decode attention with the latent tiles built in tensor-core registers (Gluon; jit only, launcher
``ops.mla.mla_decode_attention``, reference ``ops.mla_reference.mla_decode_attention_ref``).

The MLA latent is both key and value, DP = 512 (kv_lora_rank) coordinates wide, read by every query head. The
Triton kernel (``mla_decode_jit``) dequantizes a tile into a blocked layout that Triton moves into the MMA operand
layouts through shared memory, and holds the [heads, DP] queries and outputs in a few warps' registers. Here, as in
``paged_decode_jit`` (its key layout and lookups are reused), the packed words are loaded straight into the threads
whose ``mma.sync`` fragments their fields fill, and the latent's DP coordinates are split over the NW warps of a
program, DW = DP / NW each, with a leading warp dimension on every tile (batched MMAs, one batch per warp):
- scores S^T[BN, NQ] = sum over warps of K_w[BN, DW] . Q'_w^T[DW, NQ] * a + Kpe_w[BN, 16] . Qpe_w^T[16, NQ]: each
  warp multiplies its slice of the latent (``paged_decode_jit.key_word_layout`` per warp) and, in the first four
  warps, 16 of the 64 rope coordinates; the partial scores are summed across the warps (one shared-memory reduction
  per tile), so every warp then holds the whole S^T and runs the same online softmax;
- O_w^T[DW, NQ] += V_w^T[DW, BN] . P^T[BN, NQ]: V_w^T is K_w transposed in registers (each 8x8 block by one
  ``movmatrix``, the blocks renamed), so the output leaves in the queries' order; P^T comes from S^T's accumulator
  layout by one warp transpose per 8x8 block too.
MMA columns are query heads (NQ = 16 per program, a request's heads in blocks of 16); a tile is BN = 16 tokens of
one page, its loads issued DEPTH tiles ahead. Queries come in and outputs leave in ``ops.mla.mla_mma_order``; vLLM's
absorbed weights carry that order (``ops.mla.mla_absorbed_weights``).
"""

import triton  # noqa: F401  (Gluon kernels launch through Triton's runtime)
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from .paged_decode_jit import (
    MOVMATRIX_TRANS,
    _fields,
    _load_planes,
    _online_softmax_tile,
    _planes_to_words,
    _split_range,
)


@gluon.constexpr_function
def mla_key_word_layout(nw, dw, bn):
    """Layout of the K words [NW, BN, 4, DW/32]: ``paged_decode_jit.key_word_layout`` in each warp, the warps along
    dim 0."""
    gr = dw // 32
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 1 << i] for i in range(gr.bit_length() - 1)]
        + [[0, 8 << i, 0, 0] for i in range(bn.bit_length() - 4)],
        lane_bases=[[0, 0, 1, 0], [0, 0, 2, 0], [0, 1, 0, 0], [0, 2, 0, 0], [0, 4, 0, 0]],
        warp_bases=[[1 << i, 0, 0, 0] for i in range(nw.bit_length() - 1)], block_bases=[], shape=[nw, bn, 4, gr])


@gluon.jit
def _tile_loads(CACHE, CACHE16, CACHE_BF16, bt_row, stride_cb, start, lo, hi, last, koff, poff, pmask, ts,
                PAGE: gl.constexpr, B: gl.constexpr, G: gl.constexpr, GR: gl.constexpr,
                IDX_OFF: gl.constexpr, ROPE_OFF: gl.constexpr, SC_OFF: gl.constexpr):
    """The global loads of the tile of BN tokens at ``start``: the latent's planes, k_pe (in the A operand's
    registers) and the scales (zero at positions >= hi). Past ``hi`` the loads stay in the clamped last page (their
    scores are masked); an empty split reads page 0."""
    page = gl.load(bt_row + gl.minimum(start, last) // PAGE).to(gl.int64)
    page = gl.where(lo < hi, page, 0)
    base = page * stride_cb
    row = start % PAGE
    k0, k1, k2, k3 = _load_planes(CACHE + base + IDX_OFF, row * (B * G), koff, G, B, GR)
    kpe = gl.load(CACHE_BF16 + (base + ROPE_OFF) // 2 + poff + row * 64, mask=pmask, other=0.0)
    sc = gl.load(CACHE16 + (base + SC_OFF) // 2 + row + ts, mask=start + ts < hi, other=0.0)
    return (k0, k1, k2, k3, kpe, sc)


# The block table is a row slice of vLLM's (its alignment follows the batch) and the split count follows the batch:
# neither is specialized, so one variant serves every batch.
@gluon.jit(do_not_specialize=["num_splits", "BLOCK_TABLE", "stride_bt", "SEQ_LENS", "stride_pos", "stride_pls"])
def tq_mla_decode_mma_kernel(
    Q, stride_qb, stride_qh, QPE, stride_pb, stride_ph,
    CACHE, CACHE16, CACHE_BF16, stride_cb, BLOCK_TABLE, stride_bt, SEQ_LENS,
    c0, c1, c2, c3, c4, c5, c6, c7,
    PART_O, stride_pos, stride_pot, stride_poh, PART_L, stride_pls, stride_plt,
    num_heads, num_splits, q_scale, pe_scale,
    DP: gl.constexpr, NW: gl.constexpr, PAGE: gl.constexpr, B: gl.constexpr,
    IDX_OFF: gl.constexpr, ROPE_OFF: gl.constexpr, SC_OFF: gl.constexpr, DEPTH: gl.constexpr,
):
    """Grid (requests, cdiv(num_heads, 16), num_splits), NW warps each. Q [B, H, DP]: the absorbed queries in the
    kernel's order (``ops.mla.mla_mma_order``), QPE [B, H, 64] the rope queries (any float dtype; times q_scale /
    pe_scale as they are loaded, the base-2 softmax scale); c0..c7: the codebook's byte-permute words
    (``ops.paged_decode.codebook_permute_words``). Writes PART_O[split, request, head, :DP] (the split's normalized
    output, in the same order) and PART_L[split, request, head] (its log2-sum-exp; -inf for a split with no
    token)."""
    BN: gl.constexpr = 16
    NQ: gl.constexpr = 16
    RW: gl.constexpr = 16  # rope coordinates per warp (one MMA k-step): warps 0-3 hold k_pe, any others none
    RWARPS: gl.constexpr = 64 // RW
    DW: gl.constexpr = DP // NW
    G: gl.constexpr = DP // 8
    GW: gl.constexpr = DW // 8  # groups per warp
    GR: gl.constexpr = DW // 32
    gl.static_assert(NW >= RWARPS, "the 64 rope coordinates split over the first 4 warps, 16 each")
    gl.static_assert(PAGE % BN == 0, "a tile lies in one page")
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1, 1], instr_shape=[1, 16, 8])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    kw_l: gl.constexpr = mla_key_word_layout(NW, DW, BN)
    s_l: gl.constexpr = gl.SliceLayout(0, mma)  # S^T [BN, NQ], the same in every warp
    tok_l: gl.constexpr = gl.SliceLayout(1, s_l)
    head_l: gl.constexpr = gl.SliceLayout(0, s_l)

    req = gl.program_id(0)
    h0 = gl.program_id(1) * NQ
    split = gl.program_id(2)
    kv_len = gl.load(SEQ_LENS + req)
    lo, hi = _split_range(kv_len, split, num_splits, BN)

    # Q'^T [NW, DW, NQ] and Qpe^T [NW, 16, NQ] as B operands: warp w holds coordinates w*DW.. and rope w*16.. .
    bw = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, b_op)))[:, None, None]
    bd = gl.arange(0, DW, layout=gl.SliceLayout(0, gl.SliceLayout(2, b_op)))[None, :, None]
    br = gl.arange(0, RW, layout=gl.SliceLayout(0, gl.SliceLayout(2, b_op)))[None, :, None]
    bh = gl.arange(0, NQ, layout=gl.SliceLayout(0, gl.SliceLayout(1, b_op)))[None, None, :]
    hmask = (h0 + bh < num_heads) & (bd >= 0) & (bw >= 0)
    qrow = req.to(gl.int64) * stride_qb + (h0 + bh) * stride_qh
    q = gl.load(Q + qrow + bw * DW + bd, mask=hmask, other=0.0)
    q = (q.to(gl.float32) * q_scale).to(gl.float16)
    prow = req.to(gl.int64) * stride_pb + (h0 + bh) * stride_ph
    qpe = gl.load(QPE + prow + bw * RW + br, mask=(h0 + bh < num_heads) & (br >= 0) & (bw < RWARPS), other=0.0)
    qpe = (qpe.to(gl.float32) * pe_scale).to(gl.float16)

    # Per-thread byte offsets of the planes (warp w's groups are w*GW..), and k_pe's A-operand offsets.
    kp_l: gl.constexpr = gl.SliceLayout(3, kw_l)
    kwi = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, kp_l)))[:, None, None]
    kti = gl.arange(0, BN, layout=gl.SliceLayout(0, gl.SliceLayout(2, kp_l)))[None, :, None]
    kgi = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, kp_l)))[None, None, :]
    koff = kti * (B * G) + kwi * GW + kgi * GR
    aw = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, a_op)))[:, None, None]
    at = gl.arange(0, BN, layout=gl.SliceLayout(0, gl.SliceLayout(2, a_op)))[None, :, None]
    ar = gl.arange(0, RW, layout=gl.SliceLayout(0, gl.SliceLayout(1, a_op)))[None, None, :]
    poff = at * 64 + aw * RW + ar
    pmask = (aw < RWARPS) & (at >= 0) & (ar >= 0)
    ts = gl.arange(0, BN, layout=tok_l)
    hs = gl.arange(0, NQ, layout=head_l)
    head_ok = h0 + hs < num_heads

    m_i = gl.full([NQ], float("-inf"), gl.float32, layout=head_l)
    l_acc = gl.zeros([BN, NQ], gl.float32, layout=s_l)  # per-thread partial sums, reduced once at the end
    acc = gl.zeros([NW, DW, NQ], gl.float32, layout=mma)
    bt_row = BLOCK_TABLE + req.to(gl.int64) * stride_bt
    last = gl.maximum(kv_len - 1, 0)
    # Loads run DEPTH tiles ahead of the arithmetic: the bytes in flight per SM, not the instructions, bound a
    # program that waits for one tile at a time.
    ahead1 = _tile_loads(CACHE, CACHE16, CACHE_BF16, bt_row, stride_cb, lo, lo, hi, last, koff, poff, pmask, ts, PAGE,
                         B, G, GR, IDX_OFF, ROPE_OFF, SC_OFF)
    ahead2 = ahead1
    ahead3 = ahead1
    if DEPTH >= 2:
        ahead2 = _tile_loads(CACHE, CACHE16, CACHE_BF16, bt_row, stride_cb, lo + BN, lo, hi, last, koff, poff, pmask,
                             ts, PAGE, B, G, GR, IDX_OFF, ROPE_OFF, SC_OFF)
    if DEPTH >= 3:
        ahead3 = _tile_loads(CACHE, CACHE16, CACHE_BF16, bt_row, stride_cb, lo + 2 * BN, lo, hi, last, koff, poff,
                             pmask, ts, PAGE, B, G, GR, IDX_OFF, ROPE_OFF, SC_OFF)
    for start in range(lo, hi, BN):
        k0, k1, k2, k3, kpe, sc = ahead1
        nxt = _tile_loads(CACHE, CACHE16, CACHE_BF16, bt_row, stride_cb, start + DEPTH * BN, lo, hi, last, koff, poff,
                          pmask, ts, PAGE, B, G, GR, IDX_OFF, ROPE_OFF, SC_OFF)
        if DEPTH == 1:
            ahead1 = nxt
        elif DEPTH == 2:
            ahead1 = ahead2
            ahead2 = nxt
        else:
            ahead1 = ahead2
            ahead2 = ahead3
            ahead3 = nxt
        scf = sc.to(gl.float32)

        # scores: each warp's latent slice and rope slice, summed across the warps
        kw = gl.convert_layout(_planes_to_words(k0, k1, k2, k3, B, GR), kw_l, assert_trivial=True)
        kf = _fields(kw, c0, c1, c2, c3, c4, c5, c6, c7, B)  # [NW, BN, 4, GR, 2, 2, 2]
        kt = gl.reshape(gl.permute(kf, [0, 1, 3, 6, 5, 2, 4]), [NW, BN, DW])
        kt = gl.convert_layout(kt, a_op, assert_trivial=True)
        s3 = mma_v2(kt, q, gl.zeros([NW, BN, NQ], gl.float32, layout=mma))
        s3 = s3 * gl.expand_dims(gl.expand_dims(scf, 1), 0)
        s3 = mma_v2(kpe.to(gl.float16), qpe, s3)
        s = gl.sum(s3, axis=0)
        s = gl.where(((start + ts) < hi)[:, None] & head_ok[None, :], s, float("-inf"))
        m_i, p, alpha, l_acc, raised = _online_softmax_tile(s, m_i, l_acc)
        if raised:
            acc = acc * gl.expand_dims(gl.expand_dims(alpha, 0), 0)
        # p * a <= 65504 (the scales are fp16 numbers), so the fp16 operand never overflows.
        pv = gl.expand_dims((p * scf[:, None]).to(gl.float16), 0) + gl.zeros([NW, BN, NQ], gl.float16, layout=mma)
        pt = gl.inline_asm_elementwise(MOVMATRIX_TRANS, "=r,r", [pv], dtype=gl.float16, is_pure=True, pack=2)
        pt = gl.reshape(gl.permute(gl.reshape(pt, [NW, 2, 8, NQ // 8, 8]), [0, 1, 4, 3, 2]), [NW, BN, NQ])
        pt = gl.convert_layout(pt, b_op, assert_trivial=True)

        # values: the same tile transposed in registers (V^T = K^T, each 8x8 block by movmatrix, the blocks renamed)
        # -> each warp's slice of O^T
        vt = gl.inline_asm_elementwise(MOVMATRIX_TRANS, "=r,r", [kt], dtype=gl.float16, is_pure=True, pack=2)
        vt = gl.reshape(gl.permute(gl.reshape(vt, [NW, 2, 8, DW // 8, 8]), [0, 3, 2, 1, 4]), [NW, DW, BN])
        vt = gl.convert_layout(vt, a_op, assert_trivial=True)
        acc = mma_v2(vt, pt, acc)

    l_i = gl.sum(l_acc, axis=0)
    l_safe = gl.where(l_i > 0, l_i, 1.0)
    lse2 = gl.where(l_i > 0, m_i + gl.log2(l_safe), float("-inf"))
    o = acc / gl.expand_dims(gl.expand_dims(l_safe, 0), 0)
    ow = gl.arange(0, NW, layout=gl.SliceLayout(1, gl.SliceLayout(2, mma)))[:, None, None]
    od = gl.arange(0, DW, layout=gl.SliceLayout(0, gl.SliceLayout(2, mma)))[None, :, None]
    oh = gl.arange(0, NQ, layout=gl.SliceLayout(0, gl.SliceLayout(1, mma)))[None, None, :]
    sp = split.to(gl.int64)
    gl.store(PART_O + sp * stride_pos + req.to(gl.int64) * stride_pot + (h0 + oh) * stride_poh + ow * DW + od, o,
             mask=(h0 + oh < num_heads) & (od >= 0) & (ow >= 0))
    gl.store(PART_L + sp * stride_pls + req * stride_plt + h0 + hs, lse2, mask=head_ok)
