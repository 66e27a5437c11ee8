# SPDX-License-Identifier: Apache-2.0
"""Store of new MLA tokens (latent kv_c and rope key k_pe) into paged TurboQuant MLA pages (jit only).

Page layout: ``turboquant_core.ops.mla_layout`` (latent index rows | k_pe bf16 rows | latent fp16 scales, one
block per page). The kernels get the cache three times, as bytes (``CACHE``), as fp16 (``CACHE16``: the scales)
and as bf16 (``CACHE_BF16``: k_pe), views of the same memory.

The latent is rotated over all kv_lora_rank (512) coordinates: a [BN, 512] x [512, 512] product per block of
tokens. A decode step stores one token per request, so the product is split over its output columns: program
(i, c) of ``tq_mla_store_kernel`` computes column chunk c, the GW groups c*GW.. of every packing slot (the G
coordinates that share a bit position in a planar8 word), as one product per 64 input coordinates, and so owns
whole packed bytes; its share of the codebook energy sum(c^2) goes to a small fp32 buffer.
``tq_mla_store_finish_kernel`` then adds the shares into each token's norm-corrected scale and copies k_pe.
Registers hold a chunk's [BN, 8*GW] product, never the whole rotated latent (which took a one-program-per-block
kernel to 255 registers and a spill stack on sm_90). The arithmetic is the dense codec's: 16-bit rows against the
+-1 Hadamard rows in the same type (exact products, fp32 sums, 1 / |x| applied after), fp32 rows as the unit vector
in fp16 hi/lo pairs; the codebook search and the scale are ``codec_jit``'s own functions.
"""

import triton
import triton.language as tl

from .codebook_lookup_jit import INTERPRETING
from .codec_jit import _held_codebook, _quantize_held, _row_scale, _split_f16
from .paged_store_jit import _fp32_to_e4m3fn_bits

K_CHUNK = tl.constexpr(64)  # input coordinates per product


@triton.jit
def _chunk_product(X, x_off, ok, inv_norm, ROT16, ROT_HI, ROT_LO, rows, L: tl.constexpr, L_PAD: tl.constexpr,
                   EXACT16: tl.constexpr, EXACT_ROT: tl.constexpr, BN: tl.constexpr, N: tl.constexpr):
    """Rows x at X[x_off + i] (i < L) times the rotation rows ``rows`` [N] (natural padded order, ``L_PAD`` wide)
    -> ([BN, N] fp32, the rows' sum of x^2): x . rows (``EXACT16``: 16-bit x against the +-1 rows in its type, ROT16)
    or, otherwise, (x / |x|) . rows by fp16 hi/lo pairs (ROT_HI, and ROT_LO for a rotation that is not +-1)."""
    k = tl.arange(0, K_CHUNK)
    t = tl.zeros((BN, N), dtype=tl.float32)
    ss = tl.zeros((BN,), dtype=tl.float32)
    # A pipelined loop: the rotation tiles come from L2, and a decode step's few programs would otherwise wait for
    # each in turn.
    for c in tl.range(0, L_PAD // K_CHUNK, num_stages=3):
        col = c * K_CHUNK + k
        xc = tl.load(X + x_off[:, None] + col[None, :], mask=ok[:, None] & (col < L)[None, :], other=0.0)
        xf = xc.to(tl.float32)
        ss += tl.sum(xf * xf, axis=1)
        offs = rows[None, :] * L_PAD + col[:, None]  # [K_CHUNK, N]: transposed view of the rows
        if EXACT16:
            r = tl.load(ROT16 + offs)
            if INTERPRETING and xc.dtype == tl.bfloat16:
                # Triton 3.6's interpreter multiplies bf16 operands wrongly; fp32 operands hold them exactly.
                t += tl.dot(xf, r.to(tl.float32))
            else:
                t += tl.dot(xc, r)
        else:
            uh, ul = _split_f16(xf * inv_norm[:, None])
            rh = tl.load(ROT_HI + offs)
            t += tl.dot(uh, rh) + tl.dot(ul, rh)
            if not EXACT_ROT:
                t += tl.dot(uh, tl.load(ROT_LO + offs))
    return t, ss


@triton.jit
def _encode_chunk(X, x_off, ok, inv_norm, s_mul, OUT, out_off, byte0, ROT16, ROT_HI, ROT_LO, row0, g0, LEV, BND,
                  G: tl.constexpr, GP: tl.constexpr, B: tl.constexpr, GW: tl.constexpr, L: tl.constexpr,
                  L_PAD: tl.constexpr, EXACT16: tl.constexpr, EXACT_ROT: tl.constexpr, BN: tl.constexpr):
    """Groups g0..g0+GW of one codebook segment (rotation rows from row0): its 8 packing slots' coordinates
    quantized, packed (planar8) and stored at OUT[out_off + byte0 + k*G + g]; returns (the rows' sum of c^2 over
    those coordinates, their sum of x^2)."""
    bnd, lev = _held_codebook(BND, LEV, 1 << B)
    n = tl.arange(0, 8 * GW)
    j = n // GW
    g = g0 + n % GW
    t, ss = _chunk_product(X, x_off, ok, inv_norm, ROT16, ROT_HI, ROT_LO, row0 + j * GP + g, L, L_PAD, EXACT16,
                           EXACT_ROT, BN, 8 * GW)
    row_mul = s_mul
    if EXACT16:
        norm = tl.sqrt(ss)
        row_mul = tl.where(norm > 0, 1.0 / tl.maximum(norm, 1e-30), 0.0) * s_mul
    idx, sq = _quantize_held(t * row_mul[:, None], bnd, lev, 1 << B)
    valid = (g < G)[None, :]
    c2 = tl.sum(tl.where(valid, sq, 0.0), axis=1)
    # The slots' fields occupy disjoint bits of a word, so their sum is their bitwise or.
    word = tl.sum(tl.reshape(idx.to(tl.uint32) << (B * j)[None, :], (BN, 8, GW)), axis=1)
    gw = g0 + tl.arange(0, GW)
    m = ok[:, None] & (gw < G)[None, :]
    for k in tl.static_range(B):
        tl.store(OUT + out_off[:, None] + byte0 + k * G + gw[None, :], ((word >> (8 * k)) & 0xFF).to(tl.uint8), mask=m)
    return c2, ss


@triton.jit
def _encode_chunk_fp8(X, x_off, ok, inv_norm, norm_mul, OUT, out_off, ROT16, ROT_HI, ROT_LO, g0, G: tl.constexpr,
                      GW: tl.constexpr, L: tl.constexpr, L_PAD: tl.constexpr, EXACT16: tl.constexpr,
                      EXACT_ROT: tl.constexpr, BN: tl.constexpr):
    """Coordinates j*G + g0.. (g < g0 + GW, every j < 8) of R x as float8 e4m3fn bytes (natural order, clamped to
    +-448, round to nearest even) at OUT[out_off + j*G + g]; ``norm_mul`` [BN] scales the products (rot_scale, times
    |x| for unit-vector products)."""
    n = tl.arange(0, 8 * GW)
    col = (n // GW) * G + g0 + n % GW
    t, _ = _chunk_product(X, x_off, ok, inv_norm, ROT16, ROT_HI, ROT_LO, col, L, L_PAD, EXACT16, EXACT_ROT, BN,
                          8 * GW)
    code = _fp32_to_e4m3fn_bits(tl.minimum(tl.maximum(t * norm_mul[:, None], -448.0), 448.0))
    tl.store(OUT + out_off[:, None] + col[None, :], code, mask=ok[:, None])


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
    KV_C, stride_ct, SLOTS, CACHE, stride_cb, ROT_HI, ROT_LO, ROT_BF16, LEV0, BND0, LEV1, BND1, SUMS, stride_st,
    num_tokens, rot_scale, sqrt_d,
    L: tl.constexpr, L_PAD: tl.constexpr, PAGE: tl.constexpr, LATENT_FP8: tl.constexpr,
    G0: tl.constexpr, GP0: tl.constexpr, B0: tl.constexpr, G1: tl.constexpr, GP1: tl.constexpr, B1: tl.constexpr,
    EXACT_ROT: tl.constexpr, IDX_OFF: tl.constexpr, IDX_ROW: tl.constexpr, GW: tl.constexpr, BN: tl.constexpr,
):
    """Latents kv_c [T, L] -> their packed index bytes at SLOTS [T] (slot < 0: skipped, vLLM's padding). Grid
    (cdiv(T, BN), GP0/GW + GP1/GW): program (i, c) encodes column chunk c (segment 0's chunks first) of tokens
    i*BN.. and writes its sum of c^2 to SUMS[token, c], chunk 0 also |x| to SUMS[token, chunks] (codebook latents;
    fp8 latents: 8*GW coordinates per chunk, no sums). ROT_*: ``rotation_tables.codec_tables`` of the latent (fp8
    latents: a 4-bit table's rows, natural order)."""
    tok = tl.program_id(0) * BN + tl.arange(0, BN)
    chunk = tl.program_id(1)
    tmask = tok < num_tokens
    slot = tl.load(SLOTS + tok, mask=tmask, other=-1).to(tl.int64)
    ok = tmask & (slot >= 0)
    slot = tl.maximum(slot, 0)
    out_off = (slot // PAGE) * stride_cb + IDX_OFF + (slot % PAGE) * IDX_ROW
    x_off = tok.to(tl.int64) * stride_ct
    EXACT16: tl.constexpr = EXACT_ROT and KV_C.dtype.element_ty != tl.float32
    if KV_C.dtype.element_ty == tl.bfloat16:
        rot16 = ROT_BF16
    else:
        rot16 = ROT_HI
    norm = tl.zeros((BN,), dtype=tl.float32)
    inv_norm = norm
    if not EXACT16:
        # Unit-vector products need |x| first.
        k = tl.arange(0, K_CHUNK)
        ss = tl.zeros((BN,), dtype=tl.float32)
        for c in tl.static_range(L_PAD // K_CHUNK):
            col = c * K_CHUNK + k
            xc = tl.load(KV_C + x_off[:, None] + col[None, :], mask=ok[:, None] & (col < L)[None, :],
                         other=0.0).to(tl.float32)
            ss += tl.sum(xc * xc, axis=1)
        norm = tl.sqrt(ss)
        inv_norm = tl.where(norm > 0, 1.0 / tl.maximum(norm, 1e-30), 0.0)
    if LATENT_FP8:
        if EXACT16:
            norm_mul = tl.zeros((BN,), dtype=tl.float32) + rot_scale
        else:
            norm_mul = norm * rot_scale
        _encode_chunk_fp8(KV_C, x_off, ok, inv_norm, norm_mul, CACHE, out_off, rot16, ROT_HI, ROT_LO, chunk * GW,
                          G0, GW, L, L_PAD, EXACT16, EXACT_ROT, BN)
    else:
        s_mul = tl.zeros((BN,), dtype=tl.float32) + sqrt_d * rot_scale
        NC0: tl.constexpr = GP0 // GW
        if chunk < NC0:
            c2, ss = _encode_chunk(KV_C, x_off, ok, inv_norm, s_mul, CACHE, out_off, 0, rot16, ROT_HI, ROT_LO, 0,
                                   chunk * GW, LEV0, BND0, G0, GP0, B0, GW, L, L_PAD, EXACT16, EXACT_ROT, BN)
        else:
            c2, ss = _encode_chunk(KV_C, x_off, ok, inv_norm, s_mul, CACHE, out_off, B0 * G0, rot16, ROT_HI, ROT_LO,
                                   8 * GP0, (chunk - NC0) * GW, LEV1, BND1, G1, GP1, B1, GW, L, L_PAD, EXACT16,
                                   EXACT_ROT, BN)
        srow = SUMS + tok.to(tl.int64) * stride_st
        tl.store(srow + chunk, c2, mask=tmask)
        if chunk == 0:
            tl.store(srow + tl.num_programs(1), tl.sqrt(ss), mask=tmask)


@triton.jit(do_not_specialize=["num_tokens"])
def tq_mla_store_finish_kernel(
    K_PE, stride_pt, SLOTS, CACHE16, CACHE_BF16, stride_cb, SUMS, stride_st, num_tokens, sqrt_d,
    R: tl.constexpr, PAGE: tl.constexpr, CHUNKS: tl.constexpr, CHUNKS_PAD: tl.constexpr, HAS_SCALE: tl.constexpr,
    NORM_CORRECTION: tl.constexpr, ROPE_OFF: tl.constexpr, SC_OFF: tl.constexpr, BN: tl.constexpr,
):
    """After ``tq_mla_store_kernel``: each token's scale from its chunks' sums of c^2 and |x| (``HAS_SCALE``:
    codebook latents), and k_pe [T, R] as bf16 (the input rounded to nearest even when it is not bf16)."""
    tok = tl.program_id(0) * BN + tl.arange(0, BN)
    tmask = tok < num_tokens
    slot = tl.load(SLOTS + tok, mask=tmask, other=-1).to(tl.int64)
    ok = tmask & (slot >= 0)
    slot = tl.maximum(slot, 0)
    base = (slot // PAGE) * stride_cb  # bytes; even, so base // 2 indexes the 16-bit views
    off = slot % PAGE
    if HAS_SCALE:
        c = tl.arange(0, CHUNKS_PAD)
        srow = SUMS + tok.to(tl.int64)[:, None] * stride_st
        sumsq = tl.sum(tl.load(srow + c[None, :], mask=ok[:, None] & (c < CHUNKS)[None, :], other=0.0), axis=1)
        norm = tl.load(SUMS + tok.to(tl.int64) * stride_st + CHUNKS, mask=ok, other=0.0)
        scale = _row_scale(norm, sumsq, sqrt_d, NORM_CORRECTION)
        tl.store(CACHE16 + (base + SC_OFF) // 2 + off, scale.to(tl.float16), mask=ok)
    r = tl.arange(0, R)
    pe = tl.load(K_PE + tok.to(tl.int64)[:, None] * stride_pt + r[None, :], mask=ok[:, None], other=0.0)
    if K_PE.dtype.element_ty != tl.bfloat16:
        pe = _to_bf16_rtne(pe)
    tl.store(CACHE_BF16 + ((base + ROPE_OFF) // 2 + off * R)[:, None] + r[None, :], pe, mask=ok[:, None])
