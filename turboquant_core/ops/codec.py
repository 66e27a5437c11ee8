# SPDX-License-Identifier: Apache-2.0
"""Encode/decode of dense vectors with the fused Triton kernels, and their torch references.

``encode(x, bits, seed)`` -> (packed uint8 [N, bytes], scale fp16 [N]); ``decode`` inverts it.
``encode_ref``/``decode_ref`` are the plain-torch references (quantizer + packing) the kernels are
tested against: bit-exact bytes, except coordinates within float rounding of a decision boundary.
"""

from __future__ import annotations

import functools
import math

import torch
import triton

from ..kernels.codec_jit import tq_mse_decode_kernel, tq_mse_encode_kernel, tq_mse_encode_packing_order_kernel
from ..packing import pack_indices, unpack_indices
from ..quantizer import MSEQuantized, MSEQuantizer
from .rotation_tables import CodecTables, codec_tables, kernel_order_rotation, packing_order_rotation

# bf16 outputs: decode's inverse rotation runs as a single fp16 product, whose error (~2.7e-4 RMS for
# unit-variance coordinates) is a sixth of bf16's own rounding (~1.7e-3). fp16 and fp32 outputs keep the
# hi/lo products: for fp16 the single product would add more than its rounding.
SINGLE_PRODUCT_DTYPES = (torch.bfloat16,)


def permute_lookup_applies(tables: CodecTables) -> bool:
    """Whether byte-permute codebook lookups (``kernels.codebook_lookup_jit``) serve these tables: 2- to
    4-bit segments. (The interpreter runs the same kernel-order path with loaded values.)"""
    return all(2 <= seg.bits <= 4 for seg in tables.segments)


def _block_rows(dim_pad: int) -> int:
    """Rows per program of the products' encoder and of the decoder: 64 up to a padded d of 256 (at d = 256,
    64 rows ran encode and decode at about twice the speed of 32 on an H200:
    benchmarks/results/2026-11-24-h200-packing-order-encode/sweep-d256.json), 16 above, where the products
    run over chunks of the rotation."""
    return 64 if dim_pad <= 256 else 16


# Where the packing-order encoder runs (measured faster than the products at 2 to 4 bits on an H200 at d = 64,
# 128 and 256: benchmarks/results/2026-11-24-h200-paired-search/).
PACKING_ORDER_DIMS = (64, 128, 256)
# The packing-order encoder's launch: tiles of 64 rows over one warpgroup, three tiles' rows in flight, two
# programs per SM (each holds the d x d rotation and the row tiles in shared memory).
PACKING_ORDER_ROWS = 64
PACKING_ORDER_STAGES = 3
PACKING_ORDER_PROGRAMS_PER_SM = 2
# Widths whose codebook search runs as packed fp16 compares (``codec_jit._pack_order_words_paired``; inline PTX,
# so never in Triton's interpreter).
PACKING_ORDER_PAIRED_BITS = (2, 3, 4)
# Widths whose search runs as the index polynomial instead, where the tables have one
# (``index_polynomial``, ``codec_jit._pack_order_words_polynomial``; inline PTX too): 4 bits at d = 64, 128,
# 256, where it ran the encoder about a fifth faster than the compares on an H200.
PACKING_ORDER_POLYNOMIAL_BITS = (4,)


def packing_order_applies(tables: CodecTables, dtype: torch.dtype) -> bool:
    """Whether the packing-order encoder (``codec_jit.tq_mse_encode_packing_order_kernel``) can encode these
    rows: one segment (1 to 4 bits), a Hadamard rotation of d = 32..256, fp16 or bf16 rows (exact products)."""
    return (tables.exact_rot and len(tables.segments) == 1 and 32 <= tables.dim <= 256
            and dtype in (torch.float16, torch.bfloat16))


def choose_encoder(tables: CodecTables, dtype: torch.dtype) -> str:
    """The encoder kernel that runs for these tables and rows: "packing_order" where it applies at
    ``PACKING_ORDER_DIMS``, else "products" (rotation products per packing slot, any format). Both give the
    reference's indices up to coordinates within rounding of a decision boundary."""
    if tables.dim in PACKING_ORDER_DIMS and packing_order_applies(tables, dtype):
        return "packing_order"
    return "products"


def _launch(dim_pad: int, block_rows: int | None, num_warps: int | None) -> dict:
    """Rows per program and warps: the defaults, or a caller's choice (``benchmarks/sweep_codec_launch.py``)."""
    bn = block_rows or _block_rows(dim_pad)
    if bn < 16 or bn & (bn - 1):
        raise ValueError(f"block_rows must be a power of two >= 16, got {bn}")
    cfg = {"BN": bn}
    if num_warps is not None:
        if num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be one of 1, 2, 4, 8, 16, got {num_warps}")
        cfg["num_warps"] = num_warps
    return cfg


@functools.lru_cache(maxsize=16)
def _paired_search_runs(device: torch.device) -> bool:
    """Whether the packed fp16 search (inline PTX: cvt.rz.f16x2.f32 needs sm_80) runs on ``device``."""
    return (device.type == "cuda" and torch.version.hip is None
            and torch.cuda.get_device_capability(device) >= (8, 0))


@functools.lru_cache(maxsize=16)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _encode_packing_order(x2, t: CodecTables, bits, seed, out, scale, norm_correction, block_rows, num_warps):
    n = x2.shape[0]
    cfg = _launch(t.dim_pad, block_rows or PACKING_ORDER_ROWS, num_warps)
    cfg.setdefault("num_warps", 4)
    tiles = triton.cdiv(n, cfg["BN"])
    programs = tiles
    if x2.device.type == "cuda":  # a program per tile in Triton's interpreter
        programs = min(tiles, PACKING_ORDER_PROGRAMS_PER_SM * _sm_count(x2.device))
    rot = packing_order_rotation(t.dim, bits, seed, str(x2.device), x2.dtype)
    lv0, b0, _, _ = t.encode_tables()
    b = t.segments[0].bits
    packed_fp16 = _paired_search_runs(x2.device)
    poly = packed_fp16 and b in PACKING_ORDER_POLYNOMIAL_BITS and t.index_polynomial is not None
    tq_mse_encode_packing_order_kernel[(programs,)](
        x2, x2.stride(0), rot, lv0, b0, t.boundary_pairs[0], t.index_polynomial if poly else lv0, out,
        out.stride(0), scale, n, t.rot_scale, math.sqrt(t.dim), D=t.dim, B=b, NORM_CORRECTION=norm_correction,
        STAGES=PACKING_ORDER_STAGES, PAIRED=packed_fp16 and b in PACKING_ORDER_PAIRED_BITS and not poly,
        POLY=poly, **cfg,
    )


def _flat(x: torch.Tensor, dim: int) -> torch.Tensor:
    if x.shape[-1] != dim:
        raise ValueError(f"expected last dim {dim}, got {x.shape[-1]}")
    x2 = x.reshape(-1, dim)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def encode(x: torch.Tensor, bits: float, seed: int, norm_correction: bool = True, *,
           block_rows: int | None = None, num_warps: int | None = None):
    """Fused rotate + quantize + pack. x [..., d] (fp16/bf16/fp32) -> (packed [..., B] uint8, scale [...] fp16).
    ``block_rows``/``num_warps`` override the launch configuration (same bytes, other speed); the kernel is
    ``choose_encoder``'s."""
    dim = x.shape[-1]
    t = codec_tables(dim, bits, seed, str(x.device))
    x2 = _flat(x, dim)
    n = x2.shape[0]
    out = torch.empty(n, t.index_bytes, dtype=torch.uint8, device=x.device)
    scale = torch.empty(n, dtype=torch.float16, device=x.device)
    if n and choose_encoder(t, x2.dtype) == "packing_order":
        _encode_packing_order(x2, t, bits, seed, out, scale, norm_correction, block_rows, num_warps)
    elif n:
        cfg = _launch(t.dim_pad, block_rows, num_warps)
        lv0, b0, lv1, b1 = t.encode_tables()
        tq_mse_encode_kernel[(triton.cdiv(n, cfg["BN"]),)](
            x2, x2.stride(0), t.rot_hi, t.rot_lo, t.rot_bf16, lv0, b0, lv1, b1, out, out.stride(0), scale,
            n, t.rot_scale, math.sqrt(dim), NORM_CORRECTION=norm_correction, **cfg, **t.kernel_constexprs(),
        )
    lead = x.shape[:-1]
    return out.view(*lead, t.index_bytes), scale.view(lead)


def decode(packed: torch.Tensor, scale: torch.Tensor, dim: int, bits: float, seed: int,
           dtype: torch.dtype = torch.float32, *, block_rows: int | None = None,
           num_warps: int | None = None) -> torch.Tensor:
    """Unpack + codebook lookup + inverse rotation: -> [..., dim] in ``dtype``. bf16 outputs, whose single
    fp16 product rounds the codebook values to fp16 anyway, take them by byte permutes in registers; fp16
    and fp32 outputs gather the fp32 codebooks per index."""
    t = codec_tables(dim, bits, seed, str(packed.device))
    if packed.shape[-1] != t.index_bytes:
        raise ValueError(f"expected {t.index_bytes} packed bytes for d={dim}, bits={bits}, got {packed.shape[-1]}")
    p2 = packed.reshape(-1, t.index_bytes).contiguous()
    s2 = scale.reshape(-1).contiguous()
    n = p2.shape[0]
    out = torch.empty(n, dim, dtype=dtype, device=packed.device)
    cfg = _launch(t.dim_pad, block_rows, num_warps)
    c0, _, c1, _ = t.segment_tables()
    hi_only = dtype in SINGLE_PRODUCT_DTYPES and t.dim_pad <= 256
    permute = hi_only and permute_lookup_applies(t)
    rot_hi, rot_lo = kernel_order_rotation(dim, bits, seed, str(packed.device)) if permute else (t.rot_hi, t.rot_lo)
    if n:
        tq_mse_decode_kernel[(triton.cdiv(n, cfg["BN"]),)](
            p2, p2.stride(0), s2, rot_hi, rot_lo, c0, c1, out, out.stride(0), n, t.rot_scale,
            HI_ONLY=hi_only, PERMUTE=permute, **cfg, **t.kernel_constexprs(),
        )
    return out.view(*packed.shape[:-1], dim)


def encode_ref(x: torch.Tensor, bits: float, seed: int, norm_correction: bool = True):
    """Reference for ``encode``: MSEQuantizer + planar8 packing per segment."""
    q = MSEQuantizer(x.shape[-1], bits, norm_correction, seed)
    m = q.quantize(x)
    parts, start = [], 0
    for n, b in q.segments:
        parts.append(pack_indices(m.idx[..., start : start + n], b))
        start += n
    return torch.cat(parts, dim=-1), m.scale.to(torch.float16)


def unpack_segments(packed: torch.Tensor, dim: int, bits: float) -> torch.Tensor:
    """Packed bytes -> [..., dim] uint8 indices in rotated coordinate order."""
    q = MSEQuantizer(dim, bits)
    parts, byte0 = [], 0
    for n, b in q.segments:
        nb = n * b // 8
        parts.append(unpack_indices(packed[..., byte0 : byte0 + nb], b, n))
        byte0 += nb
    return torch.cat(parts, dim=-1)


def decode_ref(packed: torch.Tensor, scale: torch.Tensor, dim: int, bits: float, seed: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    q = MSEQuantizer(dim, bits, seed=seed)
    idx = unpack_segments(packed, dim, bits)
    return q.dequantize(MSEQuantized(idx, scale.float())).to(dtype)
