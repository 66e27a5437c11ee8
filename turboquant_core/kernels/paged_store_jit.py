# SPDX-License-Identifier: Apache-2.0
"""Fused rotate + quantize + pack of new K/V tokens straight into paged TurboQuant pages (jit only).

Page layout (see ``turboquant_core.ops.page_layout``): one region of ``PAGE`` tokens per (block, kv head),
structure of arrays: K index rows | V index rows | K fp16 scales | V fp16 scales. The kernels get the
cache twice, as bytes (``CACHE``) and as an fp16 view of the same memory (``CACHE16``) for the scales.

The MSE encoding is the same arithmetic as ``codec_jit.tq_mse_encode_kernel`` (same jit functions), so a
token's index bytes are exactly what ``ops.codec.encode`` writes for that vector. fp8 keys are the
rotated vector rounded to float8 e4m3fn (round to nearest even, clamped to +-448) with integer bit
arithmetic, which is exact on every backend (the Triton interpreter's own fp8 cast is not RTNE).
"""

import triton
import triton.language as tl

from .codec_jit import _mse_encode_rows, _rotate_rows
from .key_centering_jit import _center_vectors, _token_page_rows, _token_positions


@triton.jit
def _fp32_to_e4m3fn_bits(x):
    """float32 (already clamped to +-448) -> float8 e4m3fn bit pattern (uint8), round to nearest even."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    a = bits & 0x7FFFFFFF
    # Normal range |x| >= 2^-6: keep 3 mantissa bits with RTNE; a carry moves into the exponent.
    r = (a + 0x7FFFF + ((a >> 20) & 1)) >> 20
    normal = r - ((127 - 7) << 3)
    # Subnormal range: k = rtne(|x| * 2^9), k in [0, 8] (k == 8 is the smallest normal, code 8).
    e = a >> 23
    full = (a & 0x7FFFFF) | 0x800000
    shift = tl.minimum(tl.maximum(141 - e, 21), 26)
    k = full >> shift
    rem = full & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    k += ((rem > half) | ((rem == half) & ((k & 1) == 1))).to(tl.int32)
    k = tl.where(e == 0, 0, k)  # fp32 zeros / denormals
    code = tl.where(a >= (121 << 23), normal, k)
    return ((sign << 7) | code).to(tl.uint8)


@triton.jit
def _padded_coord(P: tl.constexpr, G: tl.constexpr, GP: tl.constexpr):
    """Padded kernel position p -> rotated coordinate (single segment of 8*G coords), and its validity."""
    p = tl.arange(0, P)
    return (p // GP) * G + p % GP, (p % GP) < G


@triton.jit
def _fp8_encode_rows(x, row_mask, OUT, out_off, ROT_HI, ROT_LO, rot_scale,
                     D_PAD: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, EXACT_ROT: tl.constexpr):
    """x [BN, D_PAD] fp32 -> D float8 e4m3fn bytes of R x (natural coordinate order) at OUT[out_off + i].

    The rotation runs on the unit vector (fp16 hi/lo operands must stay bounded) and is scaled back."""
    norm = tl.sqrt(tl.sum(x * x, axis=1))
    u = x * tl.where(norm > 0, 1.0 / tl.maximum(norm, 1e-30), 0.0)[:, None]
    t = _rotate_rows(u, ROT_HI, ROT_LO, 0, 8 * GP, D_PAD, EXACT_ROT) * (norm * rot_scale)[:, None]
    t = tl.minimum(tl.maximum(t, -448.0), 448.0)
    code = _fp32_to_e4m3fn_bits(t)
    coord, valid = _padded_coord(8 * GP, G, GP)
    tl.store(OUT + out_off[:, None] + coord[None, :], code, mask=row_mask[:, None] & valid[None, :])


@triton.jit
def _store_keys(x, k_ok, CACHE, CACHE16, base, off, KROT_HI, KROT_LO, KROT_BF16, KLEV0, KBND0, KLEV1, KBND1,
                k_rot_scale, sqrt_d, D_PAD: tl.constexpr, K_FP8: tl.constexpr,
                KG0: tl.constexpr, KGP0: tl.constexpr, KB0: tl.constexpr,
                KG1: tl.constexpr, KGP1: tl.constexpr, KB1: tl.constexpr, K_NC: tl.constexpr, K_EXACT: tl.constexpr,
                K_IDX_OFF: tl.constexpr, K_SC_OFF: tl.constexpr, K_ROW: tl.constexpr, BN: tl.constexpr):
    """Encode key rows x [BN, D_PAD] (rows k_ok) into their slots: fp8 bytes, or MSE indices + fp16 scale."""
    if K_FP8:
        _fp8_encode_rows(x.to(tl.float32), k_ok, CACHE, base + K_IDX_OFF + off * K_ROW, KROT_HI, KROT_LO,
                         k_rot_scale, D_PAD, KG0, KGP0, K_EXACT)
    else:
        k_scale = _mse_encode_rows(x, k_ok, CACHE, base + K_IDX_OFF + off * K_ROW, KROT_HI, KROT_LO, KROT_BF16,
                                   KLEV0, KBND0, KLEV1, KBND1, k_rot_scale, sqrt_d,
                                   D_PAD, KG0, KGP0, KB0, KG1, KGP1, KB1, K_NC, K_EXACT, BN)
        tl.store(CACHE16 + (base + K_SC_OFF) // 2 + off, k_scale.to(tl.float16), mask=k_ok)


@triton.jit
def _bump_epochs(EPOCHS, SLOTS, tok, rows, PAGE: tl.constexpr):
    """EPOCHS[block] += 1 per row ``rows`` of tokens ``tok`` [BN], block from their slots. The slots are loaded
    again here rather than kept from the program's start: held through the encode, their block ids take the
    registers that make the 4-warp store spill on sm_90."""
    blk = tl.load(SLOTS + tok, mask=rows, other=0) // PAGE
    tl.atomic_add(EPOCHS + blk, 1, mask=rows, sem="relaxed")


# The token count changes every step, the request count and the metadata pointers with the batch: one variant.
@triton.jit(do_not_specialize=["num_tokens", "num_reqs", "QUERY_START", "SEQ_LENS"])
def tq_paged_store_kernel(
    KEY, stride_kt, stride_kh, VALUE, stride_vt, stride_vh, SLOTS,
    CACHE, CACHE16, stride_cb, stride_ch,
    KROT_HI, KROT_LO, KROT_BF16, KLEV0, KBND0, KLEV1, KBND1,
    VROT_HI, VROT_LO, VROT_BF16, VLEV0, VBND0, VLEV1, VBND1,
    num_tokens, k_rot_scale, v_rot_scale, sqrt_d,
    QUERY_START, SEQ_LENS, num_reqs, SUMS, stride_sr, stride_sh, PAGE_COS, PAGE_SIN, num_pages, EPOCHS,
    D: tl.constexpr, D_PAD: tl.constexpr, PAGE: tl.constexpr,
    K_FP8: tl.constexpr, KG0: tl.constexpr, KGP0: tl.constexpr, KB0: tl.constexpr,
    KG1: tl.constexpr, KGP1: tl.constexpr, KB1: tl.constexpr, K_NC: tl.constexpr, K_EXACT: tl.constexpr,
    VG0: tl.constexpr, VGP0: tl.constexpr, VB0: tl.constexpr,
    VG1: tl.constexpr, VGP1: tl.constexpr, VB1: tl.constexpr, V_NC: tl.constexpr, V_EXACT: tl.constexpr,
    K_IDX_OFF: tl.constexpr, V_IDX_OFF: tl.constexpr, K_SC_OFF: tl.constexpr, V_SC_OFF: tl.constexpr,
    K_ROW: tl.constexpr, V_ROW: tl.constexpr,
    BN: tl.constexpr, CENTER_MODE: tl.constexpr, ROT_HALF: tl.constexpr, NEOX: tl.constexpr,
    SEARCH_STEPS: tl.constexpr, BUMP_EPOCHS: tl.constexpr,
):
    """Tokens [T, Hkv, D] of K and V -> their pages. Grid (cdiv(T, BN), Hkv, 2): keys, then values, in
    separate programs (decode batches have few tokens: twice the programs, half the latency chain each; one
    in mode 2). Slot < 0: token skipped.

    Key centering (``key_centering_jit``) stores a sequence in two passes around the launch that derives
    its centre from the first page: ``CENTER_MODE`` 0: no centering (K and V of every token); 1: V of
    every token, K of first-page tokens (position < PAGE); 2: K of later tokens minus their page's
    centre, no V; 3: both passes in one, for batches whose centres were derived before the launch (every
    request has one new token, so no first page fills while a later token of its request is stored).
    Positions come from QUERY_START / SEQ_LENS (vLLM's batch metadata).

    ``BUMP_EPOCHS`` (modes 1 and 3): EPOCHS[block] += 1 for every first-page key stored into ``block``, so that
    sums kept across steps (``tq_key_center_sums_kernel``, ``CACHED``) see that the page changed; counted in the
    head-0 program, once per token."""
    tok = tl.program_id(0) * BN + tl.arange(0, BN)
    head = tl.program_id(1)
    tmask = tok < num_tokens
    slot = tl.load(SLOTS + tok, mask=tmask, other=-1).to(tl.int64)
    ok = tmask & (slot >= 0)
    slot = tl.maximum(slot, 0)
    blk = slot // PAGE
    off = slot % PAGE
    base = blk * stride_cb + head * stride_ch  # bytes; even, so base // 2 indexes the fp16 view
    i = tl.arange(0, D_PAD)
    dmask = ok[:, None] & (i < D)[None, :]
    tok64 = tok.to(tl.int64)
    key_rows = KEY + tok64[:, None] * stride_kt + head * stride_kh + i[None, :]

    if tl.program_id(2) == 0:  # keys
        k_plain = ok
        if CENTER_MODE > 0:
            req, pos = _token_positions(tok, tmask, QUERY_START, SEQ_LENS, num_reqs, SEARCH_STEPS)
            k_plain = ok & (pos >= 0) & (pos < PAGE)
        if CENTER_MODE >= 2:
            k_later = ok & (pos >= PAGE)
        # Mode 3 runs both key passes in one program; a decode tile usually has rows for one of them only, so a pass
        # with no row to store is skipped (a run-time branch on the tile) rather than encoded fully masked.
        if CENTER_MODE != 2:  # keys stored as they are: every key (mode 0), first-page keys (modes 1, 3)
            if CENTER_MODE != 3 or tl.max(k_plain.to(tl.int32), axis=0) > 0:
                x = tl.load(key_rows, mask=k_plain[:, None] & (i < D)[None, :], other=0.0)
                _store_keys(x, k_plain, CACHE, CACHE16, base, off, KROT_HI, KROT_LO, KROT_BF16, KLEV0, KBND0, KLEV1,
                            KBND1, k_rot_scale, sqrt_d, D_PAD, K_FP8, KG0, KGP0, KB0, KG1, KGP1, KB1, K_NC, K_EXACT,
                            K_IDX_OFF, K_SC_OFF, K_ROW, BN)
                if BUMP_EPOCHS:
                    if head == 0:
                        _bump_epochs(EPOCHS, SLOTS, tl.program_id(0) * BN + tl.arange(0, BN), k_plain, PAGE)
        if CENTER_MODE >= 2:  # later keys minus their page's centre
            if CENTER_MODE != 3 or tl.max(k_later.to(tl.int32), axis=0) > 0:
                x = tl.load(key_rows, mask=k_later[:, None] & (i < D)[None, :], other=0.0)
                mu, mup = _center_vectors(SUMS, (req.to(tl.int64) * stride_sr + head * stride_sh)[:, None],
                                          D_PAD, ROT_HALF, NEOX)
                pc, ps = _token_page_rows(pos, k_later, PAGE_COS, PAGE_SIN, num_pages, D_PAD, PAGE)
                x = x.to(tl.float32) - (mu * pc + mup * ps)
                _store_keys(x, k_later, CACHE, CACHE16, base, off, KROT_HI, KROT_LO, KROT_BF16, KLEV0, KBND0, KLEV1,
                            KBND1, k_rot_scale, sqrt_d, D_PAD, K_FP8, KG0, KGP0, KB0, KG1, KGP1, KB1, K_NC, K_EXACT,
                            K_IDX_OFF, K_SC_OFF, K_ROW, BN)
    elif CENTER_MODE != 2:  # values (mode 2 writes keys only: its grid has one entry in dim 2)
        y = tl.load(VALUE + tok64[:, None] * stride_vt + head * stride_vh + i[None, :], mask=dmask, other=0.0)
        v_scale = _mse_encode_rows(y, ok, CACHE, base + V_IDX_OFF + off * V_ROW, VROT_HI, VROT_LO, VROT_BF16,
                                   VLEV0, VBND0, VLEV1, VBND1, v_rot_scale, sqrt_d,
                                   D_PAD, VG0, VGP0, VB0, VG1, VGP1, VB1, V_NC, V_EXACT, BN)
        tl.store(CACHE16 + (base + V_SC_OFF) // 2 + off, v_scale.to(tl.float16), mask=ok)
