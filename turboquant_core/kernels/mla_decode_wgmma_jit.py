# SPDX-License-Identifier: Apache-2.0
"""MLA decode attention through Hopper warpgroup MMA (Gluon, sm_90a; jit only, launcher
``ops.mla.mla_decode_attention``, reference ``ops.mla_reference.mla_decode_attention_ref``).

The MLA latent is both key and value, DP = 512 (kv_lora_rank) coordinates read by every query head. One program
serves one (request, block of 16 heads, KV split); the products are transposed so that MMA rows are tokens and latent
coordinates and the 16 heads are the N = 16 columns. Per tile of 64 cached tokens:
1. the latent's packed words (loaded into registers a tile ahead) are looked up into fp16 codebook values C [64, DP],
   16 tokens at a time, and stored once into shared memory; k_pe [64, 64] and the scales are copied in beside them;
2. S^T [64, 16] = C . Q'^T * a + Kpe . Qpe^T: C and Kpe are the A operands, the queries (stored once) the B operands;
3. online softmax over the tokens (base 2); P^T * a to shared memory (fp16);
4. O^T [DP, 16] += C^T . P^T: the same shared tile read transposed (an MN-major A operand, which 16-bit types may be),
   so the latent is looked up once per tile for both products.
The work is split between two warpgroups of one program (warp specialization): a producer runs step 1 into one of two
tile slots, while the consumer (the kernel's own warpgroup) runs steps 2-4 on the other. Two mbarriers per slot hand
it over: ``full`` when the producer has written it, ``empty`` when the consumer's output product has read it. The
consumer leaves each tile's output product in flight while it waits for the next tile and queues that tile's score
products behind it; ptxas keeps such a pipeline only where nothing but warpgroup MMAs writes an accumulator between
an MMA's issue and its wait, so every program runs at least one tile (an empty split's tokens all masked).
Position p = 8g + j of the tile holds field j of group g (the page's plane byte g), rotated coordinate j * DP/8 + g
(``ops.mla.mla_wgmma_order``): the queries come in and the outputs leave in that order.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
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



@gluon.constexpr_function
def _word_layouts():
    """[16 tok, 16 words] of a plane: lanes 0-7 take 8 tokens, so that their 16-byte stores of one group's values
    land in 8 different bank groups of the swizzled tile; the loads take all 4 planes of those words into one thread's
    registers ([16, 16, 4])."""
    w_l = gl.DistributedLinearLayout(
        reg_bases=[[8, 0]], lane_bases=[[1, 0], [2, 0], [4, 0], [0, 1], [0, 2]], warp_bases=[[0, 4], [0, 8]],
        block_bases=[], shape=[16, 16])
    w3_l = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [8, 0, 0]], lane_bases=[[1, 0, 0], [2, 0, 0], [4, 0, 0], [0, 1, 0], [0, 2, 0]],
        warp_bases=[[0, 4, 0], [0, 8, 0]], block_bases=[], shape=[16, 16, 4])
    return w_l, w3_l


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
def _tile_fields(words, c0, c1, c2, c3, c4, c5, c6, c7, B: gl.constexpr, DP: gl.constexpr):
    """16 tokens' plane words [16, 16, 4] -> their fp16 codebook values [16, DP] in the tile's order (position
    8g + j); the planes split in registers into the lookup's layout."""
    w_l: gl.constexpr = _word_layouts()[0]
    even, odd = gl.split(gl.reshape(words, [16, 16, 2, 2]))
    p0, p2 = gl.split(even)
    p1, p3 = gl.split(odd)
    p0 = gl.convert_layout(p0, w_l, assert_trivial=True).to(gl.uint32, bitcast=True)
    p1 = gl.convert_layout(p1, w_l, assert_trivial=True).to(gl.uint32, bitcast=True)
    p2 = gl.convert_layout(p2, w_l, assert_trivial=True).to(gl.uint32, bitcast=True)
    p3 = gl.convert_layout(p3, w_l, assert_trivial=True).to(gl.uint32, bitcast=True)
    f = _fields_in_order(_planes_to_words(p0, p1, p2, p3, B, 4), c0, c1, c2, c3, c4, c5, c6, c7, B)
    return gl.reshape(f, [16, DP])  # [16 tok, 16 words, 4 groups, j2, j1, j0] -> position 8g + j


@gluon.jit
def _copy_rope(CACHE, bt_row, stride_cb, start, hi, last_blk, kpe_slot, sc_slot, PAGE: gl.constexpr,
               ROPE_OFF: gl.constexpr, SC_OFF: gl.constexpr):
    """Asynchronous copies of the 64-token tile at ``start`` (none where start >= hi), one commit group: k_pe into
    ``kpe_slot`` ([64, 64] bf16) and the fp16 scales into ``sc_slot`` ([4, 16]). Rows past the sequence read its
    last page."""
    r_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    sc_l: gl.constexpr = gl.DistributedLinearLayout(  # [4 x 16 tokens] scale copies, 16 bytes per lane
        reg_bases=[[0, 1], [0, 2], [0, 4]], lane_bases=[[0, 8], [1, 0], [2, 0], [0, 0], [0, 0]],
        warp_bases=[[0, 0], [0, 0]], block_bases=[], shape=[4, 16])
    pr = gl.arange(0, 64, layout=gl.SliceLayout(1, r_l))
    pc = gl.arange(0, 64, layout=gl.SliceLayout(0, r_l))
    sr = gl.arange(0, 4, layout=gl.SliceLayout(1, sc_l))
    sk = gl.arange(0, 16, layout=gl.SliceLayout(0, sc_l))
    live = start < hi
    ppage = gl.load(bt_row + gl.minimum((start + pr) // PAGE, last_blk), mask=live, other=0).to(gl.int64)
    prow = (CACHE + ppage * stride_cb + ROPE_OFF + ((start + pr) % PAGE) * 128).to(gl.pointer_type(gl.bfloat16),
                                                                                  bitcast=True)
    async_copy.async_copy_global_to_shared(kpe_slot, prow[:, None] + pc[None, :],
                                           mask=live & (pc >= 0)[None, :] & (pr >= 0)[:, None])
    spage = gl.load(bt_row + gl.minimum((start + 16 * sr) // PAGE, last_blk), mask=live, other=0).to(gl.int64)
    srow = (CACHE + spage * stride_cb + SC_OFF + ((start + 16 * sr) % PAGE) * 2).to(gl.pointer_type(gl.float16),
                                                                                   bitcast=True)
    async_copy.async_copy_global_to_shared(sc_slot, srow[:, None] + sk[None, :],
                                           mask=live & (sk >= 0)[None, :] & (sr >= 0)[:, None])
    async_copy.commit_group()


@gluon.jit
def _producer(CACHE, bt_row, stride_cb, lo, hi, last_blk, tiles, c_smem, kpe_smem, sc_smem, full, empty,
              c0, c1, c2, c3, c4, c5, c6, c7, DP: gl.constexpr, PAGE: gl.constexpr, B: gl.constexpr,
              IDX_OFF: gl.constexpr, ROPE_OFF: gl.constexpr, SC_OFF: gl.constexpr):
    """The producer warpgroup: tile ``it`` looked up into slot it % 2 once the consumer has released it, its k_pe
    and scales copied beside it; the next tile's words are loaded into registers while this one is looked up."""
    BT: gl.constexpr = 64
    G: gl.constexpr = DP // 8
    w3_l: gl.constexpr = _word_layouts()[1]
    wt = gl.arange(0, 16, layout=gl.SliceLayout(1, gl.SliceLayout(2, w3_l)))
    ww = gl.arange(0, G // 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, w3_l)))
    wk = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, w3_l)))
    w0 = _load_words(CACHE, bt_row, stride_cb, lo, hi, last_blk, wt, ww, wk, PAGE, B, G, IDX_OFF)
    w1 = _load_words(CACHE, bt_row, stride_cb, lo + 16, hi, last_blk, wt, ww, wk, PAGE, B, G, IDX_OFF)
    w2 = _load_words(CACHE, bt_row, stride_cb, lo + 32, hi, last_blk, wt, ww, wk, PAGE, B, G, IDX_OFF)
    w3 = _load_words(CACHE, bt_row, stride_cb, lo + 48, hi, last_blk, wt, ww, wk, PAGE, B, G, IDX_OFF)
    for it in range(0, tiles):
        start = lo + it * BT
        nxt = start + BT
        s = it % 2
        mbarrier.wait(empty.index(s), ((it // 2) & 1) ^ 1)  # a slot's first use passes at once
        _copy_rope(CACHE, bt_row, stride_cb, start, hi, last_blk, kpe_smem.index(s), sc_smem.index(s), PAGE,
                   ROPE_OFF, SC_OFF)
        c_t = c_smem.index(s)
        f = _tile_fields(w0, c0, c1, c2, c3, c4, c5, c6, c7, B, DP)
        w0 = _load_words(CACHE, bt_row, stride_cb, nxt, hi, last_blk, wt, ww, wk, PAGE, B, G, IDX_OFF)
        c_t.slice(0, 16).store(f)
        f = _tile_fields(w1, c0, c1, c2, c3, c4, c5, c6, c7, B, DP)
        w1 = _load_words(CACHE, bt_row, stride_cb, nxt + 16, hi, last_blk, wt, ww, wk, PAGE, B, G, IDX_OFF)
        c_t.slice(16, 16).store(f)
        f = _tile_fields(w2, c0, c1, c2, c3, c4, c5, c6, c7, B, DP)
        w2 = _load_words(CACHE, bt_row, stride_cb, nxt + 32, hi, last_blk, wt, ww, wk, PAGE, B, G, IDX_OFF)
        c_t.slice(32, 16).store(f)
        f = _tile_fields(w3, c0, c1, c2, c3, c4, c5, c6, c7, B, DP)
        w3 = _load_words(CACHE, bt_row, stride_cb, nxt + 48, hi, last_blk, wt, ww, wk, PAGE, B, G, IDX_OFF)
        c_t.slice(48, 16).store(f)
        async_copy.wait_group(0)  # this tile's k_pe and scales
        fence_async_shared()
        mbarrier.arrive(full.index(s), count=1)  # after every producer thread's part (a barrier of the partition)


@gluon.jit
def _consumer(q_smem, qhi_smem, qlo_smem, c_smem, kpe_smem, sc_smem, p_smem, full, empty, lo, hi, tiles,
              PART_O, stride_pos, stride_pot, stride_poh, PART_L, stride_pls, stride_plt, req, h0, split, num_heads,
              DP: gl.constexpr):
    """The consumer warpgroup (the program's own): scores, softmax and the output product of each tile once its slot
    is full; a slot goes back to the producer when the output product that read it has completed. Writes the split's
    normalized output and its log2-sum-exp."""
    BT: gl.constexpr = 64
    NQ: gl.constexpr = 16
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, NQ, 16])
    tok_l: gl.constexpr = gl.SliceLayout(1, mma)
    col_l: gl.constexpr = gl.SliceLayout(0, mma)
    ts = gl.arange(0, BT, layout=tok_l)
    m_i = gl.full([NQ], float("-inf"), gl.float32, layout=col_l)
    l_acc = gl.zeros([BT, NQ], gl.float32, layout=mma)  # per-thread partial sums, reduced once at the end
    acc = warpgroup_mma_init(gl.zeros([DP, NQ], gl.float32, layout=mma))  # the output product stays in flight
    for it in range(0, tiles):
        start = lo + it * BT
        s = it % 2
        mbarrier.wait(full.index(s), (it // 2) & 1)
        c_t = c_smem.index(s)
        kpe = kpe_smem.index(s)
        # queued behind the previous tile's output product; one wait for both (warpgroup MMAs complete in order)
        zero = gl.zeros([BT, NQ], gl.float32, layout=mma)
        s_c = warpgroup_mma(c_t, q_smem.permute((1, 0)), zero, use_acc=False, is_async=True)
        s_pe = warpgroup_mma(kpe, qhi_smem.permute((1, 0)), zero, use_acc=False, is_async=True)
        s_pe = warpgroup_mma(kpe, qlo_smem.permute((1, 0)), s_pe, is_async=True)
        acc, s_c, s_pe = warpgroup_mma_wait(0, deps=(acc, s_c, s_pe))
        mbarrier.arrive(empty.index(1 - s), count=1, pred=it > 0)  # the previous tile's slot is read
        tvalid = (start + ts) < hi
        sc = sc_smem.index(s)._reinterpret(gl.float16, [BT], gl.SwizzledSharedLayout(1, 1, 1, [0])).load(tok_l)
        scf = gl.where(tvalid, sc.to(gl.float32), 0.0)
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
        # left in flight while the next tile's slot fills
        acc = warpgroup_mma(c_t.permute((1, 0)), p_smem.permute((1, 0)), acc * alpha[None, :], is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc,))

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


PRODUCER_REGISTERS = gl.constexpr(232)  # the lookup's registers; the consumer's accumulators take the rest of the 64 K


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
    """Grid (requests, cdiv(num_heads, 16), num_splits), two warpgroups each (the producer added to the program's
    own). Q [B, H, DP]: the absorbed queries in ``mla_wgmma_order``, QPE [B, H, 64] the rope queries (any float
    dtype; times q_scale / pe_scale as they are loaded, the base-2 softmax scale, then fp16); c0..c7: the codebook's
    byte-permute words (``ops.paged_decode.codebook_permute_words``). Writes PART_O[split, request, head, :DP] (the
    split's normalized output, in the same order) and PART_L[split, request, head] (its log2-sum-exp; -inf for a split
    with no token). STAGES is not used: two tile slots."""
    gl.static_assert(gl.num_warps() == 4, "one warpgroup, the producer's added")
    gl.static_assert(PAGE % 16 == 0, "each 16 tokens of a tile lie in one page")
    BT: gl.constexpr = 64  # tokens per tile: the MMA's rows
    NQ: gl.constexpr = 16  # heads per program: the MMA's columns
    R: gl.constexpr = 64  # rope coordinates
    gl.static_assert(DP // 32 == 16, "the word layout covers 16 words (64 groups) per token")
    sm_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    r_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # [16, DP] queries

    req = gl.program_id(0)
    h0 = gl.program_id(1) * NQ
    split = gl.program_id(2)
    kv_len = gl.load(SEQ_LENS + req)
    lo, hi = _split_range(kv_len, split, num_splits, BT)
    last_blk = gl.maximum(kv_len - 1, 0) // PAGE
    bt_row = BLOCK_TABLE + req.to(gl.int64) * stride_bt
    # at least one tile (an empty split's tokens all masked), so that the output product's accumulator is only ever
    # written by warpgroup MMAs between its issue and its wait
    tiles = gl.maximum((hi - lo + BT - 1) // BT, 1)

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
    c_smem = gl.allocate_shared_memory(gl.float16, [2, BT, DP], sm_l)  # the two tile slots
    kpe_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BT, R], sm_l)
    sc_smem = gl.allocate_shared_memory(gl.float16, [2, 4, 16], plain)
    p_smem = gl.allocate_shared_memory(gl.float16, [NQ, BT], sm_l)
    full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for k in gl.static_range(2):
        mbarrier.init(full.index(k), count=1)  # one arrive per partition (its elected thread, after its barrier)
        mbarrier.init(empty.index(k), count=1)
    fence_async_shared()

    gl.warp_specialize([
        (_consumer, (q_smem, qhi_smem, qlo_smem, c_smem, kpe_smem, sc_smem, p_smem, full, empty, lo, hi, tiles,
                     PART_O, stride_pos, stride_pot, stride_poh, PART_L, stride_pls, stride_plt, req, h0, split,
                     num_heads, DP)),
        (_producer, (CACHE, bt_row, stride_cb, lo, hi, last_blk, tiles, c_smem, kpe_smem, sc_smem, full, empty,
                     c0, c1, c2, c3, c4, c5, c6, c7, DP, PAGE, B, IDX_OFF, ROPE_OFF, SC_OFF)),
    ], [4], [PRODUCER_REGISTERS])
