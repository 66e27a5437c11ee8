# SPDX-License-Identifier: Apache-2.0
"""Codebook lookups of packed planar8 indices inside the kernels (jit only): loading a segment's packed
words, and turning them into fp16 codebook values, by L1 loads (``tl.load`` or an elementwise PTX load)
or by byte permutes of a codebook held in registers (``_permute_lookup4``). Shared by decode attention,
the gather-dequant and the dense decode.

Coordinate order of the returned tiles ("kernel order"): a planar8 segment of b-bit indices has G groups
of 8 (GP = G padded to a power of two); group g's b bytes (one per byte plane) form a word whose b-bit
field j is rotated coordinate j*G + g. A thread loads the planes of a [BN, GP] tile, merges them into
words, expands each word into its 8 fields and joins them in registers: the tile's position g*8 + r then
holds field j = bitrev3(r) (``ops.rotation_tables.kernel_coordinate_order``). Kernels multiply such tiles
with rotation rows permuted to the same order, so no data moves between threads.
"""

import triton
import triton.language as tl


@triton.jit
def _load_words(IN, row_off, row_mask, byte0, G: tl.constexpr, GP: tl.constexpr, B: tl.constexpr):
    """[BN, GP] uint32 words of one planar8 segment: byte plane k of group g is bits 8k..8k+7."""
    g = tl.arange(0, GP)
    m = row_mask[:, None]
    if G < GP:
        m = m & (g < G)[None, :]
    ptr = IN + row_off[:, None] + byte0 + g[None, :]
    word = tl.load(ptr, mask=m, other=0).to(tl.uint32)
    for k in tl.static_range(1, B):
        word |= tl.load(ptr + k * G, mask=m, other=0).to(tl.uint32) << (8 * k)
    return word


@triton.jit
def _lookup(TABLE, idx, two, ASM_LOOKUP: tl.constexpr):
    """Codebook values TABLE[idx] as fp16, keeping idx's register layout.

    A ``tl.load`` gather gets its own layout from the compiler (a shared-memory round trip of the
    pointer tile) plus 64-bit pointer arithmetic; the inline PTX is a wide multiply-add (``two`` is a
    run-time 2, so ptxas keeps an IMAD.WIDE rather than a shift pair) and one cached load, and is
    elementwise, so the tile stays in place. (The interpreter cannot run PTX: ``tl.load`` path.)"""
    if ASM_LOOKUP:
        v = tl.inline_asm_elementwise(
            "{ .reg .b64 a; mad.wide.u32 a, $1, $2, $3; ld.global.nc.b16 $0, [a]; }", "=h,r,r,l",
            [idx, two, TABLE.to(tl.int64)], dtype=tl.int16, is_pure=True, pack=1)
        return v.to(tl.float16, bitcast=True)
    else:
        return tl.load(TABLE + idx)


@triton.jit
def _lookup_pair(TABLE2, idx2, four, ASM_LOOKUP: tl.constexpr):
    """Two codebook values per load: TABLE2 holds, for every pair (a, b) of b-bit indices packed as
    a | b << b, the fp16 pair (c[a], c[b]). Returns (c[a], c[b])."""
    if ASM_LOOKUP:
        lo, hi = tl.inline_asm_elementwise(
            "{ .reg .b64 a; .reg .b32 r; mad.wide.u32 a, $2, $3, $4; ld.global.nc.b32 r, [a]; "
            "mov.b32 {$0, $1}, r; }", "=h,=h,r,r,l",
            [idx2, four, TABLE2.to(tl.int64)], dtype=(tl.int16, tl.int16), is_pure=True, pack=1)
        return lo.to(tl.float16, bitcast=True), hi.to(tl.float16, bitcast=True)
    else:
        return tl.load(TABLE2 + 2 * idx2), tl.load(TABLE2 + 2 * idx2 + 1)


@triton.jit
def _field(word, TABLE, j: tl.constexpr, B: tl.constexpr, two, ASM_LOOKUP: tl.constexpr):
    """Codebook value of b-bit field j of every word (fields above 8b bits are zero: no mask for j=7)."""
    if j == 0:
        idx = word & ((1 << B) - 1)
    elif j == 7:
        idx = word >> (B * j)
    else:
        idx = (word >> (B * j)) & ((1 << B) - 1)
    return _lookup(TABLE, idx, two, ASM_LOOKUP)


@triton.jit
def _field_pair(word, TABLE2, j: tl.constexpr, B: tl.constexpr, four, ASM_LOOKUP: tl.constexpr):
    """Codebook values of fields j and j+1 of every word, one load for both."""
    if j == 0:
        idx2 = word & ((1 << (2 * B)) - 1)
    elif j == 6:
        idx2 = word >> (B * j)
    else:
        idx2 = (word >> (B * j)) & ((1 << (2 * B)) - 1)
    return _lookup_pair(TABLE2, idx2, four, ASM_LOOKUP)


@triton.jit
def _table_bytes(TABLE, FIRST: tl.constexpr, HIGH: tl.constexpr):
    """One word of 4 bytes: the low (or, with HIGH, the high) byte of entries FIRST..FIRST+3 of TABLE as fp16
    (fp32 tables are rounded to fp16 first)."""
    w = tl.zeros((), tl.int32)
    for e in tl.static_range(4):
        bits = tl.load(TABLE + FIRST + e).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        if HIGH:
            bits = bits >> 8
        else:
            bits = bits & 0xFF
        w = w | (bits << (8 * e))
    return w


@triton.jit
def _codebook_bytes(TABLE, B: tl.constexpr):
    """A b-bit codebook (2**b <= 16 entries, as fp16) as byte-permute tables, computed once per program:
    (lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3), where lo_k / hi_k hold the low / high bytes of entries
    4k..4k+3 (words a codebook does not reach repeat lo0 / hi0)."""
    lo0 = _table_bytes(TABLE, 0, False)
    hi0 = _table_bytes(TABLE, 0, True)
    lo1 = lo0
    hi1 = hi0
    lo2 = lo0
    hi2 = hi0
    lo3 = lo0
    hi3 = hi0
    if B >= 3:
        lo1 = _table_bytes(TABLE, 4, False)
        hi1 = _table_bytes(TABLE, 4, True)
    if B == 4:
        lo2 = _table_bytes(TABLE, 8, False)
        hi2 = _table_bytes(TABLE, 8, True)
        lo3 = _table_bytes(TABLE, 12, False)
        hi3 = _table_bytes(TABLE, 12, True)
    return (lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3)


@triton.jit
def _nibble_fields(word, B: tl.constexpr):
    """A word of 8 b-bit fields (b = 2, 3, 4) -> the same fields one per nibble (field j in bits 4j..4j+3),
    the selector layout of ``prmt``: three shift-and-mask steps spread the fields in halves, pairs, singles."""
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


@triton.jit
def _permute_lookup4(sel, cb, B: tl.constexpr):
    """Codebook values of the four fields in nibbles 0-3 of ``sel``, looked up in registers.

    ``prmt`` picks any 4 of the 8 bytes of two registers, one 4-bit selector per output byte, so one
    instruction fetches the low bytes of four entries of an 8-entry table and one more their high bytes;
    two more interleave them into two fp16 pairs. 16-entry codebooks (4 bits) look up both halves and
    pick per byte with the field's top bit. The codebook never leaves registers: no L1 load, whose
    gathers from a shared table were the attention kernel's busiest unit (Nsight Compute on an H200)."""
    if B == 4:
        a, b, c, d = tl.inline_asm_elementwise(
            "{ .reg .b32 s, m, l0, l1, h0, h1, l, h, p, q; "
            "and.b32 s, $4, 0x7777; shr.b32 m, $4, 1; and.b32 m, m, 0x4444; or.b32 m, m, 0x3210; "
            "prmt.b32 l0, $5, $6, s; prmt.b32 l1, $7, $8, s; prmt.b32 h0, $9, $10, s; prmt.b32 h1, $11, $12, s; "
            "prmt.b32 l, l0, l1, m; prmt.b32 h, h0, h1, m; "
            "prmt.b32 p, l, h, 0x5140; prmt.b32 q, l, h, 0x7362; mov.b32 {$0, $1}, p; mov.b32 {$2, $3}, q; }",
            "=h,=h,=h,=h,r,r,r,r,r,r,r,r,r",
            [sel, cb[0], cb[1], cb[2], cb[3], cb[4], cb[5], cb[6], cb[7]],
            dtype=(tl.int16, tl.int16, tl.int16, tl.int16), is_pure=True, pack=1)
    else:
        a, b, c, d = tl.inline_asm_elementwise(
            "{ .reg .b32 l, h, p, q; prmt.b32 l, $5, $6, $4; prmt.b32 h, $7, $8, $4; "
            "prmt.b32 p, l, h, 0x5140; prmt.b32 q, l, h, 0x7362; mov.b32 {$0, $1}, p; mov.b32 {$2, $3}, q; }",
            "=h,=h,=h,=h,r,r,r,r,r",
            [sel, cb[0], cb[1], cb[4], cb[5]],
            dtype=(tl.int16, tl.int16, tl.int16, tl.int16), is_pure=True, pack=1)
    return (a.to(tl.float16, bitcast=True), b.to(tl.float16, bitcast=True), c.to(tl.float16, bitcast=True),
            d.to(tl.float16, bitcast=True))


@triton.jit
def _dequant_words(word, TABLE, TABLE2, two, four, BN: tl.constexpr, GP: tl.constexpr, B: tl.constexpr,
                   PAIRS: tl.constexpr, ASM_LOOKUP: tl.constexpr, cb, PERMUTE: tl.constexpr):
    """[BN, GP] words -> [BN, 8*GP] fp16 codebook values in kernel order (position g*8 + r holds field
    bitrev3(r)); the joins and the reshape only rename registers. ``PERMUTE``: register lookups from
    ``cb`` (``_codebook_bytes``; 2- to 4-bit codebooks, GPU only); else ``PAIRS``: one load per two
    fields, or one load per field."""
    if PERMUTE and B >= 2:
        x = _nibble_fields(word, B)
        f0, f1, f2, f3 = _permute_lookup4(x, cb, B)
        f4, f5, f6, f7 = _permute_lookup4(x >> 16, cb, B)
    elif PAIRS:
        f0, f1 = _field_pair(word, TABLE2, 0, B, four, ASM_LOOKUP)
        f2, f3 = _field_pair(word, TABLE2, 2, B, four, ASM_LOOKUP)
        f4, f5 = _field_pair(word, TABLE2, 4, B, four, ASM_LOOKUP)
        f6, f7 = _field_pair(word, TABLE2, 6, B, four, ASM_LOOKUP)
    else:
        f0 = _field(word, TABLE, 0, B, two, ASM_LOOKUP)
        f1 = _field(word, TABLE, 1, B, two, ASM_LOOKUP)
        f2 = _field(word, TABLE, 2, B, two, ASM_LOOKUP)
        f3 = _field(word, TABLE, 3, B, two, ASM_LOOKUP)
        f4 = _field(word, TABLE, 4, B, two, ASM_LOOKUP)
        f5 = _field(word, TABLE, 5, B, two, ASM_LOOKUP)
        f6 = _field(word, TABLE, 6, B, two, ASM_LOOKUP)
        f7 = _field(word, TABLE, 7, B, two, ASM_LOOKUP)
    c = tl.join(tl.join(tl.join(f0, f1), tl.join(f2, f3)), tl.join(tl.join(f4, f5), tl.join(f6, f7)))
    return tl.reshape(c, (BN, 8 * GP))
