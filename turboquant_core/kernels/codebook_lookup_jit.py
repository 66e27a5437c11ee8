# SPDX-License-Identifier: Apache-2.0
"""Codebook lookups of packed planar8 indices inside the kernels (jit only): loading a segment's packed
words, and turning them into fp16 (or bf16) codebook values by byte permutes of a codebook held in registers
(``_permute_lookup4``; Triton's interpreter, which cannot run PTX, loads the same values). Shared by decode
attention, the gather-dequant and the dense decode.

Coordinate order of the returned tiles ("kernel order"): a planar8 segment of b-bit indices has G groups
of 8 (GP = G padded to a power of two); group g's b bytes (one per byte plane) form a word whose b-bit
field j is rotated coordinate j*G + g. A thread loads the planes of a [BN, GP] tile, merges them into
words, expands each word into its 8 fields and joins them in registers: the tile's position g*8 + r then
holds field j = bitrev3(r) (``ops.rotation_tables.kernel_coordinate_order``). Kernels multiply such tiles
with rotation rows permuted to the same order, so no data moves between threads.
"""

import os

import triton
import triton.language as tl

# Read when the kernels are defined, as Triton itself reads it (tests set it before importing them).
INTERPRETING = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")

# ``_permute_lookup4``'s instruction sequences (also used by the Gluon decode kernel): $4 the selector (field j in
# nibble j; 4-bit fields: their bits 0-2, ``_lookup_selectors``), $5.. the codebook's byte-permute words; outputs the
# fp16 values of nibbles 0-3.
PERMUTE_LOOKUP4_ASM_16 = tl.constexpr(  # 16 entries: $5 the half each byte comes from, $6-$9 low bytes of entries
    # 0-15, $10-$13 high bytes
    "{ .reg .b32 l0, l1, h0, h1, l, h, p, q; "
    "prmt.b32 l0, $6, $7, $4; prmt.b32 l1, $8, $9, $4; prmt.b32 h0, $10, $11, $4; prmt.b32 h1, $12, $13, $4; "
    "prmt.b32 l, l0, l1, $5; prmt.b32 h, h0, h1, $5; "
    "prmt.b32 p, l, h, 0x5140; prmt.b32 q, l, h, 0x7362; mov.b32 {$0, $1}, p; mov.b32 {$2, $3}, q; }")
PERMUTE_LOOKUP4_ASM_8 = tl.constexpr(  # up to 8 entries: $5, $6 low bytes of entries 0-7, $7, $8 high bytes
    "{ .reg .b32 l, h, p, q; prmt.b32 l, $5, $6, $4; prmt.b32 h, $7, $8, $4; "
    "prmt.b32 p, l, h, 0x5140; prmt.b32 q, l, h, 0x7362; mov.b32 {$0, $1}, p; mov.b32 {$2, $3}, q; }")
# 16 entries of a codebook symmetric about zero (c[15 - i] = -c[i], entries ascending: the Lloyd-Max codebooks), all 8
# fields of a word at once: $8 the word (field j in nibble j), $9, $10 low bytes of the magnitudes m[k] = c[8 + k],
# k = 0-7, $11, $12 their high bytes; outputs the fp16 values of fields 0-7. A field i < 8 is -m[7 - i], i >= 8 is
# m[i - 8]: its magnitude index is i's bits 0-2, inverted unless bit 3 is set, and bit 3 clear sets the sign bit. One
# permute looks up four magnitudes' low bytes, one their high bytes, one turns bits 3 of four fields into byte masks
# (prmt's sign-replicating mode: bit 3 of field 2k+1 is byte k's top bit, that of field 2k the same byte's of the
# word shifted left by 4), one lop3 sets the sign bits; two more interleave. Six instructions per four fields where a
# table of 16 entries takes eight.
# Both lookups once m holds the 8 fields' magnitude indices (bits 0-2 of each nibble) and x4 the word shifted left by 4.
_MAGNITUDE_LOOKUP8_BODY = (
    "prmt.b32 l, $9, $10, m; prmt.b32 h, $11, $12, m; prmt.b32 s, $8, x4, 0x9D8C; lop3.b32 h, h, s, 0x80808080, 0xF2; "
    "prmt.b32 p, l, h, 0x5140; prmt.b32 q, l, h, 0x7362; mov.b32 {$0, $1}, p; mov.b32 {$2, $3}, q; "
    "shr.b32 m, m, 16; "
    "prmt.b32 l, $9, $10, m; prmt.b32 h, $11, $12, m; prmt.b32 s, $8, x4, 0xBFAE; lop3.b32 h, h, s, 0x80808080, 0xF2; "
    "prmt.b32 p, l, h, 0x5140; prmt.b32 q, l, h, 0x7362; mov.b32 {$4, $5}, p; mov.b32 {$6, $7}, q; }")
SYMMETRIC_LOOKUP8_ASM = tl.constexpr(
    "{ .reg .b32 t, m, x4, l, h, s, p, q; "
    "shr.b32 t, $8, 3; and.b32 t, t, 0x11111111; mul.lo.u32 t, t, 7; xor.b32 m, $8, t; xor.b32 m, m, 0x77777777; "
    "and.b32 m, m, 0x77777777; shl.b32 x4, $8, 4; " + _MAGNITUDE_LOOKUP8_BODY)
# The same over sign-magnitude fields (the served kernel words of ``ops.weight_codec``: a field i < 8 stored as
# 7 - i): the magnitude index is the field's bits 0-2 as they are, one AND for all 8.
SIGN_MAGNITUDE_LOOKUP8_ASM = tl.constexpr(
    "{ .reg .b32 m, x4, l, h, s, p, q; and.b32 m, $8, 0x77777777; shl.b32 x4, $8, 4; " + _MAGNITUDE_LOOKUP8_BODY)


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
def _field(word, TABLE, j: tl.constexpr, B: tl.constexpr, DT: tl.constexpr = tl.float16):
    """Codebook value (as DT) of b-bit field j of every word, loaded from TABLE (fields above 8b bits are zero: no
    mask for j=7). The interpreter's path: it cannot run the register lookups' PTX."""
    if j == 0:
        idx = word & ((1 << B) - 1)
    elif j == 7:
        idx = word >> (B * j)
    else:
        idx = (word >> (B * j)) & ((1 << B) - 1)
    return tl.load(TABLE + idx).to(DT)


@triton.jit
def _table_bytes(TABLE, FIRST: tl.constexpr, HIGH: tl.constexpr, DT: tl.constexpr):
    """One word of 4 bytes: the low (or, with HIGH, the high) byte of entries FIRST..FIRST+3 of TABLE as DT
    (fp16 or bf16; fp32 tables are rounded to DT first)."""
    w = tl.zeros((), tl.int32)
    for e in tl.static_range(4):
        bits = tl.load(TABLE + FIRST + e).to(DT).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        if HIGH:
            bits = bits >> 8
        else:
            bits = bits & 0xFF
        w = w | (bits << (8 * e))
    return w


@triton.jit
def _codebook_bytes(TABLE, B: tl.constexpr, DT: tl.constexpr = tl.float16):
    """A b-bit codebook (2**b <= 16 entries, as DT: fp16 or bf16) as byte-permute tables, made once per program:
    (lo0, lo1, lo2, lo3, hi0, hi1, hi2, hi3), where lo_k / hi_k hold the low / high bytes of entries
    4k..4k+3 (words a codebook does not reach repeat lo0 / hi0)."""
    lo0 = _table_bytes(TABLE, 0, False, DT)
    hi0 = _table_bytes(TABLE, 0, True, DT)
    lo1 = lo0
    hi1 = hi0
    lo2 = lo0
    hi2 = hi0
    lo3 = lo0
    hi3 = hi0
    if B >= 3:
        lo1 = _table_bytes(TABLE, 4, False, DT)
        hi1 = _table_bytes(TABLE, 4, True, DT)
    if B == 4:
        lo2 = _table_bytes(TABLE, 8, False, DT)
        hi2 = _table_bytes(TABLE, 8, True, DT)
        lo3 = _table_bytes(TABLE, 12, False, DT)
        hi3 = _table_bytes(TABLE, 12, True, DT)
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
def _lookup_selectors(x, B: tl.constexpr):
    """Fields in nibbles (``_nibble_fields``) -> the selectors of ``_permute_lookup4`` for all 8 at once: (x, x),
    or for 4-bit fields their bits 0-2 and the permute that picks entries 0-7 or 8-15 per byte (prmt reads a
    selector's low 16 bits: the upper four fields' selectors are these shifted right by 16)."""
    if B == 4:
        return x & 0x77777777, ((x >> 1) & 0x44444444) | 0x32103210
    else:
        return x, x


@triton.jit
def _permute_lookup4(sel, half, cb, B: tl.constexpr, DT: tl.constexpr = tl.float16):
    """Codebook values (DT, the type ``cb`` was built for) of the four fields in nibbles 0-3 of ``sel``, looked
    up in registers.

    ``prmt`` picks any 4 of the 8 bytes of two registers, one 4-bit selector per output byte, so one
    instruction fetches the low bytes of four entries of an 8-entry table and one more their high bytes;
    two more interleave them into two fp16 pairs. 16-entry codebooks (4 bits) look up both halves and
    pick per byte with the field's top bit (``half``). The codebook never leaves registers: no L1 load, whose
    gathers from a shared table were the attention kernel's busiest unit (Nsight Compute on an H200). ``sel`` and
    ``half`` come from ``_lookup_selectors``."""
    if B == 4:
        a, b, c, d = tl.inline_asm_elementwise(
            PERMUTE_LOOKUP4_ASM_16, "=h,=h,=h,=h,r,r,r,r,r,r,r,r,r,r",
            [sel, half, cb[0], cb[1], cb[2], cb[3], cb[4], cb[5], cb[6], cb[7]],
            dtype=(tl.int16, tl.int16, tl.int16, tl.int16), is_pure=True, pack=1)
    else:
        a, b, c, d = tl.inline_asm_elementwise(
            PERMUTE_LOOKUP4_ASM_8, "=h,=h,=h,=h,r,r,r,r,r",
            [sel, cb[0], cb[1], cb[4], cb[5]],
            dtype=(tl.int16, tl.int16, tl.int16, tl.int16), is_pure=True, pack=1)
    return a.to(DT, bitcast=True), b.to(DT, bitcast=True), c.to(DT, bitcast=True), d.to(DT, bitcast=True)


@triton.jit
def _dequant_words(word, TABLE, cb, BN: tl.constexpr, GP: tl.constexpr, B: tl.constexpr,
                   DT: tl.constexpr = tl.float16):
    """[BN, GP] words of b-bit fields (b = 2, 3, 4) -> [BN, 8*GP] codebook values (DT: fp16, or bf16 with a
    ``cb`` built for it) in kernel order
    (position g*8 + r holds field bitrev3(r)); the joins and the reshape only rename registers. On the GPU
    the values come from ``cb`` (``_codebook_bytes``) by register permutes; the interpreter loads them from
    TABLE (the same DT values)."""
    tl.static_assert(B >= 2 and B <= 4, "codebook lookups serve 2- to 4-bit fields")
    if INTERPRETING:
        f0 = _field(word, TABLE, 0, B, DT)
        f1 = _field(word, TABLE, 1, B, DT)
        f2 = _field(word, TABLE, 2, B, DT)
        f3 = _field(word, TABLE, 3, B, DT)
        f4 = _field(word, TABLE, 4, B, DT)
        f5 = _field(word, TABLE, 5, B, DT)
        f6 = _field(word, TABLE, 6, B, DT)
        f7 = _field(word, TABLE, 7, B, DT)
    else:
        sel, half = _lookup_selectors(_nibble_fields(word, B), B)
        f0, f1, f2, f3 = _permute_lookup4(sel, half, cb, B, DT)
        f4, f5, f6, f7 = _permute_lookup4(sel >> 16, half >> 16, cb, B, DT)
    c = tl.join(tl.join(tl.join(f0, f1), tl.join(f2, f3)), tl.join(tl.join(f4, f5), tl.join(f6, f7)))
    return tl.reshape(c, (BN, 8 * GP))


@triton.jit
def _codebook_registers(TABLE, B: tl.constexpr, DT: tl.constexpr = tl.float16):
    """What ``_dequant_words`` takes as ``cb``: the byte-permute tables (of DT values) on the GPU, a placeholder
    in the interpreter."""
    if INTERPRETING:
        return 0
    else:
        return _codebook_bytes(TABLE, B, DT)
