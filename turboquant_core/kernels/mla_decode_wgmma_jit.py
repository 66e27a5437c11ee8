# SPDX-License-Identifier: Apache-2.0
"""MLA decode attention through Hopper warpgroup MMA (Gluon, sm_90a; jit only, launcher
``ops.mla.mla_decode_attention``, reference ``ops.mla_reference.mla_decode_attention_ref``).

The MLA latent is both key and value, DP = 512 (kv_lora_rank) coordinates read by every query head. One warpgroup
serves one (request, block of 16 heads, KV split); the products are transposed so that MMA rows are tokens and latent
coordinates and the 16 heads are the N = 16 columns. Per tile of 64 cached tokens, in four chunks of 128 coordinates
(the page's plane bytes 16c..):
1. each warp looks its 16 tokens' chunk up straight into the warpgroup MMA's A registers (the register-tile decode's
   lookup and layout, ``paged_decode_jit.key_word_layout(128, 16, 4)``), issues S^T [64, 16] += C_c . Q'_c^T from
   them, and stores the chunk into the fp16 tile C [64, DP] in shared memory; the planes load two chunks ahead;
2. k_pe [64, 64] and the scales are copied in beside the tile (asynchronous copies, STAGES tiles); S^T gains
   Kpe . Qpe^T and the scale a;
3. online softmax over the tokens (base 2); P^T * a to shared memory (fp16);
4. O^T [DP, 16] += C^T . P^T: the tile read transposed (an MN-major A operand, which 16-bit types may be).
The score product reads no shared memory for the latent; only the output product reads the tile. The output product
is left in flight while the next tile's first chunk is looked up, and waited for before the chunk is stored over the
tile it reads. Queries come in and outputs leave in ``ops.mla.mla_wgmma_order``.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from .paged_decode_jit import _fields, _planes_to_words, _split_range, key_word_layout


@gluon.constexpr_function
def _chunk_load_layout():
    """[64 tok, 4 lane groups, 4 planes] int32: ``paged_decode_jit.key_word_layout(128, 16, 4)``'s threads (warp w
    tokens 16 w.., lanes 2-4 tokens 0-7 of them, lanes 0-1 the lane group) with the 4 planes in registers."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [8, 0, 0]], lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[64, 4, 4])


@gluon.jit
def _tile_rows(CACHE, bt_row, stride_cb, start, hi, last_blk, tt, PAGE: gl.constexpr, B: gl.constexpr,
               G: gl.constexpr, IDX_OFF: gl.constexpr):
    """The byte address of each of the 64 tokens' index rows of the tile at ``start``; tokens past the sequence read
    its last page, and a tile at or past ``hi`` page 0 (their scores are masked)."""
    tok = start + tt
    page = gl.load(bt_row + gl.minimum(tok // PAGE, last_blk), mask=start < hi, other=0).to(gl.int64)
    return CACHE + page * stride_cb + IDX_OFF + (tok % PAGE) * (B * G)


@gluon.jit
def _load_chunk(rows, cg, cp, chunk: gl.constexpr, B: gl.constexpr, G: gl.constexpr):
    """Plane bytes 16 chunk .. 16 chunk + 15 of the 64 tokens at ``rows`` (``_tile_rows``), [64 tok, 4 lane groups,
    4 planes] int32 in ``_chunk_load_layout``: lane group l's 4 bytes 16 chunk + 4 l of each plane (planes past B
    zero)."""
    ptr = (rows[:, None, None] + (16 * chunk + 4 * cg)[None, :, None] + (G * cp)[None, None, :]).to(
        gl.pointer_type(gl.int32), bitcast=True)
    return gl.load(ptr, mask=(cg >= 0)[None, :, None] & (cp < B)[None, None, :], other=0)


@gluon.jit
def _chunk_fields(words, c0, c1, c2, c3, c4, c5, c6, c7, kp_l: gl.constexpr, kw_l: gl.constexpr,
                  a_op: gl.constexpr, B: gl.constexpr):
    """A chunk's loaded planes (``_load_chunk``) -> their codebook values [64 tok, 128] in the warpgroup MMA's
    A-operand registers, position k of the chunk in ``ops.paged_decode.decode_key_order(128)`` (the register-tile
    decode's lookup and layout, warps over tokens)."""
    even, odd = gl.split(gl.reshape(words, [64, 4, 2, 2]))
    p0, p2 = gl.split(even)
    p1, p3 = gl.split(odd)
    kw = gl.convert_layout(_planes_to_words(gl.convert_layout(p0, kp_l, assert_trivial=True),
                                            gl.convert_layout(p1, kp_l, assert_trivial=True),
                                            gl.convert_layout(p2, kp_l, assert_trivial=True),
                                            gl.convert_layout(p3, kp_l, assert_trivial=True), B, 4),
                           kw_l, assert_trivial=True)
    kf = _fields(kw, c0, c1, c2, c3, c4, c5, c6, c7, B)  # [64, 4, 4, j0, j1, j2]
    return gl.convert_layout(gl.reshape(gl.permute(kf, [0, 2, 5, 4, 1, 3]), [64, 128]), a_op, assert_trivial=True)


@gluon.jit
def _stage_rope(CACHE, bt_row, stride_cb, start, hi, last_blk, stg_pe, stg_sc, s, pr, pc, sr, sk, PAGE: gl.constexpr,
                ROPE_OFF: gl.constexpr, SC_OFF: gl.constexpr):
    """Asynchronous copies of the 64-token tile at ``start`` into stage ``s``, one commit group (none where start >=
    hi): k_pe (stg_pe[s], [64, 64] bf16) and the fp16 scales (stg_sc[s], [4, 16]). Rows past the sequence read its
    last page."""
    live = start < hi
    ppage = gl.load(bt_row + gl.minimum((start + pr) // PAGE, last_blk), mask=live, other=0).to(gl.int64)
    prow = (CACHE + ppage * stride_cb + ROPE_OFF + ((start + pr) % PAGE) * 128).to(gl.pointer_type(gl.bfloat16),
                                                                                  bitcast=True)
    async_copy.async_copy_global_to_shared(stg_pe.index(s), prow[:, None] + pc[None, :],
                                           mask=live & (pc >= 0)[None, :] & (pr >= 0)[:, None])
    spage = gl.load(bt_row + gl.minimum((start + 16 * sr) // PAGE, last_blk), mask=live, other=0).to(gl.int64)
    srow = (CACHE + spage * stride_cb + SC_OFF + ((start + 16 * sr) % PAGE) * 2).to(gl.pointer_type(gl.float16),
                                                                                   bitcast=True)
    async_copy.async_copy_global_to_shared(stg_sc.index(s), srow[:, None] + sk[None, :],
                                           mask=live & (sk >= 0)[None, :] & (sr >= 0)[:, None])
    async_copy.commit_group()


# The block table is a row slice of vLLM's (its alignment follows the batch) and the split count follows the batch:
# neither is specialized, so one variant serves every batch.
@gluon.jit(do_not_specialize=["num_splits", "BLOCK_TABLE", "stride_bt", "SEQ_LENS", "stride_pos", "stride_pls"])
def tq_mla_decode_wgmma_kernel(
    Q, stride_qb, stride_qh, QPE, stride_pb, stride_ph,
    CACHE, CACHE16, CACHE_BF16, stride_cb, BLOCK_TABLE, stride_bt, SEQ_LENS,
    c0, c1, c2, c3, c4, c5, c6, c7,
    PART_O, stride_pos, stride_pot, stride_poh, PART_L, stride_pls, stride_plt,
    num_heads, num_splits, q_scale, pe_scale,
    DP: gl.constexpr, PAGE: gl.constexpr, B: gl.constexpr,
    IDX_OFF: gl.constexpr, ROPE_OFF: gl.constexpr, SC_OFF: gl.constexpr, STAGES: gl.constexpr,
):
    """Grid (requests, cdiv(num_heads, 16), num_splits), one warpgroup each. Q [B, H, DP]: the absorbed queries in
    ``mla_wgmma_order``, QPE [B, H, 64] the rope queries (any float dtype; times q_scale / pe_scale as they are
    loaded, the base-2 softmax scale, then fp16); c0..c7: the codebook's byte-permute words
    (``ops.paged_decode.codebook_permute_words``). Writes PART_O[split, request, head, :DP] (the split's normalized
    output, in the same order) and PART_L[split, request, head] (its log2-sum-exp; -inf for a split with no token)."""
    gl.static_assert(gl.num_warps() == 4, "one warpgroup")
    gl.static_assert(STAGES >= 2, "a tile's copies are issued a tile or more ahead")
    gl.static_assert(PAGE % 16 == 0, "each 16 tokens of a tile lie in one page")
    BT: gl.constexpr = 64  # tokens per tile: the MMA's rows
    NQ: gl.constexpr = 16  # heads per program: the MMA's columns
    R: gl.constexpr = 64  # rope coordinates
    G: gl.constexpr = DP // 8
    gl.static_assert(DP == 512, "four chunks of 128 latent coordinates")

    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NQ, 16])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    tok_l: gl.constexpr = gl.SliceLayout(1, mma)
    col_l: gl.constexpr = gl.SliceLayout(0, mma)
    sm_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    kw_l: gl.constexpr = key_word_layout(128, 16, 4)  # a chunk's words: warp w tokens 16 w..
    kp_l: gl.constexpr = gl.SliceLayout(2, kw_l)
    ld_l: gl.constexpr = _chunk_load_layout()
    r_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # [16, DP] queries, [64, 64] k_pe copies
    sc_l: gl.constexpr = gl.DistributedLinearLayout(  # [4 x 16 tokens] scale copies, 16 bytes per lane
        reg_bases=[[0, 1], [0, 2], [0, 4]], lane_bases=[[0, 8], [1, 0], [2, 0], [0, 0], [0, 0]],
        warp_bases=[[0, 0], [0, 0]], block_bases=[], shape=[4, 16])

    req = gl.program_id(0)
    h0 = gl.program_id(1) * NQ
    split = gl.program_id(2)
    kv_len = gl.load(SEQ_LENS + req)
    lo, hi = _split_range(kv_len, split, num_splits, BT)
    last_blk = gl.maximum(kv_len - 1, 0) // PAGE
    bt_row = BLOCK_TABLE + req.to(gl.int64) * stride_bt

    # Q'^T and Qpe^T as B operands in shared memory, K-major: stored [16 heads, DP] and [16, 64], read transposed.
    # k_pe (bf16 in the pages) is the rope product's A operand as copied, so the rope queries are bf16 too, as a
    # sum of two bf16 numbers (hi + lo) that keeps fp16's precision.
    qr = gl.arange(0, NQ, layout=gl.SliceLayout(1, r_l))
    qc = gl.arange(0, DP, layout=gl.SliceLayout(0, r_l))
    rc = gl.arange(0, R, layout=gl.SliceLayout(0, r_l))
    hmask = (h0 + qr < num_heads)[:, None]
    q = gl.load(Q + req.to(gl.int64) * stride_qb + (h0 + qr)[:, None] * stride_qh + qc[None, :],
                mask=hmask & (qc < DP)[None, :], other=0.0)
    q_smem = gl.allocate_shared_memory(gl.float16, [NQ, DP], sm_l, (q.to(gl.float32) * q_scale).to(gl.float16))
    qpe = gl.load(QPE + req.to(gl.int64) * stride_pb + (h0 + qr)[:, None] * stride_ph + rc[None, :],
                  mask=hmask & (rc < R)[None, :], other=0.0).to(gl.float32) * pe_scale
    qpe_hi = qpe.to(gl.bfloat16)
    qhi_smem = gl.allocate_shared_memory(gl.bfloat16, [NQ, R], sm_l, qpe_hi)
    qlo_smem = gl.allocate_shared_memory(gl.bfloat16, [NQ, R], sm_l, (qpe - qpe_hi.to(gl.float32)).to(gl.bfloat16))
    c_smem = gl.allocate_shared_memory(gl.float16, [BT, DP], sm_l)
    p_smem = gl.allocate_shared_memory(gl.float16, [NQ, BT], sm_l)
    stg_pe = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, R], sm_l)
    stg_sc = gl.allocate_shared_memory(gl.float16, [STAGES, 4, 16], plain)

    tt = gl.arange(0, BT, layout=gl.SliceLayout(1, gl.SliceLayout(2, ld_l)))
    cg = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, ld_l)))
    cp = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, ld_l)))
    pr = gl.arange(0, BT, layout=gl.SliceLayout(1, r_l))
    sr = gl.arange(0, 4, layout=gl.SliceLayout(1, sc_l))
    sk = gl.arange(0, 16, layout=gl.SliceLayout(0, sc_l))
    ts = gl.arange(0, BT, layout=tok_l)
    for t in gl.static_range(STAGES - 1):
        _stage_rope(CACHE, bt_row, stride_cb, lo + t * BT, hi, last_blk, stg_pe, stg_sc, t, pr, rc, sr, sk, PAGE,
                    ROPE_OFF, SC_OFF)
    # The planes load two chunks ahead (two sets of registers, wa and wb): the first tile's first two chunks.
    rows = _tile_rows(CACHE, bt_row, stride_cb, lo, hi, last_blk, tt, PAGE, B, G, IDX_OFF)
    wa = _load_chunk(rows, cg, cp, 0, B, G)
    wb = _load_chunk(rows, cg, cp, 1, B, G)

    m_i = gl.full([NQ], float("-inf"), gl.float32, layout=col_l)
    l_acc = gl.zeros([BT, NQ], gl.float32, layout=mma)  # per-thread partial sums, reduced once at the end
    acc = warpgroup_mma_init(gl.zeros([DP, NQ], gl.float32, layout=mma))  # the output product stays in flight
    # at least one tile (an empty split's tokens all masked), so that the output product's accumulator is only ever
    # written by warpgroup MMAs between its issue and its wait
    for it in range(0, gl.maximum((hi - lo + BT - 1) // BT, 1)):
        start = lo + it * BT
        s = it % STAGES
        nxt = start + BT
        async_copy.wait_group(STAGES - 2)  # this tile's k_pe and scales (the later tiles' stay in flight)
        _stage_rope(CACHE, bt_row, stride_cb, start + (STAGES - 1) * BT, hi, last_blk, stg_pe, stg_sc,
                    (s + STAGES - 1) % STAGES, pr, rc, sr, sk, PAGE, ROPE_OFF, SC_OFF)
        rows_next = _tile_rows(CACHE, bt_row, stride_cb, nxt, hi, last_blk, tt, PAGE, B, G, IDX_OFF)
        # Each chunk of 128 coordinates is looked up into the score product's A registers, its product issued, and
        # the chunk stored into the fp16 tile for the output product; the chunk two ahead loads in its place.
        k0 = _chunk_fields(wa, c0, c1, c2, c3, c4, c5, c6, c7, kp_l, kw_l, a_op, B)
        wa = _load_chunk(rows, cg, cp, 2, B, G)
        s_c = warpgroup_mma(k0, q_smem.slice(0, 128, dim=1).permute((1, 0)),
                            gl.zeros([BT, NQ], gl.float32, layout=mma), use_acc=False, is_async=True)
        # the previous tile's output product reads the fp16 tile: done, in every warp, before it is written
        acc = warpgroup_mma_wait(1, deps=(acc,))
        gl.thread_barrier()
        c_smem.slice(0, 128, dim=1).store(k0)
        s_c, k0 = warpgroup_mma_wait(0, deps=(s_c, k0))
        k1 = _chunk_fields(wb, c0, c1, c2, c3, c4, c5, c6, c7, kp_l, kw_l, a_op, B)
        wb = _load_chunk(rows, cg, cp, 3, B, G)
        s_c = warpgroup_mma(k1, q_smem.slice(128, 128, dim=1).permute((1, 0)), s_c, is_async=True)
        c_smem.slice(128, 128, dim=1).store(k1)
        s_c, k1 = warpgroup_mma_wait(0, deps=(s_c, k1))
        k2 = _chunk_fields(wa, c0, c1, c2, c3, c4, c5, c6, c7, kp_l, kw_l, a_op, B)
        wa = _load_chunk(rows_next, cg, cp, 0, B, G)
        s_c = warpgroup_mma(k2, q_smem.slice(256, 128, dim=1).permute((1, 0)), s_c, is_async=True)
        c_smem.slice(256, 128, dim=1).store(k2)
        s_c, k2 = warpgroup_mma_wait(0, deps=(s_c, k2))
        k3 = _chunk_fields(wb, c0, c1, c2, c3, c4, c5, c6, c7, kp_l, kw_l, a_op, B)
        wb = _load_chunk(rows_next, cg, cp, 1, B, G)
        s_c = warpgroup_mma(k3, q_smem.slice(384, 128, dim=1).permute((1, 0)), s_c, is_async=True)
        c_smem.slice(384, 128, dim=1).store(k3)
        rows = rows_next
        tvalid = (start + ts) < hi
        sc = stg_sc.index(s)._reinterpret(gl.float16, [BT], gl.SwizzledSharedLayout(1, 1, 1, [0])).load(tok_l)
        scf = gl.where(tvalid, sc.to(gl.float32), 0.0)
        fence_async_shared()
        gl.thread_barrier()  # every thread's part of the tile, and its copies of k_pe, before the products read them

        kpe = stg_pe.index(s)
        s_pe = warpgroup_mma(kpe, qhi_smem.permute((1, 0)), gl.zeros([BT, NQ], gl.float32, layout=mma), use_acc=False,
                             is_async=True)
        s_pe = warpgroup_mma(kpe, qlo_smem.permute((1, 0)), s_pe, is_async=True)
        s_c, s_pe, k3 = warpgroup_mma_wait(0, deps=(s_c, s_pe, k3))
        sco = gl.where(tvalid[:, None], s_c * scf[:, None] + s_pe, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(sco, axis=0))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(sco - m_safe[None, :])
        alpha = gl.exp2(m_i - m_safe)
        l_acc = l_acc * alpha[None, :] + p
        m_i = m_new
        # p * a <= 65504 (the scales are fp16 numbers), so the fp16 operand never overflows
        p_smem.store(gl.permute((p * scf[:, None]).to(gl.float16), [1, 0]))
        fence_async_shared()
        gl.thread_barrier()
        # left in flight: the next tile's first 16 tokens are looked up beside it
        acc = warpgroup_mma(c_smem.permute((1, 0)), p_smem.permute((1, 0)), acc * alpha[None, :], is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    async_copy.wait_group(0)

    l_i = gl.sum(l_acc, axis=0)
    l_safe = gl.where(l_i > 0, l_i, 1.0)
    lse2 = gl.where(l_i > 0, m_i + gl.log2(l_safe), float("-inf"))
    o = acc / l_safe[None, :]
    od = gl.arange(0, DP, layout=tok_l)
    oh = gl.arange(0, NQ, layout=col_l)
    sp = split.to(gl.int64)
    gl.store(PART_O + sp * stride_pos + req.to(gl.int64) * stride_pot + (h0 + oh)[None, :] * stride_poh + od[:, None],
             o, mask=(h0 + oh < num_heads)[None, :] & (od < DP)[:, None])
    gl.store(PART_L + sp * stride_pls + req * stride_plt + h0 + oh, lse2, mask=h0 + oh < num_heads)
