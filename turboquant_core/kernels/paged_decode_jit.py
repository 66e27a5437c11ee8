# SPDX-License-Identifier: Apache-2.0
"""Decode attention over paged TurboQuant pages with the dequantized tiles built in tensor-core registers
(Gluon; jit only, launcher: ``ops.paged_decode``).

The Triton kernel (``paged_attention_jit``) dequantizes a tile into a blocked register layout, and Triton
then moves it into the MMA operand layout through shared memory, one 16-bit store per value: that round
trip, not the bytes read, bounds it. Here the packed words are loaded straight into the threads whose MMA
operand fragments their fields fill, so a tile goes from global memory to ``mma.sync`` without shared
memory. The coordinate order is chosen to make that possible: rotated coordinates may be permuted freely
as long as the query and the output rotations are permuted alike (``ops.paged_decode`` builds those rows).

One warp serves one (request, KV head, KV split) and all queries of its GQA group: the QL last tokens of the
request (QL = 1 for decode; up to 1 + the draft length when verifying speculative tokens) times the group's
heads, one MMA column per (query token, head). The products are transposed so that MMA rows are tokens and
head dimensions, never empty query rows (a group of 4 would fill 4 of 16): per tile of BN = 16 tokens
(m16n8k16, fp16 operands, fp32 accumulators), NQ = QL x group padded to 8 or 16:
- scores S^T[BN, NQ] = K[BN, DP] . Q'^T[DP, NQ], K the A operand: word (token t, group g) of a b-bit
  component holds 8 fields; field j of group g = GR*gl + gr (gl < 4 from lane bits, gr < GR = DP/32 from
  registers) sits at K position  j0 + 2*gl + 8*j1 + 16*j2 + 32*gr  (j = j0 + 2*j1 + 4*j2);
- O^T[DP, NQ] += V^T[DP, BN] . P^T[BN, NQ], V^T the A operand: field j of group g = GRV*gl + gr (gl < 8,
  gr < GRV = DP/64) sits at V position  gl + 8*j0 + 16*j1 + 32*j2 + 64*gr; P^T, in the accumulator layout of
  S^T, becomes the B operand by one warp transpose per 8x8 block (``movmatrix``).
The planes of a tile's packed words are loaded as one integer per (token, lane, plane) and merged into words
by byte permutes (``plane_transpose_asm``).
Q' (queries rotated into K order and pre-scaled) comes from ``tq_rotate_queries_kernel``; the partial
outputs stay in V order for ``tq_merge_unrotate_kernel``, which merges splits and rotates back.
"""

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .codebook_lookup_jit import PERMUTE_LOOKUP4_ASM_8, PERMUTE_LOOKUP4_ASM_16, _lookup_selectors, _nibble_fields
from .codec_jit import _rotate_rows, _unrotate_rows
from .key_centering_jit import _center_query_operands

ASM_16 = gl.constexpr(PERMUTE_LOOKUP4_ASM_16.value)
ASM_8 = gl.constexpr(PERMUTE_LOOKUP4_ASM_8.value)


@gluon.jit
def _split_range(kv_len, split, num_splits, TILE: gl.constexpr):
    """Tokens [lo, hi) of KV split ``split`` of ``num_splits``: equal shares rounded up to whole tiles, so that only
    the last split ends inside a tile (and later splits of a short context are empty)."""
    per_split = (kv_len + num_splits - 1) // num_splits
    chunk = (per_split + TILE - 1) // TILE * TILE
    lo = split * chunk
    return lo, gl.minimum(kv_len, lo + chunk)


@gluon.jit
def _lookup4(sel, half, c0, c1, c2, c3, c4, c5, c6, c7, B: gl.constexpr, DT: gl.constexpr = gl.float16):
    """fp16 codebook values of nibbles 0-3 of ``sel`` (``codebook_lookup_jit._permute_lookup4``); 4-bit fields
    take ``sel`` as their bits 0-2 and ``half`` as the permute that picks entries 0-7 or 8-15
    (``codebook_lookup_jit._lookup_selectors``). ``DT``: the 16-bit type whose bit patterns the words hold."""
    if B == 4:
        a, b, c, d = gl.inline_asm_elementwise(
            ASM_16, "=h,=h,=h,=h,r,r,r,r,r,r,r,r,r,r", [sel, half, c0, c1, c2, c3, c4, c5, c6, c7],
            dtype=(gl.int16, gl.int16, gl.int16, gl.int16), is_pure=True, pack=1)
    else:
        a, b, c, d = gl.inline_asm_elementwise(
            ASM_8, "=h,=h,=h,=h,r,r,r,r,r", [sel, c0, c1, c4, c5],
            dtype=(gl.int16, gl.int16, gl.int16, gl.int16), is_pure=True, pack=1)
    return a.to(DT, bitcast=True), b.to(DT, bitcast=True), c.to(DT, bitcast=True), d.to(DT, bitcast=True)


@gluon.jit
def _fields(word, c0, c1, c2, c3, c4, c5, c6, c7, B: gl.constexpr):
    """Words -> the codebook values of their 8 fields, joined as three trailing dims (j0, j1, j2)."""
    return _nibble_fields_lookup(_nibble_fields(word, B), c0, c1, c2, c3, c4, c5, c6, c7, B)


@gluon.jit
def _nibble_fields_lookup(nib, c0, c1, c2, c3, c4, c5, c6, c7, B: gl.constexpr, DT: gl.constexpr = gl.float16):
    """``_fields`` of words whose 8 fields are already one per nibble (``codebook_lookup_jit._nibble_fields``)."""
    x, half = _lookup_selectors(nib, B)
    f0, f1, f2, f3 = _lookup4(x, half, c0, c1, c2, c3, c4, c5, c6, c7, B, DT)
    f4, f5, f6, f7 = _lookup4(x >> 16, half >> 16, c0, c1, c2, c3, c4, c5, c6, c7, B, DT)
    return gl.join(gl.join(gl.join(f0, f1), gl.join(f2, f3)), gl.join(gl.join(f4, f5), gl.join(f6, f7)))


@gluon.constexpr_function
def plane_transpose_asm(b, gr):
    """PTX that turns the b byte planes of gr consecutive groups (plane k of groups 0..gr-1 in the low gr bytes
    of input k) into gr words (byte k of word g = plane k of group g), by byte permutes. Bytes a b-bit word does
    not use are left undefined."""
    lines = []
    if b == 2:
        lines = [f"prmt.b32 ${g}, ${gr}, ${gr + 1}, {hex(((4 + g) << 4) | g)};" for g in range(gr)]
    elif b == 3:
        p0, p1, p2 = gr, gr + 1, gr + 2
        lines.append(f"prmt.b32 t0, ${p0}, ${p1}, 0x5140;")
        if gr > 2:
            lines.append(f"prmt.b32 t1, ${p0}, ${p1}, 0x7362;")
        sels = ["0x0410", "0x0532", "0x0610", "0x0732"]
        lines += [f"prmt.b32 ${g}, {'t0' if g < 2 else 't1'}, ${p2}, {sels[g]};" for g in range(gr)]
    else:
        p0, p1, p2, p3 = gr, gr + 1, gr + 2, gr + 3
        lines += [f"prmt.b32 t0, ${p0}, ${p1}, 0x5140;", f"prmt.b32 t1, ${p2}, ${p3}, 0x5140;"]
        if gr > 2:
            lines += [f"prmt.b32 t2, ${p0}, ${p1}, 0x7362;", f"prmt.b32 t3, ${p2}, ${p3}, 0x7362;"]
        sels = ["0x5410", "0x7632"]
        lines += [f"prmt.b32 ${g}, t{2 * (g // 2)}, t{2 * (g // 2) + 1}, {sels[g % 2]};" for g in range(gr)]
    return "{ .reg .b32 t0, t1, t2, t3; " + " ".join(lines) + " }"


@gluon.constexpr_function
def plane_transpose_constraints(b, gr):
    return ",".join(["=r"] * gr + ["r"] * b)


@gluon.constexpr_function
def plane_dtype(gr):
    """The integer type of one plane's bytes of gr consecutive groups (one load per token and plane)."""
    return {1: gl.uint8, 2: gl.uint16, 4: gl.uint32}[gr]


@gluon.jit
def _load_planes(base, row, gofs, PLANE: gl.constexpr, B: gl.constexpr, GR: gl.constexpr):
    """The B byte planes of a tile of packed words, each as one integer of GR bytes per (token, lane group):
    plane k at base + row + k*PLANE + gofs (bytes; gofs a multiple of GR). Unused planes repeat plane 0."""
    ptr = (base + row + gofs).to(gl.pointer_type(plane_dtype(GR)))
    step: gl.constexpr = PLANE // GR
    p0 = gl.load(ptr)
    p1 = gl.load(ptr + step)
    p2 = p0
    p3 = p0
    if B >= 3:
        p2 = gl.load(ptr + 2 * step)
    if B == 4:
        p3 = gl.load(ptr + 3 * step)
    return p0, p1, p2, p3


@gluon.jit
def _transpose_planes(args, B: gl.constexpr, GR: gl.constexpr):
    cons: gl.constexpr = plane_transpose_constraints(B, GR)
    if GR == 1:
        w0 = gl.inline_asm_elementwise(plane_transpose_asm(B, GR), cons, args, dtype=gl.uint32, is_pure=True,
                                       pack=1)
        return gl.expand_dims(w0, len(w0.shape))
    elif GR == 2:
        w0, w1 = gl.inline_asm_elementwise(plane_transpose_asm(B, GR), cons, args, dtype=(gl.uint32, gl.uint32),
                                           is_pure=True, pack=1)
        return gl.join(w0, w1)
    else:
        w0, w1, w2, w3 = gl.inline_asm_elementwise(plane_transpose_asm(B, GR), cons, args,
                                                   dtype=(gl.uint32, gl.uint32, gl.uint32, gl.uint32),
                                                   is_pure=True, pack=1)
        return gl.reshape(gl.join(gl.join(w0, w2), gl.join(w1, w3)), _with_last(w0.shape, 4))


@gluon.constexpr_function
def _with_last(shape, n):
    return list(shape) + [n]


@gluon.jit
def _planes_to_words(p0, p1, p2, p3, B: gl.constexpr, GR: gl.constexpr):
    """Planes [..., L] (``_load_planes``; any leading dims) -> words [..., L, GR]: word g = byte g of every
    plane."""
    if B == 2:
        return _transpose_planes([p0.to(gl.uint32), p1.to(gl.uint32)], B, GR)
    elif B == 3:
        return _transpose_planes([p0.to(gl.uint32), p1.to(gl.uint32), p2.to(gl.uint32)], B, GR)
    else:
        return _transpose_planes([p0.to(gl.uint32), p1.to(gl.uint32), p2.to(gl.uint32), p3.to(gl.uint32)], B, GR)


@gluon.jit
def _load_component(cache_head, scale_head, page, stride_cb, start, hi, tok, ts, gofs, PAGE: gl.constexpr,
                    B: gl.constexpr, G: gl.constexpr, GR: gl.constexpr, IDX_OFF: gl.constexpr, SC_OFF: gl.constexpr,
                    ROW: gl.constexpr):
    """The planes and scales of one component (K or V) of the tile at ``start`` (in ``page``; scales zero at
    positions >= hi)."""
    poff = start % PAGE
    p0, p1, p2, p3 = _load_planes(cache_head + page * stride_cb + IDX_OFF, ((poff + tok) * ROW)[:, None], gofs, G, B,
                                  GR)
    sc = gl.load(scale_head + page * (stride_cb // 2) + poff + ts + SC_OFF // 2, mask=start + ts < hi, other=0.0)
    return p0, p1, p2, p3, sc


@gluon.constexpr_function
def key_word_layout(dp, bn, warps=1):
    """The K word tile's register layout [BN, 4, DP/32] for one warp, such that its dequantized fields form the
    MMA A operand with no data movement (module docstring): lanes 0-1 -> gl, lanes 2-4 -> token bits 0-2;
    registers -> gr bits, then token bits 3.. . A thread's groups are contiguous bytes of each plane: one load
    per plane and token. With ``warps`` > 1, [warps * BN, 4, DP/32]: warp w takes rows w * BN.. (the warpgroup
    MMA's A operand in registers, BN = 16). (Built at compile time from ints, so launches pass no layout
    object: Triton's compile hooks serialize every constexpr argument as JSON.)"""
    gr = dp // 32
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1 << i] for i in range(gr.bit_length() - 1)]
        + [[8 << i, 0, 0] for i in range(bn.bit_length() - 4)],
        lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[bn << i, 0, 0] for i in range(warps.bit_length() - 1)], block_bases=[],
        shape=[bn * warps, 4, gr])


@gluon.constexpr_function
def value_word_layout(dp, bn):
    """The V word tile's register layout [BN, 8, DP/64], whose fields form the A operand V^T: lanes 0-1 ->
    token bits 1-2, lanes 2-4 -> gl; registers -> gr bits, token bit 0, then token bits 3.. ."""
    grv = dp // 64
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1 << i] for i in range(grv.bit_length() - 1)] + [[1, 0, 0]]
        + [[8 << i, 0, 0] for i in range(bn.bit_length() - 4)],
        lane_bases=[[2, 0, 0], [4, 0, 0], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
        warp_bases=[], block_bases=[], shape=[bn, 8, grv])


MOVMATRIX_TRANS = gl.constexpr("movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;")


@gluon.jit
def _online_softmax_tile(s, m_i, l_acc):
    """One tile's online-softmax step over scores S^T [BN, NQ] (log2 domain, -inf where masked), columns the
    queries: (new running maxima, probabilities, the old sums' rescale factors, the per-thread partial sums
    ``l_acc`` updated, whether some column's maximum rose). Running maxima are rounded up to whole numbers:
    rescaling is then by exact powers of two, and a tile's fp16 probabilities (exp2 of s - m, s - m exact near the
    maximum) come out the same whichever split the tile falls in. The split count follows the batch; this keeps a
    sequence's output from following it (beyond fp32 rounding of the sums)."""
    m_new = gl.maximum(m_i, gl.ceil(gl.max(s, axis=0)))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s - m_safe[None, :])
    alpha = gl.exp2(m_i - m_safe)
    raised = gl.max((m_new > m_i).to(gl.int32), axis=0) > 0
    return m_new, p, alpha, l_acc * alpha[None, :] + p, raised


@gluon.jit
def _transpose_8x8(x, NQ: gl.constexpr):
    """An fp16 tile [16, NQ] in the MMA accumulator layout -> the same values as the B operand [16, NQ] of the
    transposed 8x8 blocks' owners: each 8x8 block is transposed across the warp (movmatrix), then the indices
    are renamed so that block (h, t) element (y, x) reads as (x, y)."""
    t = gl.inline_asm_elementwise(MOVMATRIX_TRANS, "=r,r", [x], dtype=gl.float16, is_pure=True, pack=2)
    t = gl.permute(gl.reshape(t, [2, 8, NQ // 8, 8]), [0, 3, 2, 1])
    return gl.reshape(t, [16, NQ])


# Arguments that vary with the batch are not specialized (one compiled variant serves every CUDA-graph size): the
# split count and the log-sum-exp stride (token count x heads), the block table (a row slice of vLLM's table) and
# the request metadata slices, read by scalar loads only.
@gluon.jit(do_not_specialize=["BLOCK_TABLE", "stride_bt", "QUERY_START", "SEQ_LENS", "stride_pos", "stride_pls",
                              "num_splits"])
def tq_paged_decode_kernel(
    QROT, stride_qt, stride_qh,
    CACHE, CACHE16, stride_cb, stride_ch,
    BLOCK_TABLE, stride_bt, QUERY_START, SEQ_LENS,
    kc0, kc1, kc2, kc3, kc4, kc5, kc6, kc7, vc0, vc1, vc2, vc3, vc4, vc5, vc6, vc7,
    PART_O, stride_pos, stride_pot, stride_poh, PART_L, stride_pls, stride_plt,
    num_splits, CWZ, stride_ct, stride_ch2, CSCALE, stride_st, PAGE_COS16, PAGE_SIN16, num_pages,
    DP: gl.constexpr, GQ: gl.constexpr, BN: gl.constexpr, PAGE: gl.constexpr,
    KB: gl.constexpr, VB: gl.constexpr, KG: gl.constexpr, VG: gl.constexpr,
    K_IDX_OFF: gl.constexpr, V_IDX_OFF: gl.constexpr, K_SC_OFF: gl.constexpr, V_SC_OFF: gl.constexpr,
    K_ROW: gl.constexpr, V_ROW: gl.constexpr, CENTER: gl.constexpr, QL: gl.constexpr, PREFETCH: gl.constexpr,
):
    """Grid (requests, KV heads, splits), one warp each. A request's queries are its last q_len <= QL tokens
    (q_len from QUERY_START; causal: query i sees the first kv_len - q_len + 1 + i cached tokens); column
    c = i * GQ + h of the products is query token i, head h. Writes the split's normalized output in V order to
    PART_O[split, token, head, :DP] and its log2-sum-exp to PART_L (-inf for a query that sees no token of the
    split).

    ``CENTER`` (keys stored with key centering, ``key_centering_jit``): a tile lies in one page p (BN
    divides the page size), whose tokens' scores get q . c_p = row scale * (w . PC[p] + z . PS[p]); w, z
    and the row scales come from ``tq_center_queries_kernel`` (CWZ [T, Hq, 2, DP] fp16, CSCALE [T, Hq]).
    These terms are computed CB pages at a time as one small tensor-core product, kept in shared memory and
    read back per tile."""
    GR: gl.constexpr = DP // 32
    GRV: gl.constexpr = DP // 64
    NQ: gl.constexpr = 8 if GQ * QL <= 8 else 16
    gl.static_assert(GQ * QL <= 16, "one MMA column per (query token, head): at most 16")
    gl.static_assert(BN == 16, "one MMA row tile of tokens")
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    kw_l: gl.constexpr = key_word_layout(DP, BN)
    vw_l: gl.constexpr = value_word_layout(DP, BN)
    gl.static_assert(PAGE % BN == 0, "a tile lies in one page")
    tok_l: gl.constexpr = gl.SliceLayout(1, mma)  # per token (S^T rows)
    head_l: gl.constexpr = gl.SliceLayout(0, mma)  # per query head (S^T and O^T columns)

    req = gl.program_id(0)
    kvh = gl.program_id(1)
    split = gl.program_id(2)
    tok32 = gl.load(QUERY_START + req)
    tok = tok32.to(gl.int64)
    kv_len = gl.load(SEQ_LENS + req)
    q_len = 1
    if QL > 1:
        q_len = gl.load(QUERY_START + req + 1) - tok32
    lo, hi = _split_range(kv_len, split, num_splits, BN)

    # Q'^T [DP, NQ]: column c = i * GQ + h = query token tok + i, head kvh*GQ + h (c < GQ * q_len), zero otherwise.
    qd = gl.arange(0, DP, layout=gl.SliceLayout(1, b_op))
    qc = gl.arange(0, NQ, layout=gl.SliceLayout(0, b_op))
    q = gl.load(QROT + (tok + qc // GQ)[None, :] * stride_qt + (kvh * GQ + qc % GQ)[None, :] * stride_qh + qd[:, None],
                mask=(qc < GQ * q_len)[None, :] & (qd < DP)[:, None], other=0.0)

    kp_l: gl.constexpr = gl.SliceLayout(2, kw_l)
    vp_l: gl.constexpr = gl.SliceLayout(2, vw_l)
    kgofs = (gl.arange(0, 4, layout=gl.SliceLayout(0, kp_l)) * GR)[None, :]
    vgofs = (gl.arange(0, 8, layout=gl.SliceLayout(0, vp_l)) * GRV)[None, :]
    ktok = gl.arange(0, BN, layout=gl.SliceLayout(1, kp_l))
    vtok = gl.arange(0, BN, layout=gl.SliceLayout(1, vp_l))
    ts = gl.arange(0, BN, layout=tok_l)

    cols = gl.arange(0, NQ, layout=head_l)
    col_ok = cols < GQ * q_len
    # Causal limit of each column: its query token sees cached positions < lim (0 for empty columns).
    lim = gl.where(col_ok, kv_len - q_len + 1 + cols // GQ, 0)
    m_i = gl.full([NQ], float("-inf"), gl.float32, layout=head_l)
    l_acc = gl.zeros([BN, NQ], gl.float32, layout=mma)  # per-thread partial sums, reduced once at the end
    acc = gl.zeros([DP, NQ], gl.float32, layout=mma)
    head_off = kvh.to(gl.int64) * stride_ch
    bt_row = BLOCK_TABLE + req.to(gl.int64) * stride_bt
    cache_head = CACHE + head_off
    scale_head = CACHE16 + head_off // 2
    if CENTER:
        CB: gl.constexpr = 16
        KC: gl.constexpr = 32
        ar = gl.arange(0, 16, layout=gl.SliceLayout(1, a_op))
        ak = gl.arange(0, KC, layout=gl.SliceLayout(0, a_op))
        bk = gl.arange(0, KC, layout=gl.SliceLayout(1, b_op))
        bp = gl.arange(0, CB, layout=gl.SliceLayout(0, b_op))
        cptr = CWZ + (tok + ar // GQ)[:, None] * stride_ct + (kvh * GQ + ar % GQ)[:, None] * stride_ch2 + ak[None, :]
        cmask = (ar < GQ * q_len)[:, None] & (ak < KC)[None, :]
        crow = gl.arange(0, 16, layout=gl.SliceLayout(1, mma))
        cscale = gl.load(CSCALE + (tok + crow // GQ) * stride_st + kvh * GQ + crow % GQ, mask=crow < GQ * q_len,
                         other=0.0)
        gsm = gl.allocate_shared_memory(gl.float32, [CB, 16], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        gsm_rows = gsm._reinterpret(gl.float32, [CB, 16], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    cur_blk = -1

    last = gl.maximum(kv_len - 1, 0)
    page = gl.load(bt_row + gl.minimum(lo, last) // PAGE).to(gl.int64)
    if PREFETCH:
        # The next tile's keys and values are loaded before the current tile is computed, so a warp has two tiles'
        # loads in flight. An empty split's first load reads page 0 (a row past a request's blocks may hold
        # anything); loads past ``hi`` stay inside the clamped last page, their scales zero.
        page = gl.where(lo < hi, page, 0)
        nk0, nk1, nk2, nk3, nksc = _load_component(cache_head, scale_head, page, stride_cb, lo, hi, ktok, ts,
                                                   kgofs, PAGE, KB, KG, GR, K_IDX_OFF, K_SC_OFF, K_ROW)
        nv0, nv1, nv2, nv3, nvsc = _load_component(cache_head, scale_head, page, stride_cb, lo, hi, vtok, ts,
                                                   vgofs, PAGE, VB, VG, GRV, V_IDX_OFF, V_SC_OFF, V_ROW)
        next_page = gl.load(bt_row + gl.minimum(lo + BN, last) // PAGE).to(gl.int64)
    for start in range(lo, hi, BN):
        if CENTER:
            pg = start // PAGE
            blk = pg // CB
            if blk != cur_blk:
                pages = gl.minimum(blk * CB + bp, num_pages - 1).to(gl.int64)
                g = gl.zeros([16, CB], gl.float32, layout=mma)
                for kc in gl.static_range(0, DP, KC):
                    tab = pages[None, :] * DP + (kc + bk)[:, None]
                    g = mma_v2(gl.load(cptr + kc, mask=cmask, other=0.0), gl.load(PAGE_COS16 + tab), g)
                    g = mma_v2(gl.load(cptr + DP + kc, mask=cmask, other=0.0), gl.load(PAGE_SIN16 + tab), g)
                gl.thread_barrier()
                gsm.store(gl.permute(g * cscale[:, None], [1, 0]))
                gl.thread_barrier()
                cur_blk = blk
        if PREFETCH:
            kq0, kq1, kq2, kq3, ksc = nk0, nk1, nk2, nk3, nksc
            vq0, vq1, vq2, vq3, vsc = nv0, nv1, nv2, nv3, nvsc
            page = next_page
            nk0, nk1, nk2, nk3, nksc = _load_component(cache_head, scale_head, page, stride_cb, start + BN, hi, ktok,
                                                       ts, kgofs, PAGE, KB, KG, GR, K_IDX_OFF, K_SC_OFF, K_ROW)
            nv0, nv1, nv2, nv3, nvsc = _load_component(cache_head, scale_head, page, stride_cb, start + BN, hi, vtok,
                                                       ts, vgofs, PAGE, VB, VG, GRV, V_IDX_OFF, V_SC_OFF, V_ROW)
            next_page = gl.load(bt_row + gl.minimum(start + 2 * BN, last) // PAGE).to(gl.int64)
        else:
            this_page = page
            page = gl.load(bt_row + gl.minimum(start + BN, last) // PAGE).to(gl.int64)
            kq0, kq1, kq2, kq3, ksc = _load_component(cache_head, scale_head, this_page, stride_cb, start, hi, ktok,
                                                      ts, kgofs, PAGE, KB, KG, GR, K_IDX_OFF, K_SC_OFF, K_ROW)
            vq0, vq1, vq2, vq3, vsc = _load_component(cache_head, scale_head, this_page, stride_cb, start, hi, vtok,
                                                      ts, vgofs, PAGE, VB, VG, GRV, V_IDX_OFF, V_SC_OFF, V_ROW)
        kw = gl.convert_layout(_planes_to_words(kq0, kq1, kq2, kq3, KB, GR), kw_l, assert_trivial=True)
        tmask = start + ts < hi

        # keys: words -> K tile in A-operand registers -> scores S^T
        kf = _fields(kw, kc0, kc1, kc2, kc3, kc4, kc5, kc6, kc7, KB)  # [BN, 4, GR, 2, 2, 2]
        kt = gl.reshape(gl.permute(kf, [0, 2, 5, 4, 1, 3]), [BN, DP])
        kt = gl.convert_layout(kt, a_op, assert_trivial=True)
        s = mma_v2(kt, q, gl.zeros([BN, NQ], gl.float32, layout=mma))
        s = s * ksc.to(gl.float32)[:, None]
        if CENTER:
            gt = gsm_rows.index(pg - blk * CB).slice(0, NQ).load(head_l)
            s = s + gt[None, :]
        if QL == 1:
            s = gl.where(tmask[:, None] & col_ok[None, :], s, float("-inf"))
        else:
            s = gl.where(tmask[:, None] & ((start + ts)[:, None] < lim[None, :]), s, float("-inf"))
        m_i, p, alpha, l_acc, raised = _online_softmax_tile(s, m_i, l_acc)
        # Rescale the accumulator only in tiles that raise some head's maximum (the first tiles, mostly).
        if raised:
            acc = acc * alpha[None, :]
        # p * v_scale <= 65504 (scales are stored as fp16), so fp16 operands never overflow.
        pt = _transpose_8x8((p * vsc.to(gl.float32)[:, None]).to(gl.float16), NQ)
        pt = gl.convert_layout(pt, b_op, assert_trivial=True)
        # values: words -> V^T tile in A-operand registers -> accumulate O^T (the values' loads had the keys'
        # work to arrive)
        vw = gl.convert_layout(_planes_to_words(vq0, vq1, vq2, vq3, VB, GRV), vw_l, assert_trivial=True)
        vf = _fields(vw, vc0, vc1, vc2, vc3, vc4, vc5, vc6, vc7, VB)  # [BN, 8, GRV, 2, 2, 2]
        vt = gl.reshape(gl.permute(vf, [2, 5, 4, 3, 1, 0]), [DP, BN])
        vt = gl.convert_layout(vt, a_op, assert_trivial=True)
        acc = mma_v2(vt, pt, acc)

    l_i = gl.sum(l_acc, axis=0)
    l_safe = gl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[None, :]
    lse2 = gl.where(l_i > 0, m_i + gl.log2(l_safe), float("-inf"))
    od = gl.arange(0, DP, layout=gl.SliceLayout(1, mma))
    hq = kvh * GQ + cols % GQ
    qt = tok + cols // GQ
    sp = split.to(gl.int64)
    gl.store(PART_O + sp * stride_pos + qt[None, :] * stride_pot + hq[None, :] * stride_poh + od[:, None], o,
             mask=col_ok[None, :] & (od < DP)[:, None])
    gl.store(PART_L + sp * stride_pls + qt * stride_plt + hq, lse2, mask=col_ok)


@triton.jit(do_not_specialize=["num_rows"])
def tq_rotate_queries_kernel(Q, stride_qt, stride_qh, ROT_HI, ROT_LO, QROT, stride_rt, stride_rh, num_rows, scale,
                             HQ: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, EXACT: tl.constexpr,
                             BR: tl.constexpr, PDL: tl.constexpr = False):
    """Rows (token, head) of q [T, Hq, D] -> (R q) * scale in the decode kernel's K order, fp16 [T, Hq, DP].
    ``PDL``: the attention after it may launch as soon as every program has started (it waits for this grid)."""
    if PDL:
        gdc_launch_dependents()
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = r < num_rows
    t = (r // HQ).to(tl.int64)
    h = r % HQ
    i = tl.arange(0, DP)
    x = tl.load(Q + t[:, None] * stride_qt + h[:, None] * stride_qh + i[None, :],
                mask=rmask[:, None] & (i < D)[None, :], other=0.0).to(tl.float32)
    y = _rotate_rows(x, ROT_HI, ROT_LO, 0, DP, DP, EXACT) * scale
    tl.store(QROT + t[:, None] * stride_rt + h[:, None] * stride_rh + i[None, :], y.to(tl.float16),
             mask=rmask[:, None])


@triton.jit(do_not_specialize=["QUERY_START"])
def tq_center_queries_kernel(Q, stride_qt, stride_qh, QUERY_START, SUMS, stride_sr, stride_sh, CWZ, stride_ct,
                             stride_ch, CSCALE, stride_st, center_scale,
                             GQ: tl.constexpr, GQP: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                             ROT_HALF: tl.constexpr, NEOX: tl.constexpr, QL: tl.constexpr):
    """Grid (requests, KV heads, QL), query token i = program_id(2) of the request (if it has one): the
    key-centering operands of the GQA group's queries (``key_centering_jit._center_query_operands``):
    w = q * mu, z = q * mup (natural order, fp16, divided by the row scale) to CWZ[t, head, 0 / 1, :], the row
    scale to CSCALE[t, head]."""
    req = tl.program_id(0)
    kvh = tl.program_id(1)
    first = tl.load(QUERY_START + req)
    if QL > 1:
        if tl.program_id(2) >= tl.load(QUERY_START + req + 1) - first:
            return
    tok = (first + tl.program_id(2)).to(tl.int64)
    r = tl.arange(0, GQP)
    i = tl.arange(0, D_PAD)
    rmask = r < GQ
    head = kvh * GQ + r
    q = tl.load(Q + tok * stride_qt + head[:, None] * stride_qh + i[None, :],
                mask=rmask[:, None] & (i < D)[None, :], other=0.0).to(tl.float32)
    w, z, row_scale = _center_query_operands(q, SUMS, req.to(tl.int64) * stride_sr + kvh * stride_sh,
                                             center_scale, D_PAD, ROT_HALF, NEOX)
    base = CWZ + tok * stride_ct + head[:, None] * stride_ch + i[None, :]
    tl.store(base, w, mask=rmask[:, None])
    tl.store(base + D_PAD, z, mask=rmask[:, None])
    tl.store(CSCALE + tok * stride_st + head, row_scale, mask=rmask)


@triton.jit(do_not_specialize=["QUERY_START", "SEQ_LENS", "num_pages", "stride_lt", "stride_lh"])
def tq_center_logits_kernel(Q, stride_qt, stride_qh, QUERY_START, SEQ_LENS, SUMS, stride_sr, stride_sh, center_scale,
                            PAGE_COS16, PAGE_SIN16, num_pages, LOGITS, stride_lt, stride_lh,
                            ROT_HI, ROT_LO, QROT, stride_rt, stride_rh, rot_scale,
                            HQ: tl.constexpr, GQ: tl.constexpr, HB: tl.constexpr, D: tl.constexpr,
                            PAGE: tl.constexpr, BG: tl.constexpr, ROT_HALF: tl.constexpr, NEOX: tl.constexpr,
                            ROTATE: tl.constexpr, EXACT: tl.constexpr, PDL: tl.constexpr = False):
    """Grid (requests, head blocks of HB, blocks of BG 16-token groups): the key-centering logits of each request's
    query token (its last; one per request) for the 16-token groups of its sequence,
    LOGITS[t, h // GQ, g, h % GQ] = s * (w . PC[p] + z . PS[p]) with p = g * 16 // PAGE the group's page: w, z and
    the row scale s of head h's query as ``tq_center_queries_kernel`` makes them (``_center_query_operands``, from the
    request's first-page sums), PC / PS the fp16 page tables (``num_pages`` rows, the last reused past its end), for
    g < cdiv(seq_len, 16), as fp16 products with fp32 sums. The last dimension holds 8 columns, of which a KV head's
    GQ are written. A block of BG groups reads its table rows once for HB heads.

    ``ROTATE``: the first group block's programs also write the heads' queries as ``tq_rotate_queries_kernel``
    does, (R q) * rot_scale in fp16 to QROT, so that the decode takes one launch fewer. ``PDL``: the attention after
    it may launch once every program has made its products (it waits for this grid before reading QROT and LOGITS);
    a trigger at the start would let the attention's programs take SMs while programs of this grid still wait for
    one."""
    req = tl.program_id(0)
    tok = tl.load(QUERY_START + req).to(tl.int64)
    h = tl.program_id(1) * HB + tl.arange(0, HB)
    hmask = h < HQ
    i = tl.arange(0, D)
    q = tl.load(Q + tok * stride_qt + h[:, None] * stride_qh + i[None, :], mask=hmask[:, None], other=0.0)
    if ROTATE:
        if tl.program_id(2) == 0:  # (before the return below: a request without tokens still gets its rows)
            qr = _rotate_rows(q.to(tl.float32), ROT_HI, ROT_LO, 0, D, D, EXACT) * rot_scale
            tl.store(QROT + tok * stride_rt + h[:, None] * stride_rh + i[None, :], qr.to(tl.float16),
                     mask=hmask[:, None])
    groups = tl.cdiv(tl.load(SEQ_LENS + req), 16)
    if tl.program_id(2) * BG >= groups:
        return
    g = tl.program_id(2) * BG + tl.arange(0, BG)
    sums_off = req.to(tl.int64) * stride_sr + (tl.minimum(h, HQ - 1) // GQ * stride_sh)[:, None]
    w, z, row_scale = _center_query_operands(q.to(tl.float32), SUMS, sums_off, center_scale, D, ROT_HALF, NEOX)
    row = tl.minimum(g * 16 // PAGE, num_pages - 1).to(tl.int64)[:, None] * D + i[None, :]
    acc = tl.dot(tl.load(PAGE_COS16 + row), tl.trans(w))
    acc = tl.dot(tl.load(PAGE_SIN16 + row), tl.trans(z), acc)
    if PDL:
        gdc_launch_dependents()
    tl.store(LOGITS + tok * stride_lt + (h // GQ * stride_lh + h % GQ)[None, :] + g[:, None] * 8,
             acc * row_scale[None, :], mask=(g < groups)[:, None] & hmask[None, :])


@triton.jit
def _merge_split_chunk(PART_O, stride_pos, stride_pot, stride_poh, PART_L, stride_pls, stride_plt, s0, num_splits,
                       t, h, rmask, mx, y, total, DP: tl.constexpr, SC: tl.constexpr):
    """Splits s0 .. s0 + SC - 1 (those below num_splits) merged into rows (t, h)'s running maximum, weight sum and
    weighted output: their log2-sum-exps in one load, their partial outputs in SC loads that wait for nothing
    (unrolled). A split whose log2-sum-exp is -inf adds nothing, whatever its workspace holds."""
    i = tl.arange(0, DP)
    c = tl.arange(0, SC)
    s = s0 + c
    ls = tl.load(PART_L + s[None, :] * stride_pls + t[:, None] * stride_plt + h[:, None],
                 mask=rmask[:, None] & (s < num_splits)[None, :], other=float("-inf"))  # [BR, SC]
    new = tl.maximum(mx, tl.max(ls, axis=1))
    new_safe = tl.where(new == float("-inf"), 0.0, new)
    alpha = tl.exp2(mx - new_safe)  # 0 while nothing was merged (mx = -inf)
    w = tl.exp2(ls - new_safe[:, None])  # 0 for empty splits
    y = y * alpha[:, None]
    for j in tl.static_range(SC):
        wj = tl.sum(tl.where(c[None, :] == j, w, 0.0), axis=1)
        po = tl.load(PART_O + (s0 + j) * stride_pos + t[:, None] * stride_pot + h[:, None] * stride_poh + i[None, :],
                     mask=(rmask & (s0 + j < num_splits))[:, None], other=0.0)
        y += tl.where((wj > 0)[:, None], po * wj[:, None], 0.0)
    return new, y, total * alpha + tl.sum(w, axis=1)


@triton.jit(do_not_specialize=["num_splits", "num_rows", "stride_pos", "stride_pot", "stride_pls"])
def tq_merge_split_groups_kernel(
    PART_O, stride_pos, stride_pot, stride_poh, PART_L, stride_pls, stride_plt, num_rows, num_splits,
    HQ: tl.constexpr, DP: tl.constexpr, BR: tl.constexpr, SC: tl.constexpr, PDL: tl.constexpr = False,
):
    """The first level of a merge of many splits, grid (row blocks, split groups): splits g SC .. g SC + SC - 1 of
    rows (token, head) merged into split g SC's own workspace (normalized output, log2-sum-exp), which
    ``tq_merge_unrotate_kernel`` then reads at SC times the split stride. A program reads its splits before it
    writes the first of them, and no other program reads them. ``PDL``: launched as a programmatic dependent of
    the attention, whose grid it waits for before reading."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = r < num_rows
    t = (r // HQ).to(tl.int64)
    h = r % HQ
    s0 = tl.program_id(1) * SC
    mx, y, total = _merge_split_chunk(PART_O, stride_pos, stride_pot, stride_poh, PART_L, stride_pls, stride_plt,
                                      s0, num_splits, t, h, rmask, tl.full((BR,), float("-inf"), tl.float32),
                                      tl.zeros((BR, DP), tl.float32), tl.zeros((BR,), tl.float32), DP, SC)
    safe = tl.where(total > 0, total, 1.0)
    lse2 = tl.where(total > 0, tl.where(mx == float("-inf"), 0.0, mx) + tl.log2(safe), float("-inf"))
    i = tl.arange(0, DP)
    tl.store(PART_O + s0 * stride_pos + t[:, None] * stride_pot + h[:, None] * stride_poh + i[None, :],
             y / safe[:, None], mask=rmask[:, None])
    tl.store(PART_L + s0 * stride_pls + t * stride_plt + h, lse2, mask=rmask)


@triton.jit(do_not_specialize=["num_splits", "num_rows", "stride_pos", "stride_pot", "stride_pls", "stride_lh"])
def tq_merge_unrotate_kernel(
    PART_O, stride_pos, stride_pot, stride_poh, PART_L, stride_pls, stride_plt,
    ROT_HI, ROT_LO, OUT, stride_ot, stride_oh, LSE, stride_lh, num_rows, num_splits, v_rot_scale,
    HQ: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, EXACT: tl.constexpr,
    BR: tl.constexpr, SC: tl.constexpr, ONE_SPLIT: tl.constexpr, WRITE_LSE: tl.constexpr, PDL: tl.constexpr = False,
):
    """Rows (token, head): merge the splits' partial outputs (V order) by their log2-sum-exp, then rotate
    back once: out = (y R_V) * v_rot_scale, y scaled to max |y| = 1 first so the fp16 product operands
    stay in range. A split whose log2-sum-exp is -inf adds nothing, whatever its workspace holds.

    The splits come SC at a time: their log2-sum-exps in one load, their partial outputs in SC loads that wait
    for nothing (unrolled), merged into a running maximum; a merge waits on memory once per SC splits, not
    twice per split. ``ONE_SPLIT`` (num_splits == 1): no merge, the partial output rotated back. ``PDL``: launched
    as a programmatic dependent of the kernel before it, whose grid it waits for before reading."""
    if PDL:
        gdc_wait()
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = r < num_rows
    t = (r // HQ).to(tl.int64)
    h = r % HQ
    i = tl.arange(0, DP)
    if ONE_SPLIT:
        mx = tl.load(PART_L + t * stride_plt + h, mask=rmask, other=float("-inf"))
        po = tl.load(PART_O + t[:, None] * stride_pot + h[:, None] * stride_poh + i[None, :], mask=rmask[:, None],
                     other=0.0)
        y = tl.where((mx > float("-inf"))[:, None], po, 0.0)
        total = tl.where(mx > float("-inf"), 1.0, 0.0)
    else:
        mx = tl.full((BR,), float("-inf"), tl.float32)
        y = tl.zeros((BR, DP), tl.float32)
        total = tl.zeros((BR,), tl.float32)
        s0 = 0
        while s0 < num_splits:  # (while: Triton's interpreter takes no runtime bound in range())
            mx, y, total = _merge_split_chunk(PART_O, stride_pos, stride_pot, stride_poh, PART_L, stride_pls,
                                              stride_plt, s0, num_splits, t, h, rmask, mx, y, total, DP, SC)
            s0 += SC
    mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
    y = y / tl.where(total > 0, total, 1.0)[:, None]
    amax = tl.max(tl.abs(y), axis=1)
    inv = tl.where(amax > 0, 1.0 / tl.maximum(amax, 1e-30), 0.0)
    o = _unrotate_rows(y * inv[:, None], ROT_HI, ROT_LO, 0, DP, DP, EXACT) * (amax * v_rot_scale)[:, None]
    tl.store(OUT + t[:, None] * stride_ot + h[:, None] * stride_oh + i[None, :], o.to(OUT.dtype.element_ty),
             mask=rmask[:, None] & (i < D)[None, :])
    if WRITE_LSE:
        lse = tl.where(total > 0, (mx_safe + tl.log2(tl.where(total > 0, total, 1.0))) * 0.6931471805599453,
                       float("-inf"))
        tl.store(LSE + h * stride_lh + t, lse, mask=rmask)
