# SPDX-License-Identifier: Apache-2.0
"""Attention over paged TurboQuant KV pages, computed in the rotated domain (jit only).

One program serves one (query block, KV head, KV split). Its M rows are the query heads of the GQA
group times the queries of the block (row m: query m // GQ_PAD, head m % GQ_PAD), so each compressed
page is read once per group, not once per query head. The group is padded to a power of two (GQ_PAD;
rows with m % GQ_PAD >= GQ are masked): row-to-query maps stay shifts, and Triton 3.6 fails to compile
(or, with the inline-PTX lookups, miscompiles into illegal addresses) a 64-row block of two 32-wide
segments when the group is 3.

Math (TurboQuant identity x_hat = R^T (scale * c[idx])):
- keys:   s = k_scale * <R_K q, c_K[idx]>  (fp8 keys: <R_K q, k_fp8>), R_K q computed once per row;
- values: acc += p * v_scale * c_V[idx] stays in the V-rotated domain; the output is R_V^T acc,
          computed once per program at the end (linear, so split partials can be merged afterwards).

Kernel coordinate order: the tiles of ``codebook_lookup_jit`` (position g*8 + r holds field bitrev3(r) of
packed group g); the rotation rows given to this kernel are permuted to that order (``ops.page_layout``, zero rows
for padded groups), so the rotated query lines up with the tile. fp8 keys use the natural coordinate order.

Tiles are dequantized in registers to fp16 (codebook values < 3, fp8 values < 448: both exact or
within fp16 rounding) and multiplied on tensor cores with fp32 accumulation; softmax runs online in
fp32 in the log2 domain.

Masking: query row at absolute position ``pos`` sees cached token t iff t < seq_len, t <= pos and, with
a sliding window W, t > pos - W. ``CAUSAL``: the block's queries are the last ``nq`` cached tokens
(pos = seq_len - nq + i); otherwise they follow the cached context (pos = seq_len + i).

Split-KV (flash decoding): with ``SPLIT`` each program's key range is cut into ``num_splits`` equal chunks
(grid dim 2) whose normalized partial outputs + log2-sum-exp go to a workspace; ``tq_merge_splits_kernel``
combines them. Batch-dependent ints (``num_reqs``, ``num_splits``, ``window``) are run-time arguments
and not specialized, so CUDA-graph capture at many batch sizes reuses one compiled variant.
"""

import triton
import triton.language as tl

from .codebook_lookup_jit import _codebook_registers, _dequant_words, _load_words
from .codec_jit import _mse_decode_rows, _rotate_rows, _unrotate_rows
from .key_centering_jit import _center_query_operands, _center_vectors, _page_center_logits, _token_page_rows


@triton.jit
def _find_request(QUERY_START, num_reqs, qblock, QPB: tl.constexpr):
    """Request r whose query blocks hold ``qblock``; blocks of r start at QUERY_START[r] // QPB + r."""
    left = 0
    right = num_reqs
    while left < right:
        mid = (left + right) // 2
        val = tl.load(QUERY_START + mid) // QPB + mid
        left = tl.where(val <= qblock, mid + 1, left)
        right = tl.where(val <= qblock, right, mid)
    req = left - 1
    return req, qblock - (tl.load(QUERY_START + req) // QPB + req)


@triton.jit
def _qdot(q, kc):
    """[M, P] fp16 query x [BN, P] fp16 key tile^T -> [M, BN] fp32."""
    return tl.dot(q, tl.trans(kc))


@triton.jit
def _attend_tile(start, hi, m_i, l_i, acc0, acc1, qk0, qk1, pos, row_valid, window,
                 CACHE, CACHE16, bt_row, head_off, stride_cb, KC0, KC1, VC0, VC1,
                 BLOCK_N: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                 K_FP8: tl.constexpr, KG0: tl.constexpr, KGP0: tl.constexpr, KB0: tl.constexpr,
                 KG1: tl.constexpr, KGP1: tl.constexpr, KB1: tl.constexpr,
                 VG0: tl.constexpr, VGP0: tl.constexpr, VB0: tl.constexpr,
                 VG1: tl.constexpr, VGP1: tl.constexpr, VB1: tl.constexpr,
                 K_IDX_OFF: tl.constexpr, V_IDX_OFF: tl.constexpr, K_SC_OFF: tl.constexpr, V_SC_OFF: tl.constexpr,
                 K_ROW: tl.constexpr, V_ROW: tl.constexpr, HAS_WINDOW: tl.constexpr,
                 cw, cz, c_scale, PAGE_COS16, PAGE_SIN16, num_pages, CENTER: tl.constexpr,
                 kcb0, kcb1, vcb0, vcb1):
    """One tile of BLOCK_N cached tokens: every global load first (their latencies overlap), then
    scores, online-softmax update and the rotated-domain V accumulation."""
    t = start + tl.arange(0, BLOCK_N)
    tmask = t < hi
    page = tl.load(bt_row + t // PAGE, mask=tmask, other=0).to(tl.int64)
    off = t % PAGE
    base = page * stride_cb + head_off
    krow = base + K_IDX_OFF + off * K_ROW
    vrow = base + V_IDX_OFF + off * V_ROW
    if K_FP8:
        i = tl.arange(0, D_PAD)
        kb = tl.load(CACHE + krow[:, None] + i[None, :], mask=tmask[:, None] & (i < D)[None, :], other=0)
    else:
        kw0 = _load_words(CACHE, krow, tmask, 0, KG0, KGP0, KB0)
        if KG1 > 0:
            kw1 = _load_words(CACHE, krow, tmask, KB0 * KG0, KG1, KGP1, KB1)
        else:
            kw1 = kw0
        k_scale = tl.load(CACHE16 + base // 2 + K_SC_OFF // 2 + off, mask=tmask, other=0.0)
    vw0 = _load_words(CACHE, vrow, tmask, 0, VG0, VGP0, VB0)
    if VG1 > 0:
        vw1 = _load_words(CACHE, vrow, tmask, VB0 * VG0, VG1, VGP1, VB1)
    else:
        vw1 = vw0
    v_scale = tl.load(CACHE16 + base // 2 + V_SC_OFF // 2 + off, mask=tmask, other=0.0)

    if K_FP8:
        s = _qdot(qk0, kb.to(tl.float8e4nv, bitcast=True).to(tl.float16))
    else:
        s = _qdot(qk0, _dequant_words(kw0, KC0, kcb0, BLOCK_N, KGP0, KB0))
        if KG1 > 0:
            s += _qdot(qk1, _dequant_words(kw1, KC1, kcb1, BLOCK_N, KGP1, KB1))
        s = s * k_scale.to(tl.float32)[None, :]
        if CENTER:
            s += _page_center_logits(cw, cz, c_scale, start, PAGE_COS16, PAGE_SIN16, num_pages,
                                     D_PAD, PAGE, BLOCK_N)
    valid = row_valid[:, None] & tmask[None, :] & (t[None, :] <= pos[:, None])
    if HAS_WINDOW:
        valid = valid & (t[None, :] > pos[:, None] - window)
    s = tl.where(valid, s, float("-inf"))

    # Running maxima are whole numbers (log2 domain, ``paged_decode_jit``): split-count-independent fp16 p.
    m_new = tl.maximum(m_i, tl.ceil(tl.max(s, axis=1)))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)

    # p * v_scale <= 65504 (scales are stored as fp16), so fp16 operands never overflow.
    pv = (p * v_scale.to(tl.float32)[None, :]).to(tl.float16)
    acc0 = acc0 * alpha[:, None] + tl.dot(pv, _dequant_words(vw0, VC0, vcb0, BLOCK_N, VGP0, VB0))
    if VG1 > 0:
        acc1 = acc1 * alpha[:, None] + tl.dot(pv, _dequant_words(vw1, VC1, vcb1, BLOCK_N, VGP1, VB1))
    return m_new, l_i, acc0, acc1


# Arguments that vary with the batch are not specialized (Triton otherwise compiles one variant per
# value class: == 1, divisible by 16, 16-byte aligned pointer or not): counts, the lse / partials
# strides (they follow the token count), the block table (a row slice of vLLM's table: its start
# alignment follows the number of decode requests before it) and its row stride.
@triton.jit(do_not_specialize=["num_reqs", "num_splits", "window", "BLOCK_TABLE", "stride_bt", "QUERY_START",
                               "SEQ_LENS", "stride_lh", "stride_pos", "stride_pot", "stride_pls"])
def tq_paged_attention_kernel(
    Q, stride_qt, stride_qh,
    CACHE, CACHE16, stride_cb, stride_ch,
    BLOCK_TABLE, stride_bt, QUERY_START, SEQ_LENS,
    KROT_HI, KROT_LO, KC0, KC1, VROT_HI, VROT_LO, VC0, VC1,
    OUT, stride_ot, stride_oh, LSE, stride_lh,
    PART_O, stride_pos, stride_pot, stride_poh, PART_L, stride_pls, stride_plt,
    num_reqs, num_splits, qk_scale, v_rot_scale, window,
    SUMS, stride_sr, stride_sh, PAGE_COS16, PAGE_SIN16, num_pages, center_scale,
    D: tl.constexpr, D_PAD: tl.constexpr, GQ: tl.constexpr, GQ_PAD: tl.constexpr, QPB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    K_FP8: tl.constexpr, KG0: tl.constexpr, KGP0: tl.constexpr, KB0: tl.constexpr,
    KG1: tl.constexpr, KGP1: tl.constexpr, KB1: tl.constexpr, K_EXACT: tl.constexpr,
    VG0: tl.constexpr, VGP0: tl.constexpr, VB0: tl.constexpr,
    VG1: tl.constexpr, VGP1: tl.constexpr, VB1: tl.constexpr, V_EXACT: tl.constexpr,
    K_IDX_OFF: tl.constexpr, V_IDX_OFF: tl.constexpr, K_SC_OFF: tl.constexpr, V_SC_OFF: tl.constexpr,
    K_ROW: tl.constexpr, V_ROW: tl.constexpr,
    SPLIT: tl.constexpr, ONE_QBLOCK: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    WRITE_LSE: tl.constexpr, WHILE_LOOP: tl.constexpr, CENTER: tl.constexpr, ROT_HALF: tl.constexpr,
    NEOX: tl.constexpr,
):
    """Grid (query blocks, Hkv, num_splits). ``qk_scale`` = softmax_scale * log2(e) * rot_scale(K).

    KROT_*/VROT_* hold the rotation rows in kernel order (8*KGP0 [+ 8*KGP1] rows of D_PAD; fp8 keys:
    D_PAD rows in natural order); KC*/VC* the fp16 codebooks of each segment.

    ``CENTER`` (MSE keys): keys past the first page were stored minus their page's centre
    (``key_centering_jit``); the tile adds q . c_page to their scores, ``center_scale`` =
    softmax_scale * log2(e). SUMS is indexed by this launch's request index."""
    qblock = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if ONE_QBLOCK:
        req = qblock
        qblk = 0
    else:
        req, qblk = _find_request(QUERY_START, num_reqs, qblock, QPB)
    q_start = tl.load(QUERY_START + req)
    nq = tl.load(QUERY_START + req + 1) - q_start
    kv_len = tl.load(SEQ_LENS + req)
    q_first = qblk * QPB
    n_rows_q = tl.minimum(nq - q_first, QPB)  # <= 0: nothing to do (padding block)

    m = tl.arange(0, BLOCK_M)
    qi = m // GQ_PAD  # BLOCK_M == QPB * GQ_PAD
    r = m % GQ_PAD
    row_valid = (qi < n_rows_q) & (r < GQ)
    tok = (q_start + q_first + qi).to(tl.int64)
    head = kvh * GQ + r
    if CAUSAL:
        pos0 = kv_len - nq + q_first
    else:
        pos0 = kv_len + q_first
    pos = pos0 + qi

    # Key range of this program: [lo, hi), then this split's chunk of it.
    hi = tl.minimum(kv_len, pos0 + n_rows_q)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(pos0 - window + 1, 0)
    lo = (lo // BLOCK_N) * BLOCK_N
    hi = tl.where(n_rows_q > 0, hi, lo)
    if SPLIT:
        length = tl.maximum(hi - lo, 0)
        # (tl.cdiv on scalars gives a 1-element block in the interpreter; plain integer math does not)
        per_split = (length + num_splits - 1) // num_splits
        chunk = (per_split + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        lo = lo + split * chunk
        hi = tl.minimum(hi, lo + chunk)

    # Rotated, pre-scaled queries in kernel order, as fp16 tensor-core operands: fp16 keeps 3 more
    # mantissa bits than the bf16 query they come from, far below the keys' quantization error.
    i = tl.arange(0, D_PAD)
    q = tl.load(Q + tok[:, None] * stride_qt + head[:, None] * stride_qh + i[None, :],
                mask=row_valid[:, None] & (i < D)[None, :], other=0.0).to(tl.float32)
    if K_FP8:
        qk0 = (_rotate_rows(q, KROT_HI, KROT_LO, 0, D_PAD, D_PAD, K_EXACT) * qk_scale).to(tl.float16)
    else:
        qk0 = (_rotate_rows(q, KROT_HI, KROT_LO, 0, 8 * KGP0, D_PAD, K_EXACT) * qk_scale).to(tl.float16)
    if KG1 > 0:
        qk1 = (_rotate_rows(q, KROT_HI, KROT_LO, 8 * KGP0, 8 * KGP1, D_PAD, K_EXACT) * qk_scale).to(tl.float16)
    else:
        qk1 = qk0

    if CENTER:
        cw, cz, c_scale = _center_query_operands(q, SUMS, req.to(tl.int64) * stride_sr + kvh * stride_sh,
                                                 center_scale, D_PAD, ROT_HALF, NEOX)
    else:
        cw = qk0
        cz = qk0
        c_scale = row_valid

    # Register codebooks for the byte-permute lookups (``_permute_lookup4``), once per program.
    kcb0 = 0
    kcb1 = 0
    vcb1 = 0
    if not K_FP8:
        kcb0 = _codebook_registers(KC0, KB0)
        if KG1 > 0:
            kcb1 = _codebook_registers(KC1, KB1)
    vcb0 = _codebook_registers(VC0, VB0)
    if VG1 > 0:
        vcb1 = _codebook_registers(VC1, VB1)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc0 = tl.zeros((BLOCK_M, 8 * VGP0), tl.float32)
    if VG1 > 0:
        acc1 = tl.zeros((BLOCK_M, 8 * VGP1), tl.float32)
    else:
        acc1 = acc0
    head_off = kvh.to(tl.int64) * stride_ch
    bt_row = BLOCK_TABLE + req.to(tl.int64) * stride_bt

    if WHILE_LOOP:
        # The interpreter cannot take run-time bounds in range() (its scalars are 1-element arrays).
        start = lo
        while start < hi:
            m_i, l_i, acc0, acc1 = _attend_tile(
                start, hi, m_i, l_i, acc0, acc1, qk0, qk1, pos, row_valid, window,
                CACHE, CACHE16, bt_row, head_off, stride_cb, KC0, KC1, VC0, VC1,
                BLOCK_N, PAGE, D, D_PAD,
                K_FP8, KG0, KGP0, KB0, KG1, KGP1, KB1, VG0, VGP0, VB0, VG1, VGP1, VB1,
                K_IDX_OFF, V_IDX_OFF, K_SC_OFF, V_SC_OFF, K_ROW, V_ROW, HAS_WINDOW,
                cw, cz, c_scale, PAGE_COS16, PAGE_SIN16, num_pages, CENTER,
                kcb0, kcb1, vcb0, vcb1)
            start += BLOCK_N
    else:
        for start in range(lo, hi, BLOCK_N):
            m_i, l_i, acc0, acc1 = _attend_tile(
                start, hi, m_i, l_i, acc0, acc1, qk0, qk1, pos, row_valid, window,
                CACHE, CACHE16, bt_row, head_off, stride_cb, KC0, KC1, VC0, VC1,
                BLOCK_N, PAGE, D, D_PAD,
                K_FP8, KG0, KGP0, KB0, KG1, KGP1, KB1, VG0, VGP0, VB0, VG1, VGP1, VB1,
                K_IDX_OFF, V_IDX_OFF, K_SC_OFF, V_SC_OFF, K_ROW, V_ROW, HAS_WINDOW,
                cw, cz, c_scale, PAGE_COS16, PAGE_SIN16, num_pages, CENTER,
                kcb0, kcb1, vcb0, vcb1)

    # Normalize, then inverse V rotation once. Rows are scaled to max |y| = 1 first so the fp16
    # hi/lo operands of the rotation product stay in range whatever the value norms.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    y0 = acc0 / l_safe[:, None]
    amax = tl.max(tl.abs(y0), axis=1)
    if VG1 > 0:
        y1 = acc1 / l_safe[:, None]
        amax = tl.maximum(amax, tl.max(tl.abs(y1), axis=1))
    inv = tl.where(amax > 0, 1.0 / tl.maximum(amax, 1e-30), 0.0)
    o = _unrotate_rows(y0 * inv[:, None], VROT_HI, VROT_LO, 0, 8 * VGP0, D_PAD, V_EXACT)
    if VG1 > 0:
        o += _unrotate_rows(y1 * inv[:, None], VROT_HI, VROT_LO, 8 * VGP0, 8 * VGP1, D_PAD, V_EXACT)
    o = o * (amax * v_rot_scale)[:, None]
    lse2 = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))

    omask = row_valid[:, None] & (i < D)[None, :]
    if not SPLIT:
        tl.store(OUT + tok[:, None] * stride_ot + head[:, None] * stride_oh + i[None, :],
                 o.to(OUT.dtype.element_ty), mask=omask)
        if WRITE_LSE:
            tl.store(LSE + head * stride_lh + tok, lse2 * 0.6931471805599453, mask=row_valid)
    else:
        sp = split.to(tl.int64)
        tl.store(PART_O + sp * stride_pos + tok[:, None] * stride_pot + head[:, None] * stride_poh + i[None, :],
                 o, mask=omask)
        tl.store(PART_L + sp * stride_pls + tok * stride_plt + head, lse2, mask=row_valid)


@triton.jit(do_not_specialize=["num_splits", "stride_pos", "stride_pot", "stride_pls", "stride_lh"])
def tq_merge_splits_kernel(
    PART_O, stride_pos, stride_pot, stride_poh, PART_L, stride_pls, stride_plt,
    OUT, stride_ot, stride_oh, LSE, stride_lh, num_splits,
    S_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    """Flash-decoding reduction. Grid (Tq, Hq): partial outputs [S, Tq, Hq, D] + log2-sum-exp [S, Tq, Hq]."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    smask = s < num_splits
    lse2 = tl.load(PART_L + s * stride_pls + tok * stride_plt + head, mask=smask, other=float("-inf"))
    mx = tl.max(lse2, axis=0)
    mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.exp2(lse2 - mx_safe)
    w = tl.where(smask, w, 0.0)
    total = tl.sum(w, axis=0)
    i = tl.arange(0, D_PAD)
    po = tl.load(PART_O + s[:, None].to(tl.int64) * stride_pos + tok * stride_pot + head * stride_poh + i[None, :],
                 mask=(smask & (w > 0))[:, None] & (i < D)[None, :], other=0.0)
    o = tl.sum(po * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(OUT + tok * stride_ot + head * stride_oh + i, o.to(OUT.dtype.element_ty), mask=i < D)
    if WRITE_LSE:
        lse = tl.where(total > 0, (mx_safe + tl.log2(tl.where(total > 0, total, 1.0))) * 0.6931471805599453,
                       float("-inf"))
        tl.store(LSE + head * stride_lh + tok, lse)


@triton.jit(do_not_specialize=["BLOCK_TABLE", "stride_bt", "SEQ_LENS", "CU_KV"])
def tq_paged_gather_dequant_kernel(
    CACHE, CACHE16, stride_cb, stride_ch,
    BLOCK_TABLE, stride_bt, SEQ_LENS, CU_KV,
    KROT_HI, KROT_LO, KCENT0, KCENT1, VROT_HI, VROT_LO, VCENT0, VCENT1,
    OUT_K, stride_okt, stride_okh, OUT_V, stride_ovt, stride_ovh,
    k_rot_scale, v_rot_scale, SUMS, stride_sr, stride_sh, PAGE_COS, PAGE_SIN, num_pages,
    D: tl.constexpr, D_PAD: tl.constexpr, PAGE: tl.constexpr,
    K_FP8: tl.constexpr, KG0: tl.constexpr, KGP0: tl.constexpr, KB0: tl.constexpr,
    KG1: tl.constexpr, KGP1: tl.constexpr, KB1: tl.constexpr, K_EXACT: tl.constexpr,
    VG0: tl.constexpr, VGP0: tl.constexpr, VB0: tl.constexpr,
    VG1: tl.constexpr, VGP1: tl.constexpr, VB1: tl.constexpr, V_EXACT: tl.constexpr,
    K_IDX_OFF: tl.constexpr, V_IDX_OFF: tl.constexpr, K_SC_OFF: tl.constexpr, V_SC_OFF: tl.constexpr,
    K_ROW: tl.constexpr, V_ROW: tl.constexpr, BN: tl.constexpr,
    CENTER: tl.constexpr, ROT_HALF: tl.constexpr, NEOX: tl.constexpr,
    K_PERMUTE: tl.constexpr, V_PERMUTE: tl.constexpr,
):
    """Cached tokens of request r -> dense K/V rows CU_KV[r] + t. Grid (R, cdiv(max_seq_len, BN), Hkv).
    ``CENTER``: keys get their page's centre back (``key_centering_jit``). ``K_PERMUTE``/``V_PERMUTE``: that
    component's codebook values by byte permutes, its rotation rows (KROT_*/VROT_*) in kernel order
    (``_mse_decode_rows``)."""
    req = tl.program_id(0)
    t = tl.program_id(1) * BN + tl.arange(0, BN)
    kvh = tl.program_id(2)
    kv_len = tl.load(SEQ_LENS + req)
    tmask = t < kv_len
    page = tl.load(BLOCK_TABLE + req.to(tl.int64) * stride_bt + t // PAGE, mask=tmask, other=0).to(tl.int64)
    off = t % PAGE
    base = page * stride_cb + kvh.to(tl.int64) * stride_ch
    row = (tl.load(CU_KV + req) + t).to(tl.int64)
    i = tl.arange(0, D_PAD)
    omask = tmask[:, None] & (i < D)[None, :]

    krow = base + K_IDX_OFF + off * K_ROW
    if K_FP8:
        p = tl.arange(0, 8 * KGP0)
        coord = (p // KGP0) * KG0 + p % KGP0
        kb = tl.load(CACHE + krow[:, None] + coord[None, :],
                     mask=tmask[:, None] & ((p % KGP0) < KG0)[None, :], other=0)
        y = kb.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        amax = tl.max(tl.abs(y), axis=1)
        inv = tl.where(amax > 0, 1.0 / tl.maximum(amax, 1e-30), 0.0)
        k = _unrotate_rows(y * inv[:, None], KROT_HI, KROT_LO, 0, 8 * KGP0, D_PAD, K_EXACT)
        k = k * (amax * k_rot_scale)[:, None]
    else:
        k_scale = tl.load(CACHE16 + base // 2 + K_SC_OFF // 2 + off, mask=tmask, other=0.0).to(tl.float32)
        k = _mse_decode_rows(CACHE, krow, tmask, KROT_HI, KROT_LO, KCENT0, KCENT1, D_PAD, KG0, KGP0, KB0,
                             KG1, KGP1, KB1, K_EXACT, BN, False, K_PERMUTE) * (k_scale * k_rot_scale)[:, None]
        if CENTER:
            mu, mup = _center_vectors(SUMS, req.to(tl.int64) * stride_sr + kvh * stride_sh, D_PAD, ROT_HALF, NEOX)
            pc, ps = _token_page_rows(t, tmask, PAGE_COS, PAGE_SIN, num_pages, D_PAD, PAGE)
            k += mu[None, :] * pc + mup[None, :] * ps
    tl.store(OUT_K + row[:, None] * stride_okt + kvh * stride_okh + i[None, :], k.to(OUT_K.dtype.element_ty),
             mask=omask)

    vrow = base + V_IDX_OFF + off * V_ROW
    v_scale = tl.load(CACHE16 + base // 2 + V_SC_OFF // 2 + off, mask=tmask, other=0.0).to(tl.float32)
    v = _mse_decode_rows(CACHE, vrow, tmask, VROT_HI, VROT_LO, VCENT0, VCENT1, D_PAD, VG0, VGP0, VB0,
                         VG1, VGP1, VB1, V_EXACT, BN, False, V_PERMUTE) * (v_scale * v_rot_scale)[:, None]
    tl.store(OUT_V + row[:, None] * stride_ovt + kvh * stride_ovh + i[None, :], v.to(OUT_V.dtype.element_ty),
             mask=omask)
