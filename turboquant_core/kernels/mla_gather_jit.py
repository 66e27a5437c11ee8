# SPDX-License-Identifier: Apache-2.0
"""Cached MLA tokens gathered from paged TurboQuant MLA pages as rotated latents and k_pe (jit only; launcher
``ops.mla.mla_gather_dequant``, reference ``ops.mla_reference.mla_gather_dequant_ref``).

The prefill context of an MLA layer: vLLM's ``gather_and_maybe_dequant_cache`` contract (dst row i = token i of
the gather, of request ``token_to_seq[i]`` at position ``i - cu_seq_lens[seq] + seq_starts[seq]``). Each program
serves BN tokens: the latent's codebook values (``codebook_lookup_jit``; fp8 latents: the e4m3 bytes) times the
token's scale go to Y in the order of ``MLATables.attn_rows``, still rotated, and k_pe straight into its columns of
dst. The launcher rotates Y back with one product over all its rows, as the decode launcher rotates its output.
"""

import triton
import triton.language as tl

from .codebook_lookup_jit import _codebook_registers, _dequant_words, _load_words


@triton.jit
def _gather_segment(CACHE, row, ok, a, C, cb, yrow, col0, G: tl.constexpr, GP: tl.constexpr, B: tl.constexpr,
                    byte0: tl.constexpr, BN: tl.constexpr):
    c = _dequant_words(_load_words(CACHE, row, ok, byte0, G, GP, B), C, cb, BN, GP, B)
    p = tl.arange(0, 8 * GP)
    tl.store(yrow + col0 + p[None, :], c.to(tl.float32) * a[:, None], mask=ok[:, None])


# The block table is a row slice of vLLM's and the gather's metadata follows the batch: none is specialized.
@triton.jit(do_not_specialize=["BLOCK_TABLE", "stride_bt", "CU", "TOKEN_TO_SEQ", "SEQ_STARTS", "num_tokens"])
def tq_mla_gather_kernel(
    CACHE, CACHE16, CACHE_BF16, stride_cb, BLOCK_TABLE, stride_bt, CU, TOKEN_TO_SEQ, SEQ_STARTS, num_tokens, C0, C1,
    Y, stride_y, DST, stride_d,
    L: tl.constexpr, L_PAD: tl.constexpr, R: tl.constexpr, PAGE: tl.constexpr, LATENT_FP8: tl.constexpr,
    G0: tl.constexpr, GP0: tl.constexpr, B0: tl.constexpr, G1: tl.constexpr, GP1: tl.constexpr, B1: tl.constexpr,
    IDX_OFF: tl.constexpr, ROPE_OFF: tl.constexpr, SC_OFF: tl.constexpr, IDX_ROW: tl.constexpr,
    HAS_STARTS: tl.constexpr, BN: tl.constexpr,
):
    """Grid (cdiv(num_tokens, BN),). Y [num_tokens, rows] fp32 (the rotated latent, ``attn_rows`` order); DST
    [>= num_tokens, L + R]: columns L.. get k_pe."""
    i = tl.program_id(0) * BN + tl.arange(0, BN)
    ok = i < num_tokens
    seq = tl.load(TOKEN_TO_SEQ + i, mask=ok, other=0)
    pos = i - tl.load(CU + seq, mask=ok, other=0)
    if HAS_STARTS:
        pos += tl.load(SEQ_STARTS + seq, mask=ok, other=0)
    page = tl.load(BLOCK_TABLE + seq.to(tl.int64) * stride_bt + pos // PAGE, mask=ok, other=0).to(tl.int64)
    off = pos % PAGE
    base = page * stride_cb
    row = base + IDX_OFF + off * IDX_ROW
    yrow = Y + i.to(tl.int64)[:, None] * stride_y
    if LATENT_FP8:
        p = tl.arange(0, L_PAD)
        lb = tl.load(CACHE + row[:, None] + p[None, :], mask=ok[:, None] & (p < L)[None, :], other=0)
        tl.store(yrow + p[None, :], lb.to(tl.float8e4nv, bitcast=True).to(tl.float32), mask=ok[:, None])
    else:
        a = tl.load(CACHE16 + (base + SC_OFF) // 2 + off, mask=ok, other=0.0).to(tl.float32)
        _gather_segment(CACHE, row, ok, a, C0, _codebook_registers(C0, B0), yrow, 0, G0, GP0, B0, 0, BN)
        if G1 > 0:
            _gather_segment(CACHE, row, ok, a, C1, _codebook_registers(C1, B1), yrow, 8 * GP0, G1, GP1, B1, B0 * G0,
                            BN)
    r = tl.arange(0, R)
    kpe = tl.load(CACHE_BF16 + ((base + ROPE_OFF) // 2 + off * R)[:, None] + r[None, :], mask=ok[:, None], other=0.0)
    tl.store(DST + i.to(tl.int64)[:, None] * stride_d + L + r[None, :], kpe.to(DST.dtype.element_ty),
             mask=ok[:, None])
