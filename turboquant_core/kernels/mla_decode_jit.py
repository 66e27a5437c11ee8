# SPDX-License-Identifier: Apache-2.0
"""MLA decode attention with the absorbed query over paged TurboQuant MLA pages, split-KV (jit only; launcher
``ops.mla.mla_decode_attention``, reference ``ops.mla_reference.mla_decode_attention_ref``).

One program serves one (request, block of BLOCK_H heads, KV split): every head of the block reads each page tile
once. Per tile of BLOCK_N cached tokens, in the rotated domain (``ops.mla_reference``'s identity):
- the latent's packed words are looked up into codebook values C [BLOCK_N, L_PAD] in kernel order
  (``codebook_lookup_jit``; fp8 latents: the e4m3 bytes, natural order), the same tile serving the scores and the
  output, as the latent is both key and value;
- scores S [BLOCK_H, BLOCK_N] = (Q' . C^T) * a_j + Q_pe . k_pe^T, with Q' the absorbed queries rotated into kernel
  order and Q_pe the rope queries, both pre-scaled by softmax_scale * log2(e) (the launcher's work, once per
  head), a_j the tokens' fp16 scales (applied once per score column, never per element);
- online softmax in base 2; the output accumulates (p_j a_j) C, still rotated. The partial outputs go to
  PART_O in kernel order with their log2-sum-exp; ``paged_attention_jit.tq_merge_splits_kernel`` merges the
  splits and the launcher rotates the merged output back, once per head.
"""

import triton
import triton.language as tl

from .codebook_lookup_jit import _codebook_registers, _dequant_words, _load_words


@triton.jit
def _mla_load(start, hi, CACHE, CACHE16, CACHE_BF16, bt_row, stride_cb, L: tl.constexpr, L_PAD: tl.constexpr,
              R: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, LATENT_FP8: tl.constexpr, G0: tl.constexpr,
              GP0: tl.constexpr, B0: tl.constexpr, G1: tl.constexpr, GP1: tl.constexpr, B1: tl.constexpr,
              IDX_OFF: tl.constexpr, ROPE_OFF: tl.constexpr, SC_OFF: tl.constexpr, IDX_ROW: tl.constexpr):
    """Global loads of one tile of BLOCK_N cached tokens from ``start`` (none past ``hi``): (token mask, segment 0's
    words (fp8 latents: the bytes), segment 1's words, the fp16 scales, k_pe as fp16)."""
    t = start + tl.arange(0, BLOCK_N)
    tmask = t < hi
    page = tl.load(bt_row + t // PAGE, mask=tmask, other=0).to(tl.int64)
    off = t % PAGE
    base = page * stride_cb
    row = base + IDX_OFF + off * IDX_ROW
    if LATENT_FP8:
        i = tl.arange(0, L_PAD)
        w0 = tl.load(CACHE + row[:, None] + i[None, :], mask=tmask[:, None] & (i < L)[None, :], other=0)
        w1 = w0
        a = tl.zeros((BLOCK_N,), tl.float32)
    else:
        w0 = _load_words(CACHE, row, tmask, 0, G0, GP0, B0)
        if G1 > 0:
            w1 = _load_words(CACHE, row, tmask, B0 * G0, G1, GP1, B1)
        else:
            w1 = w0
        a = tl.load(CACHE16 + (base + SC_OFF) // 2 + off, mask=tmask, other=0.0).to(tl.float32)
    r = tl.arange(0, R)
    kpe = tl.load(CACHE_BF16 + ((base + ROPE_OFF) // 2 + off * R)[:, None] + r[None, :], mask=tmask[:, None],
                  other=0.0).to(tl.float16)
    return tmask, w0, w1, a, kpe


@triton.jit
def _mla_tile(tmask, w0, w1, a, kpe, m_i, l_i, acc0, acc1, q0, q1, qpe, C0, C1, cb0, cb1, BLOCK_N: tl.constexpr,
              LATENT_FP8: tl.constexpr, GP0: tl.constexpr, B0: tl.constexpr, G1: tl.constexpr, GP1: tl.constexpr,
              B1: tl.constexpr):
    """One loaded tile (``_mla_load``): the scores, the online-softmax update and the rotated-domain
    accumulation."""
    if LATENT_FP8:
        c0 = w0.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        c1 = c0
        s = tl.dot(q0, tl.trans(c0))
    else:
        c0 = _dequant_words(w0, C0, cb0, BLOCK_N, GP0, B0)
        s = tl.dot(q0, tl.trans(c0))
        if G1 > 0:
            c1 = _dequant_words(w1, C1, cb1, BLOCK_N, GP1, B1)
            s += tl.dot(q1, tl.trans(c1))
        else:
            c1 = c0
        s = s * a[None, :]
    s += tl.dot(qpe, tl.trans(kpe))
    s = tl.where(tmask[None, :], s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if LATENT_FP8:
        pv = p.to(tl.float16)
    else:
        pv = (p * a[None, :]).to(tl.float16)  # p * a <= 65504: the scales are fp16 numbers
    acc0 = acc0 * alpha[:, None] + tl.dot(pv, c0)
    if G1 > 0:
        acc1 = acc1 * alpha[:, None] + tl.dot(pv, c1)
    return m_new, l_i, acc0, acc1


@triton.jit
def _mla_step(start, hi, tm, w0, w1, a, kpe, m_i, l_i, acc0, acc1, q0, q1, qpe, CACHE, CACHE16, CACHE_BF16, bt_row,
              stride_cb, C0, C1, cb0, cb1, L: tl.constexpr, L_PAD: tl.constexpr, R: tl.constexpr,
              PAGE: tl.constexpr, BLOCK_N: tl.constexpr, LATENT_FP8: tl.constexpr, G0: tl.constexpr,
              GP0: tl.constexpr, B0: tl.constexpr, G1: tl.constexpr, GP1: tl.constexpr, B1: tl.constexpr,
              IDX_OFF: tl.constexpr, ROPE_OFF: tl.constexpr, SC_OFF: tl.constexpr, IDX_ROW: tl.constexpr):
    """The loop body: the next tile's loads issued, then the loaded tile (at ``start``) computed."""
    nxt = _mla_load(start + BLOCK_N, hi, CACHE, CACHE16, CACHE_BF16, bt_row, stride_cb, L, L_PAD, R, PAGE, BLOCK_N,
                    LATENT_FP8, G0, GP0, B0, G1, GP1, B1, IDX_OFF, ROPE_OFF, SC_OFF, IDX_ROW)
    m_i, l_i, acc0, acc1 = _mla_tile(tm, w0, w1, a, kpe, m_i, l_i, acc0, acc1, q0, q1, qpe, C0, C1, cb0, cb1, BLOCK_N,
                                     LATENT_FP8, GP0, B0, G1, GP1, B1)
    return nxt[0], nxt[1], nxt[2], nxt[3], nxt[4], m_i, l_i, acc0, acc1


# The block table is a row slice of vLLM's (its alignment follows the batch) and the split count follows the batch:
# neither is specialized, so one variant serves every batch.
@triton.jit(do_not_specialize=["num_splits", "BLOCK_TABLE", "stride_bt", "SEQ_LENS", "stride_pos", "stride_pls"])
def tq_mla_decode_kernel(
    Q, stride_qb, stride_qh, QPE, stride_pb, stride_ph,
    CACHE, CACHE16, CACHE_BF16, stride_cb, BLOCK_TABLE, stride_bt, SEQ_LENS, C0, C1,
    PART_O, stride_pos, stride_pot, stride_poh, PART_L, stride_pls, stride_plt,
    num_heads, num_splits, q_scale, pe_scale,
    L: tl.constexpr, L_PAD: tl.constexpr, R: tl.constexpr, PAGE: tl.constexpr, LATENT_FP8: tl.constexpr,
    G0: tl.constexpr, GP0: tl.constexpr, B0: tl.constexpr, G1: tl.constexpr, GP1: tl.constexpr, B1: tl.constexpr,
    IDX_OFF: tl.constexpr, ROPE_OFF: tl.constexpr, SC_OFF: tl.constexpr, IDX_ROW: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, WHILE_LOOP: tl.constexpr,
):
    """Grid (requests, cdiv(num_heads, BLOCK_H), num_splits). Q [B, H, L_PAD]: the rotated absorbed queries in kernel
    order (segment 0 at 0, segment 1 at 8*GP0), QPE [B, H, R], any float dtype, times q_scale / pe_scale as they are
    loaded (the base-2 softmax scale) and then fp16 MMA operands; C0/C1: the segments' fp16 codebooks. Writes
    PART_O[split, request, head, :L_PAD] (the split's normalized output, kernel order) and PART_L[split, request,
    head] (its log2-sum-exp; -inf for a split with no token)."""
    req = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    hmask = h < num_heads
    kv_len = tl.load(SEQ_LENS + req)
    # (tl.cdiv on scalars gives a 1-element block in the interpreter; plain integer math does not)
    per_split = (kv_len + num_splits - 1) // num_splits
    chunk = (per_split + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(kv_len, lo + chunk)

    qrow = Q + req.to(tl.int64) * stride_qb + h[:, None] * stride_qh
    p0 = tl.arange(0, 8 * GP0)
    q0 = (tl.load(qrow + p0[None, :], mask=hmask[:, None], other=0.0).to(tl.float32) * q_scale).to(tl.float16)
    if G1 > 0:
        p1 = tl.arange(0, 8 * GP1)
        q1 = tl.load(qrow + 8 * GP0 + p1[None, :], mask=hmask[:, None], other=0.0)
        q1 = (q1.to(tl.float32) * q_scale).to(tl.float16)
    else:
        q1 = q0
    r = tl.arange(0, R)
    qpe = tl.load(QPE + req.to(tl.int64) * stride_pb + h[:, None] * stride_ph + r[None, :], mask=hmask[:, None],
                  other=0.0)
    qpe = (qpe.to(tl.float32) * pe_scale).to(tl.float16)

    cb0 = 0
    cb1 = 0
    if not LATENT_FP8:
        cb0 = _codebook_registers(C0, B0)
        if G1 > 0:
            cb1 = _codebook_registers(C1, B1)

    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc0 = tl.zeros((BLOCK_H, 8 * GP0), tl.float32)
    if G1 > 0:
        acc1 = tl.zeros((BLOCK_H, 8 * GP1), tl.float32)
    else:
        acc1 = acc0
    bt_row = BLOCK_TABLE + req.to(tl.int64) * stride_bt
    # The next tile's loads are issued before this tile's arithmetic, so that their latency overlaps it (loads past
    # ``hi`` are masked off).
    tm, w0, w1, a, kpe = _mla_load(lo, hi, CACHE, CACHE16, CACHE_BF16, bt_row, stride_cb, L, L_PAD, R, PAGE, BLOCK_N,
                                   LATENT_FP8, G0, GP0, B0, G1, GP1, B1, IDX_OFF, ROPE_OFF, SC_OFF, IDX_ROW)
    if WHILE_LOOP:
        # The interpreter cannot take run-time bounds in range() (its scalars are 1-element arrays).
        start = lo
        while start < hi:
            tm, w0, w1, a, kpe, m_i, l_i, acc0, acc1 = _mla_step(
                start, hi, tm, w0, w1, a, kpe, m_i, l_i, acc0, acc1, q0, q1, qpe, CACHE, CACHE16, CACHE_BF16, bt_row,
                stride_cb, C0, C1, cb0, cb1, L, L_PAD, R, PAGE, BLOCK_N, LATENT_FP8, G0, GP0, B0, G1, GP1, B1, IDX_OFF,
                ROPE_OFF, SC_OFF, IDX_ROW)
            start += BLOCK_N
    else:
        for start in range(lo, hi, BLOCK_N):
            tm, w0, w1, a, kpe, m_i, l_i, acc0, acc1 = _mla_step(
                start, hi, tm, w0, w1, a, kpe, m_i, l_i, acc0, acc1, q0, q1, qpe, CACHE, CACHE16, CACHE_BF16, bt_row,
                stride_cb, C0, C1, cb0, cb1, L, L_PAD, R, PAGE, BLOCK_N, LATENT_FP8, G0, GP0, B0, G1, GP1, B1, IDX_OFF,
                ROPE_OFF, SC_OFF, IDX_ROW)

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    lse2 = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
    sp = split.to(tl.int64)
    orow = PART_O + sp * stride_pos + req.to(tl.int64) * stride_pot + h[:, None] * stride_poh
    tl.store(orow + p0[None, :], acc0 / l_safe[:, None], mask=hmask[:, None])
    if G1 > 0:
        tl.store(orow + 8 * GP0 + p1[None, :], acc1 / l_safe[:, None], mask=hmask[:, None])
    tl.store(PART_L + sp * stride_pls + req * stride_plt + h, lse2, mask=hmask)
