# SPDX-License-Identifier: Apache-2.0
"""Decode attention over today's paged TurboQuant pages with e4m3 operands through Hopper warpgroup MMA (Gluon,
sm_90a; jit only, launcher: ``ops.paged_decode_wgmma``).

One warpgroup (4 warps) serves one (request, KV head, KV split) and the GQA group's queries (one query token per
request, the group padded to N = 8 MMA columns). Per tile of 64 cached tokens:
1. S^T [64 tok, 8] = K [64, 128] . Q'^T [128, 8]: K is the A operand, looked up from the 3-bit indices straight into
   e4m3 registers (one ``prmt`` per 4 values from the 8-entry codebook held in two registers); Q'^T (e4m3, stored
   once) is the B operand in shared memory: 4 x QGMMA.64x8x32.
2. Online softmax over the tokens (log2 domain, whole-number maxima); P^T * v_scale to shared memory in e4m3, at a
   power-of-two scale that follows the largest value scale so far.
3. O^T [128, 8] += V^T [128, 64] . P^T [64, 8]: V^T looked up from the 4-bit indices (natural indices turned into
   sign and magnitude in registers; the value codebook is symmetric) from its 8 magnitudes: 4 x QGMMA.64x8x32.

The pages are the store kernel's (``ops.page_layout``, planar8). Each tile's key words, value bytes and scales are
copied into shared memory a tile ahead (``cp.async``, two stages; warp w copies the tile's tokens 16w .. 16w + 15,
one page), so the loop waits on no global load of the tile it computes. From shared memory:
- keys: each of the 4 threads holding a token's A row reads the word of its 4 groups from planes 0, 1 and 2 and
  builds 4 selector words pairing fields (0, 4), (1, 7), (3, 6), (2, 5) per byte lane; A column
  k = sw * 32 + h * 16 + tid * 4 + j holds rotated coordinate ``WGMMA_KEY_ORDER[k]``;
- values: a thread reads the halfword (4 coordinates) of 4 consecutive tokens, two ``prmt`` regroup them by
  coordinate pair; V^T row R = q + 8e + 16w + 64s holds coordinate ``WGMMA_VALUE_ORDER[R]`` = 2q + s + 32w + 16e.
The softmax maximum of a tile is exchanged between the 4 warps through shared memory once (by tile parity), and
every warp reduces the tile's value scales itself, so a tile has 4 barriers of its own (Triton adds 2).
The query rotation writes Q' in the key order and the split merge rotates the outputs back from the value order.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from .paged_decode_jit import _split_range

PRMT_LOOKUP_8 = gl.constexpr("prmt.b32 $0, $5, $9, $1;")  # pack 4: $1-$4 selector, $5-$8 / $9-$12 table regs
PRMT_LOOKUP_8_SIGN = gl.constexpr("{ .reg .b32 t; prmt.b32 t, $5, $9, $1; xor.b32 $0, t, $13; }")
PRMT_6420 = gl.constexpr("prmt.b32 $0, $1, $2, 0x6420;")  # even bytes of (a, b)
PRMT_7531 = gl.constexpr("prmt.b32 $0, $1, $2, 0x7531;")  # odd bytes of (a, b)

# A column k = sw * 32 + h * 16 + tid * 4 + j of the key tile <- rotated coordinate (planar8 index position).
WGMMA_KEY_FIELDS = ((0, 4), (1, 7), (3, 6), (2, 5))  # the fields (low, high nibble) of selector word sw
WGMMA_KEY_ORDER = tuple(4 * tid + 2 * h + (j >> 1) + 16 * WGMMA_KEY_FIELDS[sw][j & 1]
                        for sw in range(4) for h in range(2) for tid in range(4) for j in range(4))
# V^T row R = q + 8e + 16w + 64s <- rotated coordinate 2q + s + 32w + 16e.
WGMMA_VALUE_ORDER = tuple(2 * (r & 7) + (r >> 6) + 32 * ((r >> 4) & 3) + 16 * ((r >> 3) & 1) for r in range(128))


@gluon.constexpr_function
def _key5_layout():
    """[64 tok, 4 sw, 2 h, 4 tid, 4 j] -> the wgmma A operand [64, 128] (k = sw*32 + h*16 + tid*4 + j) reg by reg."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 0, 1], [0, 0, 0, 0, 2], [8, 0, 0, 0, 0], [0, 0, 1, 0, 0], [0, 1, 0, 0, 0],
                   [0, 2, 0, 0, 0]],
        lane_bases=[[0, 0, 0, 1, 0], [0, 0, 0, 2, 0], [1, 0, 0, 0, 0], [2, 0, 0, 0, 0], [4, 0, 0, 0, 0]],
        warp_bases=[[16, 0, 0, 0, 0], [32, 0, 0, 0, 0]], block_bases=[], shape=[64, 4, 2, 4, 4])


@gluon.constexpr_function
def _keyword_layout():
    """[64 tok, 4 tid]: one index word per (token, thread)."""
    return gl.DistributedLinearLayout(
        reg_bases=[[8, 0]], lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 4])


@gluon.constexpr_function
def _val5_layout():
    """[128 rows, 2 kb, 2 h, 4 tid, 4 j] -> the A operand V^T [128, 64] (k = kb*32 + h*16 + tid*4 + j)."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 0, 1], [0, 0, 0, 0, 2], [8, 0, 0, 0, 0], [0, 0, 1, 0, 0], [0, 1, 0, 0, 0],
                   [64, 0, 0, 0, 0]],
        lane_bases=[[0, 0, 0, 1, 0], [0, 0, 0, 2, 0], [1, 0, 0, 0, 0], [2, 0, 0, 0, 0], [4, 0, 0, 0, 0]],
        warp_bases=[[16, 0, 0, 0, 0], [32, 0, 0, 0, 0]], block_bases=[], shape=[128, 2, 2, 4, 4])


@gluon.constexpr_function
def _valhalf_layout():
    """[32 halfwords G = w * 8 + q, 2 kb, 2 h, 4 tid]: lane q, warp w, thread tid, so that the halfword's 4
    coordinates are the A operand's rows q + 8e + 16w + 64s of the thread."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1, 0], [0, 1, 0, 0]],
        lane_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]],
        warp_bases=[[8, 0, 0, 0], [16, 0, 0, 0]], block_bases=[], shape=[32, 2, 2, 4])


@gluon.constexpr_function
def _copy_layout(words: int):
    """[4 pages, 16 token rows, ``words`` elements of 4 bytes or 2]: warp w copies the tile's tokens 16w .. 16w + 15
    (one page, so one page id per thread) in 16-byte pieces; ``words`` = 16 int32 (keys) or 32 int16 (values)."""
    vec = [[0, 0, 1], [0, 0, 2]] + ([[0, 0, 4]] if words == 32 else [])
    pieces = [[0, 0, words // 4], [0, 0, words // 2]]
    return gl.DistributedLinearLayout(
        reg_bases=vec + [[0, 8, 0]], lane_bases=pieces + [[0, 1, 0], [0, 2, 0], [0, 4, 0]],
        warp_bases=[[1, 0, 0], [2, 0, 0]], block_bases=[], shape=[4, 16, words])


@gluon.constexpr_function
def _scale_copy_layout():
    """[2 (key, value), 4 pages, 16 token rows] fp16 scales: 16-byte pieces, warp w copies page w's (lanes 0-3)."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4]], lane_bases=[[0, 0, 8], [1, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]],
        warp_bases=[[0, 1, 0], [0, 2, 0]], block_bases=[], shape=[2, 4, 16])


@gluon.constexpr_function
def _staged_key_layout():
    """[64 tok, 16 words] staged key words -> registers: word w = 4 * plane + tid at lane tid, planes in registers
    (``_keyword_layout`` per plane)."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 4], [0, 8], [8, 0]], lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 16])


@gluon.constexpr_function
def _staged_value_layout():
    """[64 tok, 32 halfwords] staged value halfwords -> registers: token tid*16 + kb*8 + h*4 + u, halfword
    G = w*8 + q at warp w, lane (q, tid), registers (u, h, kb) (``_valhalf_layout`` per u)."""
    return gl.DistributedLinearLayout(
        reg_bases=[[1, 0], [2, 0], [4, 0], [8, 0]], lane_bases=[[16, 0], [32, 0], [0, 1], [0, 2], [0, 4]],
        warp_bases=[[0, 8], [0, 16]], block_bases=[], shape=[64, 32])


@gluon.constexpr_function
def _staged_scale_layout():
    """[2 (key, value), 64 tok] staged scales -> registers, each half the score tile's row layout."""
    return gl.DistributedLinearLayout(
        reg_bases=[[1, 0], [0, 8]], lane_bases=[[0, 0], [0, 0], [0, 1], [0, 2], [0, 4]],
        warp_bases=[[0, 16], [0, 32]], block_bases=[], shape=[2, 64])


@gluon.constexpr_function
def _all_scales_layout():
    """[2 (key, value), 64 tok] staged scales -> every warp holds all 64 (2 per lane): reductions stay in the warp."""
    return gl.DistributedLinearLayout(
        reg_bases=[[1, 0], [0, 1]], lane_bases=[[0, 2], [0, 4], [0, 8], [0, 16], [0, 32]],
        warp_bases=[[0, 0], [0, 0]], block_bases=[], shape=[2, 64])


@gluon.constexpr_function
def _warp_max_layout():
    """[4 warps, 8 columns] per-warp score maxima -> every thread holds the 4 of its columns (``col_l`` after the
    reduction over warps)."""
    return gl.DistributedLinearLayout(
        reg_bases=[[1, 0], [2, 0], [0, 1]], lane_bases=[[0, 2], [0, 4], [0, 0], [0, 0], [0, 0]],
        warp_bases=[[0, 0], [0, 0]], block_bases=[], shape=[4, 8])


@gluon.jit
def _split4(x):
    """[..., 2, 2] (both in registers) -> the 4 slices of the dim they split, in order."""
    a, b = gl.split(x)
    x0, x2 = gl.split(a)
    x1, x3 = gl.split(b)
    return x0, x1, x2, x3


# The staged pieces in shared memory, as the copies write them ([4 pages, 16 rows, ...]) and as the loop reads them
# ([64 tok, ...]); offset bit -> index. Key rows 2t, 2t + 1 rotate their 4 planes, value rows of each 16 tokens their 4
# pieces, so that a warp's reads hit 32 banks.
KEY_COPY_SMEM = gl.constexpr(gl.SharedLinearLayout(
    offset_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 1, 0], [0, 2, 4], [0, 4, 8], [0, 8, 0], [1, 0, 0],
                  [2, 0, 0]]))
KEY_READ_SMEM = gl.constexpr(gl.SharedLinearLayout(
    offset_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [1, 0], [2, 4], [4, 8], [8, 0], [16, 0], [32, 0]]))
VALUE_COPY_SMEM = gl.constexpr(gl.SharedLinearLayout(
    offset_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 0, 16], [0, 1, 0], [0, 2, 0], [0, 4, 0], [0, 8, 0],
                  [1, 0, 8], [2, 0, 16]]))
VALUE_READ_SMEM = gl.constexpr(gl.SharedLinearLayout(
    offset_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [0, 16], [1, 0], [2, 0], [4, 0], [8, 0], [16, 8], [32, 16]]))
SCALE_COPY_SMEM = gl.constexpr(gl.SharedLinearLayout(
    offset_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 0, 8], [0, 1, 0], [0, 2, 0], [1, 0, 0]]))
SCALE_READ_SMEM = gl.constexpr(gl.SharedLinearLayout(
    offset_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [0, 16], [0, 32], [1, 0]]))


@gluon.jit
def _stage_tile(head, bt_row, last_blk, start, hi, c_pg, k_off, k_ok, v_off, s_off, stage_buf, s_st, s, stride_cb,
                PAGE: gl.constexpr, K_IDX_OFF: gl.constexpr, V_IDX_OFF: gl.constexpr, kc_l: gl.constexpr,
                vc_l: gl.constexpr, sc_l: gl.constexpr):
    """Asynchronous copies of the 64-token tile from ``start`` into stage ``s`` (none where start >= hi), one commit
    group. Rows past the sequence read its last page, as the scores mask them."""
    live = start < hi
    first = start + c_pg * 16  # each warp's 16 tokens lie in one page
    pid = gl.load(bt_row + gl.minimum(first // PAGE, last_blk), mask=live, other=0).to(gl.int64)
    page = head + pid * stride_cb
    kp = (page + K_IDX_OFF + (first % PAGE) * 48).to(gl.pointer_type(gl.int32), bitcast=True)
    async_copy.async_copy_global_to_shared(
        stage_buf.index(2 * s)._reinterpret(gl.int32, [4, 16, 16], KEY_COPY_SMEM), kp[:, None, None] + k_off,
        mask=k_ok & live)
    vpage = gl.convert_layout(page, gl.SliceLayout(1, gl.SliceLayout(2, vc_l)), assert_trivial=True)
    vfirst = gl.convert_layout(first, gl.SliceLayout(1, gl.SliceLayout(2, vc_l)), assert_trivial=True)
    vp = (vpage + V_IDX_OFF + (vfirst % PAGE) * 64).to(gl.pointer_type(gl.int16), bitcast=True)
    # (the value and scale masks only spread ``live`` over the pointers' shape)
    async_copy.async_copy_global_to_shared(
        stage_buf.index(2 * s + 1)._reinterpret(gl.int16, [4, 16, 32], VALUE_COPY_SMEM), vp[:, None, None] + v_off,
        mask=((vfirst >= 0)[:, None, None] & (v_off >= 0)) & live)
    spage = gl.convert_layout(page, gl.SliceLayout(0, gl.SliceLayout(2, sc_l)), assert_trivial=True)
    sfirst = gl.convert_layout(first, gl.SliceLayout(0, gl.SliceLayout(2, sc_l)), assert_trivial=True)
    sp = (spage + (sfirst % PAGE) * 2).to(gl.pointer_type(gl.float16), bitcast=True)
    async_copy.async_copy_global_to_shared(
        s_st.index(s)._reinterpret(gl.float16, [2, 4, 16], SCALE_COPY_SMEM), sp[None, :, None] + s_off,
        mask=((sfirst >= 0)[None, :, None] & (s_off >= 0)) & live)
    async_copy.commit_group()


@gluon.jit
def _copy_logits(base, b, hi, groups, row, col, lg_smem, GQ: gl.constexpr):
    """Asynchronous copy of block b's centering logits (64 groups of 16 tokens x 8 columns from ``base``, a KV head's
    rows of ``tq_center_logits_kernel``'s output) into ``lg_smem``'s half b % 2, committed with the next tile's
    copies; none past the sequence's last block (``hi``) or the groups held, zero past the KV head's GQ columns."""
    g = b * 64 + row
    async_copy.async_copy_global_to_shared(
        lg_smem.index(b % 2), base + b.to(gl.int64) * 512 + (row * 8)[:, None] + col[None, :],
        mask=((g < groups) & (b * 1024 < hi))[:, None] & (col < GQ)[None, :])


@gluon.jit
def _value_selectors(x):
    """x: byte j = token j's byte of one coordinate pair (natural 4-bit indices, low nibble e = 0) -> (selector
    word: low / high 16 bits = the 4 tokens' magnitude ranks of e = 0 / e = 1, sign words of e = 0 and e = 1:
    bit 7 of byte j set where the value is negative)."""
    x4 = x >> 4
    xa = (x & 0x0F0F0F0F) | (x4 & 0xF0F0F0F0)
    xb = (x4 & 0x0F0F0F0F) | ((x >> 8) & 0xF0F0F0F0)
    y = gl.inline_asm_elementwise(PRMT_6420, "=r,r,r", [xa, xb], dtype=gl.uint32, is_pure=True, pack=1)
    nb = ~y & 0x88888888  # negative where bit 3 is clear (natural index < 8): magnitude rank 7 - i there
    return (y ^ (nb - (nb >> 3))) & 0x77777777, (~x << 4) & 0x80808080, ~x & 0x80808080


@gluon.jit
def _lookup(sel4, tab0, tab1, L5: gl.constexpr, SHAPE: gl.constexpr):
    """Selectors [.., 4 tid] (one 16-bit prmt selector per A-operand register) -> e4m3 values [.., 4 tid, 4 j] in the
    A-operand layout: one prmt per register (the selector broadcast over j: pack 4 gives the asm one register)."""
    sel5 = gl.expand_dims(gl.convert_layout(sel4, gl.SliceLayout(4, L5), assert_trivial=True), 4)
    sel5 = sel5 + gl.zeros(SHAPE, gl.uint32, layout=L5)
    return gl.inline_asm_elementwise(PRMT_LOOKUP_8, "=r,r,r,r,r,r,r,r,r,r,r,r,r", [sel5, tab0, tab1],
                                     dtype=gl.float8e4nv, is_pure=True, pack=4)


@gluon.jit
def _lookup_sign(sel4, sgn4, tab0, tab1, L5: gl.constexpr, SHAPE: gl.constexpr):
    """``_lookup`` of magnitudes, with the sign bits of ``sgn4`` xored into the e4m3 bytes."""
    sel5 = gl.expand_dims(gl.convert_layout(sel4, gl.SliceLayout(4, L5), assert_trivial=True), 4)
    sel5 = sel5 + gl.zeros(SHAPE, gl.uint32, layout=L5)
    sgn5 = gl.expand_dims(gl.convert_layout(sgn4, gl.SliceLayout(4, L5), assert_trivial=True), 4)
    sgn5 = sgn5 + gl.zeros(SHAPE, gl.uint32, layout=L5)
    return gl.inline_asm_elementwise(PRMT_LOOKUP_8_SIGN, "=r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r",
                                     [sel5, tab0, tab1, sgn5], dtype=gl.float8e4nv, is_pure=True, pack=4)


@gluon.jit
def _halves(x):
    """[64, 4] selector words -> [64, 2 h, 4]: low half, high half (prmt reads bits 0-15)."""
    return gl.permute(gl.join(x, x >> 16), [0, 2, 1])


@gluon.jit
def _grid_dependency_wait():
    """Programmatic dependent launch: wait until the previous grid has finished and its writes are visible."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _launch_dependents():
    """Programmatic dependent launch: the next grid may launch once every program of this one has called this."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                              pack=1)


# Arguments that vary with the batch are not specialized (one compiled variant serves every CUDA-graph size and split
# count, as for ``paged_decode_jit.tq_paged_decode_kernel``): the block table (a row slice of vLLM's table) and its
# stride, the request metadata slices, the split count, the partial outputs' strides and the centering logits'
# strides (their group count follows the batch's longest sequence).
@gluon.jit(do_not_specialize=["BLOCK_TABLE", "stride_bt", "QUERY_START", "SEQ_LENS", "stride_pos", "stride_pls",
                              "num_splits", "stride_lt", "stride_lh"])
def tq_paged_decode_wgmma_kernel(
    QROT, stride_qt, stride_qh,
    CACHE, stride_cb, stride_ch,
    BLOCK_TABLE, stride_bt, QUERY_START, SEQ_LENS,
    kt0, kt1, vt0, vt1,
    PART_O, stride_pos, stride_pot, stride_poh, PART_L, stride_pls, stride_plt,
    num_splits,
    CWZ, stride_ct, stride_cwh, CSCALE, stride_st, PAGE_COS16, PAGE_SIN16, num_pages,
    LOGITS, stride_lt, stride_lh,
    GQ: gl.constexpr, PAGE: gl.constexpr,
    K_IDX_OFF: gl.constexpr, V_IDX_OFF: gl.constexpr, K_SC_OFF: gl.constexpr, V_SC_OFF: gl.constexpr,
    P_EXP: gl.constexpr, CENTER: gl.constexpr, PDL: gl.constexpr = False,
):
    """Grid (requests, KV heads, splits), one warpgroup each; one query token per request (its last), the GQA group's GQ
    <= 8 heads as MMA columns. QROT [T, Hq, 128] fp16: queries rotated into ``WGMMA_KEY_ORDER``, pre-scaled to the log2
    domain (``tq_rotate_queries_kernel``, or the centring logits launch); each column is rounded to e4m3 at a
    power-of-two scale that puts its largest value in [224, 448), divided out of its scores. CACHE: the uint8 pages
    (block stride ``stride_cb``, head stride ``stride_ch``, bytes; page offsets ``K_IDX_OFF`` ... as ``PagedTQLayout``),
    head_dim 128, 3-bit keys, 4-bit values. P_EXP: P^T * v_scale is stored at 2^(P_EXP - e), e the running ceil(log2) of
    the largest value scale. kt0 / kt1: the 8 key centroids as e4m3 bytes (entries 0-3, 4-7); vt0 / vt1: the value
    codebook's 8 magnitudes (entries 8-15) likewise. Writes the split's normalized output in ``WGMMA_VALUE_ORDER`` to
    PART_O[split, token, head, :128] and its log2-sum-exp to PART_L (-inf for a head that sees no token).

    ``CENTER`` (keys stored with key centering, ``ops.key_centering``): the scores of a token in page p get
    q . c_p = row scale * (w . PC[p] + z . PS[p]) (w, z: CWZ [T, Hq, 2, 128] fp16 and the row scales CSCALE [T, Hq]
    from ``tq_center_queries_kernel``; PC / PS the fp16 page tables, ``num_pages`` rows, the last reused past its
    end). Both modes keep the terms of 64 groups of 16 tokens (1024 tokens) at a time in shared memory, and each tile
    reads its 4 groups back. CENTER = 2: they are copied from LOGITS [T, KV heads, groups, 8] fp32
    (``tq_center_logits_kernel``) one block ahead, with the tile copies. CENTER = 1 (where those do not fit the
    workspace): they are computed here, as one fp16 warpgroup product [64 groups, 256] . [256, 8] per block.

    ``PDL``: launched as a programmatic dependent of the launch before it (the logits or the query rotation), which
    lets it start once all that launch's programs have: the set-up and the first tile's copies (the pages, written
    before that launch started) run before the wait for its grid, and QROT, LOGITS and CWZ are read after. The split
    merge after it may launch once every program has left its tile loop (it waits for this grid before reading)."""
    gl.static_assert(gl.num_warps() == 4, "one warpgroup")
    gl.static_assert(GQ <= 8, "the GQA group fills at most the 8 MMA columns")
    gl.static_assert(PAGE % 16 == 0, "a warp's 16 token rows lie in one page")
    req = gl.program_id(0)
    kvh = gl.program_id(1)
    split = gl.program_id(2)
    tok = gl.load(QUERY_START + req).to(gl.int64)  # the request's query token
    kv_len = gl.load(SEQ_LENS + req)
    lo, hi = _split_range(kv_len, split, num_splits, 64)

    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 8, 32])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4)
    k5: gl.constexpr = _key5_layout()
    kw_l: gl.constexpr = _keyword_layout()
    v5: gl.constexpr = _val5_layout()
    vh_l: gl.constexpr = _valhalf_layout()
    sm_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    ps_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
    tok_l: gl.constexpr = gl.SliceLayout(1, mma)
    col_l: gl.constexpr = gl.SliceLayout(0, mma)

    head = CACHE + kvh.to(gl.int64) * stride_ch
    bt_row = BLOCK_TABLE + req.to(gl.int64) * stride_bt
    last_blk = gl.maximum(kv_len - 1, 0) // PAGE
    ts = gl.arange(0, 64, layout=tok_l)

    # The tiles' key words, value halfwords and scales reach shared memory by asynchronous copies one tile ahead.
    kc_l: gl.constexpr = _copy_layout(16)
    vc_l: gl.constexpr = _copy_layout(32)
    sc_l: gl.constexpr = _scale_copy_layout()
    # one buffer of 4 KB pieces: stage s's keys at 2s, values at 2s + 1 (allocated with the centre product's layout,
    # whose alignment the centred variant needs: it computes in the free stage's pieces)
    stage_buf = gl.allocate_shared_memory(gl.float16, [4, 64, 32],
                                          gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2))
    s_st = gl.allocate_shared_memory(gl.float16, [2, 2, 64], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    c_pg = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, kc_l)))  # the page (16 tokens) each warp copies
    c_row = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, kc_l)))
    c_kw = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, kc_l)))
    c_vrow = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, vc_l)))
    c_vh = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, vc_l)))
    c_kind = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, sc_l)))
    c_srow = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, sc_l)))
    # element offsets within a warp's 16 tokens: key words (12 of 16 per token: the last piece is not copied), value
    # halfwords, the key and value scales
    k_off = (c_row * 12)[None, :, None] + c_kw[None, None, :]
    k_ok = (c_kw < 12)[None, None, :] & (c_row < 16)[None, :, None] & (c_pg < 4)[:, None, None]
    v_off = (c_vrow * 32)[None, :, None] + c_vh[None, None, :]
    s_off = gl.where(c_kind == 0, K_SC_OFF // 2, V_SC_OFF // 2)[:, None, None] + c_srow[None, None, :]
    # [4 groups of 16 tokens, 16, 8]: reshaped to [64, 8] it is the score tile's layout, so a tile's 4 group terms
    # broadcast over their 16 rows without moving data.
    g3: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 8, 0]], lane_bases=[[0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
        warp_bases=[[1, 0, 0], [2, 0, 0]], block_bases=[], shape=[4, 16, 8])
    if PDL:
        _stage_tile(head, bt_row, last_blk, lo, hi, c_pg, k_off, k_ok, v_off, s_off, stage_buf, s_st, 0, stride_cb,
                    PAGE, K_IDX_OFF, V_IDX_OFF, kc_l, vc_l, sc_l)
        _grid_dependency_wait()
    # Q'^T in shared memory, K-major (e4m3 B operands must be): stored [8 q, 128 d], read as [128, 8]. Column c is
    # head kvh * GQ + c (zero past the group), scaled by a power of two into e4m3's range.
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [1, 4], [1, 0])
    qr = gl.arange(0, 8, layout=gl.SliceLayout(1, blk))
    qc = gl.arange(0, 128, layout=gl.SliceLayout(0, blk))
    q = gl.load(QROT + tok * stride_qt + (kvh * GQ + qr)[:, None] * stride_qh + qc[None, :],
                mask=(qr < GQ)[:, None] & (qc < 128)[None, :], other=0.0).to(gl.float32)
    amax = gl.max(gl.abs(q), axis=1)
    q_exp = gl.where(amax > 0, gl.floor(gl.log2(448.0 / gl.where(amax > 0, amax, 1.0))), 0.0)
    q_exp = gl.where(amax * gl.exp2(q_exp) >= 448.0, q_exp - 1.0, q_exp)
    q_smem = gl.allocate_shared_memory(gl.float8e4nv, [8, 128], sm_l, (q * gl.exp2(q_exp)[:, None]).to(gl.float8e4nv))
    p_smem = gl.allocate_shared_memory(gl.float8e4nv, [8, 64], ps_l)
    # the 4 warps' score maxima of a tile, by tile parity: one barrier exchanges them, and a warp a tile ahead writes
    # the other half
    mx_smem = gl.allocate_shared_memory(gl.float32, [2, 4, 8], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    all_tok = gl.arange(0, 64, layout=gl.SliceLayout(0, _all_scales_layout()))
    cols = gl.arange(0, 8, layout=col_l)
    q_unscale = gl.exp2(-gl.convert_layout(q_exp, col_l))

    if CENTER == 2:
        # the logits of two blocks' 64 groups (by block parity), each block's copied with the tile copies a block
        # ahead: shared memory, not registers, carries them across the tile loop
        gsm = gl.allocate_shared_memory(gl.float32, [32, 4, 8], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        lg_smem = gsm._reinterpret(gl.float32, [2, 64, 8], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        lg_l: gl.constexpr = gl.BlockedLayout([1, 4], [16, 2], [4, 1], [1, 0])
        lg_row = gl.arange(0, 64, layout=gl.SliceLayout(1, lg_l))
        lg_col = gl.arange(0, 8, layout=gl.SliceLayout(0, lg_l))
        # (whole multiples of 8 columns: 32-byte rows, copied 16 bytes at a time)
        lg_base = LOGITS + tok * (stride_lt // 8 * 8) + kvh.to(gl.int64) * (stride_lh // 8 * 8)
        _copy_logits(lg_base, lo // 1024, hi, stride_lh // 8, lg_row, lg_col, lg_smem, GQ)
        if PDL:
            # a commit group of their own after the first tile's: the first tile's wait covers both
            async_copy.commit_group()
    if not PDL:
        _stage_tile(head, bt_row, last_blk, lo, hi, c_pg, k_off, k_ok, v_off, s_off, stage_buf, s_st, 0, stride_cb,
                    PAGE, K_IDX_OFF, V_IDX_OFF, kc_l, vc_l, sc_l)
    if CENTER == 1:
        # B operand of the centre product: [w | z] of the group's heads in 8 chunks of 32 (one 64-byte swizzle row
        # each), read as [32, 8] per chunk; zero past the group.
        mma16: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 8, 16])
        cw_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)
        cwz_smem = gl.allocate_shared_memory(gl.float16, [8, 8, 32], cw_l)
        cblk: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
        cr = gl.arange(0, 8, layout=gl.SliceLayout(1, cblk))
        cc = gl.arange(0, 32, layout=gl.SliceLayout(0, cblk))
        cbase = CWZ + tok * stride_ct + (kvh * GQ + cr)[:, None] * stride_cwh + cc[None, :]
        for c in gl.static_range(8):
            cwz_smem.index(c).store(gl.load(cbase + c * 32, mask=(cr < GQ)[:, None] & (cc < 32)[None, :], other=0.0))
        cscale = gl.load(CSCALE + tok * stride_st + kvh * GQ + cols, mask=cols < GQ, other=0.0)
        gsm = gl.allocate_shared_memory(gl.float32, [16, 4, 8], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        gsm2 = gsm._reinterpret(gl.float32, [64, 8], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        ga_l: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
        grow = gl.arange(0, 64, layout=gl.SliceLayout(1, ga_l))
        gk = gl.arange(0, 32, layout=gl.SliceLayout(0, ga_l))
        fence_async_shared()
    m_i = gl.full([8], float("-inf"), gl.float32, layout=col_l)
    e_v = -64.0  # running power of two >= every value scale seen (P^T's e4m3 scale follows it)
    l_acc = gl.zeros([64, 8], gl.float32, layout=mma)
    acc = gl.zeros([128, 8], gl.float32, layout=mma)
    # Tiles in blocks of 1024 tokens: the centred variant computes a block's centre terms before its tiles, outside
    # the tile loop, whose registers it would otherwise crowd (benchmarks/results/INDEX.md, 2026-11-27 rows).
    for blk in range(lo // 1024 * 1024, hi, 1024):
        first = gl.maximum(lo, blk)
        if CENTER == 2:
            # the next block's logits join the next tile's copies (this block's came with its first tile's)
            _copy_logits(lg_base, blk // 1024 + 1, hi, stride_lh // 8, lg_row, lg_col, lg_smem, GQ)
        if CENTER == 1:
            stage = ((first - lo) // 64) % 2
            # the centre terms of the 64 groups of 16 tokens from this 1024-token block's start
            gpage = gl.minimum((blk + grow * 16) // PAGE, num_pages - 1)
            gptr = gpage[:, None] * 128 + gk[None, :]
            g = gl.zeros([64, 8], gl.float32, layout=mma16)
            # The table chunks go through shared memory in 16-byte loads, one table at a time: loaded as A
            # operands in registers they would need an address per 4 bytes, more than the tile loop's 64 registers
            # can hold. They use the free stage's two pieces, whose copies are issued after this block.
            ga_cos = stage_buf.index(2 - 2 * stage)
            ga_sin = stage_buf.index(3 - 2 * stage)
            for kc in range(4):
                gl.thread_barrier()  # the last chunk's products have read the pieces
                ga_cos.store(gl.load(PAGE_COS16 + gptr + kc * 32))
                gl.thread_barrier()  # one table's chunk in registers at a time
                ga_sin.store(gl.load(PAGE_SIN16 + gptr + kc * 32))
                fence_async_shared()
                gl.thread_barrier()
                g = warpgroup_mma(ga_cos, cwz_smem.index(kc).permute((1, 0)), g)
                g = warpgroup_mma(ga_sin, cwz_smem.index(4 + kc).permute((1, 0)), g)
            gl.thread_barrier()  # the previous block's terms are read
            gsm2.store(g * gl.convert_layout(cscale, gl.SliceLayout(0, mma16))[None, :])
            gl.thread_barrier()
        for start in range(first, gl.minimum(hi, blk + 1024), 64):
            stage = ((start - lo) // 64) % 2
            _stage_tile(head, bt_row, last_blk, start + 64, hi, c_pg, k_off, k_ok, v_off, s_off, stage_buf, s_st,
                        1 - stage, stride_cb, PAGE, K_IDX_OFF, V_IDX_OFF, kc_l, vc_l, sc_l)
            async_copy.wait_group(1)  # this tile's copies (the next tile's stay in flight)
            gl.thread_barrier()
            kx = stage_buf.index(2 * stage)._reinterpret(gl.int32, [64, 16], KEY_READ_SMEM).load(_staged_key_layout())
            w0, w1, w2, _w3 = _split4(gl.permute(gl.reshape(kx, [64, 2, 2, 4]), [0, 3, 1, 2]))
            w0 = gl.convert_layout(w0, kw_l, assert_trivial=True).to(gl.uint32, bitcast=True)
            w1 = gl.convert_layout(w1, kw_l, assert_trivial=True).to(gl.uint32, bitcast=True)
            w2 = gl.convert_layout(w2, kw_l, assert_trivial=True).to(gl.uint32, bitcast=True)
            # planar8 planes P0, P1, P2 (bytes = groups 4 tid .. 4 tid + 3): field f of a group at bits 3f .. 3f + 2 of
            # P0 | P1 << 8 | P2 << 16
            s0 = (w0 & 0x07070707) | (w1 & 0x70707070)
            s1 = ((w0 >> 3) & 0x07070707) | ((w2 >> 1) & 0x70707070)
            s2 = ((w1 >> 1) & 0x07070707) | ((w2 << 2) & 0x70707070)
            s3 = (((w0 >> 6) & 0x03030303) | ((w1 << 2) & 0x04040404) | ((w1 >> 3) & 0x10101010)
                  | ((w2 << 5) & 0x60606060))
            sel = gl.join(gl.join(_halves(s0), _halves(s1)), gl.join(_halves(s2), _halves(s3)))  # [64, 2h, 4tid, 2, 2]
            sel = gl.reshape(gl.permute(sel, [0, 4, 3, 1, 2]), [64, 4, 2, 4])
            kt = gl.reshape(_lookup(sel, kt0, kt1, k5, [64, 4, 2, 4, 4]), [64, 128])
            kt = gl.convert_layout(kt, a_op, assert_trivial=True)
            s = warpgroup_mma(kt, q_smem.permute((1, 0)), gl.zeros([64, 8], gl.float32, layout=mma))

            tvalid = start + ts < hi
            sx = s_st.index(stage)._reinterpret(gl.float16, [2, 64], SCALE_READ_SMEM).load(_staged_scale_layout())
            ksc, vsc = gl.split(gl.permute(sx, [1, 0]))
            ksc = gl.where(tvalid, gl.convert_layout(ksc, tok_l, assert_trivial=True).to(gl.float32), 0.0)
            vsc = gl.where(tvalid, gl.convert_layout(vsc, tok_l, assert_trivial=True).to(gl.float32), 0.0)
            if CENTER:
                if CENTER == 2:
                    gt = gsm.index((start // 64) % 32).load(gl.SliceLayout(1, g3))
                else:
                    gt = gsm.index((start % 1024) // 64).load(gl.SliceLayout(1, g3))
                gt = gl.reshape(gl.expand_dims(gt, 1) + gl.zeros([4, 16, 8], gl.float32, layout=g3), [64, 8])
                s = s * ksc[:, None] * q_unscale[None, :] + gl.convert_layout(gt, mma, assert_trivial=True)
            else:
                s = s * ksc[:, None] * q_unscale[None, :]
            s = gl.where(tvalid[:, None], s, float("-inf"))
            mx_smem.index(stage).store(gl.max(gl.reshape(s, [4, 16, 8]), axis=1))
            gl.thread_barrier()
            m_tile = gl.convert_layout(gl.max(mx_smem.index(stage).load(_warp_max_layout()), axis=0), col_l,
                                       assert_trivial=True)
            m_new = gl.maximum(m_i, gl.ceil(m_tile))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            p = gl.exp2(s - m_safe[None, :])
            alpha = gl.exp2(m_i - m_safe)
            l_acc = l_acc * alpha[None, :] + p
            # p * v_scale goes to e4m3 at 2^(P_EXP - e_v), e_v a whole power of two >= every value scale so far: at
            # most 2^P_EXP (< 448), and out of e4m3's subnormals for the probabilities that count; the accumulator
            # follows e_v as it follows the softmax maximum.
            scales = s_st.index(stage)._reinterpret(gl.float16, [2, 64], SCALE_READ_SMEM)
            _ks, vs_all = gl.split(gl.permute(scales.load(_all_scales_layout()), [1, 0]))
            vs_all = gl.convert_layout(vs_all, all_tok.type.layout, assert_trivial=True).to(gl.float32)
            vmax = gl.max(gl.where(start + all_tok < hi, vs_all, 0.0), axis=0)
            e_new = gl.maximum(e_v, gl.where(vmax > 0, gl.ceil(gl.log2(gl.where(vmax > 0, vmax, 1.0))), e_v))
            raised = (gl.max((m_new > m_i).to(gl.int32), axis=0) > 0) | (e_new > e_v)
            if raised:
                acc = acc * (alpha * gl.exp2(e_v - e_new))[None, :]
            m_i = m_new
            e_v = e_new
            # P^T [64 k, 8] in V's token order: k = kb*32 + h*16 + tid*4 + j <- token tid*16 + kb*8 + h*4 + j.
            pv = (p * (vsc * gl.exp2(P_EXP - e_v))[:, None]).to(gl.float8e4nv)
            pv = gl.reshape(gl.permute(gl.reshape(pv, [4, 2, 2, 4, 8]), [1, 2, 0, 3, 4]), [64, 8])
            p_smem.store(gl.permute(pv, [1, 0]))
            fence_async_shared()
            gl.thread_barrier()

            # values: V^T [128, 64 k], thread tid's 16 tokens start + tid * 16 ...: token tid*16 + kb*8 + h*4 + u
            vx = stage_buf.index(2 * stage + 1)._reinterpret(gl.int16, [64, 32], VALUE_READ_SMEM)
            vx = gl.reshape(vx.load(_staged_value_layout()), [4, 2, 2, 4, 32])
            u0, u1, u2, u3 = _split4(gl.reshape(gl.permute(vx, [4, 1, 2, 0, 3]), [32, 2, 2, 4, 2, 2]))
            u0 = gl.convert_layout(u0, vh_l, assert_trivial=True).to(gl.uint16, bitcast=True).to(gl.uint32)
            u1 = gl.convert_layout(u1, vh_l, assert_trivial=True).to(gl.uint16, bitcast=True).to(gl.uint32)
            u2 = gl.convert_layout(u2, vh_l, assert_trivial=True).to(gl.uint16, bitcast=True).to(gl.uint32)
            u3 = gl.convert_layout(u3, vh_l, assert_trivial=True).to(gl.uint16, bitcast=True).to(gl.uint32)
            ua = u0 | (u1 << 16)
            ub = u2 | (u3 << 16)
            y0, sa0, sb0 = _value_selectors(gl.inline_asm_elementwise(PRMT_6420, "=r,r,r", [ua, ub], dtype=gl.uint32,
                                                                      is_pure=True, pack=1))
            y1, sa1, sb1 = _value_selectors(gl.inline_asm_elementwise(PRMT_7531, "=r,r,r", [ua, ub], dtype=gl.uint32,
                                                                      is_pure=True, pack=1))
            ysel = gl.join(y0, y1)  # [32 G, 2 kb, 2 h, 4 tid, 2 s]
            ysel = gl.join(ysel, ysel >> 16)  # [.., 2 s, 2 e]
            vsel = gl.reshape(gl.permute(gl.reshape(ysel, [4, 8, 2, 2, 4, 2, 2]), [5, 0, 6, 1, 2, 3, 4]),
                              [128, 2, 2, 4])
            vsgn = gl.join(gl.join(sa0, sa1), gl.join(sb0, sb1))  # [.., 2 s, 2 e]
            vsgn = gl.reshape(gl.permute(gl.reshape(vsgn, [4, 8, 2, 2, 4, 2, 2]), [5, 0, 6, 1, 2, 3, 4]),
                              [128, 2, 2, 4])
            vt = gl.reshape(_lookup_sign(vsel, vsgn, vt0, vt1, v5, [128, 2, 2, 4, 4]), [128, 64])
            vt = gl.convert_layout(vt, a_op, assert_trivial=True)
            acc = warpgroup_mma(vt, p_smem.permute((1, 0)), acc)
            gl.thread_barrier()  # P^T is rewritten by the next tile
    if PDL:
        _launch_dependents()
    l_i = gl.sum(l_acc, axis=0)
    l_safe = gl.where(l_i > 0, l_i, 1.0)
    o = acc * (gl.exp2(e_v - P_EXP) / l_safe)[None, :]
    lse2 = gl.where(l_i > 0, m_i + gl.log2(l_safe), float("-inf"))
    od = gl.arange(0, 128, layout=gl.SliceLayout(1, mma))
    sp = split.to(gl.int64)
    hq = kvh * GQ + cols
    col_ok = cols < GQ
    gl.store(PART_O + sp * stride_pos + tok * stride_pot + hq[None, :] * stride_poh + od[:, None], o,
             mask=col_ok[None, :] & (od < 128)[:, None])
    gl.store(PART_L + sp * stride_pls + tok * stride_plt + hq, lse2, mask=col_ok)
