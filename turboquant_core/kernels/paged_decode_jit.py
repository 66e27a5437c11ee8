# SPDX-License-Identifier: Apache-2.0
"""Decode attention over paged TurboQuant pages with the dequantized tiles built in tensor-core registers
(Gluon; jit only, launcher: ``ops.paged_decode``).

The Triton kernel (``paged_attention_jit``) dequantizes a tile into a blocked register layout, and Triton
then moves it into the MMA operand layout through shared memory, one 16-bit store per value: that round
trip, not the bytes read, bounds it. Here the packed words are loaded straight into the threads whose MMA
operand fragments their fields fill, so a tile goes from global memory to ``mma.sync`` without shared
memory. The coordinate order is chosen to make that possible: rotated coordinates may be permuted freely
as long as the query and the output rotations are permuted alike (``ops.paged_decode`` builds those rows).

One warp serves one (request, KV head, KV split) and all query heads of its GQA group (rows of a 16-row
MMA tile). Per tile of BN tokens (m16n8k16, fp16 operands, fp32 accumulators):
- scores S[16, BN] = Q'[16, DP] . K^T[DP, BN], K^T the B operand: word (token t, group g) of a b-bit
  component holds 8 fields; field j of group g = GR*gl + gr (gl < 4 from lane bits, gr < GR = GP/4 from
  registers) sits at K position  j0 + 2*gl + 8*j1 + 16*j2 + 32*gr  (j = j0 + 2*j1 + 4*j2);
- O[16, DP] += P[16, BN] . V[BN, DP], P kept in registers (the accumulator layout of S is the A-operand
  layout of P), V the B operand: field j of group g = GRV*gl + gr (gl < 8, gr < GRV = GP/8) sits at
  V position  gl + 8*j0 + 16*j1 + 32*j2 + 64*gr.
Q' (queries rotated into K order and pre-scaled) comes from ``tq_rotate_queries_kernel``; the partial
outputs stay in V order for ``tq_merge_unrotate_kernel``, which merges splits and rotates back.
"""

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from .codebook_lookup_jit import PERMUTE_LOOKUP4_ASM_8, PERMUTE_LOOKUP4_ASM_16
from .codec_jit import _rotate_rows, _unrotate_rows
from .key_centering_jit import _center_query_operands

ASM_16 = gl.constexpr(PERMUTE_LOOKUP4_ASM_16.value)
ASM_8 = gl.constexpr(PERMUTE_LOOKUP4_ASM_8.value)


@gluon.jit
def _nibbles(word, B: gl.constexpr):
    """Words of 8 b-bit fields -> the fields one per nibble (``codebook_lookup_jit._nibble_fields``)."""
    if B == 4:
        return word
    elif B == 3:
        x = (word & 0xFFF) | ((word & 0xFFF000) << 4)
        x = (x & 0x003F003F) | ((x & 0x0FC00FC0) << 2)
        return (x & 0x07070707) | ((x & 0x38383838) << 1)
    else:
        x = (word & 0xFF) | ((word & 0xFF00) << 8)
        x = (x & 0x000F000F) | ((x & 0x00F000F0) << 4)
        return (x & 0x03030303) | ((x & 0x0C0C0C0C) << 2)


@gluon.jit
def _lookup4(sel, c0, c1, c2, c3, c4, c5, c6, c7, B: gl.constexpr):
    """fp16 codebook values of nibbles 0-3 of ``sel`` (``codebook_lookup_jit._permute_lookup4``)."""
    if B == 4:
        a, b, c, d = gl.inline_asm_elementwise(
            ASM_16, "=h,=h,=h,=h,r,r,r,r,r,r,r,r,r", [sel, c0, c1, c2, c3, c4, c5, c6, c7],
            dtype=(gl.int16, gl.int16, gl.int16, gl.int16), is_pure=True, pack=1)
    else:
        a, b, c, d = gl.inline_asm_elementwise(
            ASM_8, "=h,=h,=h,=h,r,r,r,r,r", [sel, c0, c1, c4, c5],
            dtype=(gl.int16, gl.int16, gl.int16, gl.int16), is_pure=True, pack=1)
    return (a.to(gl.float16, bitcast=True), b.to(gl.float16, bitcast=True), c.to(gl.float16, bitcast=True),
            d.to(gl.float16, bitcast=True))


@gluon.jit
def _fields(word, c0, c1, c2, c3, c4, c5, c6, c7, B: gl.constexpr):
    """Words -> the codebook values of their 8 fields, joined as three trailing dims (j0, j1, j2)."""
    x = _nibbles(word, B)
    f0, f1, f2, f3 = _lookup4(x, c0, c1, c2, c3, c4, c5, c6, c7, B)
    f4, f5, f6, f7 = _lookup4(x >> 16, c0, c1, c2, c3, c4, c5, c6, c7, B)
    return gl.join(gl.join(gl.join(f0, f1), gl.join(f2, f3)), gl.join(gl.join(f4, f5), gl.join(f6, f7)))


@gluon.jit
def _load_words(CACHE, row, PLANE: gl.constexpr, gofs, B: gl.constexpr):
    """uint32 words from planar8 bytes: byte k of (row, group) at CACHE + row + k*PLANE + group offset."""
    ptr = CACHE + row + gofs
    word = gl.load(ptr).to(gl.uint32)
    for k in gl.static_range(1, B):
        word = word | (gl.load(ptr + k * PLANE).to(gl.uint32) << (8 * k))
    return word


@gluon.constexpr_function
def key_word_layout(dp, bn):
    """The K word tile's register layout [BN, 4, DP/32] for one warp, such that its dequantized fields form the
    MMA B operand with no data movement (module docstring): lanes 0-1 -> gl, lanes 2-4 -> token bits 0-2;
    registers -> gr bits, then token bits 3.. . A thread's groups come first among its registers: their bytes
    are contiguous, one vector load per plane. (Built at compile time from ints, so launches pass no layout
    object: Triton's compile hooks serialize every constexpr argument as JSON.)"""
    gr = dp // 32
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1 << i] for i in range(gr.bit_length() - 1)]
        + [[8 << i, 0, 0] for i in range(bn.bit_length() - 4)],
        lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[], block_bases=[], shape=[bn, 4, gr])


@gluon.constexpr_function
def value_word_layout(dp, bn):
    """The V word tile's register layout [BN, 8, DP/64]: lanes 0-1 -> token bits 1-2, lanes 2-4 -> gl;
    registers -> gr bits, token bit 0, then token bits 3.. ."""
    grv = dp // 64
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1 << i] for i in range(grv.bit_length() - 1)] + [[1, 0, 0]]
        + [[8 << i, 0, 0] for i in range(bn.bit_length() - 4)],
        lane_bases=[[2, 0, 0], [4, 0, 0], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
        warp_bases=[], block_bases=[], shape=[bn, 8, grv])


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
    K_ROW: gl.constexpr, V_ROW: gl.constexpr, CENTER: gl.constexpr, GQP: gl.constexpr,
):
    """Grid (requests, KV heads, splits), one warp each; one query per request (decode). Writes the split's
    normalized output in V order to PART_O[split, token, head, :DP] and its log2-sum-exp to PART_L.

    ``CENTER`` (keys stored with key centering, ``key_centering_jit``): a tile lies in one page p (BN
    divides the page size), whose tokens' scores get q . c_p = row scale * (w . PC[p] + z . PS[p]); w, z
    and the row scales come from ``tq_center_queries_kernel`` (CWZ [T, Hq, 2, DP] fp16, CSCALE [T, Hq]),
    GQP = GQ padded to a power of two. The GQP values go to the score rows through shared memory."""
    GR: gl.constexpr = DP // 32
    GRV: gl.constexpr = DP // 64
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    kw_l: gl.constexpr = key_word_layout(DP, BN)
    vw_l: gl.constexpr = value_word_layout(DP, BN)
    gl.static_assert(PAGE % BN == 0, "a tile lies in one page")
    kt_l: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, kw_l))
    vt_l: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, vw_l))
    st_l: gl.constexpr = gl.SliceLayout(0, mma)
    row_l: gl.constexpr = gl.SliceLayout(1, mma)

    req = gl.program_id(0)
    kvh = gl.program_id(1)
    split = gl.program_id(2)
    tok = gl.load(QUERY_START + req).to(gl.int64)
    kv_len = gl.load(SEQ_LENS + req)
    per_split = (kv_len + num_splits - 1) // num_splits
    chunk = (per_split + BN - 1) // BN * BN
    lo = split * chunk
    hi = gl.minimum(kv_len, lo + chunk)

    # Q' rows: query head kvh*GQ + r for r < GQ; other rows are zero.
    qr = gl.arange(0, 16, layout=gl.SliceLayout(1, a_op))
    qi = gl.arange(0, DP, layout=gl.SliceLayout(0, a_op))
    qmask = (qr < GQ)[:, None] & (qi < DP)[None, :]
    q = gl.load(QROT + tok * stride_qt + (kvh * GQ + qr)[:, None] * stride_qh + qi[None, :], mask=qmask, other=0.0)

    # Group offsets within a plane, per layout.
    kgl = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, kw_l)))
    kgr = gl.arange(0, GR, layout=gl.SliceLayout(0, gl.SliceLayout(1, kw_l)))
    kgofs = (kgl * GR)[None, :, None] + kgr[None, None, :]
    vgl = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, vw_l)))
    vgr = gl.arange(0, GRV, layout=gl.SliceLayout(0, gl.SliceLayout(1, vw_l)))
    vgofs = (vgl * GRV)[None, :, None] + vgr[None, None, :]

    rows = gl.arange(0, 16, layout=row_l)
    row_ok = rows < GQ
    m_i = gl.full([16], float("-inf"), gl.float32, layout=row_l)
    l_i = gl.zeros([16], gl.float32, layout=row_l)
    acc = gl.zeros([16, DP], gl.float32, layout=mma)
    head_off = kvh.to(gl.int64) * stride_ch
    bt_row = BLOCK_TABLE + req.to(gl.int64) * stride_bt
    if CENTER:
        cw_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, DP // 32], threads_per_warp=[1, 32],
                                              warps_per_cta=[1, 1], order=[1, 0])
        cr = gl.arange(0, GQP, layout=gl.SliceLayout(1, cw_l))
        ci = gl.arange(0, DP, layout=gl.SliceLayout(0, cw_l))
        cmask = (cr < GQ)[:, None] & (ci < DP)[None, :]
        cptr = CWZ + tok * stride_ct + (kvh * GQ + cr)[:, None] * stride_ch2 + ci[None, :]
        cw = gl.load(cptr, mask=cmask, other=0.0)
        cz = gl.load(cptr + DP, mask=cmask, other=0.0)
        cscale = gl.load(CSCALE + tok * stride_st + kvh * GQ + cr, mask=cr < GQ, other=0.0)
        gsm = gl.allocate_shared_memory(gl.float32, [16], gl.SwizzledSharedLayout(1, 1, 1, [0]),
                                        gl.zeros([16], gl.float32, layout=row_l))
    for start in range(lo, hi, BN):
        # The tile lies in one page (BN divides the page size): one block-table entry, then every global load
        # of the tile (K and V words, scales) from that page's base, so their latencies overlap.
        page = gl.load(bt_row + start // PAGE).to(gl.int64)
        pbase = CACHE + page * stride_cb + head_off
        poff = start % PAGE
        tk = poff + gl.arange(0, BN, layout=kt_l)
        kw = _load_words(pbase + K_IDX_OFF, (tk * K_ROW)[:, None, None], KG, kgofs, KB)
        tv = poff + gl.arange(0, BN, layout=vt_l)
        vw = _load_words(pbase + V_IDX_OFF, (tv * V_ROW)[:, None, None], VG, vgofs, VB)
        ts = gl.arange(0, BN, layout=st_l)
        tmask = start + ts < hi
        sbase = CACHE16 + (page * stride_cb + head_off) // 2 + poff + ts
        k_scale = gl.load(sbase + K_SC_OFF // 2, mask=tmask, other=0.0).to(gl.float32)
        v_scale = gl.load(sbase + V_SC_OFF // 2, mask=tmask, other=0.0).to(gl.float32)
        # keys: words -> K^T tile in B-operand registers -> scores
        kf = _fields(kw, kc0, kc1, kc2, kc3, kc4, kc5, kc6, kc7, KB)  # [BN, 4, GR, 2, 2, 2]
        kt = gl.reshape(gl.permute(kf, [2, 5, 4, 1, 3, 0]), [DP, BN])
        kt = gl.convert_layout(kt, b_op, assert_trivial=True)
        s = mma_v2(q, kt, gl.zeros([16, BN], gl.float32, layout=mma))
        s = s * k_scale[None, :]
        if CENTER:
            pg = gl.minimum(start // PAGE, num_pages - 1).to(gl.int64)
            pc = gl.load(PAGE_COS16 + pg * DP + ci).to(gl.float32)
            pz = gl.load(PAGE_SIN16 + pg * DP + ci).to(gl.float32)
            g = gl.sum(cw.to(gl.float32) * pc[None, :] + cz.to(gl.float32) * pz[None, :], axis=1) * cscale
            gsm.slice(0, GQP).store(g)
            gl.thread_barrier()
            s = s + gsm.load(row_l)[:, None]
            gl.thread_barrier()
        s = gl.where(row_ok[:, None] & tmask[None, :], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - m_safe[:, None])
        alpha = gl.exp2(m_i - m_safe)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        # Rescale the accumulator only in tiles that raise some row's maximum (the first tiles, mostly).
        if gl.max((m_new > m_i).to(gl.int32), axis=0) > 0:
            acc = acc * alpha[:, None]
        m_i = m_new
        # p * v_scale <= 65504 (scales are stored as fp16), so fp16 operands never overflow.
        pv = gl.convert_layout((p * v_scale[None, :]).to(gl.float16), a_op, assert_trivial=True)
        # values: words -> V tile in B-operand registers -> accumulate
        vf = _fields(vw, vc0, vc1, vc2, vc3, vc4, vc5, vc6, vc7, VB)  # [BN, 8, GRV, 2, 2, 2]
        vt = gl.reshape(gl.permute(vf, [0, 2, 5, 4, 3, 1]), [BN, DP])
        vt = gl.convert_layout(vt, b_op, assert_trivial=True)
        acc = mma_v2(pv, vt, acc)

    l_safe = gl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    lse2 = gl.where(l_i > 0, m_i + gl.log2(l_safe), float("-inf"))
    oi = gl.arange(0, DP, layout=gl.SliceLayout(0, mma))
    heads = kvh * GQ + rows
    sp = split.to(gl.int64)
    gl.store(PART_O + sp * stride_pos + tok * stride_pot + heads[:, None] * stride_poh + oi[None, :], o,
             mask=row_ok[:, None] & (oi < DP)[None, :])
    gl.store(PART_L + sp * stride_pls + tok * stride_plt + heads, lse2, mask=row_ok)


@triton.jit(do_not_specialize=["num_rows"])
def tq_rotate_queries_kernel(Q, stride_qt, stride_qh, ROT_HI, ROT_LO, QROT, stride_rt, stride_rh, num_rows, scale,
                             HQ: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, EXACT: tl.constexpr,
                             BR: tl.constexpr):
    """Rows (token, head) of q [T, Hq, D] -> (R q) * scale in the decode kernel's K order, fp16 [T, Hq, DP]."""
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
                             ROT_HALF: tl.constexpr, NEOX: tl.constexpr):
    """Grid (requests, KV heads), one query per request: the key-centering operands of the GQA group's
    queries (``key_centering_jit._center_query_operands``): w = q * mu, z = q * mup (natural order, fp16,
    divided by the row scale) to CWZ[t, head, 0 / 1, :], the row scale to CSCALE[t, head]."""
    req = tl.program_id(0)
    kvh = tl.program_id(1)
    tok = tl.load(QUERY_START + req).to(tl.int64)
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


@triton.jit(do_not_specialize=["num_splits", "num_rows", "stride_pos", "stride_pot", "stride_pls", "stride_lh"])
def tq_merge_unrotate_kernel(
    PART_O, stride_pos, stride_pot, stride_poh, PART_L, stride_pls, stride_plt,
    ROT_HI, ROT_LO, OUT, stride_ot, stride_oh, LSE, stride_lh, num_rows, num_splits, v_rot_scale,
    HQ: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, EXACT: tl.constexpr,
    BR: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    """Rows (token, head): merge the splits' partial outputs (V order) by their log2-sum-exp, then rotate
    back once: out = (y R_V) * v_rot_scale, y scaled to max |y| = 1 first so the fp16 product operands
    stay in range."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = r < num_rows
    t = (r // HQ).to(tl.int64)
    h = r % HQ
    mx = tl.full((BR,), float("-inf"), tl.float32)
    for s in range(0, num_splits):
        mx = tl.maximum(mx, tl.load(PART_L + s * stride_pls + t * stride_plt + h, mask=rmask, other=float("-inf")))
    mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
    i = tl.arange(0, DP)
    y = tl.zeros((BR, DP), tl.float32)
    total = tl.zeros((BR,), tl.float32)
    for s in range(0, num_splits):
        ls = tl.load(PART_L + s * stride_pls + t * stride_plt + h, mask=rmask, other=float("-inf"))
        w = tl.where(ls == float("-inf"), 0.0, tl.exp2(ls - mx_safe))
        po = tl.load(PART_O + s * stride_pos + t[:, None] * stride_pot + h[:, None] * stride_poh + i[None, :],
                     mask=(rmask & (w > 0))[:, None], other=0.0)
        y += po * w[:, None]
        total += w
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
