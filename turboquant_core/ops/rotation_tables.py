# SPDX-License-Identifier: Apache-2.0
"""Device tables the kernels share: padded, permuted rotation rows and codebooks per segment."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ..codebooks import codebook_tensors
from ..index_polynomial import INDEX_POLYNOMIALS
from ..quantizer import split_segments
from ..rotation import is_power_of_two, rotation_matrix


def next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class SegmentGeometry:
    start: int  # first rotated coordinate of the segment
    n: int  # coordinates in the segment
    bits: int
    groups: int  # n / 8
    groups_pad: int  # next power of two >= groups
    row0: int  # first row of this segment in the padded rotation table
    byte0: int  # first packed byte of this segment


@dataclass(frozen=True)
class CodecTables:
    """Everything a kernel needs to (de)quantize one component with an MSE codebook."""

    dim: int
    dim_pad: int
    segments: tuple[SegmentGeometry, ...]
    rot_hi: torch.Tensor  # [rows, dim_pad] fp16
    rot_lo: torch.Tensor  # [rows, dim_pad] fp16 (zeros when exact_rot)
    rot_bf16: torch.Tensor  # rot_hi in bf16: the +-1 rows exactly, the operand for bf16 inputs (exact_rot)
    rot_scale: float
    exact_rot: bool
    centroids: tuple[torch.Tensor, ...]  # per segment, fp32 [2**bits]
    boundaries: tuple[torch.Tensor, ...]  # per segment, fp32 [2**bits - 1]
    levels: tuple[torch.Tensor, ...]  # per segment, int32 [2**(bits-1)]: ``encoder_levels``
    boundary_pairs: tuple[torch.Tensor, ...]  # per segment, int32 [2**(bits-1) - 1]: ``encoder_boundary_pairs``
    index_bytes: int
    index_polynomial: torch.Tensor | None = None  # int32 [11]: ``encoder_index_polynomial``, one-segment formats

    def kernel_constexprs(self) -> dict:
        s0 = self.segments[0]
        s1 = self.segments[1] if len(self.segments) > 1 else None
        return dict(
            D=self.dim, D_PAD=self.dim_pad,
            G0=s0.groups, GP0=s0.groups_pad, B0=s0.bits,
            G1=s1.groups if s1 else 0, GP1=s1.groups_pad if s1 else 1, B1=s1.bits if s1 else 1,
            EXACT_ROT=self.exact_rot,
        )

    def segment_tables(self):
        """(cent0, bnd0, cent1, bnd1): second segment falls back to the first when absent."""
        c, b = self.centroids, self.boundaries
        return c[0], b[0], c[-1], b[-1]

    def encode_tables(self):
        """(levels0, bnd0, levels1, bnd1) for the encoder; the second segment falls back to the first."""
        lv, b = self.levels, self.boundaries
        return lv[0], b[0], lv[-1], b[-1]


def encoder_levels(centroids: torch.Tensor) -> torch.Tensor:
    """int32 [L/2] for a symmetric codebook of L levels: entry m is c[L/2 + m]^2 as fp32 bits with the low
    log2(L/2) mantissa bits replaced by m. The encoder's compare chain selects one of these per coordinate
    and reads both the half-index (low bits) and c^2 for the norm correction (the word as fp32, within
    2^-20 relative of c^2: far below the fp16 scale's own rounding, 2^-11)."""
    h = centroids.numel() // 2
    sq = (centroids[h:].float() ** 2).view(torch.int32)
    return ((sq & ~(h - 1)) | torch.arange(h, dtype=torch.int32, device=centroids.device)).contiguous()


def encoder_boundary_pairs(boundaries: torch.Tensor) -> torch.Tensor:
    """int32 [L/2 - 1] for a symmetric codebook of L levels: the positive thresholds, each as an fp16 pair (the
    same fp16 number in both halves), for the packed fp16 compares of ``codec_jit._pair_threshold_masks``. The
    thresholds are fp16 numbers by construction (``codebooks.decision_boundaries``); checked here, since the
    compares are exact only then."""
    pos = boundaries[(boundaries.numel() + 1) // 2 :].float()
    f16 = pos.to(torch.float16)
    if not torch.equal(f16.float(), pos):
        raise ValueError("encoder thresholds must be fp16 numbers (codebooks.decision_boundaries)")
    return ((f16.view(torch.int16).to(torch.int32) & 0xFFFF) * 0x10001).contiguous()


# The norm correction's c^2 per index, in the polynomial search: fixed point with this many fraction bits,
# so that c^2 - c_0^2 (< 7.5 for every codebook here) fits 16 bits and two byte lookups give it.
SQUARE_FRACTION_BITS = 13


def _word(v: int) -> int:
    """An unsigned 32-bit pattern as the int32 holding it."""
    return v - (1 << 32) if v >= 1 << 31 else v


def _fp16_pair(v: float) -> int:
    bits16 = int(torch.tensor(v, dtype=torch.float16).view(torch.int16).item()) & 0xFFFF
    if float(torch.tensor(v, dtype=torch.float16)) != v:
        raise ValueError(f"{v!r} is not an fp16 number")
    return _word(bits16 * 0x10001)


def encoder_index_polynomial(bits: int, dim: int, centroids: torch.Tensor) -> torch.Tensor | None:
    """int32 [11] for the packing-order encoder's polynomial search (``codec_jit._index_polynomial_lanes``),
    or None where ``index_polynomial.INDEX_POLYNOMIALS`` has no entry:

    - words 0-5: c4, c3, c2, c1, c0 and the clamp, each an fp16 pair (the same number in both halves);
    - words 6-9: c^2 of the magnitude index k (0..7) as g_k = round((c_{H+k}^2 - c_H^2) 2^13), a 16-bit
      number, split into its low bytes (words 6, 7: k = 0-3, 4-7) and high bytes (words 8, 9), the byte
      tables of two ``prmt`` lookups. g_0 = 0, which the lookups' unused bytes rely on;
    - word 10: c_H^2 as fp32 bits.
    The rows' sum of c^2 is then n c_H^2 + sum g / 2^13: each c^2 within 2^-14, the norm correction's scale
    within 2^-14 relative of the exact one."""
    poly = INDEX_POLYNOMIALS.get((bits, dim))
    if poly is None:
        return None
    half = centroids.double().cpu()[1 << (bits - 1) :]
    g = torch.round((half * half - half[0] * half[0]) * (1 << SQUARE_FRACTION_BITS)).to(torch.int64).tolist()
    if g[0] != 0 or max(g) >= 1 << 16:
        raise ValueError(f"c^2 of the {bits}-bit codebook does not fit the 16-bit lookup")

    def byte_word(vals: list[int]) -> int:
        return _word(sum((v & 0xFF) << (8 * i) for i, v in enumerate(vals)))

    lo = [v & 0xFF for v in g]
    hi = [v >> 8 for v in g]
    c0sq = int(torch.tensor(float(half[0] * half[0]), dtype=torch.float32).view(torch.int32).item())
    words = [_fp16_pair(v) for v in poly.coefficients()]
    words += [byte_word(lo[:4]), byte_word(lo[4:]), byte_word(hi[:4]), byte_word(hi[4:]), c0sq]
    return torch.tensor(words, dtype=torch.int32, device=centroids.device)


def _build(dim: int, bits: float, seed: int, device: str) -> CodecTables:
    segs = split_segments(dim, bits)
    dim_pad = next_pow2(dim)
    exact = is_power_of_two(dim)
    r = rotation_matrix(dim, seed, dtype=torch.float64)
    rot_scale = 1.0 / math.sqrt(dim) if exact else 1.0
    if exact:
        r = torch.round(r * math.sqrt(dim))  # exactly +-1
    geoms, rows, start, row0, byte0 = [], [], 0, 0, 0
    for n, b in segs:
        g = n // 8
        gp = next_pow2(g)
        table = torch.zeros(8 * gp, dim_pad, dtype=torch.float64)
        for j in range(8):
            table[j * gp : j * gp + g, :dim] = r[start + j * g : start + (j + 1) * g]
        geoms.append(SegmentGeometry(start, n, b, g, gp, row0, byte0))
        rows.append(table)
        start += n
        row0 += 8 * gp
        byte0 += n * b // 8
    full = torch.cat(rows).float()
    hi = full.to(torch.float16)
    lo = (full - hi.float()).to(torch.float16)
    cents, bnds = zip(*(codebook_tensors(b, dim, device) for _, b in segs))
    hi = hi.to(device).contiguous()
    return CodecTables(dim, dim_pad, tuple(geoms), hi, lo.to(device).contiguous(), hi.to(torch.bfloat16),
                       rot_scale, exact, tuple(cents), tuple(bnds), tuple(encoder_levels(c) for c in cents),
                       tuple(encoder_boundary_pairs(b) for b in bnds), byte0,
                       encoder_index_polynomial(segs[0][1], dim, cents[0]) if len(segs) == 1 else None)


@functools.lru_cache(maxsize=256)
def codec_tables(dim: int, bits: float, seed: int, device: str = "cpu") -> CodecTables:
    """Cached tables for (dim, bits, seed) on ``device`` (a string such as 'cuda:0')."""
    return _build(dim, bits, seed, device)


def padded_rotated_order(tables: CodecTables) -> torch.Tensor:
    """Map padded kernel positions -> rotated coordinate (-1 for padding), per concatenated segments."""
    out = []
    for s in tables.segments:
        pos = torch.full((8 * s.groups_pad,), -1, dtype=torch.long)
        for j in range(8):
            pos[j * s.groups_pad : j * s.groups_pad + s.groups] = s.start + j * s.groups + torch.arange(s.groups)
        out.append(pos)
    return torch.cat(out)


def _bitrev3(r: int) -> int:
    return ((r & 1) << 2) | (r & 2) | ((r >> 2) & 1)


def kernel_coordinate_order(tables: CodecTables, fp8: bool = False) -> torch.Tensor:
    """Rotated coordinate held by each position of the tiles that ``kernels.codebook_lookup_jit`` builds
    (-1: padding): the order of decode attention, and of the dense and paged decodes with byte permutes.

    MSE segments: position off_s + g*8 + r holds field j = bitrev3(r) of group g, i.e. coordinate
    start_s + j*G + g. fp8 keys: natural order, padded to dim_pad."""
    if fp8:
        pos = torch.full((tables.dim_pad,), -1, dtype=torch.long)
        pos[: tables.dim] = torch.arange(tables.dim)
        return pos
    out = []
    for seg in tables.segments:
        for g in range(seg.groups_pad):
            for r in range(8):
                out.append(seg.start + _bitrev3(r) * seg.groups + g if g < seg.groups else -1)
    return torch.tensor(out, dtype=torch.long)


def rotation_rows_in_order(tables: CodecTables, order: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rot_hi, rot_lo) of ``tables`` with the rows gathered from the codec's ``padded_rotated_order`` into
    ``order`` (the rotated coordinate each position holds; -1: a zero row for padding)."""
    row_of = {c: i for i, c in enumerate(padded_rotated_order(tables).tolist()) if c >= 0}
    want = order.tolist()
    dev = tables.rot_hi.device
    src = torch.tensor([row_of.get(c, 0) for c in want], dtype=torch.long, device=dev)
    keep = torch.tensor([c >= 0 for c in want], device=dev)[:, None]
    hi = torch.where(keep, tables.rot_hi[src], torch.zeros_like(tables.rot_hi[src])).contiguous()
    lo = torch.where(keep, tables.rot_lo[src], torch.zeros_like(tables.rot_lo[src])).contiguous()
    return hi, lo


@functools.lru_cache(maxsize=256)
def kernel_order_rotation(dim: int, bits: float, seed: int, device: str = "cpu",
                          fp8: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(rot_hi, rot_lo) of ``codec_tables(dim, bits, seed, device)`` in ``kernel_coordinate_order``."""
    tables = codec_tables(dim, bits, seed, device)
    return rotation_rows_in_order(tables, kernel_coordinate_order(tables, fp8=fp8))


def packing_order(dim: int) -> torch.Tensor:
    """Rotated coordinate of each output column n of the packing-order encoder's product
    (``codec_jit._pack_order_words``): j * dim/8 + g with j = 4 b4 + 2 b3 + b0 and g = (2 b2 + b1) * dim/32 +
    (n >> 5), b_i bit i of n. A permutation of range(dim) for dim a power of two >= 32."""
    if dim < 32 or dim & (dim - 1):
        raise ValueError(f"packing order needs a power-of-two dim >= 32, got {dim}")
    n = torch.arange(dim)
    bit = [(n >> i) & 1 for i in range(5)]
    j = 4 * bit[4] + 2 * bit[3] + bit[0]
    g = (2 * bit[2] + bit[1]) * (dim // 32) + (n >> 5)
    return j * (dim // 8) + g


@functools.lru_cache(maxsize=256)
def packing_order_rotation(dim: int, bits: float, seed: int, device: str, dtype: torch.dtype) -> torch.Tensor:
    """The +-1 Hadamard rows of ``codec_tables(dim, bits, seed, device)`` (one segment) in ``packing_order``,
    in ``dtype`` (fp16 or bf16: exact), [dim, dim]."""
    tables = codec_tables(dim, bits, seed, device)
    if not tables.exact_rot or len(tables.segments) != 1:
        raise ValueError(f"the packing-order encoder needs one segment and a Hadamard rotation (d={dim}, bits={bits})")
    # One segment of a power-of-two dim: table row j*G + g is rotated coordinate j*G + g.
    rows = tables.rot_hi[packing_order(dim).to(tables.rot_hi.device)]
    return rows.to(dtype).contiguous()
