# SPDX-License-Identifier: Apache-2.0
"""MLA decode attention through Hopper warpgroup MMA (Gluon, sm_90a; jit only, launcher
``ops.mla.mla_decode_attention``, reference ``ops.mla_reference.mla_decode_attention_ref``).

The MLA latent is both key and value, DP = 512 (kv_lora_rank) coordinates read by every query head. One warpgroup
serves one (request, block of 16 heads, KV split); the products are transposed so that MMA rows are tokens and latent
coordinates and the 16 heads are the N = 16 columns. Per tile of 64 cached tokens:
1. the latent's packed words (loaded into registers a tile ahead) are looked up into fp16 codebook values C [64, DP],
   16 tokens at a time, and stored once into shared memory; k_pe [64, 64] and the scales are copied in beside them
   (asynchronous copies, STAGES tiles);
2. S^T [64, 16] = C . Q'^T * a + Kpe . Qpe^T: C and Kpe are the A operands, the queries (stored once) the B operands;
3. online softmax over the tokens (base 2); P^T * a to shared memory (fp16);
4. O^T [DP, 16] += C^T . P^T: the same shared tile read transposed (an MN-major A operand, which 16-bit types may be),
   so the latent is looked up once per tile for both products.
One fp16 tile, the words in registers and two copy stages take about 103 KB of shared memory, so that two programs
share each SM and one's lookup runs beside the other's products. The output product is left in flight while the next
tile's first 16 tokens are looked up, and waited for before they are stored over the tile it reads; ptxas keeps such
an overlap only where nothing but warpgroup MMAs writes an accumulator between an MMA's issue and its wait, so every
program runs at least one tile (an empty split's tokens all masked) and the loop has no path around it.
Position p = 8g + j of the tile holds field j of group g (the page's plane byte g), rotated coordinate j * DP/8 + g
(``ops.mla.mla_wgmma_order``): the queries come in and the outputs leave in that order.
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

from .codebook_lookup_jit import _lookup_selectors, _nibble_fields
from .paged_decode_jit import _lookup4, _planes_to_words, _split_range


@gluon.jit
def _fields_in_order(word, c0, c1, c2, c3, c4, c5, c6, c7, B: gl.constexpr):
    """Words -> the codebook values of their 8 fields as trailing dims (j2, j1, j0): field j = 4 j2 + 2 j1 + j0 in
    register j of the 8 (``paged_decode_jit._fields`` joins them the other way round), so that a group's 8 values
    leave in one 16-byte store."""
    x, half = _lookup_selectors(_nibble_fields(word, B), B)
    f0, f1, f2, f3 = _lookup4(x, half, c0, c1, c2, c3, c4, c5, c6, c7, B)
    f4, f5, f6, f7 = _lookup4(x >> 16, half >> 16, c0, c1, c2, c3, c4, c5, c6, c7, B)
    return gl.join(gl.join(gl.join(f0, f4), gl.join(f2, f6)), gl.join(gl.join(f1, f5), gl.join(f3, f7)))


@gluon.jit
def _load_words(CACHE, bt_row, stride_cb, start, hi, last_blk, wt, ww, wk, PAGE: gl.constexpr, B: gl.constexpr,
                G: gl.constexpr, IDX_OFF: gl.constexpr):
    """The latent's plane words of the 16 tokens at ``start`` (one page: PAGE % 16 == 0), [16 tok, 16 words, 4
    planes] int32 in the lookup's register layout; planes past B, and everything where start >= hi, zero. Rows past
    the sequence read its last page (their scores are masked)."""
    live = start < hi
    page = gl.load(bt_row + gl.minimum(start // PAGE, last_blk), mask=live, other=0).to(gl.int64)
    row = (CACHE + page * stride_cb + IDX_OFF + ((start % PAGE) + wt) * (B * G)).to(gl.pointer_type(gl.int32),
                                                                                  bitcast=True)
    ptr = row[:, None, None] + ww[None, :, None] + (wk * (G // 4))[None, None, :]
    return gl.load(ptr, mask=live & (wt >= 0)[:, None, None] & (ww >= 0)[None, :, None] & (wk < B)[None, None, :],
                   other=0)


@gluon.jit
def _plane_words(words, w_l: gl.constexpr):
    """[16 tok, 16 words, 4 planes] -> the 4 planes, [16, 16] each in ``w_l`` (a register relabelling)."""
    even, odd = gl.split(gl.reshape(words, [16, 16, 2, 2]))
    p0, p2 = gl.split(even)
    p1, p3 = gl.split(odd)
    return (gl.convert_layout(p0, w_l, assert_trivial=True).to(gl.uint32, bitcast=True),
            gl.convert_layout(p1, w_l, assert_trivial=True).to(gl.uint32, bitcast=True),
            gl.convert_layout(p2, w_l, assert_trivial=True).to(gl.uint32, bitcast=True),
            gl.convert_layout(p3, w_l, assert_trivial=True).to(gl.uint32, bitcast=True))


@gluon.jit
def _tile_fields(words, c0, c1, c2, c3, c4, c5, c6, c7, w_l: gl.constexpr, B: gl.constexpr, DP: gl.constexpr):
    """16 tokens' plane words -> their fp16 codebook values [16, DP] in the tile's order (position 8g + j)."""
    p0, p1, p2, p3 = _plane_words(words, w_l)
    f = _fields_in_order(_planes_to_words(p0, p1, p2, p3, B, 4), c0, c1, c2, c3, c4, c5, c6, c7, B)
    return gl.reshape(f, [16, DP])  # [16 tok, 16 words, 4 groups, j2, j1, j0] -> position 8g + j


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
    NW: gl.constexpr = G // 4  # plane words (4 groups each) per token
    gl.static_assert(NW == 16, "the word layout covers 16 words (64 groups) per token")

    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NQ, 16])
    tok_l: gl.constexpr = gl.SliceLayout(1, mma)
    col_l: gl.constexpr = gl.SliceLayout(0, mma)
    sm_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    # [16 tok, 16 words] of a plane: lanes 0-7 take 8 tokens, so that their 16-byte stores of one group's values land
    # in 8 different bank groups of the swizzled tile; the loads take all 4 planes (registers) of those words at once
    w_l: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[8, 0]], lane_bases=[[1, 0], [2, 0], [4, 0], [0, 1], [0, 2]], warp_bases=[[0, 4], [0, 8]],
        block_bases=[], shape=[16, 16])
    w3_l: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [8, 0, 0]], lane_bases=[[1, 0, 0], [2, 0, 0], [4, 0, 0], [0, 1, 0], [0, 2, 0]],
        warp_bases=[[0, 4, 0], [0, 8, 0]], block_bases=[], shape=[16, 16, 4])
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

    wt = gl.arange(0, 16, layout=gl.SliceLayout(1, gl.SliceLayout(2, w3_l)))
    ww = gl.arange(0, NW, layout=gl.SliceLayout(0, gl.SliceLayout(2, w3_l)))
    wk = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, w3_l)))
    pr = gl.arange(0, BT, layout=gl.SliceLayout(1, r_l))
    sr = gl.arange(0, 4, layout=gl.SliceLayout(1, sc_l))
    sk = gl.arange(0, 16, layout=gl.SliceLayout(0, sc_l))
    ts = gl.arange(0, BT, layout=tok_l)
    for t in gl.static_range(STAGES - 1):
        _stage_rope(CACHE, bt_row, stride_cb, lo + t * BT, hi, last_blk, stg_pe, stg_sc, t, pr, rc, sr, sk, PAGE,
                    ROPE_OFF, SC_OFF)
    # the first tile's words, 16 tokens each
    w0 = _load_words(CACHE, bt_row, stride_cb, lo, hi, last_blk, wt, ww, wk, PAGE, B, G, IDX_OFF)
    w1 = _load_words(CACHE, bt_row, stride_cb, lo + 16, hi, last_blk, wt, ww, wk, PAGE, B, G, IDX_OFF)
    w2 = _load_words(CACHE, bt_row, stride_cb, lo + 32, hi, last_blk, wt, ww, wk, PAGE, B, G, IDX_OFF)
    w3 = _load_words(CACHE, bt_row, stride_cb, lo + 48, hi, last_blk, wt, ww, wk, PAGE, B, G, IDX_OFF)

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
        # each 16 tokens' words are looked up, then the next tile's loaded in their registers
        f = _tile_fields(w0, c0, c1, c2, c3, c4, c5, c6, c7, w_l, B, DP)
        w0 = _load_words(CACHE, bt_row, stride_cb, nxt, hi, last_blk, wt, ww, wk, PAGE, B, G, IDX_OFF)
        # the previous tile's output product reads the fp16 tile: done, in every warp, before it is written
        acc = warpgroup_mma_wait(0, deps=(acc,))
        gl.thread_barrier()
        c_smem.slice(0, 16).store(f)
        f = _tile_fields(w1, c0, c1, c2, c3, c4, c5, c6, c7, w_l, B, DP)
        w1 = _load_words(CACHE, bt_row, stride_cb, nxt + 16, hi, last_blk, wt, ww, wk, PAGE, B, G, IDX_OFF)
        c_smem.slice(16, 16).store(f)
        f = _tile_fields(w2, c0, c1, c2, c3, c4, c5, c6, c7, w_l, B, DP)
        w2 = _load_words(CACHE, bt_row, stride_cb, nxt + 32, hi, last_blk, wt, ww, wk, PAGE, B, G, IDX_OFF)
        c_smem.slice(32, 16).store(f)
        f = _tile_fields(w3, c0, c1, c2, c3, c4, c5, c6, c7, w_l, B, DP)
        w3 = _load_words(CACHE, bt_row, stride_cb, nxt + 48, hi, last_blk, wt, ww, wk, PAGE, B, G, IDX_OFF)
        c_smem.slice(48, 16).store(f)
        tvalid = (start + ts) < hi
        sc = stg_sc.index(s)._reinterpret(gl.float16, [BT], gl.SwizzledSharedLayout(1, 1, 1, [0])).load(tok_l)
        scf = gl.where(tvalid, sc.to(gl.float32), 0.0)
        fence_async_shared()
        gl.thread_barrier()  # every thread's part of the tile, and its copies of k_pe, before the products read them

        kpe = stg_pe.index(s)
        zero = gl.zeros([BT, NQ], gl.float32, layout=mma)
        s_c = warpgroup_mma(c_smem, q_smem.permute((1, 0)), zero, use_acc=False, is_async=True)
        s_pe = warpgroup_mma(kpe, qhi_smem.permute((1, 0)), zero, use_acc=False, is_async=True)
        s_pe = warpgroup_mma(kpe, qlo_smem.permute((1, 0)), s_pe, is_async=True)
        s_c, s_pe = warpgroup_mma_wait(0, deps=(s_c, s_pe))
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
