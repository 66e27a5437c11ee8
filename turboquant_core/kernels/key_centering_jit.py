# SPDX-License-Identifier: Apache-2.0
"""Key centering anchored in the first page: jit functions shared by the store, attention and gather kernels.

Encoding (``turboquant_core.ops.key_centering`` has the tables, the references and the derivation):
- tokens of a sequence's first page (t < PAGE) are stored plain;
- mu = mean over t = 1..PAGE-1 of RoPE_t^-1(k_hat_t), the first page's decoded keys rotated back, per
  sequence, layer and KV head. It is a function of the first page's bytes alone, so it is derived from them
  (``tq_key_center_sums_kernel``) instead of stored, and it is the same for every sequence that shares
  that page (prefix caching). A caller that keeps the sums across steps has them derived again only when
  a row's first page changed (tags per row, epochs per block that the store bumps: the kernel's ``CACHED``);
- a token t >= PAGE of page p is stored as k_t - c_p with the page's constant centre
  c_p = RoPE_{m_p}(rho * mu) (m_p: the page's middle position; rho per RoPE pair: the least-squares
  constant for a pair that turns by theta per token), and read back as k_hat + c_p, i.e. its logit
  gets the extra term q . c_p, one value per (query, page).

The centre in natural coordinates: c_i = mu_i * PC[p, i] + mup_i * PS[p, i] with PC = rho cos(m_p theta_f(i)),
PS = rho sin(m_p theta_f(i)) (row 0 is zero: the first page is plain; unrotated channels have PC = 1,
PS = 0) and mup_i = sgn_i * mu_partner(i), sgn = -1 on the first coordinate of a pair, +1 on the second.

Sums layout: SUMS[r, h] holds U = mean_t k_t * cos(t theta) and V = mean_t k_t * sin(t theta) (D_PAD
each), from which mu_i = U_i - sgn_i V_partner(i) and mup_i = sgn_i U_partner(i) + V_i.
"""

import triton
import triton.language as tl

from .codec_jit import _mse_decode_rows, _split_f16


@triton.jit
def _rope_partner(D_PAD: tl.constexpr, ROT_HALF: tl.constexpr, NEOX: tl.constexpr):
    """Per natural coordinate i: the other coordinate of its RoPE pair and sgn_i (0 for unrotated ones)."""
    i = tl.arange(0, D_PAD)
    if NEOX:  # pairs (f, f + h)
        partner = tl.where(i < ROT_HALF, i + ROT_HALF, i - ROT_HALF)
        sgn = tl.where(i < ROT_HALF, -1.0, 1.0)
    else:  # pairs (2f, 2f + 1)
        partner = i ^ 1
        sgn = tl.where((i % 2) == 0, -1.0, 1.0)
    rotated = i < 2 * ROT_HALF
    return tl.where(rotated, partner, i), tl.where(rotated, sgn, 0.0)


@triton.jit
def _center_vectors(SUMS, sums_off, D_PAD: tl.constexpr, ROT_HALF: tl.constexpr, NEOX: tl.constexpr):
    """(mu, mup) in natural coordinates from the sums at SUMS + sums_off: [D_PAD] for a scalar offset,
    [BN, D_PAD] for a column of row offsets [BN, 1]."""
    i = tl.arange(0, D_PAD)
    partner, sgn = _rope_partner(D_PAD, ROT_HALF, NEOX)
    u = tl.load(SUMS + sums_off + i)
    u_p = tl.load(SUMS + sums_off + partner)
    v = tl.load(SUMS + sums_off + D_PAD + i)
    v_p = tl.load(SUMS + sums_off + D_PAD + partner)
    return u - sgn * v_p, sgn * u_p + v


@triton.jit
def _token_page_rows(t, tmask, PAGE_COS, PAGE_SIN, num_pages, D_PAD: tl.constexpr, PAGE: tl.constexpr):
    """(PC, PS) rows [BN, D_PAD] of the pages of tokens at positions t [BN]: centre = mu * PC + mup * PS."""
    i = tl.arange(0, D_PAD)
    pg = tl.minimum(t // PAGE, num_pages - 1).to(tl.int64)
    off = pg[:, None] * D_PAD + i[None, :]
    pc = tl.load(PAGE_COS + off, mask=tmask[:, None], other=0.0)
    ps = tl.load(PAGE_SIN + off, mask=tmask[:, None], other=0.0)
    return pc, ps


@triton.jit
def _token_positions(tok, tmask, QUERY_START, SEQ_LENS, num_reqs, STEPS: tl.constexpr):
    """(request, position) of batch tokens tok [BN]: a vectorized binary search over QUERY_START
    (STEPS halvings cover up to 2**STEPS requests); token q_start[r] + j sits at seq_len[r] - nq[r] + j."""
    lo = tl.zeros_like(tok)
    hi = tl.zeros_like(tok) + num_reqs
    for _ in tl.static_range(STEPS):
        active = lo < hi
        mid = (lo + hi) // 2
        right = tl.load(QUERY_START + mid + 1, mask=active & tmask, other=0) <= tok
        lo = tl.where(active & right, mid + 1, lo)
        hi = tl.where(active & (right == 0), mid, hi)
    req = tl.minimum(lo, num_reqs - 1)
    q0 = tl.load(QUERY_START + req, mask=tmask, other=0)
    q1 = tl.load(QUERY_START + req + 1, mask=tmask, other=0)
    pos = tl.load(SEQ_LENS + req, mask=tmask, other=0) - (q1 - q0) + (tok - q0)
    return req, tl.where(tmask & (lo < num_reqs), pos, -1)


@triton.jit
def _center_query_operands(q, SUMS, sums_off, center_scale, D_PAD: tl.constexpr, ROT_HALF: tl.constexpr,
                           NEOX: tl.constexpr):
    """Once per program: w = q * mu, z = q * mup (times ``center_scale``) as fp16 tensor-core operands,
    each row divided by a power of two (returned, [M] fp32) that keeps it in fp16 range. A scalar ``sums_off``
    gives every row of q the same sums, a column [M, 1] each row its own."""
    mu, mup = _center_vectors(SUMS, sums_off, D_PAD, ROT_HALF, NEOX)
    mu = mu * center_scale
    mup = mup * center_scale
    if len(mu.shape) == 1:
        mu = mu[None, :]
        mup = mup[None, :]
    w = q * mu
    z = q * mup
    amax = tl.maximum(tl.max(tl.abs(w), axis=1), tl.max(tl.abs(z), axis=1))
    row_scale = tl.where(amax > 0, tl.exp2(tl.ceil(tl.log2(tl.maximum(amax, 1e-30)))), 1.0)
    inv = 1.0 / row_scale
    return (w * inv[:, None]).to(tl.float16), (z * inv[:, None]).to(tl.float16), row_scale


@triton.jit
def _page_center_logits(w, z, row_scale, start, PAGE_COS16, PAGE_SIN16, num_pages,
                        D_PAD: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Extra logits [M, BLOCK_N] of the tile of tokens start..start+BLOCK_N-1 (start a multiple of BLOCK_N):
    q . c_page(t) = row_scale * (w . PC[page] + z . PS[page]) (``_center_query_operands``).

    The tile's pages (BLOCK_N / PAGE of them, at most 16) are one fp16 product against their rows of the
    fp16 page tables (rows past them are not loaded), then a 0/1 matrix spreads each page's value over
    its tokens (hi + lo fp16 parts: exact). The centre term is then as precise as an fp16 score."""
    PP: tl.constexpr = 16
    PPT: tl.constexpr = BLOCK_N // PAGE if BLOCK_N >= PAGE else 1
    i = tl.arange(0, D_PAD)
    pp = tl.arange(0, PP)
    pg0 = start // PAGE
    pg = tl.minimum(pg0 + pp, num_pages - 1).to(tl.int64)
    off = pg[:, None] * D_PAD + i[None, :]
    rows = (pp < PPT)[:, None]
    pc = tl.load(PAGE_COS16 + off, mask=rows, other=0.0)
    ps = tl.load(PAGE_SIN16 + off, mask=rows, other=0.0)
    gp = tl.dot(w, tl.trans(pc))
    gp = tl.dot(z, tl.trans(ps), gp)  # [M, PP], |.| <= D_PAD: fp16 hi + lo hold it
    gh, gl = _split_f16(gp)
    n = tl.arange(0, BLOCK_N)
    spread = (((start + n) // PAGE - pg0)[None, :] == pp[:, None]).to(tl.float16)  # [PP, BLOCK_N]
    g = tl.dot(gh, spread)
    g = tl.dot(gl, spread, g)
    return g * row_scale[:, None]


@triton.jit
def _first_page_sums(CACHE, CACHE16, base, KROT_HI, KROT_LO, KCENT0, KCENT1, POS_COS, POS_SIN, k_rot_scale,
                     D_PAD: tl.constexpr, PAGE: tl.constexpr,
                     KG0: tl.constexpr, KGP0: tl.constexpr, KB0: tl.constexpr,
                     KG1: tl.constexpr, KGP1: tl.constexpr, KB1: tl.constexpr, K_EXACT: tl.constexpr,
                     K_IDX_OFF: tl.constexpr, K_SC_OFF: tl.constexpr, K_ROW: tl.constexpr, BN: tl.constexpr):
    """(U, V) [D_PAD] each of the full first page whose region starts at byte ``base``: decoded keys of tokens
    1..PAGE-1 (natural coordinates, fp32) times POS_COS / POS_SIN [PAGE, D_PAD] (cos / sin of t theta per
    coordinate), averaged; chunks of BN rows in a fixed order, so the result is the same bits at every step,
    in every batch and whichever launch computes it."""
    i = tl.arange(0, D_PAD)
    u = tl.zeros((D_PAD,), tl.float32)
    v = tl.zeros((D_PAD,), tl.float32)
    for c in tl.static_range(PAGE // BN):
        t = c * BN + tl.arange(0, BN)
        ok = t >= 1
        k_scale = tl.load(CACHE16 + base // 2 + K_SC_OFF // 2 + t, mask=ok, other=0.0).to(tl.float32)
        k = _mse_decode_rows(CACHE, base + K_IDX_OFF + t * K_ROW, ok, KROT_HI, KROT_LO, KCENT0, KCENT1, D_PAD,
                             KG0, KGP0, KB0, KG1, KGP1, KB1, K_EXACT, BN, False, False)
        k = k * (k_scale * k_rot_scale)[:, None]
        k = tl.where(ok[:, None], k, 0.0)
        pc = tl.load(POS_COS + t[:, None] * D_PAD + i[None, :])
        ps = tl.load(POS_SIN + t[:, None] * D_PAD + i[None, :])
        u += tl.sum(k * pc, axis=0)
        v += tl.sum(k * ps, axis=0)
    return u * (1.0 / (PAGE - 1)), v * (1.0 / (PAGE - 1))


# The batch's metadata pointers change with the batch; TAGS is a per-layer slice of one allocation, whose
# offset need not keep 16-byte alignment: one compiled variant for all of them.
@triton.jit(do_not_specialize=["BLOCK_TABLE", "stride_bt", "SEQ_LENS", "TAGS"])
def tq_key_center_sums_kernel(
    CACHE, CACHE16, stride_cb, stride_ch, BLOCK_TABLE, stride_bt, SEQ_LENS,
    KROT_HI, KROT_LO, KCENT0, KCENT1, POS_COS, POS_SIN, SUMS, stride_sr, stride_sh, k_rot_scale,
    TAGS, stride_tr, stride_th, EPOCHS,
    D_PAD: tl.constexpr, PAGE: tl.constexpr,
    KG0: tl.constexpr, KGP0: tl.constexpr, KB0: tl.constexpr,
    KG1: tl.constexpr, KGP1: tl.constexpr, KB1: tl.constexpr, K_EXACT: tl.constexpr,
    K_IDX_OFF: tl.constexpr, K_SC_OFF: tl.constexpr, K_ROW: tl.constexpr, BN: tl.constexpr,
    BEFORE_STORE: tl.constexpr, CACHED: tl.constexpr,
):
    """Grid (R, Hkv): SUMS[r, h] = (U, V) of the first page of request r (``_first_page_sums``; zeros until that
    page is full). ``BEFORE_STORE``: launched before this step's tokens (one per request) are stored, so a first
    page counts once it was full before the step (seq_len - 1 >= PAGE); otherwise after them (seq_len >= PAGE).

    ``CACHED``: SUMS persists across steps (one buffer per layer) and TAGS[r, h] = (block, epoch) names what
    its row holds: the sums of first block ``block`` as of EPOCHS[block], a counter the centred store bumps for
    every first-page token it writes into that block. A full first page whose tag matches is skipped (the
    row's sums are those bytes' sums already); any other is recomputed and tagged, a page that is not full
    gets zeros and the invalid tag (-1, 0). Rows may change requests between steps and blocks may be reused:
    the tag names the block and its contents, not the request. Without ``CACHED`` every row is recomputed
    (TAGS, EPOCHS unused)."""
    req = tl.program_id(0)
    head = tl.program_id(1)
    full = tl.load(SEQ_LENS + req) - BEFORE_STORE >= PAGE
    page = tl.load(BLOCK_TABLE + req.to(tl.int64) * stride_bt).to(tl.int64)
    out = SUMS + req.to(tl.int64) * stride_sr + head * stride_sh
    i = tl.arange(0, D_PAD)
    if CACHED:
        tag = TAGS + req.to(tl.int64) * stride_tr + head * stride_th
        # a row that is not full may hold any block id (CUDA-graph padding rows): its epoch is not read
        epoch = tl.load(EPOCHS + page, mask=full, other=0)
        stale = (full == 0) | (tl.load(tag) != page) | (tl.load(tag + 1) != epoch)
    else:
        stale = True
    if stale:
        if full:
            u, v = _first_page_sums(CACHE, CACHE16, page * stride_cb + head.to(tl.int64) * stride_ch, KROT_HI,
                                    KROT_LO, KCENT0, KCENT1, POS_COS, POS_SIN, k_rot_scale, D_PAD, PAGE,
                                    KG0, KGP0, KB0, KG1, KGP1, KB1, K_EXACT, K_IDX_OFF, K_SC_OFF, K_ROW, BN)
        else:
            u = tl.zeros((D_PAD,), tl.float32)
            v = tl.zeros((D_PAD,), tl.float32)
        tl.store(out + i, u)
        tl.store(out + D_PAD + i, v)
        if CACHED:
            tl.store(tag, tl.where(full, page, -1).to(tl.int32))
            tl.store(tag + 1, tl.where(full, epoch, 0).to(tl.int32))
