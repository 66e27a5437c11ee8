# SPDX-License-Identifier: Apache-2.0
"""Store of new MLA tokens (latent kv_c and rope key k_pe) into paged TurboQuant MLA pages (jit only).

Page layout: ``turboquant_core.ops.mla_layout`` (latent index rows | k_pe bf16 rows | latent fp16 scales, one
block per page). The kernel gets the cache three times, as bytes (``CACHE``), as fp16 (``CACHE16``: the scales)
and as bf16 (``CACHE_BF16``: k_pe), views of the same memory.

The latent is rotated over all kv_lora_rank (512) coordinates. A whole [BN, 512] rotated tile held in registers
(the dense codec's ``codec_jit._mse_encode_rows``) took this kernel to 255 registers and a 1.4-2.3 KB spill stack
per thread on sm_90, so here the rotation runs one packing slot at a time (the G coordinates that share a bit
position in a planar8 word), each slot's product summed over chunks of 64 input coordinates re-read from
memory: [BN, 64] x [64, G] products, a slot's indices shifted into the words at once. Registers then hold the words,
the slot's tile and the sum of c^2, never the whole latent. The arithmetic is the dense codec's: 16-bit rows
against the +-1 Hadamard rows in the same type (exact products, fp32 sums, 1 / |x| applied after), fp32 rows as
the unit vector in fp16 hi/lo pairs; the codebook search and the scale are ``codec_jit``'s own functions.
"""

import triton
import triton.language as tl

from .codebook_lookup_jit import INTERPRETING
from .codec_jit import _held_codebook, _quantize_held, _row_scale, _split_f16
from .paged_store_jit import _fp32_to_e4m3fn_bits

K_CHUNK = tl.constexpr(64)  # input coordinates per product


@triton.jit
def _slot_product(X, x_off, ok, inv_norm, ROT16, ROT_HI, ROT_LO, row0, GP: tl.constexpr, L: tl.constexpr,
                  L_PAD: tl.constexpr, EXACT16: tl.constexpr, EXACT_ROT: tl.constexpr, BN: tl.constexpr):
    """Rows x at X[x_off + i] (i < L) times rotation rows row0..row0+GP (natural padded order, ``L_PAD`` wide)
    -> [BN, GP] fp32: x . rows (``EXACT16``: 16-bit x against the +-1 rows in its type, ROT16) or, otherwise,
    (x / |x|) . rows by fp16 hi/lo pairs (ROT_HI, and ROT_LO for a rotation that is not +-1)."""
    p = tl.arange(0, GP)
    k = tl.arange(0, K_CHUNK)
    t = tl.zeros((BN, GP), dtype=tl.float32)
    # A run-time loop: unrolled over the 8 slots x 8 chunks, the products' loads were hoisted and the kernel
    # spilled on sm_90 (255 registers); as a loop it takes 100-210 registers and compiles 4x faster.
    for c in range(L_PAD // K_CHUNK):
        col = c * K_CHUNK + k
        xc = tl.load(X + x_off[:, None] + col[None, :], mask=ok[:, None] & (col < L)[None, :], other=0.0)
        offs = (row0 + p)[None, :] * L_PAD + col[:, None]  # [K_CHUNK, GP]: transposed view of the rows
        if EXACT16:
            r = tl.load(ROT16 + offs)
            if INTERPRETING and xc.dtype == tl.bfloat16:
                # Triton 3.6's interpreter multiplies bf16 operands wrongly; fp32 operands hold them exactly.
                t += tl.dot(xc.to(tl.float32), r.to(tl.float32))
            else:
                t += tl.dot(xc, r)
        else:
            uh, ul = _split_f16(xc.to(tl.float32) * inv_norm[:, None])
            rh = tl.load(ROT_HI + offs)
            t += tl.dot(uh, rh) + tl.dot(ul, rh)
            if not EXACT_ROT:
                t += tl.dot(uh, tl.load(ROT_LO + offs))
    return t


@triton.jit
def _encode_latent_segment(X, x_off, ok, inv_norm, s_mul, OUT, out_off, byte0, ROT16, ROT_HI, ROT_LO, row0, LEV,
                           BND, G: tl.constexpr, GP: tl.constexpr, B: tl.constexpr, L: tl.constexpr,
                           L_PAD: tl.constexpr, EXACT16: tl.constexpr, EXACT_ROT: tl.constexpr, BN: tl.constexpr):
    """One codebook segment of the rows' latents: 8 slot products, quantized, packed (planar8) and stored at
    OUT[out_off + byte0 + k*G + g]; returns the rows' sum of c^2 over the segment."""
    bnd, lev = _held_codebook(BND, LEV, 1 << B)
    g = tl.arange(0, GP)
    valid = (g < G)[None, :]
    word = tl.zeros((BN, GP), dtype=tl.uint32)
    c2 = tl.zeros((BN, GP), dtype=tl.float32)
    row_mul = s_mul
    if EXACT16:
        row_mul = inv_norm * s_mul
    for j in tl.static_range(8):
        t = _slot_product(X, x_off, ok, inv_norm, ROT16, ROT_HI, ROT_LO, row0 + j * GP, GP, L, L_PAD, EXACT16,
                          EXACT_ROT, BN)
        idx, sq = _quantize_held(t * row_mul[:, None], bnd, lev, 1 << B)
        c2 += sq
        word |= idx.to(tl.uint32) << (B * j)
    m = ok[:, None] & valid
    for k in tl.static_range(B):
        tl.store(OUT + out_off[:, None] + byte0 + k * G + g[None, :], ((word >> (8 * k)) & 0xFF).to(tl.uint8), mask=m)
    return tl.sum(tl.where(valid, c2, 0.0), axis=1)


@triton.jit
def _encode_latent_fp8(X, x_off, ok, norm, inv_norm, rot_scale, OUT, out_off, ROT16, ROT_HI, ROT_LO,
                       G: tl.constexpr, L: tl.constexpr, L_PAD: tl.constexpr, EXACT16: tl.constexpr,
                       EXACT_ROT: tl.constexpr, BN: tl.constexpr):
    """R x as L float8 e4m3fn bytes (natural order, clamped to +-448, round to nearest even) at OUT[out_off + i]:
    8 products of G = L/8 rotated coordinates, the rotation table's rows being in natural order (one segment of
    G == GP groups)."""
    g = tl.arange(0, G)
    for j in tl.static_range(8):
        t = _slot_product(X, x_off, ok, inv_norm, ROT16, ROT_HI, ROT_LO, j * G, G, L, L_PAD, EXACT16, EXACT_ROT, BN)
        if EXACT16:
            t = t * rot_scale
        else:
            t = t * (norm * rot_scale)[:, None]
        code = _fp32_to_e4m3fn_bits(tl.minimum(tl.maximum(t, -448.0), 448.0))
        tl.store(OUT + out_off[:, None] + j * G + g[None, :], code, mask=ok[:, None])


@triton.jit
def _to_bf16_rtne(x):
    """fp16 / fp32 -> bf16, round to nearest even, by integer arithmetic on the fp32 bits: exact on every backend
    (Triton's interpreter truncates in its own cast). Infinities stay infinite, NaNs become the quiet NaN."""
    bits = x.to(tl.float32).to(tl.int32, bitcast=True)
    r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    r = tl.where(x != x, 0x7FC0, r)
    return r.to(tl.int16).to(tl.bfloat16, bitcast=True)


# The token count changes every step: one variant for all.
@triton.jit(do_not_specialize=["num_tokens"])
def tq_mla_store_kernel(
    KV_C, stride_ct, K_PE, stride_pt, SLOTS, CACHE, CACHE16, CACHE_BF16, stride_cb,
    ROT_HI, ROT_LO, ROT_BF16, LEV0, BND0, LEV1, BND1, num_tokens, rot_scale, sqrt_d,
    L: tl.constexpr, L_PAD: tl.constexpr, R: tl.constexpr, PAGE: tl.constexpr, LATENT_FP8: tl.constexpr,
    G0: tl.constexpr, GP0: tl.constexpr, B0: tl.constexpr, G1: tl.constexpr, GP1: tl.constexpr, B1: tl.constexpr,
    NORM_CORRECTION: tl.constexpr, EXACT_ROT: tl.constexpr,
    IDX_OFF: tl.constexpr, ROPE_OFF: tl.constexpr, SC_OFF: tl.constexpr, IDX_ROW: tl.constexpr, BN: tl.constexpr,
):
    """Tokens kv_c [T, L], k_pe [T, R] -> their pages at SLOTS [T] (slot < 0: skipped, vLLM's padding). Grid
    (cdiv(T, BN), 2): latents in programs (i, 0), k_pe in (i, 1), so that the short k_pe copy does not wait
    behind the rotation. k_pe is stored as bf16 (the input rounded to nearest even when it is not bf16).
    ROT_*: ``rotation_tables.codec_tables`` of the latent (fp8 latents: a 4-bit table's rows, natural order)."""
    tok = tl.program_id(0) * BN + tl.arange(0, BN)
    tmask = tok < num_tokens
    slot = tl.load(SLOTS + tok, mask=tmask, other=-1).to(tl.int64)
    ok = tmask & (slot >= 0)
    slot = tl.maximum(slot, 0)
    base = (slot // PAGE) * stride_cb  # bytes; even, so base // 2 indexes the 16-bit views
    off = slot % PAGE
    x_off = tok.to(tl.int64) * stride_ct
    if tl.program_id(1) == 0:
        EXACT16: tl.constexpr = EXACT_ROT and KV_C.dtype.element_ty != tl.float32
        if KV_C.dtype.element_ty == tl.bfloat16:
            rot16 = ROT_BF16
        else:
            rot16 = ROT_HI
        ss = tl.zeros((BN,), dtype=tl.float32)
        k = tl.arange(0, K_CHUNK)
        for c in tl.static_range(L_PAD // K_CHUNK):
            col = c * K_CHUNK + k
            xc = tl.load(KV_C + x_off[:, None] + col[None, :], mask=ok[:, None] & (col < L)[None, :],
                         other=0.0).to(tl.float32)
            ss += tl.sum(xc * xc, axis=1)
        norm = tl.sqrt(ss)
        inv_norm = tl.where(norm > 0, 1.0 / tl.maximum(norm, 1e-30), 0.0)
        out_off = base + IDX_OFF + off * IDX_ROW
        if LATENT_FP8:
            _encode_latent_fp8(KV_C, x_off, ok, norm, inv_norm, rot_scale, CACHE, out_off, rot16, ROT_HI, ROT_LO,
                               G0, L, L_PAD, EXACT16, EXACT_ROT, BN)
        else:
            s_mul = tl.zeros((BN,), dtype=tl.float32) + sqrt_d * rot_scale
            sumsq = _encode_latent_segment(KV_C, x_off, ok, inv_norm, s_mul, CACHE, out_off, 0, rot16, ROT_HI,
                                           ROT_LO, 0, LEV0, BND0, G0, GP0, B0, L, L_PAD, EXACT16, EXACT_ROT, BN)
            if G1 > 0:
                sumsq += _encode_latent_segment(KV_C, x_off, ok, inv_norm, s_mul, CACHE, out_off, B0 * G0, rot16,
                                                ROT_HI, ROT_LO, 8 * GP0, LEV1, BND1, G1, GP1, B1, L, L_PAD, EXACT16,
                                                EXACT_ROT, BN)
            scale = _row_scale(norm, sumsq, sqrt_d, NORM_CORRECTION)
            tl.store(CACHE16 + (base + SC_OFF) // 2 + off, scale.to(tl.float16), mask=ok)
    else:
        r = tl.arange(0, R)
        pe = tl.load(K_PE + tok.to(tl.int64)[:, None] * stride_pt + r[None, :], mask=ok[:, None], other=0.0)
        if K_PE.dtype.element_ty != tl.bfloat16:
            pe = _to_bf16_rtne(pe)
        tl.store(CACHE_BF16 + ((base + ROPE_OFF) // 2 + off * R)[:, None] + r[None, :], pe, mask=ok[:, None])
